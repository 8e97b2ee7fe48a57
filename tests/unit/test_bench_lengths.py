"""Length mixes of the benchmarks (bench/lengths.py): parsing and bad input, draws keyed by request id, a
log-normal's mean and cap, a file of lengths, the wrapper engine that applies them; ``bench generate --lengths`` end
to end on the demo model (static batches and the slot pool on the same requests); bad input gets one error line."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest

from relax_hpc.bench.lengths import (
    FromFile,
    LengthMixEngine,
    LogNormal,
    Uniform,
    occupancy,
    parse_lengths,
    percentiles,
)
from relax_hpc.errors import UserError
from tests.helpers.runutil import cli


def test_parse_lengths_and_bad_specs(tmp_path: Path) -> None:
    assert parse_lengths("uniform", 256) == Uniform(256)
    assert parse_lengths("lognormal:mean=512,sigma=1.0,cap=4096", 256) == LogNormal(512.0, 1.0, 4096)
    assert parse_lengths("lognormal:cap=100", 8) == LogNormal(512.0, 1.0, 100)
    f = tmp_path / "lengths.json"
    f.write_text(json.dumps({"lengths": [3, 9, 27]}))
    law = parse_lengths(f"file:{f}", 8)
    assert isinstance(law, FromFile) and law.cap == 27
    assert {law.length(f"r{i}") for i in range(200)} == {3, 9, 27}
    for bad, words in (("gaussian", "expected uniform"), ("lognormal:mean=x", "must be numbers"),
                       ("lognormal:mean=0", "mean must be >= 1"), ("lognormal:mu=3", "is not mean="),
                       (f"file:{tmp_path / 'none.json'}", "cannot read"), ("uniform:3", "expected uniform")):
        with pytest.raises(UserError, match=words):
            parse_lengths(bad, 8)
    f.write_text("[1, 0]")
    with pytest.raises(UserError, match="integers >= 1"):
        parse_lengths(f"file:{f}", 8)
    f.write_text("{not json")
    with pytest.raises(UserError, match="not JSON"):
        parse_lengths(f"file:{f}", 8)


def test_lognormal_draws_have_the_mean_and_the_cap() -> None:
    law = LogNormal(512.0, 1.0, 4096)
    xs = np.array([law.length(f"req-{i}") for i in range(20000)])
    assert xs.min() >= 1 and xs.max() == 4096  # a long tail, cut at the cap
    assert abs(xs.mean() - 512) / 512 < 0.05  # the cap takes ~1 % of the mass above 4096
    assert np.percentile(xs, 99) > 4 * np.percentile(xs, 50)
    assert law.length("req-7") == law.length("req-7"), "a request's length depends only on its id"
    p = percentiles(xs.tolist())
    assert p["p50"] < p["mean"] < p["p99"] <= p["max"] == 4096


def test_length_mix_engine_sets_each_requests_budget() -> None:
    from types import SimpleNamespace

    from relax_hpc.config.schema import SamplingConfig
    from relax_hpc.rollout.engine import GenerateRequest, SamplingParams, generate_all
    from relax_hpc.rollout.hf_engine import HFEngine
    from tests.helpers.tinymodel import VOCAB, tiny_model

    inner = HFEngine(tiny_model(), SimpleNamespace(eos_token_id=VOCAB, pad_token_id=0), SamplingConfig(), threads=1,
                     slots=4)
    law = LogNormal(6.0, 1.0, 20)
    eng = LengthMixEngine(inner, law)
    reqs = [GenerateRequest(f"q{i}", [1, 2, 3], SamplingParams(n=2, max_new_tokens=12)) for i in range(6)]
    try:
        out = asyncio.run(generate_all(eng, reqs))
        assert eng.slots == 4 and eng.version == 0  # the wrapped engine's own attributes
        windows = list(eng.windows)
        asyncio.run(eng.close())
    finally:
        inner.shutdown()
    for r in out:
        want = min(12, law.length(r.request_id))
        assert [len(s.token_ids) for s in r.samples] == [want, want]
    assert len({len(r.samples[0].token_ids) for r in out}) > 1
    assert windows == [] and len(eng.windows) == 1 and 0 < eng.windows[0]["perf/decode_occupancy"] <= 1
    occ = occupancy([{"perf/decode_occupancy": 0.5, "perf/decode_steps": 10, "perf/decode_time": 1.0,
                      "perf/decode_low_occupancy_time": 0.2},
                     {"perf/decode_occupancy": 1.0, "perf/decode_steps": 30, "perf/decode_time": 2.0,
                      "perf/decode_low_occupancy_time": 0.0}, {}])
    assert occ["decode_occupancy"] == pytest.approx(0.875) and occ["decode_low_occupancy_s"] == pytest.approx(0.2)


def test_length_mix_engine_is_the_wrapped_engine_at_every_seam() -> None:
    """The wrapper declares the wrapped engine's capabilities and passes every hook of the engine interface on (it
    once kept the interface's defaults: colocate's hand-over took a shared module's engine for unshared and copied
    the trainer's whole state into that same module every step, and a LoRA policy's adapter-only state was refused)."""
    import inspect
    from types import SimpleNamespace

    from relax_hpc.config.schema import SamplingConfig
    from relax_hpc.rollout.engine import RolloutEngine
    from relax_hpc.rollout.hf_engine import HFEngine
    from tests.helpers.tinymodel import VOCAB, tiny_model

    hooks = [n for n, f in vars(RolloutEngine).items() if inspect.isfunction(f) and not n.startswith("_")]
    assert {"generate", "receive", "run_on_thread", "sleep", "wake", "weight_template"} <= set(hooks)
    assert [n for n in hooks if n not in vars(LengthMixEngine)] == []
    inner = HFEngine(tiny_model(), SimpleNamespace(eos_token_id=VOCAB, pad_token_id=0), SamplingConfig(), threads=1,
                     shared=True)
    try:
        eng = LengthMixEngine(inner, Uniform(4))
        assert inner.shared and inner.threaded
        assert (eng.shared, eng.threaded, eng.can_sleep) == (inner.shared, inner.threaded, inner.can_sleep)
        import threading

        where = asyncio.run(eng.run_on_thread(threading.get_ident))
        assert where != threading.get_ident()  # on the wrapped engine's own thread
    finally:
        inner.shutdown()


def test_bench_generate_with_a_length_mix() -> None:
    r = cli("bench", "generate", "--json", "--lengths", "lognormal:mean=10,sigma=1.0,cap=30", "--batches", "3",
            "--warmup", "1", "--set", "rollout.batch_prompts=4", "--set", "rollout.n_samples=2", timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout)
    assert res["lengths"] == "lognormal:mean=10,sigma=1,cap=30" and res["decoders"] == ["auto", "slots"]
    for d in ("auto", "slots"):
        assert res[f"{d}_tokens_per_s"] > 0 and 0 < res[f"{d}_decode_occupancy"] <= 1
        assert 1 <= res[f"{d}_response_length_p50"] <= res[f"{d}_critical_path_tokens"] <= 30
        assert res[f"{d}_decode_low_occupancy_s"] >= 0
    assert res["slots_speedup"] == pytest.approx(res["slots_tokens_per_s"] / res["auto_tokens_per_s"])
    for bad in (["--lengths", "lognormal:sigma=-1"], ["--lengths", "uniform", "--decoders", "auto,turbo"]):
        b = cli("bench", "generate", *bad, timeout=120)
        assert b.returncode == 2 and b.stderr.startswith("error: ") and "Traceback" not in b.stderr, b.stderr


def test_bench_step_bad_lengths_is_one_error_line() -> None:
    r = cli("bench", "step", "--device", "cpu", "--lengths", "file:/nonexistent/lengths.json", "--peers", "none",
            timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("error: --lengths") and "Traceback" not in r.stderr, r.stderr


def test_bench_generate_vllm_decoder_without_vllm_is_one_error_line() -> None:
    """``--decoders vllm`` where vLLM is not importable (this machine) and a bad ``--vllm-memory``: one line each."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        r = cli("bench", "generate", "--lengths", "uniform", "--decoders", "auto,vllm", "--batches", "1", timeout=120)
        assert r.returncode == 2 and r.stderr.startswith("error: --decoders vllm: the vllm package is not importable")
        assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr
    r = cli("bench", "generate", "--lengths", "uniform", "--decoders", "auto", "--vllm-memory", "1.5", timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("error: --vllm-memory 1.5") and "Traceback" not in r.stderr


@pytest.mark.slow
def test_bench_generate_on_a_bench_step_shape(tmp_path: Path) -> None:
    """``--shape`` builds bench step's recipe (it lacked fields bench step's recipe reads, and failed) and, with a
    length mix, runs static batches and the slot pool on the shape's random weights and the real Qwen vocabulary."""
    r = cli("bench", "generate", "--shape", "qwen3-tiny", "--cache", str(tmp_path / "cache"), "--lengths",
            "lognormal:mean=8,sigma=1.0,cap=32", "--batches", "2", "--warmup", "1", "--set", "rollout.batch_prompts=2",
            "--set", "rollout.n_samples=2", "--json", timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout)
    assert res["recipe"].endswith("generate-qwen3-tiny.yaml") and res["batch"].startswith("2 prompts x 2 samples")
    for d in ("auto", "slots"):
        assert res[f"{d}_tokens_per_s"] > 0 and res[f"{d}_critical_path_tokens"] <= 32
    # random weights almost never sample EOS: each response ends at its request's drawn length, for both decoders
    assert res["auto_response_tokens_mean"] == res["slots_response_tokens_mean"]
