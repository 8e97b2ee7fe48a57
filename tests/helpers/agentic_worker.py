"""A rollout worker process for the kill/resume test: runs groups of episodes of the tiny digit-lookup recipe and
writes each group as one shard; on start it resumes after the groups it already published (its shards on disk).

    python tests/helpers/agentic_worker.py RUN_DIR WRITER_ID NUM_GROUPS
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from agentic_helpers import ModelEngine, env_driver, task_prompts

from relax_hpc.config.load import load_recipe
from relax_hpc.envs.api import Task
from relax_hpc.models.tiny import build_digits_tokenizer, build_tiny_model
from relax_hpc.rundir import RunDir
from relax_hpc.store.layout import list_shards
from relax_hpc.store.writer import ShardWriter

RECIPE = Path(__file__).parents[2] / "recipes" / "tiny-digit-lookup-tool.yaml"


def run(rd: RunDir, writer_id: str, num_groups: int) -> None:
    cfg = load_recipe(RECIPE)
    tok = build_digits_tokenizer()
    torch.manual_seed(0)
    model = build_tiny_model(cfg.model.tiny, len(tok), pad_token_id=tok.pad_token_id)
    engine = ModelEngine(model, tok, chunk=1)  # slow turns: the kill lands mid-episode
    writer = ShardWriter(rd, writer_id)
    driver = env_driver(cfg, tok, engine, n=4, writer=writer, writer_id=writer_id)
    start = len(list_shards(rd, writer_id))
    driver.counter = start  # group ids continue after the published ones
    print(f"resume at group {start}", flush=True)
    for i in range(start, num_groups):
        driver.run_batch(task_prompts([Task(f"{i % 100:02d}")]))  # one group, one shard
        print(f"wrote {i}", flush=True)
    writer.close()


if __name__ == "__main__":
    run(RunDir.open(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
