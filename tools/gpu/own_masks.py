"""The decode loop (rollout/decode.sample) with its own 4-D masks against the model's mask building, on CUDA:
the same tokens (float32; bf16 rounds differently), and the time of each (tools/gpu/dec1.sh)."""

from __future__ import annotations

import statistics
import time

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import relax_hpc.rollout.decode as decode

torch.manual_seed(0)
cfg = Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=4,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, attn_implementation="sdpa")
model = Qwen3ForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
g = torch.Generator().manual_seed(1)
lengths = torch.randint(40, 120, (32,), generator=g).tolist()
width = max(lengths)
ids = torch.zeros((32, width), dtype=torch.long)
attn = torch.zeros((32, width), dtype=torch.long)
for i, n in enumerate(lengths):
    ids[i, width - n:] = torch.randint(10, 150000, (n,), generator=g)
    attn[i, width - n:] = 1
ids, attn = ids.cuda(), attn.cuda()
real = decode._own_masks


def run(own: bool) -> tuple[float, torch.Tensor]:
    decode._own_masks = (lambda m: own) if not own else real
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    toks, _ = decode.sample(model, ids, attn, n=8, max_new_tokens=64, temperature=0.0, top_k=0, top_p=1.0,
                            eos_id=-1, pad_id=0)
    torch.cuda.synchronize()
    return time.perf_counter() - t0, toks


print("own masks used for this model:", real(model))
same = torch.equal(run(True)[1], run(False)[1])
times: dict[bool, list[float]] = {True: [], False: []}
for _ in range(8):
    for own in (True, False):
        times[own].append(run(own)[0])
for own in (True, False):
    t = times[own]
    print(f"{'own 4-D masks' if own else 'model masks  '}: min {min(t) * 1e3:.1f} ms, median "
          f"{statistics.median(t) * 1e3:.1f} ms per 256 x 64 tokens")
print("same tokens (greedy, bf16):", same)
a, b = run(True)[1], run(False)[1]
agree = (a == b).cumprod(dim=1).sum(dim=1).float()
print(f"bf16: rows equal throughout {(agree == a.shape[1]).sum().item()}/{a.shape[0]}, tokens before the first "
      f"difference: median {agree.median().item():.0f}, min {agree.min().item():.0f}")
model.float()
print("same tokens (greedy, float32):", torch.equal(run(True)[1], run(False)[1]))
