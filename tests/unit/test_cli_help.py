"""``relax-hpc --help`` speaks to a user: it starts with what the tool does, lists the user's commands with examples,
and leaves out the launcher's internal ``role`` command, which still works (``role --help``, and every run uses it)."""

from __future__ import annotations

import subprocess
import sys

from relax_hpc.cli import COMMANDS, HIDDEN


def relax(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "relax_hpc", *args], capture_output=True, text=True, timeout=120)


def test_help_starts_with_what_the_tool_does_and_hides_the_role_command() -> None:
    r = relax("--help")
    assert r.returncode == 0 and r.stderr == ""
    lines = r.stdout.splitlines()
    assert lines[0].startswith("usage: relax-hpc") and lines[1] == ""
    assert lines[2].startswith("Reinforcement-learning post-training of language models")
    assert "Thin:" not in r.stdout and "``" not in r.stdout  # no developer docstring
    listed = [ln.split()[0] for ln in r.stdout.split("COMMAND\n", 1)[1].split("\noptions:")[0].splitlines()
              if ln.startswith("    ") and not ln.startswith("     ")]
    assert listed == [c for c in COMMANDS if c not in HIDDEN] and "role" not in listed
    assert "relax-hpc submit recipes/demo.yaml --executor local" in r.stdout
    assert {"role"} == HIDDEN


def test_the_hidden_role_command_still_parses_and_refuses_bad_input(tmp_path) -> None:
    r = relax("role", "--help")
    assert r.returncode == 0 and "--run-dir" in r.stdout and "{trainer,rollout,colocate}" in r.stdout
    r = relax("role", "trainer", "--run-dir", str(tmp_path / "no-such-run"))
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "Traceback" not in r.stderr, r.stderr
    r = relax()  # no command: the help on stdout, exit 2
    assert r.returncode == 2 and "\n    role " not in r.stdout and "\n    submit " in r.stdout
