"""The trainer ranks' default process group, formed through the run dir (no MASTER_ADDR juggling on Slurm)."""

from __future__ import annotations

from relax_hpc.rundir import RunDir


def init_trainer_group(run_dir: RunDir, rank: int, world_size: int, device_pref: str,
                       timeout_s: float = 600.0) -> None:
    """Initialise torch.distributed's default group among the trainer ranks (no-op for one rank)."""
    if world_size <= 1:
        return
    import datetime

    import torch
    import torch.distributed as dist

    from relax_hpc.rendezvous import rendezvous_store

    store = rendezvous_store(run_dir, "trainer", rank=rank, world_size=world_size, timeout_s=timeout_s)
    backend = "nccl" if device_pref != "cpu" and torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
