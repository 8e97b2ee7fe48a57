"""Carry a wheel set larger than one device call allows to the GPU machine, in parts, over consecutive calls.

A device call takes at most 64 MiB of working tree, and the GPU machine has no network. A wheel set of ~300 MiB
(vLLM 0.26.0 and its no-deps set, ``tools/gpu/vllm-0.26.txt``) therefore travels as parts of at most 60 MiB, one
part per call, issued back to back while the machine stays warm (files under /tmp survive between calls of a warm
machine). Each call copies its part out of the repo to /tmp/carry and checks its sha256; the last call also joins
the parts, checks every part's and every wheel's sha256 and installs the wheels with
``pip install --no-index --no-deps --target``.

Here (network allowed)::

    python3 tools/gpu/carry.py download                 # pip download --no-deps, CPython 3.12, manylinux x86-64
    python3 tools/gpu/carry.py split                    # .carry/part-KK-of-NN + .carry/manifest.json
    python3 tools/gpu/carry.py plan                     # the device calls, in order (carry list + command)

On the GPU machine (the commands ``plan`` prints; ``bash tools/gpu/suite.sh carry ...`` is the same)::

    python3 tools/gpu/carry.py stash K                  # part K: repo -> /tmp/carry, sha256 checked
    python3 tools/gpu/carry.py install                  # join, check, pip install --target /tmp/vllm-site

Other files travel in the same plan: ``split --first W.whl|DIR`` puts wheels at the start of the stream and ``split
--file PATH`` a plain file (a model, say: never pip-installed), so they arrive with the first parts. Each ``stash``
cuts out every entry whose bytes have all arrived (sha256 checked) into /tmp/carry/wheels and /tmp/carry/files, and
``install --partial`` installs the wheels that are there so far: a model and the wheels that use it are ready after
two calls while the rest of the set is still on its way.

Bad input (a missing or damaged part, two versions of one project, a part that does not fit a call) prints one
``error:`` line per problem and exits 2.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FORMAT = "relax-hpc-carry/1"
MIB = 1024 * 1024
CALL_LIMIT = 64 * MIB
"""What one device call carries: the working tree (tracked and untracked-not-ignored files) plus carried paths."""
PART_MIB = 60
HERE = Path(__file__).resolve().parent
SPEC = HERE / "vllm-0.26.txt"
CACHE = Path("~/.cache/relax-hpc/carry/vllm-0.26").expanduser()
OUT = Path(".carry")
DEST = Path("/tmp/carry")
TARGET = Path("/tmp/vllm-site")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")
CHUNK = 4 * MIB


class CarryError(Exception):
    """Bad input: one line per problem, exit code 2."""

    def __init__(self, *problems: str) -> None:
        super().__init__(problems[0] if problems else "")
        self.problems = list(problems)


@dataclass(frozen=True)
class Part:
    index: int
    name: str
    size: int
    sha256: str


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def project_of(wheel: str) -> str:
    """The normalised project name of a wheel file name (``pydantic_core-2.1-...whl`` -> ``pydantic-core``)."""
    return wheel.split("-", 1)[0].lower().replace("_", "-").replace(".", "-")


def part_name(index: int, count: int) -> str:
    return f"part-{index:02d}-of-{count:02d}"


# ---------------------------------------------------------------------------------------------------- download


ALLOW = "allow-conflict:"
"""A wheel-list line ``allow-conflict: NAME`` accepts that the set's NAME is not the version another wheel asks for
(for instance when no such version is published for the GPU machine)."""


def read_spec(path: Path) -> list[str]:
    """The requirements of a wheel list (one a line; ``#`` comments and ``allow-conflict:`` lines left out)."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise CarryError(f"cannot read the wheel list {path}: {exc.strerror}") from None
    reqs = [x.split("#", 1)[0].strip() for x in lines]
    return [r for r in reqs if r and not r.startswith(ALLOW)]


def read_allowed(path: Path) -> list[str]:
    """The project names of the wheel list's ``allow-conflict:`` lines."""
    lines = [x.split("#", 1)[0].strip() for x in path.read_text().splitlines()]
    return [x[len(ALLOW):].strip() for x in lines if x.startswith(ALLOW)]


def pip_download_command(reqs: list[str], cache: Path, python_version: str = "3.12") -> list[str]:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
           python_version, "--implementation", "cp", "-d", str(cache)]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    return cmd + reqs


def download(spec: Path, cache: Path) -> dict[str, Any]:
    """``pip download --no-deps`` of every requirement of ``spec`` into ``cache`` (network), then lock.json there:
    the exact files and their sha256s. The files land in a fresh folder that replaces ``cache`` once pip succeeds, so
    a changed pin leaves no older wheel beside the new one."""
    reqs = read_spec(spec)
    incoming = cache.parent / f"{cache.name}.incoming"
    shutil.rmtree(incoming, ignore_errors=True)
    incoming.mkdir(parents=True)
    cmd = pip_download_command(reqs, incoming)
    print("$", " ".join(cmd), file=sys.stderr)
    r = subprocess.run(cmd, timeout=3600)
    if r.returncode != 0:
        raise CarryError(f"pip download failed (exit {r.returncode}); its output is above; {cache} is unchanged")
    shutil.rmtree(cache, ignore_errors=True)
    incoming.rename(cache)
    wheels = select_wheels(cache)
    allowed = read_allowed(spec)
    lock = {"format": FORMAT, "spec": str(spec), "requirements": reqs, "allowed_conflicts": allowed,
            "python": "3.12", "platforms": list(PLATFORMS),
            "wheels": [{"name": w.name, "bytes": w.stat().st_size, "sha256": sha256_file(w)} for w in wheels]}
    (cache / "lock.json").write_text(json.dumps(lock, indent=1) + "\n")
    check_versions(wheels, allowed)
    return lock


TARGET_ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "platform_machine": "x86_64",
              "platform_system": "Linux", "sys_platform": "linux", "os_name": "posix", "implementation_name": "cpython",
              "platform_python_implementation": "CPython", "extra": ""}
"""The GPU machine, for the environment markers of a wheel's requirements."""


def requires(wheel: Path) -> list[str]:
    """The ``Requires-Dist`` lines of a wheel's METADATA."""
    import zipfile

    with zipfile.ZipFile(wheel) as z:
        meta = next((n for n in z.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")), None)
        text = z.read(meta).decode("utf-8", "replace") if meta else ""
    return [ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("Requires-Dist:")]


def check_versions(wheels: list[Path], allowed: list[str]) -> None:
    """Refuse a set with version conflicts, except on the projects ``allowed`` (those are printed as notes)."""
    from packaging.utils import canonicalize_name

    ok = {canonicalize_name(a) for a in allowed}
    problems = []
    for name, text in version_conflicts(wheels):
        if canonicalize_name(name) in ok:
            print(f"note: {text} (allowed by the wheel list)", file=sys.stderr)
        else:
            problems.append(f"{text}: pin it in the wheel list")
    if problems:
        raise CarryError(*problems)


def version_conflicts(wheels: list[Path]) -> list[tuple[str, str]]:
    """Each requirement of a wheel of the set that names another wheel of the set whose version it does not allow
    (markers evaluated for CPython 3.12 on x86-64 Linux, extras not taken). Projects outside the set are the GPU
    machine's or not needed: not checked."""
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.utils import canonicalize_name
    from packaging.version import InvalidVersion, Version

    versions = {canonicalize_name(project_of(w.name)): w.name.split("-")[1] for w in wheels}
    problems = []
    for w in wheels:
        for line in requires(w):
            try:
                req = Requirement(line)
            except InvalidRequirement:
                continue
            have = versions.get(canonicalize_name(req.name))
            if have is None or (req.marker is not None and not req.marker.evaluate(TARGET_ENV)):
                continue
            try:
                ok = req.specifier.contains(Version(have), prereleases=True)
            except InvalidVersion:
                ok = False
            if not ok:
                problems.append((req.name, f"{w.name.split('-')[0]} {w.name.split('-')[1]} requires "
                                           f"{req.name}{req.specifier}, the set has {have}"))
    return problems


def select_wheels(folder: Path, first: list[Path] | None = None) -> list[Path]:
    """The wheels of ``first`` (each a wheel or a folder of wheels, in that order) and then every wheel of
    ``folder``, sorted; two versions of one project are refused (pip would stop at install)."""
    wheels: list[Path] = []
    for f in first or []:
        if f.is_dir():
            wheels += sorted(f.glob("*.whl"))
        elif f.is_file() and f.name.endswith(".whl"):
            wheels.append(f)
        else:
            raise CarryError(f"--first {f}: not a wheel or a folder of wheels")
    found = sorted(folder.glob("*.whl"))
    if not found:
        raise CarryError(f"no wheels in {folder}: run `carry.py download` first")
    wheels += found
    seen: dict[str, str] = {}
    problems = []
    for w in wheels:
        p = project_of(w.name)
        if p in seen:
            problems.append(f"two wheels of {p} in {folder}: {seen[p]} and {w.name}; keep one")
        seen[p] = w.name
    if problems:
        raise CarryError(*problems)
    return wheels


# ------------------------------------------------------------------------------------------------------- split


def tree_bytes(repo: Path) -> int:
    """What a device call sends of ``repo`` besides carried paths: tracked and untracked-not-ignored files."""
    r = subprocess.run(["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                       capture_output=True, timeout=60)
    if r.returncode != 0:
        raise CarryError(f"{repo} is not a git checkout: {r.stderr.decode(errors='replace').strip()}")
    total = 0
    for name in r.stdout.decode().split("\0"):
        f = repo / name
        if name and f.is_file() and not f.is_symlink():
            total += f.stat().st_size
    return total


def check_ignored(repo: Path, out: Path) -> None:
    """The parts must not travel with every call as untracked files: ``out`` has to be ignored by git."""
    rel = out.resolve().relative_to(repo.resolve()) if out.resolve().is_relative_to(repo.resolve()) else None
    if rel is None:
        raise CarryError(f"{out} is outside the repo {repo}: a device call carries only paths inside it")
    r = subprocess.run(["git", "-C", str(repo), "check-ignore", "-q", f"{rel}/x"], timeout=60)
    if r.returncode != 0:
        raise CarryError(f"{rel}/ is not ignored by git, so every part would travel with every call: "
                         f"add `/{rel}/` to .gitignore or .git/info/exclude")


def split(wheels_dir: Path, out: Path, part_bytes: int, repo: Path | None, name: str,
          first: list[Path] | None = None, files: list[Path] | None = None) -> dict[str, Any]:
    """Concatenate ``first``'s wheels, the plain ``files`` and then the wheels of ``wheels_dir`` into one stream and
    cut it into parts of at most ``part_bytes``; manifest.json holds the offset, size, sha256 and kind (``wheel`` or
    ``file``) of every entry and the size and sha256 of every part. A set whose wheels ask for other versions of each
    other is refused."""
    all_wheels = select_wheels(wheels_dir, first)
    n_first = len(all_wheels) - len(list(wheels_dir.glob("*.whl")))
    plain = list(files or [])
    for f in plain:
        if not f.is_file():
            raise CarryError(f"--file {f}: no such file")
    names = [w.name for w in all_wheels] + [f.name for f in plain]
    if len(set(names)) != len(names):
        raise CarryError("two entries of the set have the same file name: rename one")
    wheels = all_wheels
    lock = wheels_dir / "lock.json"
    try:
        allowed = json.loads(lock.read_text()).get("allowed_conflicts", []) if lock.is_file() else []
    except ValueError:
        raise CarryError(f"{lock} is not JSON: download again") from None
    check_versions(wheels, allowed)
    if part_bytes <= 0:
        raise CarryError(f"part size must be positive, not {part_bytes}")
    if repo is not None:
        check_ignored(repo, out)
        tree = tree_bytes(repo)
        if tree + part_bytes + 64 * 1024 > CALL_LIMIT:
            raise CarryError(f"a part of {part_bytes / MIB:.1f} MiB beside the repo's {tree / MIB:.1f} MiB of "
                             f"working tree is over a call's {CALL_LIMIT // MIB} MiB: give a smaller --part-mib")
    if out.exists():
        for old in out.glob("part-*"):
            old.unlink()
    out.mkdir(parents=True, exist_ok=True)
    stream = [(w, "wheel") for w in wheels[:n_first]] + [(f, "file") for f in plain] + \
        [(w, "wheel") for w in wheels[n_first:]]
    entries, offset = [], 0
    for w, kind in stream:
        size = w.stat().st_size
        entries.append({"name": w.name, "offset": offset, "bytes": size, "sha256": sha256_file(w), "kind": kind})
        offset += size
    total = offset
    count = max(1, -(-total // part_bytes))
    parts = _write_parts([w for w, _ in stream], out, part_bytes, count)
    manifest = {"format": FORMAT, "name": name, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "bytes": total, "part_bytes": part_bytes,
                "parts": [p.__dict__ for p in parts], "wheels": entries}
    # "wheels" lists every entry of the stream (the name predates plain files); "kind" tells them apart
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def _write_parts(wheels: list[Path], out: Path, part_bytes: int, count: int) -> list[Part]:
    parts: list[Part] = []
    index, cur, h, written = 0, None, hashlib.sha256(), 0

    def close() -> None:
        nonlocal cur
        if cur is not None:
            cur.close()
            name = part_name(index, count)
            parts.append(Part(index, name, written, h.hexdigest()))
            cur = None

    for w in wheels:
        with w.open("rb") as f:
            while block := f.read(min(CHUNK, part_bytes - written if cur is not None else part_bytes)):
                if cur is None:
                    index, h, written = index + 1, hashlib.sha256(), 0
                    cur = (out / part_name(index, count)).open("wb")
                cur.write(block)
                h.update(block)
                written += len(block)
                if written == part_bytes:
                    close()
    close()
    return parts


# -------------------------------------------------------------------------------------------------------- plan


def load_manifest(folder: Path) -> dict[str, Any]:
    path = folder / "manifest.json"
    try:
        m = json.loads(path.read_text())
    except OSError:
        raise CarryError(f"no manifest at {path}: carry .carry/manifest.json with every part") from None
    except ValueError as exc:
        raise CarryError(f"{path} is not JSON ({exc}): split again") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT or not m.get("parts"):
        raise CarryError(f"{path} is not a {FORMAT} manifest: split again")
    return m


def plan(out: Path, dest: Path, target: Path, check: str | None) -> list[dict[str, Any]]:
    """The device calls, in order: what each carries and the command it runs."""
    m = load_manifest(out)
    parts = m["parts"]
    calls = []
    tool = "python3 tools/gpu/carry.py"
    for p in parts:
        cmd = f"{tool} stash {p['index']} --from {out} --dest {dest}"
        if p is parts[-1]:
            cmd += f" && {tool} install --dest {dest} --target {target}"
            if check:
                cmd += f" --check {check}"
        calls.append({"call": p["index"], "of": len(parts), "carry": [f"{out}/{p['name']}", f"{out}/manifest.json"],
                      "command": cmd, "bytes": p["size"]})
    return calls


def print_plan(calls: list[dict[str, Any]], manifest: dict[str, Any]) -> None:
    print(f"{manifest['name']}: {len(manifest['wheels'])} wheels, {manifest['bytes'] / MIB:.1f} MiB in "
          f"{len(calls)} parts. Issue the calls back to back on one warm machine (the files under /tmp live only "
          f"while it stays warm); a call that finds it cold says which parts to send again.")
    for c in calls:
        print(f"call {c['call']}/{c['of']} ({c['bytes'] / MIB:.1f} MiB): carry {json.dumps(c['carry'])}")
        print(f"  {c['command']}")


# ---------------------------------------------------------------------------------------------- on the device


def stash(index: int, src: Path, dest: Path) -> str:
    """Part ``index``: copy it out of the repo to ``dest`` (with the manifest) and check its sha256 there."""
    m = load_manifest(src)
    by_index = {p["index"]: p for p in m["parts"]}
    if index not in by_index:
        raise CarryError(f"no part {index}: the manifest has parts 1..{len(by_index)}")
    p = by_index[index]
    dest.mkdir(parents=True, exist_ok=True)
    if (dest / "manifest.json").exists() and load_manifest(dest).get("parts") != m["parts"]:
        for old in dest.glob("part-*"):  # parts of another split: useless beside this one
            old.unlink()
    source = src / p["name"]
    if not source.is_file():
        raise CarryError(f"{source} is not here: carry it with this call")
    tmp = dest / f".{p['name']}.tmp"
    shutil.copyfile(source, tmp)
    got = sha256_file(tmp)
    if got != p["sha256"] or tmp.stat().st_size != p["size"]:
        tmp.unlink()
        raise CarryError(f"{p['name']}: sha256 {got[:12]}... is not the manifest's {p['sha256'][:12]}...: "
                         "split again or send it again")
    os.replace(tmp, dest / p["name"])
    shutil.copyfile(src / "manifest.json", dest / "manifest.json")
    have = sorted(q["index"] for q in m["parts"] if (dest / q["name"]).is_file())
    ready = extract_ready(dest, m)
    return (f"{p['name']} in {dest}, sha256 ok; parts here: {have} of {len(m['parts'])}; entries ready: "
            f"{len(ready)} of {len(m['wheels'])}")


def entry_dir(dest: Path, entry: dict[str, Any]) -> Path:
    """Where an entry is cut out to: ``dest/files`` for plain files, ``dest/wheels`` for wheels."""
    return dest / ("files" if entry.get("kind") == "file" else "wheels")


def extract_ready(dest: Path, m: dict[str, Any]) -> list[Path]:
    """Cut out every entry whose bytes lie in parts already in ``dest`` (each sha256 checked; one already cut out
    and intact is kept). Returns the entries ready, in stream order."""
    sizes = {p["index"]: p["size"] for p in m["parts"]}
    starts, start = {}, 0
    for p in sorted(m["parts"], key=lambda q: q["index"]):
        starts[p["index"]] = start
        start += p["size"]
    here = {p["index"] for p in m["parts"] if (dest / p["name"]).is_file()}
    ready = []
    for e in sorted(m["wheels"], key=lambda x: x["offset"]):
        lo, hi = e["offset"], e["offset"] + e["bytes"]
        needed = {i for i in starts if starts[i] < hi and starts[i] + sizes[i] > lo}
        if not needed <= here:
            continue
        path = entry_dir(dest, e) / e["name"]
        if not (path.is_file() and path.stat().st_size == e["bytes"] and sha256_file(path) == e["sha256"]):
            path.parent.mkdir(parents=True, exist_ok=True)
            stream = _PartStream([dest / p["name"] for p in sorted(m["parts"], key=lambda q: q["index"])
                                  if p["index"] in needed], skip=min(needed) - 1, m=m)
            with path.open("wb") as f:
                stream.copy(lo, e["bytes"], f)
            if sha256_file(path) != e["sha256"]:
                path.unlink()
                raise CarryError(f"{e['name']}: sha256 differs after the cut: split again")
        ready.append(path)
    return ready


def verify_parts(dest: Path, m: dict[str, Any]) -> None:
    problems = []
    for p in m["parts"]:
        f = dest / p["name"]
        if not f.is_file():
            problems.append(f"{p['name']} is missing from {dest} (the machine was not warm since its call, or it "
                            f"was never sent): send part {p['index']} again")
        elif f.stat().st_size != p["size"] or sha256_file(f) != p["sha256"]:
            problems.append(f"{p['name']} in {dest} is damaged (sha256 or size differs from the manifest): "
                            f"send part {p['index']} again")
    if problems:
        raise CarryError(*problems)


def join(dest: Path, m: dict[str, Any]) -> list[Path]:
    """The wheels cut back out of the parts (which are checked first) into ``dest/wheels``, each sha256 checked."""
    verify_parts(dest, m)
    for sub in ("wheels", "files"):
        if (dest / sub).exists():
            shutil.rmtree(dest / sub)
        (dest / sub).mkdir()
    stream = _PartStream([dest / p["name"] for p in m["parts"]])
    out = []
    for w in sorted(m["wheels"], key=lambda e: e["offset"]):
        path = entry_dir(dest, w) / w["name"]
        with path.open("wb") as f:
            stream.copy(w["offset"], w["bytes"], f)
        if sha256_file(path) != w["sha256"]:
            raise CarryError(f"{w['name']}: sha256 differs after the join: split again")
        out.append(path)
    return out


class _PartStream:
    """The parts read as one byte stream."""

    def __init__(self, files: list[Path], skip: int = 0, m: dict[str, Any] | None = None) -> None:
        """``files``: consecutive parts; ``skip``: how many parts of the manifest ``m`` come before the first."""
        self.files = files
        self.sizes = [f.stat().st_size for f in files]
        parts = sorted(m["parts"], key=lambda q: q["index"]) if m else []
        self.start = sum(p["size"] for p in parts[:skip])

    def copy(self, offset: int, size: int, sink: Any) -> None:
        start = self.start
        for f, n in zip(self.files, self.sizes):
            lo, hi = max(offset, start), min(offset + size, start + n)
            if lo < hi:
                with f.open("rb") as src:
                    src.seek(lo - start)
                    left = hi - lo
                    while left:
                        block = src.read(min(CHUNK, left))
                        sink.write(block)
                        left -= len(block)
            start += n
        if offset + size > start:
            raise CarryError("the parts are shorter than the manifest says: split again")


def install_command(wheels: list[Path], target: Path) -> list[str]:
    return [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
            "--no-cache-dir", "--upgrade", "--target", str(target), *map(str, wheels)]


def install(dest: Path, target: Path, check: str | None, dry_run: bool, partial: bool = False) -> list[str]:
    """Join and check the parts, then install the wheels into ``target`` (``dry_run``: print the pip command).
    ``partial``: only the entries whose parts are all here (the rest of the set is still on its way)."""
    m = load_manifest(dest)
    entries = extract_ready(dest, m) if partial else join(dest, m)
    wheels = [w for w in entries if w.parent.name == "wheels"]
    if not wheels:
        raise CarryError(f"no wheel of the set is complete in {dest} yet: stash more parts")
    cmd = install_command(wheels, target)
    print(f"{len(wheels)} wheels joined and checked in {dest / 'wheels'}; "
          f"{len(entries) - len(wheels)} files in {dest / 'files'}", file=sys.stderr)
    if dry_run:
        print(" ".join(cmd))
        return cmd
    r = subprocess.run(cmd, timeout=1200)
    if r.returncode != 0:
        raise CarryError(f"pip install into {target} failed (exit {r.returncode}); its output is above")
    print(f"installed into {target}: export PYTHONPATH={target}${{PYTHONPATH:+:$PYTHONPATH}}")
    if check:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(target), os.environ.get("PYTHONPATH")]))}
        r = subprocess.run([sys.executable, "-c", f"import {check} as m; print('{check}', getattr(m, '__version__', "
                            "'(no __version__)'), m.__file__)"], env=env, timeout=600)
        if r.returncode != 0:
            raise CarryError(f"installed, but `import {check}` failed (exit {r.returncode}); its output is above")
    return cmd


# --------------------------------------------------------------------------------------------------------- CLI


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="carry.py", description=__doc__.splitlines()[0] if __doc__ else None)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("download", help="pip download --no-deps the wheel list for CPython 3.12 (network)")
    d.add_argument("--spec", type=Path, default=SPEC)
    d.add_argument("--cache", type=Path, default=CACHE)
    s = sub.add_parser("split", help="cut the wheels into parts that fit a device call, with a manifest")
    s.add_argument("--wheels", type=Path, default=CACHE, help="folder of the wheels (default: download's cache)")
    s.add_argument("--out", type=Path, default=OUT)
    s.add_argument("--part-mib", type=float, default=PART_MIB)
    s.add_argument("--part-bytes", type=int, default=None, help=argparse.SUPPRESS)
    s.add_argument("--repo", type=Path, default=Path("."), help="the repo the calls send (its size counts)")
    s.add_argument("--no-repo-check", action="store_true", help="skip the git checks (parts not sent from a repo)")
    s.add_argument("--name", default="vllm-0.26.0")
    s.add_argument("--first", type=Path, action="append", default=[], metavar="WHEEL|DIR",
                   help="wheels put first in the stream, so they arrive with the first parts (repeatable)")
    s.add_argument("--file", type=Path, action="append", default=[], metavar="PATH",
                   help="a plain file carried with the set (after --first, before the wheel folder; never "
                        "pip-installed: cut out to /tmp/carry/files) (repeatable)")
    pl = sub.add_parser("plan", help="print the device calls: what each carries and runs")
    pl.add_argument("--out", type=Path, default=OUT)
    pl.add_argument("--dest", type=Path, default=DEST)
    pl.add_argument("--target", type=Path, default=TARGET)
    pl.add_argument("--check", default="vllm", help="module the last call imports after the install ('' for none)")
    pl.add_argument("--json", action="store_true")
    st = sub.add_parser("stash", help="(device) copy part K out of the repo to --dest and check it")
    st.add_argument("index", type=int)
    st.add_argument("--from", dest="src", type=Path, default=OUT)
    st.add_argument("--dest", type=Path, default=DEST)
    i = sub.add_parser("install", help="(device) join and check the parts, pip install --no-index --no-deps --target")
    i.add_argument("--dest", type=Path, default=DEST)
    i.add_argument("--target", type=Path, default=TARGET)
    i.add_argument("--check", default=None, help="a module to import after the install")
    i.add_argument("--dry-run", action="store_true", help="join and check, print the pip command, install nothing")
    i.add_argument("--partial", action="store_true",
                   help="install the wheels whose parts are all here (the others are still to come)")
    return p


def run(a: argparse.Namespace) -> int:
    if a.cmd == "download":
        lock = download(a.spec, a.cache)
        total = sum(w["bytes"] for w in lock["wheels"])
        print(f"{len(lock['wheels'])} wheels, {total / MIB:.1f} MiB in {a.cache} (lock.json there)")
    elif a.cmd == "split":
        size = a.part_bytes if a.part_bytes is not None else int(a.part_mib * MIB)
        m = split(a.wheels, a.out, size, None if a.no_repo_check else a.repo, a.name, a.first, a.file)
        print(f"{len(m['wheels'])} wheels, {m['bytes'] / MIB:.1f} MiB -> {len(m['parts'])} parts in {a.out}")
    elif a.cmd == "plan":
        calls = plan(a.out, a.dest, a.target, a.check or None)
        if a.json:
            print(json.dumps(calls, indent=1))
        else:
            print_plan(calls, load_manifest(a.out))
    elif a.cmd == "stash":
        print(stash(a.index, a.src, a.dest))
    else:
        install(a.dest, a.target, a.check, a.dry_run, a.partial)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = parser()
    try:
        a = p.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0) if isinstance(exc.code, int) else 2
    try:
        return run(a)
    except CarryError as exc:
        for line in exc.problems:
            print(f"error: {line}", file=sys.stderr)
        return 2
    except (OSError, subprocess.TimeoutExpired) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
