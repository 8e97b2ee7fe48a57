"""The data sets the shipped recipes read, and how each is made: ``relax-hpc data make NAME [--out FOLDER]``.

Generated sets (``red_squares``, ``higher_tone``) are written here, offline. Hub sets (``gsm8k``, ``math``) are
downloaded with the ``datasets`` library and written as the JSONL rows the recipes expect: run it where the hub is
reachable (a login node), into the shared filesystem the compute nodes read. Sets without a public source
(``geo3k`` in verl's Parquet layout, ``geometry``, ``av_qa``, ``omni_qa``) are yours to supply: their recipe's
header describes the rows. :func:`data_hint` turns a missing ``data.path`` into the one command that makes it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from relax_hpc.errors import UserError


@dataclass(frozen=True)
class DataSet:
    name: str
    file: str
    """The file the recipes read, inside the set's folder (``recipes/data/<name>/<file>``)."""
    what: str
    maker: str | None = None
    """``synthetic`` (generated here), ``hub:<repo>[:<config>]`` (downloaded), or None (supplied by the user)."""


DATASETS: dict[str, DataSet] = {d.name: d for d in (
    DataSet("red_squares", "red_squares.jsonl", "generated images: count the red squares (tiny-vl-red-squares)",
            "synthetic"),
    DataSet("higher_tone", "higher_tone.jsonl", "generated 1 s clips: which tone is higher (tiny-omni-tones)",
            "synthetic"),
    DataSet("gsm8k", "train.jsonl", "GSM8K train split, {question, answer '... #### 72'} (qwen3-1.7b-gsm8k)",
            "hub:openai/gsm8k:main"),
    DataSet("math", "train.jsonl", "MATH train split, {prompt, answer: the last \\boxed{} of the solution} "
            "(the qwen3-4b and qwen3-32b math recipes)", "hub:DigitalLearningGmbH/MATH-lighteval"),
    DataSet("geo3k", "train.parquet", "Geometry3K in verl's Parquet layout (qwen2.5-vl-3b-geo3k)"),
    DataSet("geometry", "train.jsonl", "geometry questions with diagram images (qwen2.5-vl-3b-geometry)"),
    DataSet("av_qa", "train.jsonl", "audio-visual multiple-choice QA (qwen2.5-omni-7b-av-qa)"),
    DataSet("omni_qa", "train.jsonl", "omni-modal QA (qwen3-omni-30b-a3b)"),
)}


def data_hint(path: str | Path) -> str | None:
    """How to make the missing data file ``path``: the command, or where its rows are described. None when the
    file is none of the shipped recipes' sets."""
    p = Path(path)
    d = DATASETS.get(p.parent.name)
    if d is None or p.name != d.file:
        return None
    if d.maker is None:
        return f"no command makes it: you supply it ({d.what}; the recipe's header describes its rows)"
    return f"make it with: relax-hpc data make {d.name} --out {p.parent}"


def make(name: str, out: Path, *, rows: int | None = None, seed: int = 0) -> Path:
    """Write data set ``name`` into folder ``out``; returns the file written. One :class:`UserError` on failure."""
    d = DATASETS.get(name)
    if d is None:
        raise UserError(f"unknown data set {name!r}; known: {', '.join(DATASETS)}")
    if d.maker is None:
        raise UserError(f"{name}: no command makes it: you supply it ({d.what}; the recipe's header describes its "
                        "rows)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"--out: cannot create {out} ({exc.strerror or exc})") from None
    if d.maker == "synthetic":
        from relax_hpc.data.synthetic import write_task

        return write_task(name, out, rows=rows or 512, seed=seed)
    _, repo, *config = d.maker.split(":")
    return _from_hub(d, repo, config[0] if config else None, out, rows)


def _from_hub(d: DataSet, repo: str, config: str | None, out: Path, rows: int | None) -> Path:
    try:
        import datasets
    except ImportError:
        raise UserError(f"{d.name} is downloaded with the `datasets` library: pip install datasets") from None
    try:
        ds = datasets.load_dataset(repo, config, split="train")
    except Exception as exc:  # offline, no such repo, ...: many types
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        raise UserError(f"{d.name}: cannot download {repo} from the hub ({type(exc).__name__}: {first}); run "
                        "this where the hub is reachable (a login node)") from None
    convert = CONVERTERS[d.name]
    path = out / d.file
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for i, rec in enumerate(ds):
            if rows is not None and i >= rows:
                break
            row = convert(rec)
            if row is not None:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    tmp.replace(path)
    return path


def _gsm8k(rec: dict) -> dict | None:
    return {"question": rec["question"], "answer": rec["answer"]}


def _math(rec: dict) -> dict | None:
    from relax_hpc.data.answers import last_boxed

    answer = last_boxed(rec.get("solution") or "")
    return {"prompt": rec["problem"], "answer": answer} if answer else None


CONVERTERS: dict[str, Callable[[dict], dict | None]] = {"gsm8k": _gsm8k, "math": _math}
