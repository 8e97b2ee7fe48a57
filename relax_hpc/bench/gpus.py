"""GPU placement and GPU busy sampling for ``relax-hpc bench pipeline --gpus``.

Placement. colocate: ``trainer.num_ranks`` = every GPU, rank r on GPU r (FSDP2 over all of them, each rank generating
its slice of the step's prompts). fully_async: the trainer's ranks on ``trainer`` GPUs, one rollout worker per
``rollout`` GPU (``launch.<role>.gpus``, which the local executor turns into ``CUDA_VISIBLE_DEVICES`` per rank), the
fast path ``auto`` (NCCL between GPUs; with one GPU shared by both roles it is gloo, which NCCL needs).

Busy fraction. A thread runs ``nvidia-smi --query-gpu=index,utilization.gpu`` every ``period_s`` (the share of the
last sample period in which a kernel ran on the GPU) and keeps (time, {gpu: percent}); a window's busy fraction of
a GPU is the mean of its samples inside the window / 100. Without ``nvidia-smi`` on PATH nothing is sampled and the
fractions are None.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, field

QUERY = ["--query-gpu=index,utilization.gpu", "--format=csv,noheader,nounits"]


def one_role(mode: str) -> bool:
    """Whether ``mode`` generates and trains in one role (its ranks on every GPU), from the role table."""
    from relax_hpc.roles.spec import mode_spec

    return any(r.generates and r.trains for r in mode_spec(mode).roles)


@dataclass(frozen=True)
class GpuLayout:
    """Which GPUs each mode's roles use (ids as ``nvidia-smi`` numbers them)."""

    gpus: int
    trainer: tuple[int, ...]
    rollout: tuple[int, ...]

    @classmethod
    def parse(cls, gpus: int, trainer: str | None, rollout: str | None) -> GpuLayout:
        """``--gpus N`` with optional ``--trainer-gpus`` / ``--rollout-gpus`` lists (default: the first N // 2 GPUs
        train, the others generate). ValueError with the reason for a layout that does not fit."""
        if gpus < 2:
            raise ValueError("--gpus must be >= 2 for a multi-GPU layout (1: both roles share the one GPU)")
        t = _ids(trainer) if trainer else tuple(range(gpus // 2))
        r = _ids(rollout) if rollout else tuple(g for g in range(gpus) if g not in t)
        if not t or not r:
            raise ValueError(f"--trainer-gpus {list(t)} and --rollout-gpus {list(r)} must both name GPUs")
        bad = [g for g in (*t, *r) if g >= gpus]
        if bad:
            raise ValueError(f"GPU ids {bad} are outside --gpus {gpus} (ids 0..{gpus - 1})")
        if len(set(t)) != len(t) or len(set(r)) != len(r):
            raise ValueError("--trainer-gpus and --rollout-gpus must not repeat a GPU")
        return cls(gpus, t, r)

    def overrides(self, mode: str) -> list[str]:
        """Recipe overrides placing ``mode``'s roles (``launch.<role>.gpus``, ranks, workers, fast path)."""
        if one_role(mode):
            every = list(range(self.gpus))
            return ["mode=colocate", f"trainer.num_ranks={self.gpus}", f"launch.trainer.gpus={_yaml(every)}"]
        shared = set(self.trainer) & set(self.rollout)
        return ["mode=fully_async", f"trainer.num_ranks={len(self.trainer)}",
                f"launch.trainer.gpus={_yaml(self.trainer)}",
                f"rollout.num_workers={len(self.rollout)}", f"launch.rollout.gpus={_yaml(self.rollout)}",
                # NCCL refuses two ranks on one GPU: a worker sharing trainer rank 0's GPU needs gloo
                f"weights.fast_path={'gloo' if self.trainer[0] in shared else 'auto'}"]

    def env(self, role: str) -> dict[str, str]:
        """The environment of a process measuring ``role`` (``gen``/``train``) alone on the role's first GPU."""
        from relax_hpc.launch.local import cuda_visible

        return cuda_visible((self.rollout if role == "gen" else self.trainer)[0], self.gpus - 1)

    def threads(self, mode: str, cpus: int) -> list[str]:
        """``cpus_per_task`` of each role: this machine's CPUs shared evenly by the mode's processes."""
        procs = self.gpus if one_role(mode) else len(self.trainer) + len(self.rollout)
        k = max(1, cpus // procs)
        return [f"launch.trainer.cpus_per_task={k}"] + ([f"launch.rollout.cpus_per_task={k}"]
                                                         if not one_role(mode) else [])

    def describe(self) -> dict[str, str]:
        return {"colocate": f"trainer.num_ranks={self.gpus}, rank r on GPU r (the backend's parallelism over all: "
                            f"FSDP2 for torch; each rank generates its slice of the prompts)",
                "fully_async": f"trainer ranks on GPUs {list(self.trainer)}, one rollout worker on each of GPUs "
                               f"{list(self.rollout)}"}


def _yaml(ids: list[int] | tuple[int, ...]) -> str:
    return "[" + ",".join(map(str, ids)) + "]"


def _ids(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip() != "")
    except ValueError:
        raise ValueError(f"GPU list {text!r}: give ids separated by commas, e.g. 0,1") from None


def parse_query(text: str) -> dict[int, float]:
    """``{gpu: percent}`` from ``nvidia-smi`` CSV lines ``index, utilization`` (lines that do not parse are skipped:
    ``[N/A]`` on GPUs that do not report it)."""
    out = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit():
            try:
                out[int(parts[0])] = float(parts[1])
            except ValueError:
                continue
    return out


@dataclass
class GpuSampler:
    """Samples every GPU's utilisation in a thread while a mode runs (a no-op without ``nvidia-smi``)."""

    period_s: float = 0.5
    command: str = "nvidia-smi"
    samples: list[tuple[float, dict[int, float]]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    @property
    def available(self) -> bool:
        return shutil.which(self.command) is not None

    def __enter__(self) -> GpuSampler:
        if self.available:
            self._thread = threading.Thread(target=self._loop, name="gpu-sampler", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                out = subprocess.run([self.command, *QUERY], capture_output=True, text=True, timeout=10).stdout
            except (OSError, subprocess.SubprocessError):
                out = ""
            now = time.time()
            if (util := parse_query(out)):
                self.samples.append((now, util))
            self._stop.wait(self.period_s)

    def busy(self, start: float, end: float) -> dict[str, float] | None:
        """Each GPU's mean busy fraction over the samples in [start, end] (None: nothing sampled there)."""
        inside = [u for t, u in self.samples if start <= t <= end]
        if not inside:
            return None
        gpus = sorted({g for u in inside for g in u})
        return {str(g): sum(u.get(g, 0.0) for u in inside) / len(inside) / 100.0 for g in gpus}
