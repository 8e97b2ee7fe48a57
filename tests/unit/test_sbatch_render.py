"""The rendered sbatch text: golden files per placement, shell/sbatch quoting of odd paths, parameter checks.

Refresh the goldens after an intended template change with:
    RELAX_UPDATE_GOLDEN=1 pytest tests/unit/test_sbatch_render.py
"""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest

from relax_hpc.config.load import validate_dict
from relax_hpc.errors import ConfigError, UserError
from relax_hpc.launch.checks import check_plugins
from relax_hpc.launch.sbatch import render_rollout_array, render_run, render_sweep, templates_dir
from relax_hpc.launch.slurm_params import check_slurm_params, directive_quote, valid_slurm_params

GOLDEN = Path(__file__).parent / "golden"
WEIRD = "/shared/runs/it's a \"run\" $HOME; echo pwned #1"


def recipe(**over: Any) -> Any:
    base: dict[str, Any] = {
        "name": "demo", "mode": "fully_async", "num_steps": 10, "data": {"task": {"name": "reverse_digits"}},
        "rollout": {"num_workers": 4}, "trainer": {"num_ranks": 2},
        "launch": {
            "placement": "hetjob", "partition": "gpu", "account": "rl-team", "qos": "high", "time_min": 600,
            "signal_delay_s": 180, "max_requeues": 5, "setup": ["module load cuda/12.4", "source ~/venv/bin/activate"],
            "trainer": {"nodes": 1, "tasks_per_node": 2, "gpus_per_node": 2, "cpus_per_task": 8, "mem_gb": 64,
                        "constraint": "h100", "env": {"NCCL_DEBUG": "WARN", "ODD": "a b'c"},
                        "extra_sbatch": ["--reservation=rl"], "slurm": {"exclude": "node13", "exclusive": True}},
            "rollout": {"nodes": 2, "tasks_per_node": 2, "gpus_per_node": 2, "cpus_per_task": 4, "mem_gb": 31.5,
                        "partition": "inference"},
        },
    }
    for key, value in over.items():
        node = base
        *parents, last = key.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return validate_dict(base)


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("RELAX_UPDATE_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.is_file(), f"missing golden {path}; create it with RELAX_UPDATE_GOLDEN=1 pytest {__file__}"
    expected = path.read_text()
    assert text == expected, (f"rendered sbatch text differs from {path}; if the change is intended, refresh the "
                              f"goldens with: RELAX_UPDATE_GOLDEN=1 pytest {Path(__file__).name}")


def bash_syntax_ok(text: str) -> None:
    res = subprocess.run(["bash", "-n"], input=text, text=True, capture_output=True, timeout=30)
    assert res.returncode == 0, res.stderr


def render(cfg: Any, run_dir: str = "/shared/runs/demo-1", **kw: Any) -> list[Any]:
    return render_run(run_dir, cfg, python="/opt/venv/bin/python", pythonpath=None, **kw)


def test_golden_hetjob() -> None:
    (script,) = render(recipe())
    assert (script.name, script.kind, script.ranks) == ("hetjob", "hetjob", (0, 1, 2, 3))
    check_golden("hetjob.sbatch", script.text)
    bash_syntax_ok(script.text)
    assert script.text.startswith("#!/bin/bash\n")
    assert script.text.count("#SBATCH hetjob") == 1
    assert "srun --unbuffered --het-group=0" in script.text and "--het-group=1" in script.text


def test_golden_separate_trainer_and_rollout_array() -> None:
    trainer, rollout = render(recipe(launch__placement="separate"))
    assert (trainer.kind, rollout.kind, rollout.name, rollout.ranks) == ("trainer", "rollout_array", "rollout-0-3",
                                                                         (0, 1, 2, 3))
    check_golden("separate-trainer.sbatch", trainer.text)
    check_golden("separate-rollout.sbatch", rollout.text)
    for s in (trainer, rollout):
        bash_syntax_ok(s.text)
    assert "#SBATCH --array=0-3\n" in rollout.text
    assert '--rank "$SLURM_ARRAY_TASK_ID"' in rollout.text
    # one worker per array task, whatever the het-group shape says
    assert "#SBATCH --nodes=1\n#SBATCH --ntasks=1\n" in rollout.text


def test_golden_colocate() -> None:
    (script,) = render(recipe(mode="colocate"))
    assert script.kind == "colocate"
    check_golden("colocate.sbatch", script.text)
    bash_syntax_ok(script.text)
    assert "role colocate" in script.text and "hetjob" not in script.text


def test_golden_sweep_array() -> None:
    script = render_sweep("/shared/sweeps/lr sweep", recipe(mode="colocate"), 6, parallel=2,
                          python="/opt/venv/bin/python", pythonpath=None)
    check_golden("sweep.sbatch", script.text)
    bash_syntax_ok(script.text)
    assert "#SBATCH --array=0-5%2\n" in script.text


def test_golden_weird_run_dir() -> None:
    (script,) = render(recipe(), run_dir=WEIRD)
    check_golden("hetjob-weird-path.sbatch", script.text)
    bash_syntax_ok(script.text)


def test_body_quotes_odd_paths_for_the_shell(tmp_path: Path) -> None:
    """RUN_DIR, the interpreter and the env values reach bash unchanged: no expansion, no injected command."""
    (script,) = render_run(WEIRD, recipe(), python="/opt/my python/bin/py$thon", pythonpath="/src/it's here")
    text = script.text
    preamble = text[text.index("set -u"):text.index("# launch.setup")]
    res = subprocess.run(["bash", "-c", preamble + 'printf "%s\\n" "$RUN_DIR" "$RELAX_PYTHON" "$PYTHONPATH"'],
                         capture_output=True, text=True, timeout=30, env={"PATH": os.environ["PATH"]})
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == [WEIRD, "/opt/my python/bin/py$thon", "/src/it's here"]
    assert "pwned" not in res.stdout.replace(WEIRD, "")
    assert "export ODD='a b'\"'\"'c'" in text


def _sbatch_parse(value: str) -> str:
    """sbatch's #SBATCH argument parser (src/sbatch/opt.c _get_argument): quotes, backslash escapes, # comments."""
    out, quote, escape = [], "", False
    for ch in value:
        if escape:
            out.append(ch)
            escape = False
        elif ch == "\\":
            escape = True
        elif quote:
            if ch == quote:
                quote = ""
            else:
                out.append(ch)
        elif ch in "\"'":
            quote = ch
        elif ch == "#" or ch.isspace():
            break
        else:
            out.append(ch)
    return "".join(out)


@pytest.mark.parametrize("value", ["/plain/path", "/a b/c", "it's", 'say "hi"', "a\\b", "x#y", "$HOME; echo x",
                                   "%j-%x"])
def test_directive_quote_round_trips_through_sbatch_parser(value: str) -> None:
    assert _sbatch_parse(directive_quote(value)) == value


def test_newline_in_run_dir_is_a_user_error() -> None:
    with pytest.raises(UserError, match="newline"):
        render(recipe(), run_dir="/tmp/a\nb")


def test_unknown_slurm_parameter_lists_valid_ones() -> None:
    with pytest.raises(UserError) as err:
        check_slurm_params({"exlude": "node3"})
    msg = str(err.value)
    assert "unknown Slurm parameter 'exlude'" in msg
    for name in ("exclude", "gres", "nodelist", "mail_type", "comment", "exclusive"):
        assert f"{name} (default" in msg
    assert "\n" not in msg
    # the same through the recipe (one line per problem, pointing at the field)
    with pytest.raises(ConfigError) as err2:
        check_plugins(recipe(launch__trainer__slurm={"exlude": "node3"}))
    assert any("launch.trainer.slurm" in p and "valid parameters" in p for p in err2.value.problems)


def test_managed_slurm_parameter_points_to_its_field() -> None:
    with pytest.raises(UserError, match=r"'nodes' is set by the recipe field launch.<role>.nodes"):
        check_slurm_params({"nodes": 2})
    assert "nodes" not in valid_slurm_params() and "exclude" in valid_slurm_params()


def test_resource_mismatch_is_a_user_error() -> None:
    with pytest.raises(UserError, match="cannot hold 4 tasks"):
        render(recipe(trainer__num_ranks=4, launch__trainer__tasks_per_node=3, launch__trainer__nodes=1))
    with pytest.raises(UserError, match="at least one task per node"):
        render(recipe(mode="colocate", trainer__num_ranks=1, launch__trainer__nodes=2,
                      launch__trainer__tasks_per_node=1))


def test_bad_env_name_is_a_user_error() -> None:
    with pytest.raises(UserError, match="not a valid environment variable name"):
        render(recipe(launch__trainer__env={"BAD-NAME": "1"}))


def test_rollout_array_of_new_ranks_and_sweep_needs_colocate() -> None:
    script = render_rollout_array("/r", recipe(launch__placement="separate"), [4, 5, 7], python="py",
                                  pythonpath=None)
    assert (script.name, script.ranks) == ("rollout-4-7", (4, 5, 7))
    assert "#SBATCH --array=4-5,7\n" in script.text
    with pytest.raises(UserError, match="mode: colocate"):
        render_sweep("/s", recipe(), 2, parallel=1, python="py", pythonpath=None)


def test_time_limit_warning() -> None:
    from relax_hpc.launch.slurm_time import time_limit_warnings

    quick = recipe(mode="colocate", launch__time_min=600, trainer__checkpoint_every=5)
    assert time_limit_warnings(quick) == []
    slow = recipe(mode="colocate", launch__time_min=30, trainer__checkpoint_every=1000,
                  rollout__prompts_per_step=256, rollout__n_samples=16,
                  rollout__sampling={"max_new_tokens": 4096})
    (w,) = time_limit_warnings(slow)
    assert "trainer.checkpoint_every=1000" in w and "rough throughput estimate" in w and "consider" in w
    (w,) = time_limit_warnings(recipe(launch__time_min=2, launch__signal_delay_s=100))
    assert "leaves no time" in w


def test_templates_ship_with_the_package() -> None:
    folder = templates_dir()
    names = {p.name for p in folder.glob("*.j2")}
    # one template per job shape (a role's job, an elastic role's array, a het job, a sweep array), none per role
    assert {"_base.sbatch.j2", "hetjob.sbatch.j2", "job.sbatch.j2", "array.sbatch.j2", "sweep.sbatch.j2"} <= names
    assert shlex.quote("x") == "x"


@pytest.mark.slow
def test_wheel_contains_templates(tmp_path: Path) -> None:
    """Built as a wheel, the package carries the templates under relax_hpc/sbatch/."""
    import zipfile

    root = Path(__file__).resolve().parents[2]
    res = subprocess.run(["python3", "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                          str(tmp_path), str(root)], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    (wheel,) = tmp_path.glob("relax_hpc-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for t in ("_base", "hetjob", "job", "array", "sweep"):
        assert f"relax_hpc/sbatch/{t}.sbatch.j2" in names, sorted(n for n in names if "sbatch" in n)
