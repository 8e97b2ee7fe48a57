"""Damaged run-dir files: every command gives one clear error naming the file, or survives it; ``resume`` falls
back to the newest complete and verified checkpoint and snapshot; read-only run dirs give one error line.

The run dir is a real fully_async demo run (trainer + 2 rollout workers as processes, a few steps); each case
damages a copy of it.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.badinput import assert_error_or_survived, assert_one_error, run_cli
from tests.helpers.runutil import DEMO, cli

pytestmark = pytest.mark.integration

SMALL = ["--set", "mode=fully_async", "--set", "num_steps=6", "--set", "warmup.steps=0",
         "--set", "trainer.checkpoint_every=2", "--set", "trainer.keep_checkpoints=3",
         "--set", "rollout.prompts_per_step=4", "--set", "rollout.n_samples=4",
         "--set", "trainer.async_checkpoint=false"]


@pytest.fixture(scope="module")
def base_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("damaged") / "run"
    res = cli("submit", str(DEMO), "--executor", "local", "--run-dir", str(root), *SMALL, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert json.loads((root / "STATUS.json").read_text())["state"] == "completed"
    rec = json.loads((root / "launch.json").read_text())
    for p in rec["procs"]:  # the recorded pids are dead; make sure a reused pid is never taken for them
        p["starttime"] = 1
    (root / "launch.json").write_text(json.dumps(rec))
    return root


def copy_run(base: Path, dst: Path) -> Path:
    shutil.copytree(base, dst, symlinks=True)
    return dst


def damage(path: Path, kind: str) -> None:
    if kind == "garbage":
        path.write_bytes(bytes(range(200, 256)) * 3)
    elif kind == "truncated":
        data = path.read_bytes()
        path.write_bytes(data[: max(1, len(data) // 2)])
    elif kind == "pickled":
        path.write_bytes(pickle.dumps({"state": "completed", "version": 3}))
    elif kind == "not-utf8":
        path.write_bytes(b'{"state": "\xff\xfe\xfd"}')
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "json-array":
        path.write_text("[1, 2, 3]")
    elif kind == "json-string":
        path.write_text('"hello"')
    elif kind == "a-folder":
        path.unlink()
        path.mkdir()
    elif kind == "deeply-nested":
        path.write_text("[" * 100_000 + "]" * 100_000)
    else:
        raise AssertionError(kind)


FILES = ["RUN.json", "config.json", "launch.json", "STATUS.json", "heartbeats/trainer-0.json",
         "checkpoints/LATEST", "weights/LATEST", "samples/consumers/trainer/position.json",
         "samples/consumers/trainer/planned.json", "logs/events/trainer-0.jsonl", "weights/v000006/manifest.json"]
KINDS = ["garbage", "truncated", "pickled", "not-utf8", "empty", "json-array", "json-string", "a-folder",
         "deeply-nested"]
COMMANDS = [["status"], ["status", "--json"], ["monitor", "--once"], ["monitor", "--json"],
            ["plot", "-o", "{tmp}/curves.png"], ["cancel", "--no-wait", "--timeout", "1"]]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", FILES)
def test_damaged_file_every_command(base_run: Path, tmp_path: Path, name: str, kind: str) -> None:
    rd = copy_run(base_run, tmp_path / "run")
    damage(rd / name, kind)
    for cmd in COMMANDS:
        args = [a.format(tmp=tmp_path) for a in cmd]
        res = run_cli(args[0], str(rd), *args[1:])
        assert_error_or_survived(res, Path(name).name)


# ---------------------------------------------------------------------------------------------- sweep files
SWEEP_CONTENT = [bytes(range(200, 256)), b"", b"[]", b'"x"', pickle.dumps({"runs": []}), b'{"runs": 5}',
                 b'{"runs": [5]}', b'{"runs": [{"index": "a"}]}', b'{"executor": 5}', b'{"grid": 5, "runs": []}']


@pytest.mark.parametrize("content", SWEEP_CONTENT, ids=[repr(c[:12]) for c in SWEEP_CONTENT])
@pytest.mark.parametrize("name", ["sweep.json", "launch.json"])
def test_damaged_sweep_files(base_run: Path, tmp_path: Path, name: str, content: bytes) -> None:
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "sweep.json").write_text(json.dumps({
        "name": "s", "created": 0, "grid": {"trainer.lr": [0.1]},
        "runs": [{"index": 0, "label": "a", "overrides": ["trainer.lr=0.1"], "run_dir": str(base_run)}]}))
    (sweep / "launch.json").write_text(json.dumps({"executor": "local"}))
    assert run_cli("sweep-status", str(sweep)).rc == 0
    (sweep / name).write_bytes(content)
    for cmd in (["sweep-status"], ["sweep-status", "--json"], ["monitor", "--once"], ["plot", "-o",
                str(tmp_path / "s.png")], ["cancel", "--no-wait"]):
        res = run_cli(cmd[0], str(sweep), *cmd[1:])
        assert_error_or_survived(res)
        if res.rc:  # names the file, or (a valid but empty list of runs) says there is nothing to show
            assert name in res.error_lines[0] or "nothing to plot" in res.error_lines[0], res.error_lines


# ------------------------------------------------------------------------------------------------- resume
def _resume(rd: Path) -> subprocess.CompletedProcess[str]:
    (rd / "STATUS.json").unlink(missing_ok=True)
    return cli("resume", str(rd), "--executor", "local", timeout=600)


def _completed(rd: Path, res: subprocess.CompletedProcess[str]) -> None:
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert json.loads((rd / "STATUS.json").read_text())["state"] == "completed"


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip_byte(path: Path) -> None:
    """One byte of tensor data changed: the file's size and header stay valid, only the checksum can tell."""
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x40
    path.write_bytes(bytes(data))


RESUME_CASES = {
    "bitflip-newest-checkpoint-tensors": lambda rd: _flip_byte(rd / "checkpoints/step_00000006/model.safetensors"),
    "truncated-newest-checkpoint-tensors": lambda rd: _truncate(rd / "checkpoints/step_00000006/model.safetensors"),
    "garbage-newest-checkpoint-state": lambda rd: damage(rd / "checkpoints/step_00000006/state.json", "garbage"),
    "garbage-checkpoint-latest": lambda rd: (_truncate(rd / "checkpoints/step_00000006/optimizer.safetensors"),
                                             damage(rd / "checkpoints/LATEST", "garbage")),
    "missing-checkpoint-latest": lambda rd: (rd / "checkpoints/LATEST").unlink(),
    "pickled-store-position": lambda rd: (shutil.rmtree(rd / "checkpoints/step_00000006"),
                                          damage(rd / "samples/consumers/trainer/position.json", "pickled")),
    "garbage-weights-latest": lambda rd: (shutil.rmtree(rd / "checkpoints/step_00000006"),
                                          damage(rd / "weights/LATEST", "garbage")),
    "missing-weights-latest-version-on-disk": lambda rd: (shutil.rmtree(rd / "checkpoints/step_00000006"),
                                                          (rd / "weights/LATEST").unlink()),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(RESUME_CASES))
def test_resume_survives(base_run: Path, tmp_path: Path, case: str) -> None:
    rd = copy_run(base_run, tmp_path / "run")
    RESUME_CASES[case](rd)
    _completed(rd, _resume(rd))
    log = (rd / "logs" / "trainer-0.log").read_text()
    if "checkpoint" in case and "latest" not in case.split("-")[-1:]:
        assert "resumed from" in log and "step_00000004" in log.split("resumed from")[-1][:200], log[-2000:]


@pytest.mark.slow
def test_publisher_replaces_debris_of_the_version_it_publishes(base_run: Path, tmp_path: Path) -> None:
    rd = copy_run(base_run, tmp_path / "run")
    shutil.rmtree(rd / "checkpoints/step_00000006")
    for v in ("v000005", "v000006"):
        shutil.rmtree(rd / "weights" / v, ignore_errors=True)
    (rd / "weights/v000005").mkdir()  # a folder left without its COMPLETE marker
    (rd / "weights/v000005/junk.safetensors").write_bytes(b"half")
    (rd / "weights/LATEST").write_text(json.dumps({"version": 4, "name": "v000004", "step": 4, "time": 0}))
    _completed(rd, _resume(rd))
    assert (rd / "weights/v000006/COMPLETE").is_file()
    assert json.loads((rd / "weights/LATEST").read_text())["version"] == 6


@pytest.mark.slow
def test_reader_falls_back_past_a_damaged_snapshot(base_run: Path, tmp_path: Path) -> None:
    from relax_hpc.rundir import RunDir
    from relax_hpc.weights import SnapshotReader

    rd = copy_run(base_run, tmp_path / "run")
    newest = sorted((rd / "weights").glob("v*/*.safetensors"))[-1]
    data = bytearray(newest.read_bytes())
    data[-3] ^= 0x40
    newest.write_bytes(bytes(data))
    snap = SnapshotReader(RunDir(rd)).load()
    assert snap.version < int(newest.parent.name[1:])


def test_damaged_status_blocks_resume_with_one_line(base_run: Path, tmp_path: Path) -> None:
    rd = copy_run(base_run, tmp_path / "run")
    damage(rd / "STATUS.json", "pickled")
    assert_one_error(run_cli("resume", str(rd), "--executor", "local"), "STATUS.json", "pickle")


# ---------------------------------------------------------------------------------------------- read-only
@pytest.fixture
def read_only_run(base_run: Path, tmp_path: Path) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("a read-only bind mount needs root (file modes do not stop root)")
    src = copy_run(base_run, tmp_path / "src")
    (src / "STATUS.json").unlink()
    mnt = tmp_path / "ro"
    mnt.mkdir()
    for cmd in (["mount", "--bind", str(src), str(mnt)], ["mount", "-o", "remount,bind,ro", str(mnt)]):
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        if res.returncode:
            subprocess.run(["umount", str(mnt)], capture_output=True, timeout=30)
            pytest.skip(f"cannot make a read-only bind mount here: {res.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True, timeout=30)


def test_read_only_run_dir(read_only_run: Path, tmp_path: Path) -> None:
    ro = read_only_run
    assert_one_error(run_cli("resume", str(ro), "--executor", "local"), "read-only")
    assert_one_error(run_cli("plot", str(ro), "-o", str(ro / "curves.png")), "read-only")
    assert_one_error(run_cli("cancel", str(ro)), "read-only")
    assert_one_error(run_cli("submit", str(DEMO), "--executor", "local", "--run-dir", str(ro / "new")),
                     "Read-only")
    assert run_cli("plot", str(ro), "-o", str(tmp_path / "curves.png")).rc == 0
    assert run_cli("status", str(ro)).rc == 0
    assert run_cli("monitor", str(ro), "--once").rc == 0
    assert not (ro / "STATUS.json").exists()
