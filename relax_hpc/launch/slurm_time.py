"""Does a job's time limit fit the checkpoint interval? A rough estimate, for a warning (never an error).

How a step's duration is estimated, best source first:

1. measured: the median ``perf/step_time`` of the last metrics records in the run dir (a resumed run);
2. otherwise a deliberately rough throughput model: tokens per step = ``prompts_per_step x n_samples x
   (max_new_tokens + 64)``; generation at ~2,000 tokens/s per GPU (hf engine; ~10,000 with sglang) or ~300
   tokens/s per CPU worker; training at ~20,000 tokens/s per GPU or ~2,000 per CPU rank. The roles that generate
   and train come from the role table: when one role does both (colocate) the two phases add up, when different
   roles do them (fully_async) they overlap (the slower one sets the pace).

The usable time of one job is ``time_min x 60 - signal_delay_s - 60 s`` (start-up). When ``checkpoint_every`` steps
take longer than that, a job that dies without the preemption signal's grace (node failure, hard kill) loses all
its steps; the warning says so and suggests a smaller ``trainer.checkpoint_every``.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from relax_hpc.config.schema import RecipeConfig
from relax_hpc.roles import spec as roles
from relax_hpc.rundir import RunDir, proc_name

STARTUP_S = 60.0
PROMPT_TOKENS = 64


def _tail_lines(path: Path, max_bytes: int = 262_144) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read()
    except OSError:
        return []
    lines = data.decode(errors="replace").splitlines()
    return lines[1:] if size > max_bytes else lines


def measured_step_time(rd: RunDir, *, last: int = 20) -> float | None:
    """Median ``perf/step_time`` of the trainer's last ``last`` metrics records, if any were logged."""
    for role in roles.trainer_side_names():
        times = []
        for line in reversed(_tail_lines(rd.event_log(proc_name(role, 0)))):
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            value = rec.get("metrics", {}).get("perf/step_time") if rec.get("kind") == "metrics" else None
            if isinstance(value, (int, float)) and value > 0:
                times.append(float(value))
                if len(times) >= last:
                    break
        if times:
            return statistics.median(times)
    return None


def _gpus_and_ranks(cfg: RecipeConfig, role: roles.RoleSpec) -> tuple[int, int]:
    """(GPUs, ranks) of a role: an elastic role in placement ``separate`` has one node per rank (a job array)."""
    res, n = roles.resources(cfg, role), roles.num_ranks(cfg, role)
    one_node_each = role.elastic and roles.placement(cfg) == "separate"
    return res.gpus_per_node * (n if one_node_each else res.nodes), n


def modelled_step_time(cfg: RecipeConfig) -> float:
    """The rough throughput model of the module docstring (seconds per trainer step)."""
    tokens = cfg.rollout.prompts_per_step * cfg.rollout.n_samples * (cfg.rollout.sampling.max_new_tokens
                                                                     + PROMPT_TOKENS)
    per_gpu = 10_000.0 if cfg.rollout.engine == "sglang" else 2_000.0
    mode = roles.mode_spec(cfg)
    gen = [_gpus_and_ranks(cfg, r) for r in mode.roles if r.generates]
    train = [_gpus_and_ranks(cfg, r) for r in mode.roles if r.trains]
    gen_gpus, train_gpus = sum(g for g, _ in gen), sum(g for g, _ in train)
    gen_rate = per_gpu * gen_gpus if gen_gpus else 300.0 * sum(n for _, n in gen)
    train_rate = 20_000.0 * train_gpus if train_gpus else 2_000.0 * sum(n for _, n in train)
    gen_s, train_s = tokens / gen_rate, tokens / train_rate
    return max(gen_s, train_s) if mode.overlapped else gen_s + train_s


def time_limit_warnings(cfg: RecipeConfig, rd: RunDir | None = None) -> list[str]:
    """Warnings about ``launch.time_min`` against ``launch.signal_delay_s`` and ``trainer.checkpoint_every``."""
    launch = cfg.launch
    limit_s = launch.time_min * 60.0
    usable_s = limit_s - launch.signal_delay_s - STARTUP_S
    if usable_s <= 0:
        return [f"launch.time_min={launch.time_min} min leaves no time to train: the preemption signal comes "
                f"{launch.signal_delay_s}s before the limit and start-up takes ~{STARTUP_S:.0f}s"]
    measured = measured_step_time(rd) if rd is not None else None
    step_s = measured if measured is not None else modelled_step_time(cfg)
    how = "measured in this run dir" if measured is not None else "rough throughput estimate"
    every = cfg.trainer.checkpoint_every
    interval_s = every * step_s
    if interval_s <= usable_s:
        return []
    fit = max(1, int(usable_s // step_s))
    return [f"launch.time_min={launch.time_min} leaves ~{usable_s / 60:.0f} min of training per job, but "
            f"trainer.checkpoint_every={every} steps take ~{interval_s / 60:.0f} min at ~{step_s:.1f} s/step "
            f"({how}): only the preemption signal's checkpoint saves a job's work; consider "
            f"trainer.checkpoint_every <= {fit} or a longer launch.time_min"]
