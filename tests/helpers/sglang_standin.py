"""A stand-in for an SGLang server (HTTP API of SGLang 0.5.10), used by the ``sglang`` engine tests because SGLang
cannot run on these machines (no CPU kernels for this processor; its GPU wheels pin torch 2.9.1).

A real HTTP server process (stdlib ``http.server``, one thread per request) with a HF causal LM behind SGLang's
endpoints. Every JSON body is checked against the fields SGLang 0.5.10 names for that endpoint: an unknown field or
a missing required one is answered 400, and unknown command-line flags stop the process at start, so drift between
the engine and the API it was written against fails loudly. Generation is a token-by-token loop (one forward at a
time under a lock), so pause/abort/weight updates land between tokens as they do in SGLang's scheduler.

    python tests/helpers/sglang_standin.py --model-path DIR --port 30000 [--host ...] [--weight-version 0] ...
"""

from __future__ import annotations

import argparse
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch

# endpoint -> (required fields, optional fields) of SGLang 0.5.10's request structs (io_struct.py)
SCHEMAS: dict[str, tuple[set[str], set[str]]] = {
    "/generate": ({"input_ids", "sampling_params"}, {"rid", "return_logprob", "logprob_start_len",
                                                     "top_logprobs_num", "stream", "image_data", "audio_data",
                                                     "video_data"}),
    "/abort_request": (set(), {"rid", "abort_all"}),
    "/pause_generation": (set(), {"mode"}),
    "/continue_generation": (set(), set()),
    "/update_weights_from_disk": ({"model_path"}, {"load_format", "abort_all_requests", "weight_version",
                                                   "flush_cache", "is_async", "torch_empty_cache", "keep_pause"}),
    "/init_weights_update_group": ({"master_address", "master_port", "rank_offset", "world_size"},
                                   {"group_name", "backend"}),
    "/update_weights_from_distributed": ({"names", "dtypes", "shapes"}, {"group_name", "flush_cache",
                                                                         "abort_all_requests", "weight_version"}),
}
SAMPLING = {"max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "sampling_seed",
            "no_stop_trim", "skip_special_tokens", "ignore_eos", "n"}
_SAY = threading.Lock()


def _say(line: str) -> None:
    """One log line in one write: print() writes the text and its newline separately, so lines of two request
    threads could interleave."""
    import sys

    with _SAY:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


class State:
    def __init__(self, args: argparse.Namespace):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=torch.float32).eval()
        conf = json.loads((Path(args.model_path) / "config.json").read_text())
        self.eos = conf.get("eos_token_id")
        self.context = args.context_length
        self.weight_version = args.weight_version
        self.lock = threading.Lock()  # one forward (or weight update) at a time
        self.cond = threading.Condition()
        self.paused = False
        self.abort_epoch = 0  # bumped by pause(mode=abort) / abort_all: in-flight requests return
        self.aborted: set[str] = set()
        self.inflight: dict[str, int] = {}
        self.seed = args.random_seed
        self.gen = torch.Generator().manual_seed(args.random_seed)
        self.groups: dict[str, Any] = {}  # weight update groups by name

    def wait_running(self) -> None:
        with self.cond:
            self.cond.wait_for(lambda: not self.paused, timeout=600)


def _sample(logits: torch.Tensor, sp: dict[str, Any], gen: torch.Generator) -> tuple[int, float]:
    temp = float(sp.get("temperature", 1.0))
    t = temp if temp > 0 else 1.0
    logp = torch.log_softmax(logits.float() / t, -1)  # SGLang's default: log-probs of logits / temperature
    if temp <= 0:
        tok = int(torch.argmax(logits))
        return tok, float(logp[tok])
    cut = logp.clone()
    top_k = int(sp.get("top_k", -1))
    if 0 < top_k < cut.numel():
        kth = torch.topk(cut, top_k).values[-1]
        cut[cut < kth] = -float("inf")
    top_p = float(sp.get("top_p", 1.0))
    if top_p < 1.0:
        probs, order = torch.sort(cut.softmax(-1), descending=True)
        drop = probs.cumsum(-1) - probs > top_p
        cut[order[drop]] = -float("inf")
    tok = int(torch.multinomial(cut.softmax(-1), 1, generator=gen))
    return tok, float(logp[tok])


def check_media(body: dict[str, Any]) -> str:
    """SGLang 0.5.10 takes ``image_data`` / ``audio_data`` / ``video_data`` as one item or a list of items, each a
    path, URL or base64 data (``data:<mime>;base64,...``); the stand-in's model is text-only, so it decodes each data
    URL (images with PIL, as SGLang's loader does) and reports what it got. Anything else: 400."""
    import base64
    import binascii
    import io

    seen = []
    for kind in ("image", "audio", "video"):
        items = body.get(f"{kind}_data")
        if items is None:
            continue
        items = items if isinstance(items, list) else [items]
        for item in items:
            if not isinstance(item, str) or not item.startswith("data:") or ";base64," not in item:
                raise ValueError(f"{kind}_data: expected data URLs (data:<mime>;base64,...), got {str(item)[:40]!r}")
            mime, b64 = item[5:].split(";base64,", 1)
            try:
                raw = base64.b64decode(b64, validate=True)
            except binascii.Error as exc:
                raise ValueError(f"{kind}_data: bad base64 ({exc})") from None
            if not mime.startswith(f"{kind}/"):
                raise ValueError(f"{kind}_data: mime type {mime!r} is not an {kind}")
            if kind == "image":
                from PIL import Image

                try:
                    Image.open(io.BytesIO(raw)).load()
                except Exception as exc:  # PIL raises OSError subclasses on undecodable data
                    raise ValueError(f"image_data: cannot decode the image ({exc})") from None
            seen.append(f"{kind} {mime} {len(raw)} bytes")
    return ", ".join(seen)


def generate(st: State, body: dict[str, Any]) -> dict[str, Any]:
    media = check_media(body)
    if media:
        _say(f"media of {body.get('rid')}: {media}; prompt ids {list(body['input_ids'])}")
    sp = body["sampling_params"]
    unknown = set(sp) - SAMPLING
    if unknown:
        raise ValueError(f"unknown sampling_params {sorted(unknown)}")
    rid = body.get("rid") or "anon"
    ids = [int(t) for t in body["input_ids"]]
    max_new = int(sp.get("max_new_tokens", 128))
    if len(ids) + max_new > st.context:
        raise ValueError(f"input ({len(ids)} tokens) + max_new_tokens ({max_new}) exceeds context {st.context}")
    # a request's own seed, else the server's generator (advanced by every request, as SGLang's sampler is)
    gen = torch.Generator().manual_seed(int(sp["sampling_seed"])) if "sampling_seed" in sp else st.gen
    stops = set(sp.get("stop_token_ids") or []) | ({st.eos} if isinstance(st.eos, int) else set())
    st.wait_running()
    epoch = st.abort_epoch
    out: list[int] = []
    lps: list[float] = []
    reason: dict[str, Any] = {"type": "length", "length": max_new}
    version = st.weight_version
    st.inflight[rid] = len(out)
    try:
        while len(out) < max_new:
            if rid in st.aborted or st.abort_epoch != epoch:
                reason = {"type": "abort", "message": "Abort before weight update."}
                break
            st.wait_running()
            if st.abort_epoch != epoch:
                continue
            with st.lock, torch.no_grad():
                logits = st.model(input_ids=torch.tensor([ids + out])).logits[0, -1]
                version = st.weight_version
            tok, lp = _sample(logits, sp, gen)
            out.append(tok)
            lps.append(lp)
            if tok in stops and not sp.get("ignore_eos"):
                reason = {"type": "stop", "matched": tok}
                break
    finally:
        st.inflight.pop(rid, None)
        st.aborted.discard(rid)
    triples = [[lp, t, None] for lp, t in zip(lps, out)] if body.get("return_logprob") else []
    return {"text": "", "output_ids": out, "meta_info": {
        "id": rid, "finish_reason": reason, "prompt_tokens": len(ids), "completion_tokens": len(out),
        "output_token_logprobs": triples, "weight_version": version}}


def load_disk(st: State, body: dict[str, Any]) -> dict[str, Any]:
    from safetensors.torch import load_file

    folder = Path(body["model_path"])
    if not (folder / "config.json").exists():  # SGLang builds a ModelConfig from the folder first
        return {"success": False, "message": f"{folder}: no config.json", "num_paused_requests": 0}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return {"success": False, "message": f"no safetensors in {folder}", "num_paused_requests": 0}
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(f))
    with st.lock:
        _, unexpected = st.model.load_state_dict(state, strict=False)
        if unexpected:
            return {"success": False, "message": f"unexpected tensors {unexpected[:3]}", "num_paused_requests": 0}
        if body.get("weight_version") is not None:
            st.weight_version = str(body["weight_version"])
    return {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}


def init_group(st: State, body: dict[str, Any]) -> dict[str, Any]:
    """SGLang's weight update group: a ``tcp://`` rendezvous with the trainer (rank 0, which hosts the store), the
    store prefixed with the group name, the group made by torch's group helper (SGLang's
    ``init_custom_process_group``), this server's rank = ``rank_offset`` (+ its TP rank, 0 here)."""
    import inspect
    from datetime import timedelta

    from torch.distributed import distributed_c10d as c10d

    timeout = timedelta(seconds=120)
    store, rank, world = next(c10d.rendezvous(f"tcp://{body['master_address']}:{body['master_port']}",
                                              int(body["rank_offset"]), int(body["world_size"]), timeout=timeout))
    store.set_timeout(timeout)
    name = body.get("group_name", "weight_update_group")
    opts = "backend_options" if "backend_options" in inspect.signature(c10d._new_process_group_helper).parameters \
        else "pg_options"
    pg, _ = c10d._new_process_group_helper(world, rank, [], c10d.Backend(body.get("backend", "nccl")),
                                           c10d.PrefixStore(name, store), group_name=name, timeout=timeout,
                                           **{opts: None})
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world)}
    st.groups[name] = pg
    return {"success": True, "message": "Succeeded to initialize custom process group."}


def load_distributed(st: State, body: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    name = body.get("group_name", "weight_update_group")
    pg = st.groups.get(name)
    if pg is None:
        return {"success": False, "message": f"weights update group {name!r} is not initialized"}
    params = dict(st.model.named_parameters())
    with st.lock:
        for pname, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"], strict=True):
            buf = torch.empty(shape, dtype=getattr(torch, dtype))
            dist.broadcast(buf, src=0, group=pg)
            if pname not in params:
                return {"success": False, "message": f"unknown parameter {pname}"}
            params[pname].data.copy_(buf)
        if body.get("weight_version") is not None:
            st.weight_version = str(body["weight_version"])
    return {"success": True, "message": "Succeeded to update parameter online."}


def pause(st: State, body: dict[str, Any]) -> dict[str, Any]:
    mode = body.get("mode", "abort")
    if mode not in ("abort", "retract", "in_place"):
        raise ValueError(f"Invalid mode: {mode!r}")
    with st.cond:
        st.paused = True
        if mode == "abort":
            st.abort_epoch += 1
    return {}


def resume(st: State, body: dict[str, Any]) -> dict[str, Any]:
    with st.cond:
        st.paused = False
        st.cond.notify_all()
    return {}


def abort(st: State, body: dict[str, Any]) -> dict[str, Any]:
    if body.get("abort_all"):
        st.abort_epoch += 1
    elif body.get("rid"):
        st.aborted.add(str(body["rid"]))
    return {}


ROUTES = {"/generate": generate, "/update_weights_from_disk": load_disk, "/init_weights_update_group": init_group,
          "/update_weights_from_distributed": load_distributed, "/pause_generation": pause,
          "/continue_generation": resume, "/abort_request": abort}


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
            if self.path == "/health":
                self._send(200, {})
            elif self.path == "/model_info":
                self._send(200, {"model_path": "standin", "weight_version": st.weight_version})
            else:
                self._send(404, {"detail": "Not Found"})

        def do_POST(self) -> None:
            route = ROUTES.get(self.path)
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if route is None:
                return self._send(404, {"detail": "Not Found"})
            required, optional = SCHEMAS[self.path]
            problems = [f"missing field {k!r}" for k in sorted(required - set(body))]
            problems += [f"unknown field {k!r}" for k in sorted(set(body) - required - optional)]
            if problems:
                return self._send(400, {"error": {"message": "; ".join(problems)}})
            try:
                self._send(200, route(st, body))
            except (ValueError, KeyError, TypeError) as exc:
                self._send(400, {"error": {"message": str(exc)}})

    return Handler


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--tokenizer-path")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--context-length", type=int, default=2048)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--random-seed", type=int, default=0)
    p.add_argument("--weight-version", default="default")
    p.add_argument("--skip-server-warmup", action="store_true")
    args = p.parse_args()  # unknown flags: exit 2 at start, as SGLang's parser does
    torch.set_num_threads(1)
    st = State(args)
    server = ThreadingHTTPServer((args.host, args.port), make_handler(st))
    server.daemon_threads = True
    print(f"sglang stand-in serving {args.model_path} on {args.host}:{args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
