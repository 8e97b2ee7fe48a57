"""Bad server input through a whole run (``relax-hpc submit``, mode fully_async, local executor): a server command
that does not exist, a server that exits at start, a port already in use. Each gives one clear error naming the
server log (no traceback), the rollout worker exits 2, and since no worker is left to feed the trainer the run
stops with exit code 2 (the trainer checkpoints; nothing in the store is lost).

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
