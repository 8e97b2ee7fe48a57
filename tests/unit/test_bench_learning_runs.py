"""``relax-hpc bench learning --runs``: the figures of run dirs already there (a run still going, say), read from
their event logs: the mismatch KL per step and its median / 90th percentile, and the response-length figures, each
checked against a computation of its own here."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from relax_hpc.config.load import config_to_json, load_recipe
from relax_hpc.rundir import RunDir

REPO = Path(__file__).resolve().parents[2]


def make_run(root: Path, seed: int, kls: list[float], lengths: list[tuple[float, float, float]]) -> Path:
    """A run dir of the demo recipe whose main process logged one metrics record per step (no process runs)."""
    rd = RunDir.create(root / f"run{seed}")
    cfg = load_recipe(REPO / "recipes" / "demo.yaml", [f"seed={seed}", "num_steps=10"])
    rd.config.write_text(json.dumps(config_to_json(cfg)))
    with rd.event_log("colocate-0").open("w") as f:
        for step, (kl, (mean, p50, top)) in enumerate(zip(kls, lengths), 1):
            metrics = {"perf/step_time": 2.0 + step, "rollout/reward": 0.1 * step, "train/mismatch_kl": kl,
                       "rollout/response_length": mean, "rollout/response_length_p50": p50,
                       "rollout/response_length_max": top}
            f.write(json.dumps({"kind": "metrics", "step": step, "metrics": metrics}) + "\n")
        f.write("not json: a torn last line is skipped\n")
    return rd.root


def test_runs_report_the_mismatch_kl_per_step_and_the_length_figures(tmp_path) -> None:
    kls = [4e-4, 1e-4, 9e-4, 2e-4, 3e-4]
    lengths = [(20.0, 18.0, 64.0), (15.0, 12.0, 40.0), (10.0, 10.0, 10.0), (12.0, 11.0, 30.0), (9.0, 8.0, 16.0)]
    a = make_run(tmp_path, 0, kls, lengths)
    b = make_run(tmp_path, 1, kls[:2], lengths[:2])
    r = subprocess.run([sys.executable, "-m", "relax_hpc", "bench", "learning", "--json", "--runs", f"{a},{b}",
                        "--last", "2"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    runs = {x["seed"]: x for x in res["runs"]["colocate"]}
    one = runs[0]
    assert one["steps"] == 5 and one["finished"] is False and one["run_dir"] == str(a)
    assert one["mismatch_kl_per_step"] == kls
    assert one["mismatch_kl_median"] == sorted(kls)[2] and one["mismatch_kl_max"] == 9e-4
    assert one["mismatch_kl_p90"] == 9e-4
    assert math.isclose(one["final_reward"], (0.4 + 0.5) / 2)
    # most rows finished: a static batch of a step decodes max steps, past the median length most rows are done
    want = sum(top - p50 for _, p50, top in lengths) / sum(top for *_, top in lengths)
    assert math.isclose(one["most_finished_fraction"], want)
    assert one["response_length_max"] == 64.0 and math.isclose(one["response_length_mean"], 66.0 / 5)
    assert runs[1]["steps"] == 2 and runs[1]["mismatch_kl_per_step"] == kls[:2]


def test_a_folder_that_is_no_run_dir_gets_one_error_line(tmp_path) -> None:
    r = subprocess.run([sys.executable, "-m", "relax_hpc", "bench", "learning", "--runs", str(tmp_path)],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 2 and r.stderr.strip().startswith("error:") and len(r.stderr.strip().splitlines()) == 1
    assert "Traceback" not in r.stderr
