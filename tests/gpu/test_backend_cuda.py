"""Both trainer backends run the backend conformance suite (tests/helpers/backend_conformance.py) on a CUDA GPU,
float32:
the same reference step (written out on the CPU), the bitwise checkpoint round trip and resume, the HF export, the
HF-named state. Marked ``gpu``: skipped where torch sees no GPU (the CPU suite runs the same tests on the CPU)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from relax_hpc.algorithms.registry import get_algorithm  # noqa: E402
from relax_hpc.config.schema import RecipeConfig  # noqa: E402
from relax_hpc.models.tiny import build_digits_tokenizer, build_tiny_model  # noqa: E402
from relax_hpc.trainer.backend import TrainerBackend, make_backend  # noqa: E402
from tests.helpers.backend_conformance import *  # noqa: E402, F403  (the suite's tests run here)
from tests.helpers.backend_conformance import with_trainer  # noqa: E402


class CudaFactory:
    """A tiny Qwen3 policy (float32, on the GPU) in the given backend."""

    outliers = 1e-3
    """Elements per tensor whose AdamW update may differ from the CPU reference's by more than the suite's
    tolerance (still within lr): gradients near AdamW's eps, rounded differently by the GPU's kernels."""

    def __init__(self, backend: str) -> None:
        self.backend, _, option = backend.partition("+")
        self.compile_layers = option == "compile"  # the torch backend with trainer.compile_layers
        self.tokenizer = build_digits_tokenizer()

    def make(self, cfg: RecipeConfig, seed: int) -> TrainerBackend:
        tok = self.tokenizer
        extra = {"compile_layers": self.compile_layers} if self.backend == "torch" else {}
        cfg = with_trainer(cfg, backend=self.backend, device="cuda", **extra)
        model = build_tiny_model(cfg.model.tiny, len(tok), seed=seed, pad_token_id=tok.pad_token_id,
                                 bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
        if self.backend == "torch":  # trains the module it is given, where it is (megatron builds its own on the GPU)
            model = model.to("cuda")
        return make_backend(cfg, rank=0, world_size=1, device="cuda", dtype=torch.float32,
                            algorithm=get_algorithm(cfg.algorithm.name), tokenizer=tok, model=model)


@pytest.fixture(scope="module", autouse=True)
def _exact_matmuls() -> Iterator[None]:
    """float32 matmuls without TF32 (the suite compares with a float32 CPU reference); the megatron backend's
    process group and parallel state gone after the module."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before
    import torch.distributed as dist

    try:
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
    except ImportError:
        pass
    if dist.is_initialized():
        dist.destroy_process_group()


def _megatron_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("megatron") is not None


@pytest.fixture(params=["torch", "torch+compile", pytest.param("megatron", marks=pytest.mark.skipif(
    not _megatron_installed(), reason="megatron-core is an optional extra"))])
def backend_factory(request: pytest.FixtureRequest) -> Any:
    return CudaFactory(request.param)


def test_the_backend_trains_on_the_gpu(backend_factory: Any) -> None:
    """Not the suite's: the parameters live on the GPU, and a step moves them there."""
    from tests.helpers.backend_conformance import make_cfg, make_items

    backend = backend_factory.make(make_cfg(), seed=0)
    model = getattr(backend, "gpt", None) or backend.model
    assert all(p.device.type == "cuda" for p in model.parameters())
    before = backend.full_state_dict(copy=True)
    backend.train_step(make_items(8, seed=6))
    after = backend.full_state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_a_lora_adapter_is_copied_to_the_host_on_a_side_stream() -> None:
    """``model.lora`` on one GPU: the snapshot's weights (the adapter under PEFT's names) come from the pinned copy
    on the side stream, equal to the synchronous copy after a training step; a checkpoint's copy stays synchronous
    (None)."""
    from relax_hpc.models.load import load_model, load_tokenizer
    from relax_hpc.models.lora import adapter_state
    from tests.helpers.backend_conformance import make_cfg, make_items

    cfg = with_trainer(make_cfg(model={"lora": {"rank": 4, "alpha": 8.0}}), device="cuda")
    tok = load_tokenizer(cfg.model)
    model = load_model(cfg.model, tok, device="cuda", dtype=torch.float32)
    trainer = make_backend(cfg, model=model, rank=0, world_size=1, device="cuda", dtype=torch.float32,
                           algorithm=get_algorithm(cfg.algorithm.name), tokenizer=tok)
    trainer.begin_step()
    trainer.accumulate(make_items(seed=0))
    trainer.finish_step()
    host = trainer.host_copy_async()
    assert host is not None and trainer.host_copy_async(optimizer=True) is None
    host.wait()
    got, want = host.weights(), adapter_state(trainer.model)
    assert got.keys() == want.keys() and got and all("lora_" in k for k in got)
    assert any(bool(v.abs().sum() > 0) for k, v in want.items() if "lora_B" in k)  # the step moved B off zero
    for k, v in want.items():
        assert got[k].device.type == "cpu" and torch.equal(got[k], v), k
