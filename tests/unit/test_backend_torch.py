"""The ``torch`` trainer backend runs the backend conformance suite (tests/helpers/backend_conformance.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from relax_hpc.algorithms.registry import get_algorithm
from relax_hpc.config.schema import RecipeConfig
from relax_hpc.models.tiny import build_digits_tokenizer, build_tiny_model
from relax_hpc.trainer.backend import TrainerBackend, make_backend
from tests.helpers.backend_conformance import *  # noqa: F403  (the suite's tests run here)


class TorchFactory:
    def __init__(self) -> None:
        self.tokenizer = build_digits_tokenizer()

    def make(self, cfg: RecipeConfig, seed: int) -> TrainerBackend:
        tok = self.tokenizer
        model = build_tiny_model(cfg.model.tiny, len(tok), seed=seed, pad_token_id=tok.pad_token_id,
                                 bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
        return make_backend(cfg, rank=0, world_size=1, device="cpu", dtype=torch.float32,
                            algorithm=get_algorithm(cfg.algorithm.name), tokenizer=tok, model=model)


@pytest.fixture
def backend_factory() -> Any:
    return TorchFactory()


def test_a_loss_mixing_normalisers_is_refused() -> None:
    """Deferred normalisation is exact only when every loss term uses the loss_agg normaliser."""
    from relax_hpc.algorithms.grpo import GRPO
    from tests.helpers.backend_conformance import make_cfg, make_items

    class Mixed(GRPO):
        name = "mixed"

        def loss(self, x: Any, cfg: Any) -> Any:  # a token-normalised term beside a sequence-normalised loss
            loss, m = super().loss(x, cfg)
            return loss + (x.logprobs * x.loss_mask).sum() / max(x.global_num_tokens, 1.0), m

    cfg = make_cfg(algorithm={"loss_agg": "seq_mean_token_mean"})
    factory = TorchFactory()
    backend = factory.make(cfg, seed=0)
    backend.algorithm = Mixed()
    with pytest.raises(ValueError, match="more than one normaliser"):
        backend.train_step(make_items(8))
