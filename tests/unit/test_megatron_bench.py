"""``relax-hpc bench trainer --backend megatron`` prints both backends' figures from one run (tiny shape, CPU)."""

from __future__ import annotations

import json

import pytest

from tests.helpers.runutil import cli

pytest.importorskip("megatron.core", reason="megatron-core is an optional extra: pip install -e '.[megatron]'")


def test_bench_trainer_megatron_prints_both_backends() -> None:
    proc = cli("bench", "trainer", "--backend", "megatron", "--shape", "tiny", "--batch", "8", "--seq-len", "32",
               "--iters", "1", "--peak-tflops", "1", "--json", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout[proc.stdout.index("{"):])
    for key in ("tokens_per_s", "megatron_tokens_per_s", "mfu", "megatron_mfu", "peak_rss_gb", "megatron_peak_rss_gb"):
        assert out[key] > 0, key
    assert out["megatron_vs_torch"] == pytest.approx(out["megatron_tokens_per_s"] / out["tokens_per_s"])
    assert out["megatron_micro_batches"] == out["micro_batches"] == 1
