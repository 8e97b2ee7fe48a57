"""Synthetic multimodal tasks written as real media files plus a JSONL of rows (for the tiny CPU examples and tests).

- ``red_squares``: a PNG with 1-3 red squares and 0-1 blue one on white, each in its own slot of a 2x2 grid (at the
  default 56 px, the slot of one merged vision token of the tiny VL model); "How many red squares are in the image?";
  answer ``\\boxed{n}`` (scored by ``boxed_answer``; chance 1/3).
- ``higher_tone``: a 1 s WAV at 16 kHz holding two tones (0.45 s each, 0.1 s apart), one low (250-450 Hz) and one
  high (1200-2000 Hz) in random order; "Which tone is higher? A) the first B) the second"; answer ``A`` or ``B``
  (scored by ``multiple_choice``).
- ``moving_square``: an MP4 (8 frames at 4 fps) of a square moving left or right; "Which way does the square move?
  A) left B) right"; answer ``A`` or ``B``.

Rows depend only on the task, the count and the seed.

    python -m relax_hpc.data.synthetic red_squares OUT_DIR --rows 512 [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

TASKS = ("red_squares", "higher_tone", "moving_square")


def _red_squares(rng: np.random.Generator, folder: Path, i: int, size: int) -> dict[str, Any]:
    from PIL import Image

    img = np.full((size, size, 3), 255, dtype=np.uint8)
    n_red, n_blue = int(rng.integers(1, 4)), int(rng.integers(0, 2))
    cell = size // 2  # a 2x2 grid of slots (at the default size, one merged vision token each): no overlaps
    side = red_square_side(size)
    cells = rng.permutation(4)[:n_red + n_blue]
    for k, c in enumerate(cells):
        y = (c // 2) * cell + int(rng.integers(0, cell - side + 1))
        x = (c % 2) * cell + int(rng.integers(0, cell - side + 1))
        img[y:y + side, x:x + side] = (220, 20, 20) if k < n_red else (20, 40, 220)
    name = f"red_squares_{i:05d}.png"
    Image.fromarray(img).save(folder / name)
    return {"prompt": "<image>How many red squares are in the image?", "answer": f"\\boxed{{{n_red}}}",
            "images": [name]}


def red_square_side(size: int) -> int:
    """Side in pixels of the squares of a ``red_squares`` image of ``size`` pixels: 0.7 of a slot."""
    return int(size // 2 * 0.7)


def _higher_tone(rng: np.random.Generator, folder: Path, i: int, rate: int = 16000) -> dict[str, Any]:
    from relax_hpc.data.media import write_wav

    low, high = float(rng.uniform(250, 450)), float(rng.uniform(1200, 2000))
    first_high = bool(rng.integers(0, 2))
    t = np.arange(int(0.45 * rate)) / rate
    a, b = (high, low) if first_high else (low, high)
    wave = np.concatenate([np.sin(2 * np.pi * a * t), np.zeros(int(0.1 * rate)), np.sin(2 * np.pi * b * t)]) * 0.5
    name = f"higher_tone_{i:05d}.wav"
    write_wav(folder / name, wave, rate)
    return {"prompt": "<audio>Which tone is higher? A) the first B) the second", "answer": "A" if first_high else "B",
            "audios": [name]}


def _moving_square(rng: np.random.Generator, folder: Path, i: int, size: int) -> dict[str, Any]:
    from relax_hpc.data.video import write_video

    right = bool(rng.integers(0, 2))
    side = size // 4
    y = int(rng.integers(0, size - side))
    xs = np.linspace(0, size - side, 8).astype(int)
    frames = np.full((8, size, size, 3), 255, dtype=np.uint8)
    for f, x in enumerate(xs if right else xs[::-1]):
        frames[f, y:y + side, x:x + side] = (220, 20, 20)
    name = f"moving_square_{i:05d}.mp4"
    write_video(folder / name, frames, fps=4)
    return {"prompt": "<video>Which way does the square move? A) left B) right", "answer": "B" if right else "A",
            "videos": [name]}


def write_task(task: str, folder: Path | str, *, rows: int, seed: int = 0, size: int = 56) -> Path:
    """Write ``rows`` rows of ``task`` (media files + ``<task>.jsonl``) into ``folder``; returns the JSONL path."""
    if task not in TASKS:
        raise ValueError(f"unknown synthetic task {task!r}; known: {', '.join(TASKS)}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng([seed, TASKS.index(task)])
    out = []
    for i in range(rows):
        if task == "red_squares":
            out.append(_red_squares(rng, folder, i, size))
        elif task == "higher_tone":
            out.append(_higher_tone(rng, folder, i))
        else:
            out.append(_moving_square(rng, folder, i, size))
    path = folder / f"{task}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in out))
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m relax_hpc.data.synthetic", description=__doc__.splitlines()[0])
    p.add_argument("task", choices=TASKS)
    p.add_argument("out", help="folder for the media files and the JSONL")
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--size", type=int, default=56, help="image/video side in pixels")
    args = p.parse_args(argv)
    if args.rows < 1 or args.size < 16:
        print("error: --rows must be >= 1 and --size >= 16", file=sys.stderr)
        return 2
    print(write_task(args.task, args.out, rows=args.rows, seed=args.seed, size=args.size))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
