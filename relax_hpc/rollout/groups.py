"""Turn prompts + completions + rewards into store groups (the rollout side of the sample store)."""

from __future__ import annotations

from typing import Any

import numpy as np

from relax_hpc.rollout.engine import Completion


def score_completions(reward_runner: Any, tokenizer: Any, prompts: list[Any],
                      completions: list[list[Completion]]) -> tuple[list[list[str]], Any]:
    """Decode every completion and score it. Returns (texts per prompt, RewardResult over the flat list)."""
    texts = [[tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in group] for group in completions]
    flat = [t for g in texts for t in g]
    answers = [p.answer for p, g in zip(prompts, completions) for _ in g]
    metas = [p.meta for p, g in zip(prompts, completions) for _ in g]
    return texts, reward_runner.score(flat, answers, metas)


def build_groups(prompts: list[Any], completions: list[list[Completion]], result: Any, *, writer_id: str,
                 counter: int, version: int) -> tuple[list[Any], dict[str, float]]:
    """Store groups for scored completions. A group with a sample whose reward failed under ``on_error=drop`` is
    dropped whole (counted). Returns (groups, counts)."""
    from relax_hpc.store.sample import Sample, SampleGroup

    groups: list[Any] = []
    dropped = 0
    k = 0
    rewards = np.asarray(result.rewards, dtype=np.float32)
    drop = np.asarray(getattr(result, "dropped", np.zeros(len(rewards), dtype=bool)))
    for i, (prompt, comps) in enumerate(zip(prompts, completions)):
        idx = range(k, k + len(comps))
        k += len(comps)
        if drop[list(idx)].any():
            dropped += 1
            continue
        gid = f"{writer_id}:{counter + i}"
        samples = []
        for j, c in zip(idx, comps):
            extras = {name: float(np.asarray(v)[j]) for name, v in getattr(result, "extras", {}).items()}
            samples.append(Sample(
                prompt_ids=np.asarray(prompt.prompt_ids, dtype=np.int32), response_ids=c.token_ids,
                logprobs=c.logprobs, reward=float(rewards[j]), version=version, version_first=c.version_first,
                version_last=c.version_last, rewards=extras, timings=dict(c.timings),
                metadata={"finish_reason": c.finish_reason, **({"prompt": prompt.meta} if prompt.meta else {})},
                tensors=dict(prompt.multimodal or {}),
            ))
        groups.append(SampleGroup(group_id=gid, samples=samples))
    return groups, {"rollout/groups_dropped_reward_error": float(dropped)}


def samples_to_items(samples: list[Any]) -> list[Any]:
    """Store samples -> trainer items (the trainer never sees the store's classes)."""
    from relax_hpc.store.sample import to_torch
    from relax_hpc.trainer.batch import TrainItem

    nd = np.ndarray
    items: list[Any] = [None] * len(samples)
    for i, s in enumerate(samples):
        p, r, lp, m = s.prompt_ids, s.response_ids, s.logprobs, s.loss_mask
        if m is None:
            m = np.ones(len(r), dtype=np.uint8)
        mm = {k: to_torch(v, s.tensor_dtypes.get(k)) for k, v in s.tensors.items()} if s.tensors else {}
        items[i] = TrainItem(prompt_ids=p if type(p) is nd else np.asarray(p),
                             response_ids=r if type(r) is nd else np.asarray(r),
                             rollout_logprobs=lp if type(lp) is nd else np.asarray(lp),
                             loss_mask=m if type(m) is nd else np.asarray(m),
                             reward=float(s.reward), version=int(s.version), group_id=s.group_id, multimodal=mm)
    return items
