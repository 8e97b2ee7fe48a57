"""tools/gpu/carry.py, the part-wise carry of a wheel set to the GPU machine, dry-run on this CPU: real wheels
(small, built here), a real split into parts, each device call played in a fresh checkout that holds only what that
call carries, the real sha256 checks, the join and a real ``pip install --no-index --no-deps --target``; damaged,
missing and misplaced parts are refused with one error line each. No network (``download`` is not run)."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "gpu" / "carry.py"
PART = 100_000


def make_wheel(folder: Path, name: str, version: str, payload: int, requires: tuple[str, ...] = ()) -> Path:
    """A minimal, installable pure-Python wheel whose package holds ``payload`` random (incompressible) bytes."""
    dist = f"{name}-{version}.dist-info"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(f"Requires-Dist: {r}\n"
                                                                                 for r in requires)
    files = {
        f"{name}/__init__.py": f"VALUE = {name!r}\n".encode(),
        f"{name}/blob.bin": os.urandom(payload),
        f"{dist}/METADATA": meta.encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{dist}/RECORD,,")
    files[f"{dist}/RECORD"] = ("\n".join(record) + "\n").encode()
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as z:
        for path, data in files.items():
            z.writestr(path, data)
    return wheel


def carry(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(TOOL), *args], cwd=cwd, capture_output=True, text=True, timeout=300)


@pytest.fixture
def split_repo(tmp_path: Path) -> tuple[Path, list[Path], dict]:
    """A git checkout (``.carry/`` ignored) split into parts of 100,000 bytes from three wheels."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    made = [make_wheel(wheels, "carrya", "1.0", 150_000, ("carryb>=2.0", "carryc<0.1; python_version < '3'")),
            make_wheel(wheels, "carryb", "2.1", 40_000), make_wheel(wheels, "carryc", "0.3", 260_000)]
    repo = tmp_path / "repo"
    (repo / "tools" / "gpu").mkdir(parents=True)
    shutil.copy(TOOL, repo / "tools" / "gpu" / "carry.py")
    (repo / ".gitignore").write_text(".carry/\n")
    subprocess.run(["git", "init", "-q", str(repo)], check=True, timeout=60)
    r = carry("split", "--wheels", str(wheels), "--out", ".carry", "--repo", ".", "--part-bytes", str(PART),
              "--name", "test-set", cwd=repo)
    assert r.returncode == 0, r.stderr
    return repo, made, json.loads((repo / ".carry" / "manifest.json").read_text())


def play_call(call: dict, repo: Path, device: Path) -> subprocess.CompletedProcess[str]:
    """One device call: a fresh checkout holding the tool and only the paths the call carries, then its command."""
    if device.exists():
        shutil.rmtree(device)
    (device / "tools" / "gpu").mkdir(parents=True)
    shutil.copy(repo / "tools" / "gpu" / "carry.py", device / "tools" / "gpu" / "carry.py")
    for rel in call["carry"]:
        (device / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(repo / rel, device / rel)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run(["bash", "-c", call["command"]], cwd=device, env=env, capture_output=True, text=True,
                          timeout=300)


def test_split_cuts_the_set_into_checked_parts(split_repo) -> None:
    repo, made, manifest = split_repo
    total = sum(w.stat().st_size for w in made)
    parts = manifest["parts"]
    assert manifest["bytes"] == total and len(parts) == -(-total // PART) >= 4
    stream = b"".join(w.read_bytes() for w in sorted(made))
    joined = b""
    for k, p in enumerate(parts, 1):
        data = (repo / ".carry" / p["name"]).read_bytes()
        assert p["index"] == k and p["name"] == f"part-{k:02d}-of-{len(parts):02d}"
        assert len(data) == p["size"] <= PART and hashlib.sha256(data).hexdigest() == p["sha256"]
        joined += data
    assert joined == stream  # the parts are the wheels, in order, byte for byte
    for w in manifest["wheels"]:
        src = (made[0].parent / w["name"]).read_bytes()
        assert stream[w["offset"]:w["offset"] + w["bytes"]] == src and hashlib.sha256(src).hexdigest() == w["sha256"]
    # a second split replaces the parts of the first (no stale part left beside the new ones)
    r = carry("split", "--wheels", str(made[0].parent), "--out", ".carry", "--repo", ".", "--part-bytes", "200000",
              cwd=repo)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in (repo / ".carry").glob("part-*")) == ["part-01-of-03", "part-02-of-03",
                                                                       "part-03-of-03"]


def test_the_planned_calls_carry_join_check_and_install(split_repo, tmp_path) -> None:
    repo, made, manifest = split_repo
    dest, target = tmp_path / "carry", tmp_path / "site"
    r = carry("plan", "--out", ".carry", "--dest", str(dest), "--target", str(target), "--check", "carryc", "--json",
              cwd=repo)
    assert r.returncode == 0, r.stderr
    calls = json.loads(r.stdout)
    assert [c["call"] for c in calls] == list(range(1, len(manifest["parts"]) + 1))
    for c, p in zip(calls, manifest["parts"]):
        assert c["carry"] == [f".carry/{p['name']}", ".carry/manifest.json"] and len(c["command"]) < 2000
        assert c["command"].startswith(f"python3 tools/gpu/carry.py stash {p['index']} ")
    assert "install" in calls[-1]["command"] and all("install" not in c["command"] for c in calls[:-1])
    for c in calls[:-1]:
        r = play_call(c, repo, tmp_path / "device")
        assert r.returncode == 0, r.stderr
        assert f"sha256 ok; parts here: {list(range(1, c['call'] + 1))}" in r.stdout
        assert not target.exists()
    r = play_call(calls[-1], repo, tmp_path / "device")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "3 wheels joined and checked" in r.stderr and "carryc (no __version__)" in r.stdout
    for w in made:  # installed for real: every wheel's package imports from the target
        name = w.name.split("-")[0]
        out = subprocess.run([sys.executable, "-c", f"import {name}; print({name}.VALUE)"], capture_output=True,
                             text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(target)})
        assert out.stdout.strip() == name, out.stderr
        blob = zipfile.ZipFile(w).read(f"{name}/blob.bin")
        assert (target / name / "blob.bin").read_bytes() == blob


def test_a_damaged_or_missing_part_is_named_and_nothing_is_installed(split_repo, tmp_path) -> None:
    repo, _, manifest = split_repo
    dest, target = tmp_path / "carry", tmp_path / "site"
    n = len(manifest["parts"])
    for k in range(1, n + 1):
        r = carry("stash", str(k), "--from", ".carry", "--dest", str(dest), cwd=repo)
        assert r.returncode == 0, r.stderr
    r = carry("install", "--dest", str(dest), "--target", str(target), "--dry-run")
    assert r.returncode == 0 and "--no-index --no-deps" in r.stdout and f"--target {target}" in r.stdout, r.stderr
    second = dest / manifest["parts"][1]["name"]
    data = bytearray(second.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped bit-pattern in the middle: same size, other bytes
    second.write_bytes(bytes(data))
    (dest / manifest["parts"][-1]["name"]).unlink()
    r = carry("install", "--dest", str(dest), "--target", str(target))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 2 and all(x.startswith("error: ") for x in lines), r.stderr
    assert f"part-02-of-{n:02d}" in lines[0] and "damaged" in lines[0] and "send part 2 again" in lines[0]
    assert f"part-{n:02d}-of-{n:02d} is missing" in lines[1] and f"send part {n} again" in lines[1]
    assert not target.exists()
    # a part damaged before it leaves the repo is refused at once, and not left in /tmp/carry
    src = repo / ".carry" / manifest["parts"][0]["name"]
    src.write_bytes(src.read_bytes()[:-1] + b"\0")
    (dest / src.name).unlink()
    r = carry("stash", "1", "--from", ".carry", "--dest", str(dest), cwd=repo)
    assert r.returncode == 2 and "sha256" in r.stderr and "Traceback" not in r.stderr
    assert not (dest / src.name).exists() and not list(dest.glob(".part-*"))


def test_bad_input_gets_one_error_line(tmp_path) -> None:
    wheels = tmp_path / "w"
    wheels.mkdir()
    make_wheel(wheels, "carrya", "1.0", 10)
    repo = tmp_path / "repo"
    subprocess.run(["git", "init", "-q", str(repo)], check=True, timeout=60)

    def refused(want: str, *args: str) -> None:
        r = carry(*args, cwd=repo)
        assert r.returncode == 2 and r.stderr.startswith("error: ") and want in r.stderr, (args, r.stderr)
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr

    refused("is not ignored by git", "split", "--wheels", str(wheels), "--out", ".carry", "--repo", ".")
    (repo / ".gitignore").write_text(".carry/\n")
    refused("over a call's 64 MiB", "split", "--wheels", str(wheels), "--out", ".carry", "--part-mib", "63.99")
    refused("outside the repo", "split", "--wheels", str(wheels), "--out", str(tmp_path / "o"), "--repo", ".")
    refused("no wheels in", "split", "--wheels", str(tmp_path / "none"), "--no-repo-check")
    refused("no manifest", "plan", "--out", str(tmp_path / "none"))
    refused("no manifest", "stash", "1", "--from", str(tmp_path / "none"))
    make_wheel(wheels, "carrya", "1.1", 10)
    refused("two wheels of carrya", "split", "--wheels", str(wheels), "--out", ".carry", "--no-repo-check")
    assert not (repo / ".carry").exists()  # nothing written by a refused split


def test_wheels_that_ask_for_other_versions_of_each_other_are_refused_unless_allowed(tmp_path) -> None:
    wheels = tmp_path / "w"
    wheels.mkdir()
    make_wheel(wheels, "carrya", "1.0", 10, ("carryb>=2.0,<3", "carryc==1.0", "other>=9", "carryc>5; extra == 'x'"))
    make_wheel(wheels, "carryb", "3.1", 10)
    make_wheel(wheels, "carryc", "1.0", 10)
    r = carry("split", "--wheels", str(wheels), "--out", str(tmp_path / "o"), "--no-repo-check")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "error: carrya 1.0 requires carryb<3,>=2.0, the set has 3.1: pin it in the wheel list"], r.stderr
    assert not (tmp_path / "o").exists()
    # download's lock.json carries the wheel list's allow-conflict lines: the conflict is then a note
    (wheels / "lock.json").write_text(json.dumps({"allowed_conflicts": ["carryb"]}))
    r = carry("split", "--wheels", str(wheels), "--out", str(tmp_path / "o"), "--no-repo-check")
    assert r.returncode == 0 and "note: carrya 1.0 requires carryb<3,>=2.0" in r.stderr, r.stderr
    assert json.loads((tmp_path / "o" / "manifest.json").read_text())["bytes"] > 0


def test_download_asks_pip_for_cpython_312_manylinux_wheels_without_dependencies() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("carry", TOOL)
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    sys.modules["carry"] = tool  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(tool)
    finally:
        del sys.modules["carry"]
    reqs = tool.read_spec(tool.SPEC)
    assert reqs[0] == "vllm==0.26.0" and "xgrammar==0.2.7" in reqs and len(reqs) == len(set(reqs)) == 28
    assert "apache-tvm-ffi==0.1.10" in reqs and tool.read_allowed(tool.SPEC) == ["llguidance"]
    cmd = tool.pip_download_command(reqs, Path("/cache"))
    assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd and "--only-binary=:all:" in cmd
    assert cmd[cmd.index("--python-version") + 1] == "3.12" and cmd[cmd.index("-d") + 1] == "/cache"
    assert "manylinux_2_28_x86_64" in cmd and cmd[-len(reqs):] == reqs


def test_a_model_file_and_first_wheels_arrive_with_the_first_parts(tmp_path) -> None:
    """``split --first W --file F``: the wheel and the plain file lead the stream, so after the parts that hold them
    the stash has cut them out (sha256 checked) and ``install --partial`` installs that wheel alone; the file is
    never pip-installed, and the full install at the end still takes every wheel."""
    wheels, early = tmp_path / "wheels", tmp_path / "early"
    wheels.mkdir()
    early.mkdir()
    late = make_wheel(wheels, "carryz", "1.0", 250_000)
    first = make_wheel(early, "carrye", "0.1", 30_000)
    model = tmp_path / "model.gguf"
    model.write_bytes(os.urandom(150_000))
    repo = tmp_path / "repo"
    (repo / "tools" / "gpu").mkdir(parents=True)
    shutil.copy(TOOL, repo / "tools" / "gpu" / "carry.py")
    (repo / ".gitignore").write_text(".carry/\n")
    subprocess.run(["git", "init", "-q", str(repo)], check=True, timeout=60)
    r = carry("split", "--wheels", str(wheels), "--first", str(first), "--file", str(model), "--out", ".carry",
              "--repo", ".", "--part-bytes", str(PART), cwd=repo)
    assert r.returncode == 0, r.stderr
    m = json.loads((repo / ".carry" / "manifest.json").read_text())
    assert [(e["name"], e["kind"]) for e in m["wheels"]] == [(first.name, "wheel"), ("model.gguf", "file"),
                                                            (late.name, "wheel")]
    dest, site, full = tmp_path / "carry", tmp_path / "site", tmp_path / "full"
    calls = json.loads(carry("plan", "--out", ".carry", "--dest", str(dest), "--target", str(full), "--check", "",
                             "--json", cwd=repo).stdout)
    upto = -(-(first.stat().st_size + model.stat().st_size) // PART)  # the parts that hold the wheel and the file
    assert upto < len(calls)
    for c in calls[:upto]:
        r = play_call(c, repo, tmp_path / "device")
        assert r.returncode == 0, r.stderr
    assert (dest / "files" / "model.gguf").read_bytes() == model.read_bytes()
    assert (dest / "wheels" / first.name).read_bytes() == first.read_bytes()
    assert not (dest / "wheels" / late.name).exists()  # its bytes have not all arrived
    r = carry("install", "--dest", str(dest), "--target", str(site), "--partial", "--check", "carrye")
    assert r.returncode == 0, r.stderr
    assert "1 wheels joined" in r.stderr and "1 files" in r.stderr
    assert (site / "carrye").is_dir() and not (site / "carryz").exists() and not list(site.rglob("model.gguf"))
    for c in calls[upto:]:
        r = play_call(c, repo, tmp_path / "device")
        assert r.returncode == 0, r.stdout + r.stderr
    assert "2 wheels joined" in r.stderr and (full / "carryz").is_dir() and (full / "carrye").is_dir()
    assert (dest / "files" / "model.gguf").read_bytes() == model.read_bytes()
