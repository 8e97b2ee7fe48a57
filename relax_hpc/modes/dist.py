"""The trainer ranks' default process group, formed through the run dir (no MASTER_ADDR juggling on Slurm)."""

from __future__ import annotations

from relax_hpc.rundir import RunDir


def init_trainer_group(run_dir: RunDir, rank: int, world_size: int, device_pref: str,
                       timeout_s: float = 600.0) -> None:
    """Initialise torch.distributed's default group among the trainer ranks (no-op for one rank): through the run
    dir, or from torchrun's environment (``MASTER_ADDR``/``MASTER_PORT``) when torchrun started this process."""
    if world_size <= 1:
        return
    import datetime
    import os

    import torch
    import torch.distributed as dist

    from relax_hpc.errors import UserError
    from relax_hpc.rendezvous import rendezvous_store

    backend = "nccl" if device_pref != "cpu" and torch.cuda.is_available() else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    torchrun = "TORCHELASTIC_RUN_ID" in os.environ
    if backend == "nccl":
        local = int(os.environ["LOCAL_RANK"]) if torchrun else rank
        # launch.trainer.gpus: the local executor put this rank's own GPU first in CUDA_VISIBLE_DEVICES
        torch.cuda.set_device(0 if "RELAX_HPC_GPU" in os.environ else local % torch.cuda.device_count())
    if torchrun:
        if int(os.environ["WORLD_SIZE"]) != world_size:
            raise UserError(f"torchrun started {os.environ['WORLD_SIZE']} processes but trainer.num_ranks="
                            f"{world_size}; use nodes x tasks_per_node = trainer.num_ranks")
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size, timeout=timeout)
        return
    store = rendezvous_store(run_dir, "trainer", rank=rank, world_size=world_size, timeout_s=timeout_s)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
