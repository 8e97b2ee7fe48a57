"""The algorithm registry: built-in names, unknown names, user ``module:attr`` algorithms."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from relax_hpc.algorithms.base import PG_LOSS, Algorithm, LossInputs
from relax_hpc.algorithms.registry import BUILTIN, check_algorithm_name, get_algorithm
from relax_hpc.config.load import validate_dict
from relax_hpc.config.schema import algorithm_config
from relax_hpc.errors import ConfigError
from relax_hpc.launch.checks import check_plugins


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_builtin_names_resolve(name: str) -> None:
    check_algorithm_name(name)
    algorithm = get_algorithm(name)
    assert isinstance(algorithm, Algorithm)
    assert algorithm.name == name
    assert algorithm_config(name=name).name == name


def test_builtin_set() -> None:
    assert set(BUILTIN) == {"grpo", "gspo", "sapo", "distill"}


def test_check_importing_builtins_needs_no_torch() -> None:
    # validating a recipe must not import torch: the built-in check is a dictionary look-up
    code = (
        "import sys; from relax_hpc.algorithms.registry import check_algorithm_name; "
        "check_algorithm_name('gspo'); assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize("name", ["nope", "GRPO", "", "ppo"])
def test_unknown_name_lists_valid_ones(name: str) -> None:
    with pytest.raises(ValueError, match=r"registered: distill, grpo, gspo, sapo \(or module:attr\)"):
        check_algorithm_name(name)
    with pytest.raises(ConfigError, match=r"^algorithm\.name: .*distill, grpo, gspo, sapo"):
        check_plugins(validate_dict({"data": {"task": {}}, "algorithm": {"name": name}}))
    with pytest.raises(ConfigError, match="unknown algorithm"):
        get_algorithm(name)


USER_MODULE = '''
import numpy as np
import torch

from relax_hpc.algorithms.common import aggregate


class Reinforce:
    """Plain REINFORCE with a batch-mean baseline (no ratio, no clip)."""

    name = "reinforce"

    def sequence_advantages(self, rewards, group_ids, cfg):
        return (rewards - rewards.mean()).astype(np.float32)

    def loss(self, x, cfg):
        pg = aggregate(-x.advantages * x.logprobs, x, cfg.loss_agg)
        return pg, {"train/pg_loss": pg.detach()}


ALGO = Reinforce()
NOT_AN_ALGORITHM = 42
'''


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    name = f"relax_user_algo_{abs(hash(tmp_path))}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_user_algorithm_works(user_module: str) -> None:
    cfg = algorithm_config(name=f"{user_module}:ALGO")
    algorithm = get_algorithm(cfg.name)
    assert algorithm.name == "reinforce"
    adv = algorithm.sequence_advantages(np.array([1.0, 3.0]), np.array([0, 0]), cfg)
    np.testing.assert_allclose(adv, [-1.0, 1.0])
    logp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    x = LossInputs(
        logprobs=logp,
        old_logprobs=logp.detach(),
        rollout_logprobs=logp.detach(),
        advantages=torch.tensor([1.0, 1.0, -2.0]),
        loss_mask=torch.tensor([1.0, 0.0, 1.0]),
        seq_ids=torch.tensor([0, 0, 1]),
        num_seqs=2,
        global_num_tokens=2.0,
        global_num_seqs=2.0,
        max_response_tokens=4,
    )
    loss, metrics = algorithm.loss(x, cfg)
    assert loss.item() == pytest.approx((1.0 - 1.0) / 2)  # (-1 * -1 + -(-2) * -0.5) / 2
    loss.backward()
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad, torch.tensor([-0.5, 0.0, 1.0]))
    assert metrics[PG_LOSS].item() == pytest.approx(0.0)


def test_bad_user_algorithms_are_config_problems(user_module: str) -> None:
    with pytest.raises(ValueError, match=r"has no sequence_advantages\(\) / loss\(\) method"):
        check_algorithm_name(f"{user_module}:NOT_AN_ALGORITHM")
    with pytest.raises(ValueError, match=r"cannot import algorithm .*AttributeError"):
        check_algorithm_name(f"{user_module}:MISSING")
    with pytest.raises(ValueError, match=r"cannot import algorithm .*ModuleNotFoundError"):
        check_algorithm_name("no_such_module_xyz:ALGO")
    with pytest.raises(ValueError, match="unknown algorithm"):
        check_algorithm_name(f"{user_module}:")
    with pytest.raises(ConfigError, match="cannot import algorithm"):
        check_plugins(validate_dict({"data": {"task": {}}, "algorithm": {"name": f"{user_module}:MISSING"}}))
    with pytest.raises(ConfigError, match="has no"):
        get_algorithm(f"{user_module}:NOT_AN_ALGORITHM")
