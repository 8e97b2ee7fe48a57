"""``relax-hpc bench learning``: colocate vs fully_async final reward (and held-out accuracy) over several seeds.

Runs the recipe (default ``recipes/demo.yaml``, its own ``num_steps``) once per mode and seed, one run at a time, as
the demo runs it (local processes, no pinning: colocate is one process on every core, fully_async a trainer and the
recipe's rollout workers). For each run: the mean ``rollout/reward`` of the last ``--last`` steps and of the 10
steps ending at ``--mid`` (the middle of the curve), the median step time and the stale samples dropped per step.
Per mode: the mean over seeds and its standard error; then the difference of the two modes, the standard error of
the difference, and ``same_within_noise`` = the difference is within two of those standard errors. The seeds are
the recipe's ``seed`` (the data order, the initial weights and the warm-up); the rollout workers of fully_async
also seed their sampling from the clock, so no two fully_async runs are alike.

With an ``eval`` section in the recipe, each run also reports its held-out evaluation (``eval/vNNNNNN.json``): the
first and last ``eval/accuracy`` (and ``eval/accuracy_thresholded``) with their weight versions and the whole curve,
plus the largest ``train/mismatch_kl`` of any step and the run's wall time. ``--modes`` picks the modes (a proof of
one mode at a time); ``--dry-run`` validates every run's recipe and checks its held-out set, and runs nothing.
Every run also reports the mismatch KL's distribution over its steps (median, 90th percentile, each step's value)
and its response lengths: their mean and largest, the engine's decode-step occupancy, and
``most_finished_fraction``, the share of a static batch's decode steps that run with most of its rows already
finished ((max - median) / max of each step's responses, summed over the steps).

``--runs DIR[,DIR...]`` reads those figures from run dirs already there (finished or still running: a run started
in the background, say) and launches nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from relax_hpc.bench.common import DEMO_RECIPE, ScratchDirs, interrupt, metric_value, report, run_guarded
from relax_hpc.bench.pipeline import ModeRun, run_mode
from relax_hpc.errors import UserError

MODES = ("colocate", "fully_async")


def run_figures(run: ModeRun, *, last: int, mid: int) -> dict[str, Any]:
    """One run's reward at the end and around ``mid``, its median step and its stale drops per step."""
    by_step = {int(r["step"]): r["metrics"] for r in run.steps}
    steps = sorted(by_step)
    if not steps:
        raise RuntimeError(f"{run.mode} run logged no steps (exit code {run.exit_code}); logs in {run.run_dir.logs}")

    def mean_reward(window: list[int]) -> float:
        vals = [metric_value(by_step[s], "rollout/reward") for s in window if s in by_step]
        vals = [v for v in vals if math.isfinite(v)]
        return sum(vals) / len(vals) if vals else float("nan")

    times = [metric_value(by_step[s], "perf/step_time") for s in steps[1:]]
    return {
        "steps": steps[-1], "exit_code": run.exit_code,
        "final_reward": mean_reward(steps[-last:]),
        "mid_reward": mean_reward([s for s in steps if mid - 10 < s <= mid]),
        "first_reward": mean_reward(steps[:10]),
        "step_s_median": statistics.median(times) if times else float("nan"),
        "stale_dropped_per_step": sum(metric_value(by_step[s], "rollout/stale_dropped") for s in steps)
        / len(steps),
        "mismatch_kl_max": max((metric_value(by_step[s], "train/mismatch_kl") for s in steps), default=float("nan")),
        "finished": run.finished,
        **mismatch_figures([by_step[s] for s in steps]),
        **length_figures([by_step[s] for s in steps]),
        **eval_figures(run.run_dir),
    }


def quantile(vals: list[float], q: float) -> float:
    """The ``q`` quantile of ``vals`` (nearest rank; nan for none)."""
    vals = sorted(v for v in vals if math.isfinite(v))
    return vals[min(len(vals) - 1, int(q * len(vals)))] if vals else float("nan")


def mismatch_figures(metrics: list[dict[str, Any]]) -> dict[str, Any]:
    """``train/mismatch_kl`` over the steps: median, 90th percentile and each step's value (in step order)."""
    kl = [metric_value(m, "train/mismatch_kl") for m in metrics if "train/mismatch_kl" in m]
    return {"mismatch_kl_median": quantile(kl, 0.5), "mismatch_kl_p90": quantile(kl, 0.9),
            "mismatch_kl_per_step": [float(f"{v:.3g}") for v in kl]}


def length_figures(metrics: list[dict[str, Any]]) -> dict[str, Any]:
    """The response lengths over the steps and how many decode steps ran with most rows finished."""
    mean = [metric_value(m, "rollout/response_length") for m in metrics if "rollout/response_length" in m]
    p50 = [metric_value(m, "rollout/response_length_p50") for m in metrics]
    top = [metric_value(m, "rollout/response_length_max") for m in metrics]
    occ = [metric_value(m, "perf/decode_occupancy") for m in metrics if "perf/decode_occupancy" in m]
    pairs = [(a, b) for a, b in zip(p50, top) if math.isfinite(a) and math.isfinite(b) and b > 0]
    return {"response_length_mean": sum(mean) / len(mean) if mean else float("nan"),
            "response_length_p50_median": quantile(p50, 0.5),
            "response_length_max": max(top, default=float("nan")),
            "decode_occupancy_mean": sum(occ) / len(occ) if occ else float("nan"),
            "most_finished_fraction": (sum(b - a for a, b in pairs) / sum(b for _, b in pairs)) if pairs
            else float("nan")}


def figures_of_run_dirs(dirs: list[Path], *, last: int, mid: int | None) -> dict[str, Any]:
    """The figures of run dirs already there (``--runs``), per mode, as the benchmark reports its own runs."""
    from relax_hpc.bench.pipeline import read_mode_run
    from relax_hpc.config.load import validate_dict
    from relax_hpc.fsio import read_json
    from relax_hpc.rundir import RunDir

    per_run: dict[str, list[dict[str, Any]]] = {}
    num_steps = 0
    for d in dirs:
        rd = RunDir(d)
        data = read_json(rd.config, default=None)
        if not isinstance(data, dict):
            raise UserError(f"{d} is not a run dir (no {rd.config.name})")
        cfg = validate_dict(data)
        num_steps = max(num_steps, cfg.num_steps)
        run = read_mode_run(rd, cfg, code=-1)
        m = mid or max(1, cfg.num_steps * 3 // 8)
        per_run.setdefault(cfg.mode, []).append({"seed": cfg.seed, "run_dir": str(d),
                                                 **run_figures(run, last=last, mid=m), "wall_s": float("nan")})
    return {"benchmark": "learning", "recipe": ",".join(str(d) for d in dirs), "overrides": [],
            "seeds": sorted({r["seed"] for runs in per_run.values() for r in runs}), "num_steps": num_steps,
            "last": last, "mid": mid, "runs": per_run, **compare(per_run)}


def eval_figures(run_dir: Any) -> dict[str, Any]:
    """The run's held-out evaluations: first and last accuracy with their versions, and the curve."""
    from relax_hpc.eval.evaluator import read_results

    evals = read_results(run_dir)
    if not evals:
        return {}
    first, last = min(evals), max(evals)
    return {"eval_first_version": first, "eval_last_version": last,
            "eval_first_accuracy": evals[first].get("eval/accuracy", float("nan")),
            "eval_last_accuracy": evals[last].get("eval/accuracy", float("nan")),
            "eval_first_correct": evals[first].get("eval/accuracy_thresholded", float("nan")),
            "eval_last_correct": evals[last].get("eval/accuracy_thresholded", float("nan")),
            "eval_curve": {str(v): evals[v].get("eval/accuracy_thresholded", float("nan")) for v in sorted(evals)}}


def mean_se(values: list[float]) -> tuple[float, float]:
    vals = [v for v in values if math.isfinite(v)]
    if not vals:
        return float("nan"), float("nan")
    mean = sum(vals) / len(vals)
    return mean, (statistics.stdev(vals) / math.sqrt(len(vals)) if len(vals) > 1 else float("nan"))


def compare(per_run: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The per-mode means over seeds and the difference between the modes."""
    res: dict[str, Any] = {}
    if any(not per_run.get(m) for m in MODES):
        return {}  # one mode only: nothing to compare
    for mode in MODES:
        for key in ("final_reward", "mid_reward"):
            m, se = mean_se([r[key] for r in per_run[mode]])
            res[f"{key}_{mode}"], res[f"{key}_stderr_{mode}"] = m, se
        res[f"step_s_median_{mode}"] = statistics.median(r["step_s_median"] for r in per_run[mode])
    diff = res["final_reward_fully_async"] - res["final_reward_colocate"]
    se_diff = math.hypot(res["final_reward_stderr_colocate"], res["final_reward_stderr_fully_async"])
    res["final_reward_difference"] = diff
    res["final_reward_difference_stderr"] = se_diff
    res["same_within_noise"] = abs(diff) <= 2 * se_diff if math.isfinite(se_diff) else None
    return res


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="relax-hpc bench learning", description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--recipe", default=str(DEMO_RECIPE), help="recipe (default: recipes/demo.yaml)")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated recipe seeds (default: 0,1,2)")
    p.add_argument("--steps", type=int, default=None, help="trainer steps of each run (default: the recipe's)")
    p.add_argument("--last", type=int, default=50, help="final reward = mean over the last LAST steps")
    p.add_argument("--mid", type=int, default=None, help="step of the mid-curve reward (default: 3/8 of the steps)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe field in every run (repeatable)")
    p.add_argument("--out", default=None, help="folder for the run dirs (default: a new temporary folder)")
    p.add_argument("--keep", action="store_true", help="keep the run dirs (and write result.json beside them)")
    p.add_argument("--timeout-s", type=float, default=3600.0, help="limit for each run")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated modes to run (default: both)")
    p.add_argument("--dry-run", action="store_true",
                   help="validate each run's recipe and check its held-out set; run nothing")
    p.add_argument("--runs", default=None, metavar="DIR[,DIR...]",
                   help="report the figures of these run dirs (finished or running); launch nothing")
    a = p.parse_args(argv)
    a.modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    if not a.modes or any(m not in MODES for m in a.modes):
        p.error(f"--modes takes {' and/or '.join(MODES)}, got {','.join(a.modes) or 'nothing'}")
    try:
        a.seeds = [int(s) for s in a.seeds.split(",") if s.strip()]
    except ValueError:
        p.error(f"--seeds takes comma-separated integers, got {a.seeds!r}")
    if not a.seeds or a.last < 1 or (a.steps is not None and a.steps < 2):
        p.error("give at least one seed, --last >= 1 and --steps >= 2")
    return a


def main(argv: list[str] | None = None) -> int:
    from relax_hpc.config.load import load_recipe

    a = parse_args(argv)
    signal.signal(signal.SIGTERM, interrupt)
    recipe = Path(a.recipe)
    if not recipe.is_file():
        print(f"error: recipe {recipe} not found (give --recipe)", file=sys.stderr)
        return 2
    common = ([f"num_steps={a.steps}"] if a.steps else []) + a.overrides
    dirs = ScratchDirs(a.out, keep=a.keep, prefix="relax-bench-learning-")

    if a.dry_run:
        return dry_run(recipe, common, a)
    if a.runs is not None:
        return report_run_dirs(a)

    def body() -> dict[str, Any]:
        num_steps = load_recipe(recipe, common).num_steps
        mid = a.mid or max(1, num_steps * 3 // 8)
        res: dict[str, Any] = {"benchmark": "learning", "recipe": str(recipe), "overrides": common, "seeds": a.seeds,
                               "num_steps": num_steps, "last": a.last, "mid": mid}
        per_run: dict[str, list[dict[str, Any]]] = {m: [] for m in a.modes}
        for seed in a.seeds:
            for mode in a.modes:
                t0 = time.monotonic()
                run = run_mode(recipe, [*common, f"mode={mode}", f"seed={seed}"], dirs.new(f"{mode}-seed{seed}"),
                               timeout_s=a.timeout_s)
                per_run[mode].append({"seed": seed, **run_figures(run, last=a.last, mid=mid),
                                      "wall_s": time.monotonic() - t0})
        return {**res, "runs": per_run, **compare(per_run)}

    res = run_guarded(body, dirs)
    if isinstance(res, int):
        return res
    return report(res, dirs, as_json=a.json, text=print_text)


def report_run_dirs(a: argparse.Namespace) -> int:
    """``--runs``: the figures of run dirs already there."""
    dirs = [Path(d.strip()) for d in a.runs.split(",") if d.strip()]
    try:
        res = figures_of_run_dirs(dirs, last=a.last, mid=a.mid)
    except (UserError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps(res, indent=1))
    else:
        print_text(res)
    return 0


def dry_run(recipe: Path, common: list[str], a: argparse.Namespace) -> int:
    """Validate every run of the benchmark (recipe, overrides, the model folder, the held-out set); run nothing."""
    from relax_hpc.config.load import load_recipe
    from relax_hpc.errors import UserError

    try:
        for seed in a.seeds:
            for mode in a.modes:
                cfg = load_recipe(recipe, [*common, f"mode={mode}", f"seed={seed}"])
                held = ""
                if cfg.eval is not None:
                    from relax_hpc.eval.heldout import load_heldout
                    from relax_hpc.models.load import load_tokenizer

                    n = len(load_heldout(cfg, load_tokenizer(cfg.model)).prompts)
                    held = f", {n} held-out prompts checked against the training data"
                print(f"ok: {mode} seed {seed}: {cfg.num_steps} steps, model {cfg.model.path}{held}")
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def print_text(res: dict[str, Any]) -> None:
    print(f"{res['recipe']}: {res['num_steps']} steps per run, final reward = mean of the last {res['last']} steps")
    print(f"{'mode':12s} {'seed':>4s} {'first 10':>9s} {'mid':>6s} {'final':>6s} {'step s':>7s} {'stale/step':>10s}")
    for mode, runs in res["runs"].items():
        for r in runs:
            print(f"{mode:12s} {r['seed']:4d} {r['first_reward']:9.3f} {r['mid_reward']:6.3f} {r['final_reward']:6.3f} "
                  f"{r['step_s_median']:7.3f} {r['stale_dropped_per_step']:10.1f}")
    for mode, runs in res["runs"].items():
        for r in runs:
            if "eval_first_accuracy" in r:
                print(f"{mode:12s} seed {r['seed']}: eval accuracy {r['eval_first_accuracy']:.3f} "
                      f"(v{r['eval_first_version']}) -> {r['eval_last_accuracy']:.3f} (v{r['eval_last_version']}); "
                      f"correct {r['eval_first_correct']:.3f} -> {r['eval_last_correct']:.3f}; "
                      f"mismatch KL max {r['mismatch_kl_max']:.3g}; wall {r['wall_s']:.0f}s")
    if "final_reward_difference" not in res:
        return
    for mode in MODES:
        print(f"{mode:12s} final {res[f'final_reward_{mode}']:.3f} +- {res[f'final_reward_stderr_{mode}']:.3f}, "
              f"mid {res[f'mid_reward_{mode}']:.3f} (mean +- s.e. over seeds)")
    print(f"difference fully_async - colocate: {res['final_reward_difference']:+.3f} "
          f"+- {res['final_reward_difference_stderr']:.3f}; same within noise (2 s.e.): {res['same_within_noise']}")


if __name__ == "__main__":
    raise SystemExit(main())
