"""LoRA figures of docs/lora.md.

  python tools/lora_figures.py sizes [--rank 16]   # adapter snapshot vs full snapshot bytes, Qwen3-0.6B shape
  python tools/lora_figures.py decode              # hf engine decode: PEFT modules vs the adapter merged (tiny demo)
  python tools/lora_figures.py warmup RECIPE [--set KEY=VALUE ...]   # the supervised warm-up's final loss alone

``sizes`` builds the Qwen3-0.6B shape from its config on the meta device (no download, no weights), counts the full
snapshot's bytes (bfloat16, the tied embedding once) and publishes a real adapter snapshot (zeros of the adapter's
shapes, default targets) into a temporary run dir, counting every file of its folder.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

QWEN3_0_6B = {"hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
              "head_dim": 128, "intermediate_size": 3072, "vocab_size": 151936, "tie_word_embeddings": True,
              "max_position_embeddings": 40960}
"""Qwen/Qwen3-0.6B's config.json (the shape only)."""


def sizes(rank: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    from relax_hpc.config.schema import LoraConfig
    from relax_hpc.models.lora import adapter_template
    from relax_hpc.rundir import RunDir
    from relax_hpc.weights.publisher import SnapshotPublisher

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(Qwen3Config(**QWEN3_0_6B), dtype=torch.bfloat16)
    seen, full = set(), 0
    for p in model.parameters():  # parameters() yields a tied tensor once
        if id(p) not in seen:
            seen.add(id(p))
            full += p.numel() * 2
    lora = LoraConfig(rank=rank)
    adapter = {k: torch.zeros(v.shape, dtype=torch.bfloat16) for k, v in adapter_template(model, lora).items()}
    with tempfile.TemporaryDirectory() as tmp:
        rd = RunDir.create(Path(tmp) / "run")
        folder = SnapshotPublisher(rd).publish(adapter, version=1, step=1, model_config=model.config.to_dict(),
                                               adapter={"config": {"r": rank}, "base": {"path": "Qwen3-0.6B"}})
        on_disk = sum(f.stat().st_size for f in folder.iterdir())
        tensors = (folder / "adapter_model.safetensors").stat().st_size
    print(f"Qwen3-0.6B shape, bfloat16: full snapshot {full / 1e6:.1f} MB of tensors; rank-{rank} adapter snapshot "
          f"{on_disk / 1e6:.2f} MB on disk ({tensors / 1e6:.2f} MB adapter_model.safetensors) = "
          f"{100 * on_disk / full:.2f} % of the full snapshot")


def decode() -> None:
    import torch
    import yaml

    from relax_hpc.config.load import validate_dict
    from relax_hpc.models.load import load_model, load_tokenizer
    from relax_hpc.models.lora import AdapterMerger, adapter_state, apply_lora

    torch.manual_seed(0)
    torch.set_num_threads(1)  # one thread, as the figures in docs/lora.md were taken
    d = yaml.safe_load((ROOT / "recipes" / "demo.yaml").read_text())
    d["model"]["lora"] = {"rank": 16}
    cfg = validate_dict(d)
    tok = load_tokenizer(cfg.model)
    model = load_model(cfg.model, tok, device="cpu", dtype=torch.float32)
    plain = copy.deepcopy(model)
    peft = apply_lora(model, cfg.model.lora)
    t0 = time.perf_counter()
    AdapterMerger(plain, cfg.model.lora.alpha / cfg.model.lora.rank).apply(adapter_state(peft))
    t_merge = time.perf_counter() - t0
    x = torch.randint(3, len(tok), (128, 12))

    def gen(m: torch.nn.Module) -> None:
        m.eval()
        with torch.no_grad():
            m.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=8, do_sample=False,
                       pad_token_id=tok.pad_token_id)

    times: dict[str, list[float]] = {"merged": [], "peft": []}
    mods = {"merged": plain, "peft": peft.get_base_model()}
    for m in mods.values():
        gen(m)
    for _ in range(8):  # interleaved, so load from other processes falls on both alike
        for name, m in mods.items():
            t0 = time.perf_counter()
            gen(m)
            times[name].append(time.perf_counter() - t0)
    for name, ts in times.items():
        print(f"{name}: median {statistics.median(ts) * 1e3:.1f} ms, min {min(ts) * 1e3:.1f} ms per batch of 128 "
              "prompts x 8 new tokens")
    print(f"merging one adapter version: {t_merge * 1e3:.1f} ms")


def warmup(recipe: str, overrides: list[str]) -> None:
    """The recipe's supervised warm-up (``warmup`` section) alone, on the trainer backend it builds (``model.lora``
    included): its final loss, the quick check of a LoRA setting before an RL run."""
    import torch

    from relax_hpc.algorithms import registry
    from relax_hpc.config.load import load_recipe
    from relax_hpc.models.load import load_model, load_tokenizer
    from relax_hpc.modes.components import seed_everything
    from relax_hpc.modes.trainer_role import warmup_stream
    from relax_hpc.trainer.backend import make_backend

    cfg = load_recipe(recipe, overrides)
    seed_everything(cfg.seed)  # as the trainer role does: the adapters' random init
    tok = load_tokenizer(cfg.model)
    model = load_model(cfg.model, tok, device="cpu", dtype=torch.float32)
    be = make_backend(cfg, rank=0, world_size=1, device="cpu", dtype=torch.float32,
                      algorithm=registry.get_algorithm(cfg.algorithm.name), tokenizer=tok, model=model)
    w = cfg.warmup
    m = be.sft_warmup(warmup_stream(cfg, tok), tok, steps=w.steps, lr=w.lr, batch_size=w.batch_size,
                      max_tokens=cfg.trainer.micro_batch_tokens)
    print(f"warm-up: {w.steps} steps, lr {w.lr}, final loss {m['warmup/loss']:.3f} ({' '.join(overrides)})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["sizes", "decode", "warmup"])
    ap.add_argument("recipe", nargs="?", default=str(ROOT / "recipes" / "demo.yaml"))
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    a = ap.parse_args()
    if a.what == "warmup":
        warmup(a.recipe, a.overrides)
    else:
        sizes(a.rank) if a.what == "sizes" else decode()


if __name__ == "__main__":
    main()
