"""The omni-modal recipes validate (and the cluster one renders its sbatch script), the synthetic media tasks are
deterministic real files, and the multimodal rewards score as documented."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from relax_hpc.config.load import load_recipe
from relax_hpc.data.synthetic import red_square_side, write_task
from relax_hpc.rewards.multimodal import boxed_answer, multiple_choice

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


@pytest.mark.parametrize(("name", "mode", "reward", "pool"), [
    ("qwen2.5-vl-3b-geometry.yaml", "colocate", "boxed_answer", 8),
    ("qwen2.5-omni-7b-av-qa.yaml", "colocate", "multiple_choice", 16),
    ("qwen3-omni-30b-a3b-fully-async.yaml", "fully_async", "multiple_choice", 32),
    ("tiny-vl-red-squares.yaml", "colocate", "boxed_answer", 0),
    ("tiny-omni-tones.yaml", "colocate", "multiple_choice", 0),
])
def test_omni_recipes_validate(name, mode, reward, pool):
    cfg = load_recipe(RECIPES / name)
    assert cfg.mode == mode and cfg.reward.name == reward and cfg.data.media.pool_size == pool


def test_cluster_recipe_renders(tmp_path):
    recipe = RECIPES / "qwen3-omni-30b-a3b-fully-async.yaml"
    out = subprocess.run([sys.executable, "-m", "relax_hpc", "render", str(recipe), "--run-dir", str(tmp_path / "run")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "#SBATCH hetjob" in out.stdout and out.stdout.count("#SBATCH --gpus-per-node=8") == 2


def test_synthetic_tasks_are_real_deterministic_files(tmp_path):
    from PIL import Image

    from relax_hpc.data.media import load_audio
    from relax_hpc.data.video import VideoSettings, decode_frames, probe, sample_indices

    a = write_task("red_squares", tmp_path / "a", rows=12, seed=1)
    b = write_task("red_squares", tmp_path / "b", rows=12, seed=1)
    assert a.read_text() == b.read_text()
    for row in map(json.loads, a.read_text().splitlines()):
        img = np.asarray(Image.open(a.parent / row["images"][0]))
        red = (img[..., 0] > 200) & (img[..., 1] < 60)
        side = red_square_side(56)
        assert 1 <= int(row["answer"][7:-1]) <= 3
        assert red.sum() == int(row["answer"][7:-1]) * side * side  # \boxed{n}: n red squares of side 19
    t = write_task("higher_tone", tmp_path / "t", rows=6)
    for row in map(json.loads, t.read_text().splitlines()):
        x = load_audio(t.parent / row["audios"][0], 16000)
        first, second = x[:7200], x[-7200:]
        f1 = np.argmax(np.abs(np.fft.rfft(first))) * 16000 / 7200
        f2 = np.argmax(np.abs(np.fft.rfft(second))) * 16000 / 7200
        assert row["answer"] == ("A" if f1 > f2 else "B")
    m = write_task("moving_square", tmp_path / "m", rows=4)
    for row in map(json.loads, m.read_text().splitlines()):
        path = m.parent / row["videos"][0]
        meta = probe(path)
        fr = decode_frames(path, sample_indices(meta, VideoSettings(min_frames=8, max_frames=8, fps=4)))
        xs = [np.nonzero((f[..., 0] > 150) & (f[..., 1] < 100))[1].mean() for f in fr]
        assert row["answer"] == ("B" if xs[-1] > xs[0] else "A")


def test_multimodal_rewards():
    assert multiple_choice("The answer is B.", "B") == 1.0
    assert multiple_choice("\\boxed{C}", "(C) third") == 1.0
    assert multiple_choice("A", "B") == 0.0 and multiple_choice("no letter here", "A") == 0.0
    assert multiple_choice("Because A) is wrong, B", "B", choices="AB") == 0.0  # the first choice counts
    assert boxed_answer("so \\boxed{3}", "\\boxed{3}") == 1.0
    assert boxed_answer("so 3", "3") == pytest.approx(0.9)  # right, not boxed
    assert boxed_answer("\\boxed{4}", "3") == pytest.approx(0.1)  # boxed, wrong
    assert boxed_answer("\\boxed{0.5}", "1/2") == 1.0 and boxed_answer("nothing", "2") == 0.0
    assert boxed_answer("\\boxed{2}", "2", format_weight=0.0) == 1.0
