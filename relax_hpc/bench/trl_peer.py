"""TRL's ``GRPOTrainer`` as the peer of ``bench step``: the same model folder, prompts, batch and lengths.

transformers generate (no vLLM), bf16, one GPU: a per-device batch of ``prompts x samples / 4`` completions with
4 gradient-accumulation steps (= ``prompts`` prompts x ``samples`` generations per optimizer step), up to
``new_tokens`` new tokens, no KL term (beta 0), a constant zero reward (the figure is time, not learning).
Seconds per optimizer step come from a callback that synchronises the GPU at each step end. Needs the optional
``trl`` extra (trl, datasets).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any


def run_trl(folder: Path, data: Path, system: str, *, prompts: int, samples: int, new_tokens: int,
            steps: int) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    rows = [json.loads(line) for line in data.read_text().splitlines() if line.strip()]
    ds = Dataset.from_list([{"prompt": [{"role": "system", "content": system},
                                        {"role": "user", "content": r["prompt"]}]} for r in rows])
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)

    def zero_reward(completions: list[Any], **_: Any) -> list[float]:
        return [0.0 for _ in completions]

    class StepTimes(TrainerCallback):
        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            torch.cuda.synchronize()
            self.ends.append(time.perf_counter())

    accum = 4
    per_device = prompts * samples // accum
    with tempfile.TemporaryDirectory(prefix="relax-trl-") as out:
        cfg = GRPOConfig(output_dir=out, per_device_train_batch_size=per_device, gradient_accumulation_steps=accum,
                         num_generations=samples, max_completion_length=new_tokens, temperature=1.0,
                         learning_rate=1e-6, bf16=True, max_steps=steps, logging_steps=1, report_to=[],
                         save_strategy="no", beta=0.0, use_vllm=False, epsilon_high=0.28,
                         gradient_checkpointing=False)
        timer = StepTimes()
        trainer = GRPOTrainer(model=model, reward_funcs=zero_reward, args=cfg, train_dataset=ds,
                              processing_class=tok, callbacks=[timer])
        t0 = time.perf_counter()
        trainer.train()
    starts = [t0, *timer.ends[:-1]]
    dts = [b - a for a, b in zip(starts, timer.ends)]
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    res: dict[str, Any] = {"trl_step_s": [round(x, 2) for x in dts]}
    if len(dts) > 1:
        res["trl_step_s_median"] = statistics.median(dts[1:])
    if lengths:
        res["trl_completion_length_mean"] = statistics.mean(lengths)
    del trainer, model
    torch.cuda.empty_cache()
    return res
