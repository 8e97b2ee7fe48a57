"""Server process lifecycle with real processes: bad commands, exits at start, ports in use, servers that never get
healthy, stop with SIGTERM then SIGKILL, the parent-death signal. Cheap stand-in servers (``python -m http.server``,
``python -c ...``) where the engine does not matter."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from relax_hpc.rollout.server.process import ServerProcess, ServerSpec, ServerStartError, build_argv, free_port


def _spec(tmp_path: Path, argv: list[str], *, port: int | None = None, timeout: float = 20.0,
          health: str = "/health") -> ServerSpec:
    return ServerSpec(name="t-0", argv=argv, host="127.0.0.1", port=port or free_port(), health_path=health,
                      log=tmp_path / "logs" / "server-t-0.log", record=tmp_path / "servers" / "t-0.json",
                      startup_timeout_s=timeout, stop_grace_s=2.0)


async def _up(sp: ServerProcess) -> float:
    async with httpx.AsyncClient(trust_env=False) as c:
        return await sp.wait_ready(c)


def test_missing_command_one_clear_error(tmp_path):
    sp = ServerProcess(_spec(tmp_path, ["/no/such/server-binary", "--port", "1"]))
    with pytest.raises(ServerStartError) as err:
        sp.start()
    first = str(err.value).splitlines()[0]
    assert "/no/such/server-binary" in first and "cannot be run" in first and "server-t-0.log" in first


def test_exit_at_start_carries_log_tail(tmp_path):
    code = "import sys\nfor i in range(60): print('line', i)\nprint('FATAL: bad flag --frobnicate')\nsys.exit(3)"
    sp = ServerProcess(_spec(tmp_path, [sys.executable, "-c", code]))
    sp.start()
    with pytest.raises(ServerStartError) as err:
        asyncio.run(_up(sp))
    text = str(err.value)
    assert "exited at start (exit code 3)" in text.splitlines()[0] and str(sp.spec.log) in text.splitlines()[0]
    tail = text.split("---\n", 1)[1].splitlines()
    assert len(tail) == 40 and tail[-1] == "FATAL: bad flag --frobnicate" and "line 0" not in tail


def test_port_in_use(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        sp = ServerProcess(_spec(tmp_path, [sys.executable, "-m", "http.server", str(port)], port=port))
        with pytest.raises(ServerStartError, match=f"port {port} on 127.0.0.1 is already in use"):
            sp.start()
    assert sp.proc is None


def test_never_healthy_times_out_and_stops(tmp_path):
    port = free_port()
    sp = ServerProcess(_spec(tmp_path, [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                             port=port, timeout=4.0, health="/health"))  # answers 404 on /health
    sp.start()
    t0 = time.monotonic()
    with pytest.raises(ServerStartError, match=r"not healthy after 4 s \(GET /health\)"):
        asyncio.run(_up(sp))
    assert time.monotonic() - t0 < 20 and not sp.alive()
    assert json.loads(sp.spec.record.read_text())["state"] == "stopped"


def test_ready_record_and_sigterm_then_sigkill(tmp_path):
    # a server that ignores SIGTERM (the grace period runs out, SIGKILL follows), with a child in its group
    code = ("import signal, subprocess, sys, http.server\n"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
            "class H(http.server.BaseHTTPRequestHandler):\n"
            "    def do_GET(self):\n"
            "        self.send_response(200); self.end_headers(); self.wfile.write(b'ok')\n"
            "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\n")
    port = free_port()
    sp = ServerProcess(_spec(tmp_path, [sys.executable, "-c", code, str(port)], port=port))
    sp.start()
    took = asyncio.run(_up(sp))
    rec = json.loads(sp.spec.record.read_text())
    assert rec["state"] == "ready" and rec["port"] == port and rec["pid"] == sp.proc.pid and took < 20
    pgid = os.getpgid(sp.proc.pid)
    assert pgid == sp.proc.pid != os.getpgid(0)
    t0 = time.monotonic()
    code = sp.stop()
    assert code == -9 and 1.5 < time.monotonic() - t0 < 15
    time.sleep(0.3)
    left = [p for p in subprocess.run(["pgrep", "-g", str(pgid)], capture_output=True, text=True).stdout.split()
            if _alive(int(p))]
    assert not left, f"processes left in the server's group: {left}"


def test_server_dies_with_its_parent(tmp_path):
    """A rollout worker killed with SIGKILL takes its server along (PR_SET_PDEATHSIG)."""
    port = free_port()
    marker = tmp_path / "pid"
    code = ("import asyncio, sys\n"
            "from pathlib import Path\n"
            "from relax_hpc.rollout.server.process import ServerProcess, ServerSpec\n"
            f"spec = ServerSpec(name='p-0', argv=[sys.executable, '-m', 'http.server', '{port}'], host='127.0.0.1',"
            f" port={port}, health_path='/', log=Path('{tmp_path}/p.log'), record=Path('{tmp_path}/p.json'))\n"
            "sp = ServerProcess(spec); sp.start()\n"
            f"Path('{marker}').write_text(str(sp.proc.pid))\n"
            "import time; time.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        deadline = time.monotonic() + 30
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        child = int(marker.read_text())
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _alive(child):
            time.sleep(0.1)
        assert not _alive(child), "the server outlived its parent"
    finally:
        parent.kill()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (not reaped: its parent died) counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_build_argv_wrapper_and_extra():
    argv = build_argv("apptainer exec --nv 'my image.sif' python3 -m sglang.launch_server", ["--port", "1"],
                      ["--mem-fraction-static", "0.8"])
    assert argv[:4] == ["apptainer", "exec", "--nv", "my image.sif"] and argv[-2:] == ["--mem-fraction-static", "0.8"]
    assert argv[4:9] == ["python3", "-m", "sglang.launch_server", "--port", "1"]
    with pytest.raises(ValueError, match="empty"):
        build_argv("  ", [], [])


def test_server_gpus_per_task():
    from relax_hpc.errors import UserError
    from relax_hpc.rollout.server import server_gpus

    node = [str(i) for i in range(8)]
    # 8 tasks on an 8-GPU node, each task sees the whole node (--gpus-per-node): task k gets GPU k
    assert [server_gpus(k, 0, 1, node, 8) for k in range(8)] == [[str(k)] for k in range(8)]
    # 2 tasks, TP 2, 2 servers per task: task 1's second server gets GPUs 6,7
    assert server_gpus(1, 1, 2, node, 2) == ["6", "7"]
    # one task per node, TP 4: two servers, 0-3 and 4-7
    assert server_gpus(0, 0, 4, node, 1) == node[:4] and server_gpus(0, 1, 4, node, 1) == node[4:]
    # a task bound to its own GPUs (--gpus-per-task=2)
    assert server_gpus(3, 0, 2, ["4", "5"], 4) == ["4", "5"]
    with pytest.raises(UserError, match="needs 4 GPUs"):
        server_gpus(0, 0, 4, ["0", "1"], 1)


def test_snapshot_config_without_architectures_gets_a_view(tmp_path):
    """The trainer of a model built from a config (the tiny model) writes snapshots whose config.json names no
    ``architectures``; vLLM then resolves ``model_type: qwen3`` to the base ``Qwen3Model``, serves it as an
    embedding model, and a server restarted on that snapshot (tied models on the CPU) answers /v1/completions with
    404 (seen in the fully_async demo with two vllm workers). The engine hands servers a view of such a snapshot whose
    config takes the start folder's ``architectures``; a folder that names them is used as it is."""
    import torch

    from relax_hpc.config.schema import ServerConfig
    from relax_hpc.rollout.server.base import ServerSetup
    from relax_hpc.rollout.server.vllm import VLLMEngine
    from relax_hpc.rundir import RunDir
    from relax_hpc.weights.publisher import SnapshotPublisher

    rd = RunDir.create(tmp_path / "run")
    start = tmp_path / "model"
    start.mkdir()
    conf = {"model_type": "qwen3", "hidden_size": 8, "tie_word_embeddings": True}
    (start / "config.json").write_text(json.dumps({**conf, "architectures": ["Qwen3ForCausalLM"]}))
    (start / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    snap = SnapshotPublisher(rd, keep_last=3).publish({"w": torch.ones(2)}, 1, 1, model_config=conf)
    assert "architectures" not in json.loads((snap / "config.json").read_text())
    engine = VLLMEngine(ServerConfig(), ServerSetup(name="rollout-0-0", model_dir=start, record=rd.server_record(
        "rollout-0-0"), log=rd.server_log("rollout-0-0"), views=rd.server_views("rollout-0-0"), device="cpu"))
    view = engine._loadable(snap)
    assert view != snap and json.loads((view / "config.json").read_text()) == {
        **json.loads((snap / "config.json").read_text()), "architectures": ["Qwen3ForCausalLM"]}
    assert all((view / f.name).resolve() == f.resolve() for f in snap.glob("*.safetensors"))
    assert (view / "generation_config.json").exists()
    assert engine._loadable(start) == start


def test_vllm_runs_on_the_cpu_without_a_gpu(tmp_path):
    """``rollout.device: auto`` (the default) on a machine without a GPU puts the vllm server on the CPU (its GPU
    defaults would reserve 92 % of the host's memory and die at start); ``cuda`` is kept as asked."""
    import torch

    from relax_hpc.models.tiny import build_digits_tokenizer
    from relax_hpc.rollout.factory import make_engine
    from relax_hpc.rundir import RunDir
    from tests.helpers.server_util import recipe

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    rd = RunDir.create(tmp_path / "run")
    tok = build_digits_tokenizer()
    cfg = recipe("vllm", rd.root)
    assert cfg.rollout.device == "auto"
    engine = make_engine(cfg, tokenizer=tok, run_dir=rd, proc="rollout-0")
    assert engine.setup.device == "cpu" and "--gpu-memory-utilization" in engine.server_args(engine.setup.model_dir, 1)
    cfg.rollout.device = "cuda"
    assert make_engine(cfg, tokenizer=tok, run_dir=rd, proc="rollout-1").setup.device == "cuda"


@pytest.mark.parametrize(("line", "cause"), [
    ("ValueError: Free memory on device cuda:0 (20.1/139.8 GiB) on startup is less than desired GPU memory "
     "utilization (0.5, 69.9 GiB). Decrease GPU memory utilization or reduce GPU memory used by other processes.",
     "not enough free GPU memory for the server's share"),
    ("ValueError: Available memory on node 0 (14.2/23.5 GiB) on kv cache allocation is less than requested memory "
     "for kv (97656.25 GiB). Decrease --kv-cache-memory-bytes, VLLM_CPU_KVCACHE_SPACE, or reduce CPU memory used by "
     "other processes.", "not enough free host memory for the CPU server"),
    ("RuntimeError: Not enough memory. Please try to increase --mem-fraction-static.",
     "leaves no room for its KV cache"),
    ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", "out of GPU memory at start"),
    ("ImportError: /venv/lib/python3.11/site-packages/vllm/_C.abi3.so: undefined symbol: _ZN3c104cuda9SetDeviceEi",
     "do not match the installed torch"),
    ("INFO all good", None),
])
def test_start_failure_cause_reads_the_servers_own_messages(line: str, cause: str | None) -> None:
    """The servers' own start-failure texts (vLLM 0.32 ``v1/worker/utils.py``, ``v1/worker/cpu_worker.py``; SGLang
    0.5.10 ``model_runner_kv_cache_mixin.py``; the loader's ``undefined symbol``) give the cause in the error's first
    line."""
    from relax_hpc.rollout.server.process import start_failure_cause

    got = start_failure_cause(f"INFO starting\n{line}\nINFO shutting down")
    assert (got is None) if cause is None else (got is not None and cause in got), got
