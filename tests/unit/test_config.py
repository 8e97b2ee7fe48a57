"""Recipes: every shipped recipe validates; overrides; one line per problem; the CLI exits 2 without a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from relax_hpc.cli import main
from relax_hpc.config.load import apply_overrides, config_to_json, load_recipe, parse_override, validate_dict
from relax_hpc.errors import ConfigError
from relax_hpc.launch.checks import check_plugins, load_checked

RECIPES = sorted((Path(__file__).parents[2] / "recipes").glob("*.yaml"))


def test_recipes_exist() -> None:
    assert any(p.name == "demo.yaml" for p in RECIPES)


@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_every_shipped_recipe_validates(path: Path) -> None:
    cfg = load_recipe(path)
    assert cfg.num_steps >= 1
    assert validate_dict(config_to_json(cfg)) == cfg  # the resolved config (the run dir's config.json) round-trips
    # the recipe itself; the GPU recipes' data and hub models are fetched by the user, so no preflight here
    assert main(["validate", "--no-preflight", "--executor", "slurm", str(path)]) == 0
    if path.name == "demo.yaml":
        assert main(["validate", "--executor", "local", str(path)]) == 0  # the demo needs nothing outside the repo


def test_override_parsing() -> None:
    assert parse_override("algorithm.clip_high=0.28") == (["algorithm", "clip_high"], 0.28)
    assert parse_override("mode=fully_async") == (["mode"], "fully_async")
    assert parse_override("rollout.sampling.stop=[a, b]") == (["rollout", "sampling", "stop"], ["a", "b"])
    out = apply_overrides({"a": {"b": 1}}, ["a.c=2", "d.e=x"])
    assert out == {"a": {"b": 1, "c": 2}, "d": {"e": "x"}}
    with pytest.raises(ConfigError, match=r"key\.path=value"):
        parse_override("nonsense")


def test_overrides_apply_and_precedence(tmp_path: Path) -> None:
    cfg = load_recipe(RECIPES[0].parent / "demo.yaml", ["trainer.lr=5e-4", "mode=fully_async"])
    assert cfg.trainer.lr == 5e-4 and cfg.mode == "fully_async"


def test_problems_one_line_each(tmp_path: Path) -> None:
    demo = RECIPES[0].parent / "demo.yaml"
    with pytest.raises(ConfigError) as exc:
        load_recipe(demo, ["trainer.lr=-1", "trainer.bogus=1", "mode=sideways", "trainer.num_ranks=two"])
    lines = exc.value.problems
    assert len(lines) == 4
    assert any(line.startswith("trainer.lr:") for line in lines)
    bogus = next(line for line in lines if line.startswith("trainer.bogus"))
    assert "unknown key" in bogus and "micro_batch_tokens" in bogus  # lists the valid keys
    assert any(line.startswith("mode:") and "colocate" in line for line in lines)
    assert any(line.startswith("trainer.num_ranks:") for line in lines)


def test_unknown_reward_function_is_a_config_problem(tmp_path: Path) -> None:
    """The schema imports no reward code; the entry points check the names after it (relax_hpc.launch.checks)."""
    demo = RECIPES[0].parent / "demo.yaml"
    with pytest.raises(ConfigError, match=r"^reward: .*no_such_module_xyz"):
        load_checked(demo, ["reward.name=no_such_module_xyz:fn"])
    assert load_recipe(demo, ["reward.name=no_such_module_xyz:fn"]).reward.name == "no_such_module_xyz:fn"


@pytest.mark.parametrize("content, needle", [
    ("name: [unclosed\n", "malformed YAML"),
    ("- a\n- b\n", "mapping"),
    ("data: {task: {name: reverse_digits}}\nnum_steps: zero\n", "num_steps"),
    ("num_steps: 3\n", "data"),
])
def test_cli_bad_recipe_exit_2_without_traceback(tmp_path: Path, content: str, needle: str) -> None:
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(content)
    proc = subprocess.run([sys.executable, "-m", "relax_hpc", "validate", str(recipe)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    assert needle in proc.stderr
    assert "Traceback" not in proc.stderr
    assert all(line.startswith("error: ") for line in proc.stderr.strip().splitlines())


def test_cli_missing_recipe_and_wrong_type_in_set(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "relax_hpc", "validate", str(tmp_path / "nope.yaml")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "does not exist" in proc.stderr and "Traceback" not in proc.stderr
    demo = RECIPES[0].parent / "demo.yaml"
    proc = subprocess.run([sys.executable, "-m", "relax_hpc", "validate", str(demo), "--set", "rollout.n_samples=abc"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "rollout.n_samples" in proc.stderr and "Traceback" not in proc.stderr


def test_recipe_reference_is_up_to_date() -> None:
    repo = Path(__file__).parents[2]
    proc = subprocess.run([sys.executable, str(repo / "tools" / "gen_recipe_reference.py"), "--check"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_every_plugin_problem_is_one_line_naming_its_setting() -> None:
    """relax_hpc.launch.checks after the schema: each name that does not check is a line of its own, led by the
    setting that holds it (as the schema's validators wrote them)."""
    cfg = validate_dict({"data": {"task": {}}, "algorithm": {"name": "nosuchalgo"}, "reward": {"name": "nosuchreward"},
                         "launch": {"rollout": {"slurm": {"exlude": "n1"}}}})
    with pytest.raises(ConfigError) as err:
        check_plugins(cfg)
    lines = err.value.problems
    assert [line.split(":")[0] for line in lines] == ["algorithm.name", "reward", "launch.rollout.slurm"], lines
    assert "'nosuchalgo'" in lines[0] and "nosuchreward" in lines[1] and "unknown Slurm parameter 'exlude'" in lines[2]
    assert all("\n" not in line for line in lines)
    assert check_plugins(validate_dict({"data": {"task": {}}})) is not None
