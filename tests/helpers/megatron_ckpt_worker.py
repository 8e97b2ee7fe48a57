"""One trainer rank of the megatron checkpoint tests (tests/integration/test_megatron_checkpoint.py): the run loop's
checkpoint
bookkeeping (:class:`~relax_hpc.trainer.session.TrainerSession`) around the megatron backend, over gloo on the CPU,
under torchrun (two ranks: TP=1 x DP=2) or alone (one rank).

``python megatron_ckpt_worker.py OUT SPEC`` with ``SPEC`` a JSON list of runs, done one after the other in this
process, each ``{"name", "dir", "format", "steps"}`` and optionally ``"crash_at"``. A run builds the backend from
the same tiny HF model (``trainer.megatron.checkpoint_format: <format>``), resumes from the run dir's latest
checkpoint, trains on fixed items (step ``s`` trains on ``make_items(12, seed=100 + s)``, this replica's share of the
groups) up to ``steps`` with a checkpoint every 2 steps (the store position it holds is ``{"step": s}``), and rank 0
writes the final weights (HF names) to ``OUT/<name>.safetensors`` and what it resumed from to ``OUT/<name>.json``.
With ``crash_at: s``, rank 0 writes the weights of step ``s`` first, then rank 1 dies in the middle of that step's
checkpoint (its shards written, its part not): torchrun takes the other rank down.

Heavy imports stay inside :func:`main`: megatron's checkpoint writer starts a helper process that imports this file.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

_SESSIONS: list[Any] = []


def _close_and_exit(*_: Any) -> None:
    """SIGTERM (torchrun taking the ranks down): no helper process of the checkpoint writer is left behind."""
    for session in _SESSIONS:
        if session.sharded is not None:
            session.sharded.close()
    os._exit(143)


def mine(items: list, dp_rank: int, dp_size: int) -> list:
    """This replica's groups (groups of 4 items, dealt round-robin)."""
    return [it for i, it in enumerate(items) if (i // 4) % dp_size == dp_rank]


def run(out: Path, spec: dict[str, Any], rank: int, world: int) -> None:
    """One run of ``spec`` (module docstring)."""
    import torch
    from backend_conformance import make_cfg, make_items
    from safetensors.torch import save_file

    from relax_hpc.algorithms.registry import get_algorithm
    from relax_hpc.events import EventLog
    from relax_hpc.models.tiny import build_digits_tokenizer, build_tiny_model
    from relax_hpc.rundir import RunDir
    from relax_hpc.trainer.backend import make_backend
    from relax_hpc.trainer.session import TrainerSession

    tok = build_digits_tokenizer()
    cfg = make_cfg(trainer={"backend": "megatron", "num_ranks": world, "checkpoint_every": 2, "keep_checkpoints": 3,
                            "checkpoint_timeout_s": 120, "megatron": {"checkpoint_format": spec["format"]}},
                   algorithm={"loss_agg": "token_mean"})
    hf = build_tiny_model(cfg.model.tiny, len(tok), seed=5, pad_token_id=tok.pad_token_id)
    b = make_backend(cfg, rank=rank, world_size=world, device="cpu", dtype=torch.float32,
                     algorithm=get_algorithm("grpo"), tokenizer=tok, model=hf)
    if rank == 0:
        RunDir.create(spec["dir"], resume=True)
    if world > 1:
        import torch.distributed as dist

        dist.barrier()  # the run dir exists before the other ranks open it
    rd = RunDir(spec["dir"])
    session = TrainerSession(rd, cfg, b, tok, EventLog(rd, "trainer", rank), rank=rank)
    _SESSIONS.append(session)
    state = session.resume()
    resumed = 0 if state is None else state["store_position"]["step"]
    assert resumed == b.step == session.version
    while b.step < spec["steps"]:
        b.train_step(mine(make_items(12, seed=100 + b.step), b.dp_rank, b.dp_size))
        session.version = b.step
        if b.step == spec.get("crash_at"):
            _weights(b, out / f"{spec['name']}.safetensors", rank, save_file)
            if rank == 1:
                _die_in_the_save(session)
        if b.step % 2 == 0:
            session.checkpoint({"store_position": {"step": b.step}})
    _weights(b, out / f"{spec['name']}.safetensors", rank, save_file)
    if rank == 0:
        (out / f"{spec['name']}.json").write_text(json.dumps({"resumed_from": resumed, "dp_size": b.dp_size}))
    session.close()


def _weights(b: Any, path: Path, rank: int, save_file: Any) -> None:
    sd = b.full_state_dict()  # every rank calls
    if rank == 0:
        save_file({k: v.clone().contiguous() for k, v in sd.items()}, str(path))


def _die_in_the_save(session: Any) -> None:
    """This rank's next checkpoint writes its shards, then the process dies before it writes its part."""
    sharded = session.sharded
    real = sharded.save

    def save_then_die(folder: Path) -> None:
        real(folder)
        sharded.close()
        os._exit(1)

    sharded.save = save_then_die


def main(out: Path, specs: list[dict[str, Any]]) -> None:
    import torch.distributed as dist

    signal.signal(signal.SIGTERM, _close_and_exit)
    rank, world = 0, 1
    if "TORCHELASTIC_RUN_ID" in os.environ:
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
    for spec in specs:
        run(out, spec, rank, world)


if __name__ == "__main__":
    main(Path(sys.argv[1]), json.loads(sys.argv[2]))
