"""The tiny tool task learns: GRPO on ``digit_lookup`` (the answer is a secret only the tool knows) with the tiny
model and the built-in digits tokenizer, episodes through the rollout driver's multi-turn path, updates by the real
torch trainer.
Prints the success rate (greedy, held-out prompts) and the tool-call rate before and after. A diagnostic beside
the real pipeline (``relax-hpc submit`` of the recipe, whose warm-up is the environment's ``warmup_examples`` hook:
tests/integration/test_envs_learning.py): this loop adds greedy evaluation on held-out prompts.

    python tests/helpers/agentic_learning.py --steps 300
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import numpy as np
import torch
from agentic_helpers import ModelEngine, env_driver, task_prompts

from relax_hpc.algorithms.registry import get_algorithm
from relax_hpc.config.load import load_recipe
from relax_hpc.envs.api import Task
from relax_hpc.envs.metrics import episode_metrics, stats_of_samples
from relax_hpc.models.tiny import build_digits_tokenizer, build_tiny_model
from relax_hpc.trainer.items import samples_to_items
from relax_hpc.trainer.torch_trainer import TorchTrainer

RECIPE = Path(__file__).parents[2] / "recipes" / "tiny-digit-lookup-tool.yaml"


def evaluate(cfg, tok, engine: ModelEngine, prompts: list[str], seed: int) -> dict[str, float]:
    """Greedy, one episode per held-out prompt (through the rollout driver's multi-turn path)."""
    driver = env_driver(cfg, tok, engine, n=1, temperature=0.0, writer_id=f"eval-{seed}")
    eps = stats_of_samples(s.metadata for g in driver.call(driver.rollout(task_prompts([Task(p) for p in prompts])))
                           for s in g)
    return {"success": float(np.mean([e.reward >= 1.0 for e in eps])),
            "tool_call_rate": float(np.mean([e.tool_calls > 0 for e in eps]))}


def reading_warmup(model, tok, steps: int, rng: random.Random, length: int = 1) -> None:
    """Teach the model to copy a tool's answer of ``length`` digits into its own (``<bos>47=C<eos>39=`` ->
    ``39<eos>``, also after call turns with more after the ``C``, as sampled call turns have): the skill after the
    call. Whether to call the tool - the first turn - is never shown: the first-turn distribution is held at
    uniform over the turns that make sense (the ten digits of a direct answer and the call ``C``; cross-entropy to
    uniform), so calling is exactly as likely as answering any one digit and RL has to find that it pays. (Uniform
    over the whole vocabulary, padding and markers included, let the first updates push the mass of the sampled
    turns onto tokens that are never rewarded: about half the runs then stayed at reward 0 or on a fixed guess.)"""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    answer_like = torch.tensor([tok.convert_tokens_to_ids(t) for t in "0123456789C"])
    model.train()
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        reads, firsts, targets = [], [], []
        extra = rng.randrange(3)  # what a call turn may hold after its "C" (sampled turns do): one length a batch
        for _ in range(64):
            d, x = f"{rng.randrange(100):02d}", "".join(rng.choice("0123456789") for _ in range(length))
            call = "C" + "".join(rng.choice("0123456789=C") for _ in range(extra))
            msgs = [{"role": "user", "content": d}, {"role": "assistant", "content": call},
                    {"role": "tool", "content": x}]
            answer = [tok.convert_tokens_to_ids(c) for c in x]
            reads.append([*_ids(tok, msgs), *answer])
            targets.append([*answer, tok.eos_token_id])
            firsts.append(_ids(tok, msgs[:1]))
        read = torch.tensor(reads)  # all the same length: [64, L]
        logits = model(input_ids=read).logits[:, -length - 1:]  # at "=" and at the answer: the answer, <eos>
        copy = -torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(targets)[..., None]).mean()
        first = torch.log_softmax(model(input_ids=torch.tensor(firsts)).logits[:, -1].float(), -1)
        loss = copy - first[:, answer_like].mean()  # + cross-entropy of the first turn to uniform over them
        opt.zero_grad()
        loss.backward()
        opt.step()
    print(json.dumps({"reading_warmup_steps": steps, "loss": round(float(loss.detach()), 4)}), flush=True)


def _ids(tok, msgs) -> list[int]:
    return tok(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
               add_special_tokens=False)["input_ids"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--warmup-steps", type=int, default=100,
                    help="supervised steps on reading a tool answer (never on calling the tool)")
    ap.add_argument("--set", action="append", default=[], help="recipe override key=value (repeatable)")
    args = ap.parse_args(argv)
    cfg = load_recipe(RECIPE, ["trainer.lr=0.003", *args.set])  # its figures (docs/benchmarks.md) used 3e-3
    torch.set_num_threads(1)  # one thread: runs beside others on a small machine without oversubscribing it
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    tok = build_digits_tokenizer()
    model = build_tiny_model(cfg.model.tiny, len(tok), seed=args.seed, pad_token_id=tok.pad_token_id)
    engine = ModelEngine(model, tok, chunk=cfg.rollout.sampling.max_new_tokens)
    driver = env_driver(cfg, tok, engine)
    trainer = TorchTrainer(cfg, model, device="cpu", dtype=torch.float32, algorithm=get_algorithm(cfg.algorithm.name))
    algo = trainer.algorithm
    rng = random.Random(args.seed)
    held_out = [f"{rng.randrange(100):02d}" for _ in range(200)]
    reading_warmup(model, tok, args.warmup_steps, rng, int(cfg.rollout.env.kwargs.get("length", 1)))
    before = evaluate(cfg, tok, engine, held_out, 10**6)
    print(json.dumps({"step": 0, **before}), flush=True)
    t0 = time.time()
    for step in range(1, args.steps + 1):
        prompts = [f"{rng.randrange(100):02d}" for _ in range(cfg.rollout.prompts_per_step)]
        res = driver.run_batch(task_prompts([Task(p) for p in prompts]))  # the groups to train on, rewards set
        stats = stats_of_samples(s.metadata for g in res.generated for s in g)
        items = samples_to_items([s for g in res.groups for s in g.samples])
        rewards = np.array([it.sample.reward for it in items], dtype=np.float32)
        gids = np.array([it.sample.group_id for it in items])
        adv = algo.sequence_advantages(rewards, gids, cfg.algorithm)
        for it, a in zip(items, adv):
            it.advantage = float(a)
        m = trainer.train_step(items)
        engine.version = trainer.step
        if step % 10 == 0:
            am = episode_metrics(stats)
            print(json.dumps({"step": step, "reward": round(am["agent/episode_reward"], 3),
                              "turns": round(am["agent/turns_per_episode"], 2),
                              "tool_calls_per_turn": round(am["agent/tool_calls_per_turn"], 2),
                              "loss": round(m["train/loss"], 4), "s": round(time.time() - t0, 1)}), flush=True)
        if step % args.eval_every == 0 or step == args.steps:
            print(json.dumps({"step": step, **evaluate(cfg, tok, engine, held_out, 10**6)}), flush=True)
    after = evaluate(cfg, tok, engine, held_out, 10**6)
    print(json.dumps({"before": before, "after": after, "steps": args.steps, "seconds": round(time.time() - t0)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
