"""Delta snapshots of a real pretrained model on a few CPU training steps: bytes per version against the full base
every K versions, and reconstruction rate against a plain safetensors load of the same bytes.

``relax-hpc bench snapshots --delta --model PATH [--lr 1e-6] [--model-steps 12]``

The model (SmolLM2-135M-Instruct by default, ``~/.cache/relax-hpc/models/``) takes ``steps`` AdamW steps on real
gradients (next-token loss on two-digit additions; Adam's update size is about ``lr`` per element whatever the loss,
so the bytes that change per step are those of an RL step at the same ``lr``). Three ways a trainer holds and
publishes its weights, each published as versions 1..n with every version after the first a delta of version 1:

* ``bf16``: the weights themselves are bf16 and AdamW updates them in place (the torch backend with
  ``model.dtype: bfloat16``): an update far below a bf16 step rounds away, so few elements change;
* ``fp32-master->bf16``: fp32 master weights published as bf16 (mixed precision, Megatron's optimizer): an element
  changes when its master crosses a bf16 rounding boundary, and the changes accumulate over the versions;
* ``float32``: fp32 weights published as fp32 (the CPU recipe): every element's low mantissa bits change each step.

From the size ``d(k)`` of the delta ``k`` versions after its base the amortised bytes per version with a full base
every ``K`` versions are ``(full + d(1) + ... + d(K-1)) / K``, reported for each ``K`` and minimised. Reconstruction
of each delta version is timed warm (files in the page cache) and cold (this benchmark's own files dropped from the
page cache with ``posix_fadvise(DONTNEED)`` after an ``fsync``; no global cache drop), as GB of full state per
second, beside a plain ``safetensors`` load of the full version measured in the same run.
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

DEFAULT_MODEL = Path("~/.cache/relax-hpc/models/smollm2-135m-instruct-float32").expanduser()
DATA = Path(__file__).resolve().parents[2] / "recipes" / "data" / "addition-train.jsonl"
FORMS = ("bf16", "fp32-master->bf16", "float32")


def _batches(tokenizer: Any, size: int = 8) -> Iterator[Any]:
    rows = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
    texts = [f"{r['prompt']} {r['answer']}" for r in rows]
    for i in itertools.count():
        chunk = [texts[(i * size + j) % len(texts)] for j in range(size)]
        yield tokenizer(chunk, return_tensors="pt", padding=True)


def train_states(model_path: Path, form: str, lr: float, steps: int) -> Iterator[dict[str, Any]]:
    """The weights before each of ``steps`` AdamW steps, and after the last (``steps + 1`` versions), bf16 for the
    ``bf16`` form, else fp32 (cast with :func:`published`)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(model_path)
    tok.pad_token = tok.pad_token or tok.eos_token
    dtype = torch.bfloat16 if form == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    batches = _batches(tok)
    for step in range(steps + 1):
        yield {k: v.detach().clone() for k, v in model.state_dict().items()}
        if step == steps:
            return
        b = next(batches)
        labels = b["input_ids"].masked_fill(b["attention_mask"] == 0, -100)
        loss = model(**b, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def published(state: dict[str, Any], form: str) -> dict[str, Any]:
    """The state dict a trainer of this form publishes."""
    import torch

    return {k: v.to(torch.float32 if form == "float32" else torch.bfloat16) for k, v in state.items()}


def changed_fraction(a: dict[str, Any], b: dict[str, Any]) -> tuple[float, float]:
    """Fractions of elements and of bytes that differ between two versions."""
    import torch

    n = diff = nb = db = 0
    for k, t in b.items():
        ne = a[k].view(torch.uint8).reshape(-1) != t.view(torch.uint8).reshape(-1)
        diff += int((a[k].view(torch.uint8).reshape(t.numel(), -1) != t.view(torch.uint8).reshape(t.numel(), -1))
                    .any(dim=1).sum())
        n += t.numel()
        db += int(ne.sum())
        nb += ne.numel()
    return diff / n, db / nb


def amortised(full: int, deltas: list[int]) -> dict[int, float]:
    """Mean bytes per version (fraction of full) with a full base every K versions, for K = 1..len(deltas)+1."""
    return {k: (full + sum(deltas[:k - 1])) / k / full for k in range(1, len(deltas) + 2)}


def drop_cache(*folders: Path) -> bool:
    """Drop these folders' files from the page cache (fsync, then POSIX_FADV_DONTNEED); False where unsupported."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for folder in folders:
        for e in os.scandir(folder):
            if e.is_file():
                fd = os.open(e.path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
    return True


def _timed(fn: Callable[[], Any], cold: Callable[[], Any] | None) -> float:
    if cold is not None:
        cold()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def rates(rd: Any, versions: list[int], full_bytes: int) -> dict[str, float]:
    """Reconstruction (load + verify) of the delta versions vs a plain safetensors load of the full version 1,
    warm and cold, in GB of full state per second (median over versions / repeats)."""
    from safetensors.torch import load

    from relax_hpc.weights import load_snapshot
    from relax_hpc.weights.manifest import read_manifest

    base = rd.snapshot(1)
    files = read_manifest(base)["files"]
    res: dict[str, float] = {}
    for cache in ("warm", "cold"):
        def cold_of(*vs: int, _c: str = cache) -> Callable[[], Any] | None:
            return (lambda: drop_cache(*(rd.snapshot(v) for v in vs))) if _c == "cold" else None

        def plain_load() -> Any:  # every byte read and copied into tensors (load_file alone maps lazily)
            return [load((base / f["name"]).read_bytes()) for f in files]

        plain_load()  # warm-up (imports, allocator)
        plain = [_timed(plain_load, cold_of(1)) for _ in range(3)]
        full = [_timed(lambda: load_snapshot(base), cold_of(1)) for _ in range(2)]
        delta = [_timed(lambda v=v: load_snapshot(rd.snapshot(v)), cold_of(1, v)) for v in versions]
        for key, ts in (("plain_safetensors", plain), ("full_snapshot", full), ("delta", delta)):
            res[f"{key}_{cache}_gb_s"] = full_bytes / 1e9 / statistics.median(ts)
        res[f"delta_vs_plain_{cache}"] = res[f"delta_{cache}_gb_s"] / res[f"plain_safetensors_{cache}_gb_s"]
    return res


def measure_forms(model_path: Path, forms: list[str], lr: float, steps: int, root: Path) -> list[dict[str, Any]]:
    """Train once per trajectory (bf16 weights; fp32 weights for the other forms), publish each form's versions
    2..n as deltas of version 1, and report sizes, changed fractions and rates per form."""
    import tempfile

    from relax_hpc.rundir import RunDir
    from relax_hpc.weights import DeltaPolicy, SnapshotPublisher
    from relax_hpc.weights.manifest import read_manifest

    out = []
    for trajectory in [f for f in ("bf16", "fp32") if any((g == "bf16") == (f == "bf16") for g in forms)]:
        mine = [f for f in forms if (f == "bf16") == (trajectory == "bf16")]
        rds = {f: RunDir.create(Path(tempfile.mkdtemp(dir=root)) / "run") for f in mine}
        pubs = {f: SnapshotPublisher(rds[f], keep_last=steps + 2, delta=DeltaPolicy(steps + 2, 1.0)) for f in mine}
        prev: dict[str, dict[str, Any]] = {}
        figs: dict[str, dict[str, list[float]]] = {f: {"e": [], "b": [], "s": []} for f in mine}
        for v, state in enumerate(train_states(model_path, trajectory, lr, steps), 1):
            for f in mine:
                sd = published(state, f)
                if f in prev:
                    e, b = changed_fraction(prev[f], sd)
                    figs[f]["e"].append(e)
                    figs[f]["b"].append(b)
                prev[f] = sd
                figs[f]["s"].append(read_manifest(pubs[f].publish(sd, version=v, step=v))["total_bytes"])
                pubs[f].wait_housekeeping()
        for f in mine:
            out.append(_result(f, lr, figs[f], rds[f]))
    return out


def _result(form: str, lr: float, fig: dict[str, list[float]], rd: Any) -> dict[str, Any]:
    sizes = [int(x) for x in fig["s"]]
    full = sizes[0]
    am = amortised(full, sizes[1:])
    best = min(am, key=lambda k: am[k])
    return {"form": form, "lr": lr, "full_bytes": full, "changed_elements_per_step": fig["e"],
            "changed_bytes_per_step": fig["b"], "delta_of_full_by_distance": [s / full for s in sizes[1:]],
            "amortised_by_every_full": am, "best_every_full": best, "best_amortised": am[best],
            **rates(rd, list(range(2, len(sizes) + 1)), full)}


def report(res: dict[str, Any]) -> str:
    """A few lines per measured form."""
    med = statistics.median
    d = res["delta_of_full_by_distance"]
    am = res["amortised_by_every_full"]
    lines = [f"{res['form']} lr={res['lr']:g}: full {res['full_bytes'] / 1e6:.1f} MB; changed per step: elements "
             f"{med(res['changed_elements_per_step']):.3%} (max {max(res['changed_elements_per_step']):.3%}), "
             f"bytes {med(res['changed_bytes_per_step']):.3%}",
             "  delta k versions after its base (% of full): "
             + " ".join(f"k{k}={x:.1%}" for k, x in enumerate(d, 1)),
             "  amortised per version with a full base every K: "
             + " ".join(f"K{k}={x:.1%}" for k, x in am.items())
             + f"; best K={res['best_every_full']} ({res['best_amortised']:.1%})"]
    for cache in ("warm", "cold"):
        lines.append(f"  {cache}: plain safetensors {res[f'plain_safetensors_{cache}_gb_s']:.2f} GB/s, full snapshot "
                     f"(sha256) {res[f'full_snapshot_{cache}_gb_s']:.2f} GB/s, delta reconstruction "
                     f"{res[f'delta_{cache}_gb_s']:.2f} GB/s = {res[f'delta_vs_plain_{cache}']:.2f}x plain")
    return "\n".join(lines)
