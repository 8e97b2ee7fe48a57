"""``relax-hpc eval RUN_DIR --executor slurm``: a real job array over stored snapshots on the local Slurm cluster
(skipped when none answers), one array task per snapshot, each writing its evaluation."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from relax_hpc.launch import slurm_cli
from tests.helpers.runutil import DEMO, cli

EVAL = ["--set", "eval.data.task.name=reverse_digits", "--set", "eval.data.task.min_len=5",
        "--set", "eval.data.task.max_len=5", "--set", "eval.data.task.num_prompts=8", "--set", "eval.at_end=false",
        "--set", "eval.at_start=false"]


@pytest.mark.slurm
def test_eval_job_array_over_snapshots(tmp_path: Path, cluster: None) -> None:
    run = tmp_path / "run"
    made = cli("submit", str(DEMO), "--executor", "local", "--run-dir", str(run), "--set", "num_steps=3",
               "--set", "warmup.steps=2", "--set", "rollout.prompts_per_step=4", "--set", "weights.keep_last=5",
               *EVAL)
    assert made.returncode == 0, made.stderr[-2000:]
    assert not (run / "eval").exists()  # neither at the start nor at the end: the array does them all
    out = cli("eval", str(run), "--executor", "slurm", "--snapshots", "v1,v3", "--set", "eval.n_samples=2")
    assert out.returncode == 0, out.stderr[-2000:]
    job = re.search(r"Slurm job array (\d+)", out.stdout)
    assert job, out.stdout
    try:
        deadline = time.time() + 600
        while time.time() < deadline and not all((run / "eval" / f"v{v:06d}.json").is_file() for v in (1, 3)):
            time.sleep(2)
        got = {v: json.loads((run / "eval" / f"v{v:06d}.json").read_text()) for v in (1, 3)}
    finally:
        slurm_cli.scancel([job.group(1)])
    for v, rec in got.items():
        assert rec["version"] == v and rec["proc"].startswith("eval-")
        assert rec["metrics"]["eval/samples"] == 16  # the --set reached every array task
    assert not (run / "eval" / "v000002.json").exists()
    script = (run / "slurm").glob("eval-*.sbatch")
    assert any("#SBATCH --array=1,3" in p.read_text() for p in script)
