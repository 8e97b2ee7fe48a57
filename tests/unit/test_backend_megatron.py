"""The ``megatron`` trainer backend (megatron-core, CPU, gloo) runs the backend conformance suite at TP=1
(tests/helpers/backend_conformance.py), in this process (one in-process gloo rank)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is an optional extra: pip install -e '.[megatron]'")

from relax_hpc.algorithms.registry import get_algorithm
from relax_hpc.config.schema import RecipeConfig
from relax_hpc.models.tiny import build_digits_tokenizer, build_tiny_model
from relax_hpc.trainer.backend import TrainerBackend, make_backend
from tests.helpers.backend_conformance import *  # noqa: F403  (the suite's tests run here)
from tests.helpers.backend_conformance import make_cfg, with_trainer
from tests.helpers.megatron_fixtures import megatron_process_group  # noqa: F401  (autouse: the group gone after the module)


class MegatronFactory:
    def __init__(self) -> None:
        self.tokenizer = build_digits_tokenizer()

    def make(self, cfg: RecipeConfig, seed: int) -> TrainerBackend:
        tok = self.tokenizer
        cfg = with_trainer(cfg, backend="megatron")
        model = build_tiny_model(cfg.model.tiny, len(tok), seed=seed, pad_token_id=tok.pad_token_id,
                                 bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
        return make_backend(cfg, rank=0, world_size=1, device="cpu", dtype=torch.float32,
                            algorithm=get_algorithm(cfg.algorithm.name), tokenizer=tok, model=model)




@pytest.fixture
def backend_factory() -> Any:
    return MegatronFactory()


def test_it_is_the_megatron_backend_with_hf_logits() -> None:
    from relax_hpc.trainer.megatron.backend import MegatronBackend

    factory = MegatronFactory()
    backend = factory.make(make_cfg(), seed=3)
    assert isinstance(backend, MegatronBackend) and backend.tp_size == 1
    hf = build_tiny_model(make_cfg().model.tiny, len(factory.tokenizer), seed=3,
                          pad_token_id=factory.tokenizer.pad_token_id).eval()
    ids = torch.as_tensor([[1, 5, 9, 4, 17, 13, 6], [2, 3, 4, 5, 6, 7, 8]])
    with torch.no_grad():
        want = hf(input_ids=ids).logits
    torch.testing.assert_close(backend.logits(ids), want, atol=1e-5, rtol=0)


def test_megatron_core_missing_is_one_error_at_validation(monkeypatch: pytest.MonkeyPatch) -> None:
    """``relax-hpc validate`` and ``submit`` run the backend's checks (:func:`check_trainer`) on the loaded recipe."""
    import sys

    from relax_hpc.errors import UserError
    from relax_hpc.trainer.checks import check_trainer

    monkeypatch.setitem(sys.modules, "megatron.core", None)  # import megatron.core -> ImportError
    with pytest.raises(UserError, match=r"needs megatron-core, which is not installed: pip install"):
        check_trainer(make_cfg(trainer={"backend": "megatron"}))
