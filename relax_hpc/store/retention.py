"""Retention: what happens to shards below a *committed* position, and to old plan files.

Only :meth:`ConsumerGroup.commit` calls these, after the trainer's checkpoint covering the position is durable, so a
crash never loses samples. Quarantined shards are never touched (they live in another folder).
"""

from __future__ import annotations

from typing import Any

from relax_hpc.rundir import RunDir
from relax_hpc.store.layout import list_shards


def delete_consumed(rd: RunDir, position: dict[str, Any], done: dict[str, int] | None = None) -> int:
    """Delete every shard fully consumed at ``position`` (``seq`` below the writer's entry); returns how many.

    ``done`` (updated here) remembers, per writer, the ``seq`` below which this process deleted everything already:
    a writer whose entry did not move since is not listed again (a commit then lists the writers that advanced, not
    every writer of the run)."""
    n = 0
    for writer_id, (seq, _, _) in position["writers"].items():
        if done is not None and done.get(writer_id, 0) >= seq:
            continue
        for ref in list_shards(rd, writer_id):
            if ref.seq >= seq:
                break
            try:
                rd.shard_file(writer_id, ref.name).unlink()
                n += 1
            except FileNotFoundError:
                pass
        if done is not None:
            done[writer_id] = seq
    return n


def prune_plans(rd: RunDir, consumer: str, below_or_at: int) -> int:
    """Delete plan files of steps ``<= below_or_at`` (already covered by a committed checkpoint)."""
    n = 0
    for p in rd.consumer_plans(consumer).glob("step_*.json"):
        try:
            step = int(p.stem[5:])
        except ValueError:
            continue
        if step <= below_or_at:
            p.unlink(missing_ok=True)
            n += 1
    return n
