"""``relax-hpc bench step --json`` prints the JSON alone on stdout: what the peers (TRL, transformers) print while
it measures, from Python or from C, goes to stderr."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import pytest

from relax_hpc.bench import step


def test_json_output_parses_although_the_measurement_prints(monkeypatch: pytest.MonkeyPatch,
                                                            capfd: pytest.CaptureFixture[str]) -> None:
    def noisy_measure(a: Any, dirs: Any) -> dict[str, Any]:
        print("{'loss': 0.1, 'grad_norm': 2.0}")  # what TRL's trainer logs with print
        sys.stdout.flush()
        os.write(1, b"C-level line on fd 1\n")  # a library writing to the file descriptor
        return {"benchmark": "step", "step_s_steady": 1.5}

    monkeypatch.setattr(step, "measure", noisy_measure)
    assert step.main(["--json", "--device", "cpu", "--shape", "qwen3-tiny"]) == 0
    out, err = capfd.readouterr()
    assert json.loads(out) == {"benchmark": "step", "step_s_steady": 1.5}
    assert "'loss': 0.1" in err and "C-level line on fd 1" in err
    print("after")  # stdout works again afterwards
    assert capfd.readouterr().out == "after\n"


def test_text_output_is_unchanged(monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(step, "measure", lambda a, dirs: {"benchmark": "step", "machine": "m"})
    assert step.main(["--device", "cpu", "--shape", "qwen3-tiny"]) == 0
    out, _ = capfd.readouterr()
    assert "benchmark" in out and "machine" in out
