"""Config variants as discriminated unions: ``trainer`` by backend, ``rollout`` by engine, ``algorithm`` by family.

A key of a variant that is not selected is refused in one line (exit 2 from the CLI); the variant is selected after
the ``--set`` overrides are merged; a ``--set`` that selects another variant drops the recipe file's keys of the
replaced one (with a warning); run dirs written before the variants still resume; the schema imports neither torch
nor trainer code.
"""

from __future__ import annotations

import ast
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from relax_hpc.cli import main
from relax_hpc.config.load import config_to_json, load_recipe, validate_dict, validate_resolved
from relax_hpc.config.schema import (
    DistillAlgorithmConfig,
    GRPOConfig,
    HFRolloutConfig,
    MegatronTrainerConfig,
    SAPOConfig,
    SGLangRolloutConfig,
    TorchTrainerConfig,
    VLLMRolloutConfig,
)
from relax_hpc.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "recipes" / "demo.yaml"
MEGATRON = REPO / "recipes" / "qwen3-4b-megatron-tp2.yaml"
BASE = "data: {task: {name: reverse_digits}}\nmodel: {path: tiny}\n"

WRONG_VARIANT = [
    ("trainer: {backend: torch, megatron: {tp: 2}}",
     "trainer.megatron: only for trainer.backend: megatron (this recipe has trainer.backend: torch)"),
    ("trainer: {megatron: {tp: 2}}",  # the default backend is torch
     "trainer.megatron: only for trainer.backend: megatron (this recipe has trainer.backend: torch)"),
    ("rollout: {engine: hf, server: {tp_size: 2}}",
     "rollout.server: only for rollout.engine: sglang or vllm (this recipe has rollout.engine: hf)"),
    ("rollout: {sglang: {server_args: {mem_fraction_static: 0.5}}}",
     "rollout.sglang: only for rollout.engine: sglang (this recipe has rollout.engine: hf)"),
    ("rollout: {engine: vllm, sglang: {server_args: {}}}",
     "rollout.sglang: only for rollout.engine: sglang (this recipe has rollout.engine: vllm)"),
    ("rollout: {engine: sglang, hf_decoder: generate}",
     "rollout.hf_decoder: only for rollout.engine: hf (this recipe has rollout.engine: sglang)"),
    ("algorithm: {name: grpo, sapo_tau_pos: 2.0}",
     "algorithm.sapo_tau_pos: only for algorithm.name: sapo (this recipe has algorithm.name: grpo)"),
    ("algorithm: {name: gspo, distill: {teacher: tiny}}",
     "algorithm.distill: only for algorithm.name: distill (this recipe has algorithm.name: gspo)"),
    ("algorithm: {name: distill, sapo_tau_neg: 1.5}",
     "algorithm.sapo_tau_neg: only for algorithm.name: sapo (this recipe has algorithm.name: distill)"),
    ("algorithm: {name: sapo, distill: {coef: 0.5}}",
     "algorithm.distill: only for algorithm.name: distill (this recipe has algorithm.name: sapo)"),
]


@pytest.mark.parametrize("section, line", WRONG_VARIANT, ids=[s.split(":")[0] + str(i) for i, (s, _) in
                                                               enumerate(WRONG_VARIANT)])
def test_a_key_of_an_unselected_variant_is_refused_in_one_line(tmp_path: Path, section: str, line: str,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(BASE + section + "\n")
    with pytest.raises(ConfigError) as exc:
        load_recipe(recipe)
    assert exc.value.problems == [line]
    assert main(["validate", "--no-preflight", str(recipe)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"error: {line}"]


def test_the_cli_exits_2_with_one_error_line_and_no_traceback(tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(BASE + "trainer: {backend: torch, lr: 1.0e-4, megatron: {tp: 2, pp: 2}}\n")
    proc = subprocess.run([sys.executable, "-m", "relax_hpc", "validate", str(recipe)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: trainer.megatron: only for trainer.backend: megatron (this recipe has trainer.backend: torch)"]


@pytest.mark.parametrize("sets, line", [
    (["trainer.backend=jax"], "trainer.backend: Input should be 'torch' or 'megatron' (got 'jax')"),
    (["trainer.backend=5"], "trainer.backend: Input should be 'torch' or 'megatron' (got 5)"),
    (["rollout.engine=trt"], "rollout.engine: Input should be 'hf', 'sglang' or 'vllm' (got 'trt')"),
    (["trainer=5"], "trainer: Input should be a valid dictionary (got 5)"),
    (["algorithm.name=5"], "algorithm.name: Input should be a valid string (got 5)"),
])
def test_a_bad_selecting_key_is_one_line(sets: list[str], line: str) -> None:
    with pytest.raises(ConfigError) as exc:
        load_recipe(DEMO, sets)
    assert exc.value.problems == [line]


def test_problems_inside_the_selected_variant_name_its_keys() -> None:
    with pytest.raises(ConfigError) as exc:
        load_recipe(DEMO, ["trainer.backend=megatron", "trainer.megatron.tp=0", "trainer.megatron.bogus=1",
                           "algorithm.name=sapo", "algorithm.sapo_tau_pos=-1", "rollout.engine=vllm",
                           "rollout.server.port=0"])
    lines = sorted(exc.value.problems)
    assert lines[0].startswith("algorithm.sapo_tau_pos: Input should be greater than 0")
    assert lines[1].startswith("rollout.server.port: Input should be greater than or equal to 1")
    assert lines[2] == ("trainer.megatron.bogus: unknown key; valid keys: checkpoint_format, distributed_optimizer, "
                        "pp, tp, vocab_multiple")
    assert lines[3].startswith("trainer.megatron.tp: Input should be greater than or equal to 1")
    assert len(lines) == 4


@pytest.mark.parametrize("sets", [
    ["trainer.backend=megatron", "trainer.megatron.tp=2"],
    ["trainer.megatron.tp=2", "trainer.backend=megatron"],  # the variant is chosen after every override
])
def test_set_selects_a_variant_in_either_order(sets: list[str]) -> None:
    cfg = load_recipe(DEMO, sets)
    assert isinstance(cfg.trainer, MegatronTrainerConfig) and cfg.trainer.megatron.tp == 2
    assert cfg.trainer.lr == 2.0e-3  # the recipe's shared keys stay


def test_set_selects_every_kind_of_variant() -> None:
    cfg = load_recipe(DEMO, ["rollout.engine=sglang", "rollout.server.tp_size=2",
                             "rollout.sglang.server_args={mem_fraction_static: 0.5}", "algorithm.name=sapo",
                             "algorithm.sapo_tau_pos=0.9", "trainer.backend=megatron"])
    assert isinstance(cfg.rollout, SGLangRolloutConfig) and cfg.rollout.server.tp_size == 2
    assert cfg.rollout.sglang.server_args == {"mem_fraction_static": 0.5}
    assert cfg.rollout.sampling.max_new_tokens == 8  # the recipe's shared rollout keys stay
    assert isinstance(cfg.algorithm, SAPOConfig) and cfg.algorithm.sapo_tau_pos == 0.9
    assert cfg.algorithm.clip_high == 0.28
    assert isinstance(cfg.trainer, MegatronTrainerConfig) and cfg.trainer.megatron.tp == 1
    cfg = load_recipe(DEMO, ["algorithm.name=distill", "algorithm.distill.teacher=tiny", "rollout.engine=vllm"])
    assert isinstance(cfg.algorithm, DistillAlgorithmConfig) and cfg.algorithm.distill.teacher == "tiny"
    assert isinstance(cfg.rollout, VLLMRolloutConfig)
    cfg = load_recipe(DEMO, ["algorithm.name=gspo"])
    assert isinstance(cfg.algorithm, GRPOConfig) and cfg.algorithm.name == "gspo"


def test_set_switching_away_drops_the_recipe_keys_of_the_replaced_variant(caplog: pytest.LogCaptureFixture) -> None:
    base = load_recipe(MEGATRON)
    assert isinstance(base.trainer, MegatronTrainerConfig) and isinstance(base.rollout, SGLangRolloutConfig)
    with caplog.at_level(logging.WARNING, logger="relax_hpc.config.load"):
        cfg = load_recipe(MEGATRON, ["trainer.backend=torch", "rollout.engine=vllm"])
    assert isinstance(cfg.trainer, TorchTrainerConfig) and cfg.trainer.num_ranks == base.trainer.num_ranks
    assert isinstance(cfg.rollout, VLLMRolloutConfig)
    assert cfg.rollout.server == base.rollout.server  # shared by both server engines: kept
    warned = [r.getMessage() for r in caplog.records]
    assert any(w.startswith("trainer.megatron of the recipe dropped: only for trainer.backend: megatron")
               for w in warned)
    assert any(w.startswith("rollout.sglang of the recipe dropped: only for rollout.engine: sglang")
               for w in warned)
    assert not any("rollout.server" in w for w in warned)
    hf = load_recipe(MEGATRON, ["rollout.engine=hf"])
    assert isinstance(hf.rollout, HFRolloutConfig) and hf.rollout.n_samples == base.rollout.n_samples


def test_set_switching_away_still_refuses_a_key_the_override_gives_itself() -> None:
    with pytest.raises(ConfigError) as exc:
        load_recipe(MEGATRON, ["trainer.backend=torch", "trainer.megatron.tp=4"])
    assert exc.value.problems == [
        "trainer.megatron: only for trainer.backend: megatron (this recipe has trainer.backend: torch)"]
    with pytest.raises(ConfigError, match=r"rollout\.server: only for rollout\.engine: sglang or vllm"):
        load_recipe(MEGATRON, ["rollout.engine=hf", "rollout.server={tp_size: 2}"])


def test_the_resolved_config_holds_only_the_selected_variant_and_round_trips() -> None:
    for path, sets in ((DEMO, []), (MEGATRON, []), (DEMO, ["algorithm.name=sapo", "rollout.engine=vllm"])):
        cfg = load_recipe(path, sets)
        data = config_to_json(cfg)
        assert ("megatron" in data["trainer"]) == (cfg.trainer.backend == "megatron")
        assert ("server" in data["rollout"]) == (cfg.rollout.engine != "hf")
        assert ("hf_decoder" in data["rollout"]) == (cfg.rollout.engine == "hf")
        assert ("sapo_tau_pos" in data["algorithm"]) == (cfg.algorithm.name == "sapo")
        assert "distill" not in data["algorithm"]
        assert validate_dict(data) == cfg


def test_a_run_dir_written_before_the_variants_still_resolves() -> None:
    """config.json of earlier versions holds every variant's keys (ignored by the run); the run dir still loads."""
    cfg = load_recipe(DEMO)
    old = config_to_json(cfg)
    old["trainer"]["megatron"] = {"tp": 1, "pp": 1, "distributed_optimizer": True, "vocab_multiple": 128,
                                  "checkpoint_format": "auto"}
    old["rollout"].update(sglang={"server_args": {}, "startup_timeout_s": 600.0}, server={"tp_size": 1})
    old["algorithm"].update(sapo_tau_pos=1.0, sapo_tau_neg=1.05, distill={"teacher": None, "coef": 1.0})
    with pytest.raises(ConfigError, match=r"trainer\.megatron: only for trainer\.backend: megatron"):
        validate_dict(old)  # a recipe may not say it
    assert validate_resolved(old) == cfg
    old["trainer"]["bogus"] = 1  # a key of no variant is still an error
    with pytest.raises(ConfigError, match=r"trainer\.bogus: unknown key"):
        validate_resolved(old)


def test_the_reference_documents_each_variant() -> None:
    text = (REPO / "docs" / "recipes.md").read_text()
    for title in ("## trainer (backend: torch)", "## trainer (backend: megatron)", "## rollout (engine: hf)",
                  "## rollout (engine: sglang)", "## rollout (engine: vllm)", "## algorithm (name: sapo)",
                  "## algorithm (name: distill)", "## trainer.megatron", "## rollout.server"):
        assert f"\n{title}\n" in text
    assert "| `trainer.megatron` | section |" in text.split("## trainer (backend: megatron)")[1]


def test_the_schema_imports_no_torch_and_no_trainer_code() -> None:
    code = ("import sys; from relax_hpc.config.load import load_recipe; "
            f"[load_recipe(r) for r in ({str(DEMO)!r}, {str(MEGATRON)!r})]; "
            "bad = [m for m in sys.modules if m == 'torch' or "
            "m.startswith(('relax_hpc.trainer', 'relax_hpc.rollout'))]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_no_config_module_imports_trainer_code() -> None:
    """The config layer is below the trainer: the backend registry (relax_hpc/trainer/checks.py) checks recipes
    against the backends, so config <-> trainer has no import circle (lazy imports inside functions included)."""
    bad = []
    for path in sorted((REPO / "relax_hpc" / "config").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad += [f"{path.name}: {n}" for n in names if n.startswith(("relax_hpc.trainer", "relax_hpc.modes"))]
    assert bad == []


def test_an_algorithm_reading_another_variants_options_says_so() -> None:
    """The sapo loss and the distill advantages read their own variant's options; given another variant's section
    (a user algorithm reusing them, whose recipe has the shared options only) they refuse it in one line."""
    import numpy as np

    from relax_hpc.algorithms.registry import get_algorithm

    distill = get_algorithm("distill")
    rewards, groups = np.array([1.0, 0.0]), np.array([0, 0])
    cfg = load_recipe(DEMO, ["algorithm.name=distill", "algorithm.distill.reward_coef=0.5"]).algorithm
    np.testing.assert_allclose(distill.sequence_advantages(rewards, groups, cfg), [0.5, -0.5], rtol=1e-4)
    with pytest.raises(ConfigError, match=r"reads the options of algorithm\.name: distill"):
        distill.sequence_advantages(rewards, groups, GRPOConfig(name="gspo"))
    with pytest.raises(ValueError, match="sapo has options of its own"):
        GRPOConfig(name="sapo")
