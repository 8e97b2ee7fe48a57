"""The parts of held-out evaluation: pass@k against brute force, the summary, when a version is due, the held-out
check against the training prompts, snapshot selection, the Slurm job array, and bad input to ``relax-hpc eval``."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from relax_hpc.config.eval import EvalConfig
from relax_hpc.config.load import load_recipe
from relax_hpc.errors import ConfigError, UserError
from relax_hpc.eval.metrics import PromptOutcome, pass_at_k, summarize
from relax_hpc.eval.offline import select_snapshots
from tests.helpers.runutil import DEMO, cli


@pytest.mark.parametrize(("n", "c"), [(1, 0), (1, 1), (4, 1), (5, 2), (8, 3), (8, 8), (6, 0)])
def test_pass_at_k_is_the_fraction_of_k_subsets_with_a_correct_sample(n: int, c: int) -> None:
    samples = [True] * c + [False] * (n - c)
    for k in range(1, n + 1):
        subsets = list(itertools.combinations(samples, k))
        brute = sum(any(s) for s in subsets) / len(subsets)
        assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12)
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)


def test_summary_by_hand() -> None:
    outs = [PromptOutcome([1.0, 0.0, 0.5, 1.0], [3, 5, 4, 2], [False, True, False, False], "carry"),
            PromptOutcome([0.0, 0.0, 0.0, 0.0], [8, 8, 8, 8], [True] * 4, "no_carry"),
            PromptOutcome([1.0, 1.0, 1.0, 1.0], [2, 2, 2, 2], [False] * 4, "carry")]
    m = summarize(outs, threshold=1.0, pass_k=[1, 2, 4])
    assert m["eval/accuracy"] == pytest.approx(6.5 / 12)
    assert m["eval/accuracy_thresholded"] == pytest.approx(6 / 12)
    assert m["eval/pass@1"] == pytest.approx((2 / 4 + 0 + 1) / 3)
    assert m["eval/pass@2"] == pytest.approx((1 - 1 / 6 + 0 + 1) / 3)  # C(2,2)/C(4,2) = 1/6 of pairs miss
    assert m["eval/pass@4"] == pytest.approx(2 / 3)
    assert m["eval/response_length"] == pytest.approx((14 + 32 + 8) / 12) and m["eval/response_length_max"] == 8
    assert m["eval/truncated_fraction"] == pytest.approx(5 / 12)
    assert m["eval/accuracy/carry"] == pytest.approx(6.5 / 8) and m["eval/accuracy/no_carry"] == 0.0
    assert m["eval/accuracy_thresholded/carry"] == pytest.approx(6 / 8)


def test_due_versions() -> None:
    e = EvalConfig(data={"path": "x.jsonl"}, every=5)
    assert e.due(0, None, final=False)
    assert not e.due(3, 0, final=False) and e.due(5, 0, final=False) and e.due(7, 3, final=False)  # 7 crossed 5
    assert not e.due(9, 7, final=False) and e.due(12, 7, final=False)
    assert e.due(13, 12, final=True) and not e.due(12, 12, final=True)
    only_ends = EvalConfig(data={"path": "x.jsonl"}, at_start=False)
    assert not only_ends.due(0, None, final=False) and not only_ends.due(40, None, final=False)
    assert only_ends.due(50, None, final=True)
    with pytest.raises(ValueError, match="pass_k"):
        EvalConfig(data={"path": "x.jsonl"}, n_samples=2, pass_k=[4])
    with pytest.raises(ValueError, match=r"eval\.data needs"):
        EvalConfig(data={"system_prompt": "x"})


def _rows(path: Path, numbers: range) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"R{n}", "answer": str(n)[::-1]}) + "\n" for n in numbers))
    return path


def test_heldout_sharing_training_prompts_is_refused(tmp_path: Path) -> None:
    from relax_hpc.eval.heldout import load_heldout
    from relax_hpc.models.tiny import build_digits_tokenizer

    train, held = _rows(tmp_path / "train.jsonl", range(100, 140)), _rows(tmp_path / "held.jsonl", range(135, 150))
    cfg = load_recipe(DEMO, [f"data.path={train}", "data.task=null", f"eval.data.path={held}"])
    with pytest.raises(ConfigError, match=r"5 of the 15 held-out prompts .* are training prompts too"):
        load_heldout(cfg, build_digits_tokenizer())
    ok = _rows(tmp_path / "ok.jsonl", range(140, 150))
    cfg = load_recipe(DEMO, [f"data.path={train}", "data.task=null", f"eval.data.path={ok}"])
    assert [p.raw for p in load_heldout(cfg, build_digits_tokenizer()).prompts] == [f"R{n}" for n in range(140, 150)]


def test_heldout_task_leaves_out_what_the_training_task_can_make(tmp_path: Path) -> None:
    from relax_hpc.eval.heldout import load_heldout
    from relax_hpc.models.tiny import build_digits_tokenizer

    # training: reverse 2-4 digits (any seed); held out: reverse 3-5 digits: the 3-4 digit ones are left out
    cfg = load_recipe(DEMO, ["eval.data.task.name=reverse_digits", "eval.data.task.min_len=3",
                             "eval.data.task.max_len=5", "eval.data.task.num_prompts=60"])
    held = load_heldout(cfg, build_digits_tokenizer())
    assert held.overlap_dropped > 0 and held.prompts
    assert all(len(p.raw) == 6 for p in held.prompts)  # "R" + 5 digits
    assert held.overlap_dropped + len(held.prompts) == 60
    cfg = load_recipe(DEMO, ["eval.data.task.name=reverse_digits", "eval.data.task.max_len=3",
                             "eval.data.task.num_prompts=50"])
    with pytest.raises(ConfigError, match=r"every prompt .* can be a training prompt"):
        load_heldout(cfg, build_digits_tokenizer())


def test_select_snapshots() -> None:
    assert select_snapshots("all", [0, 2, 4]) == [0, 2, 4]
    assert select_snapshots("v4, 0,v4", [0, 2, 4]) == [4, 0]
    with pytest.raises(UserError, match="v3 is not a complete stored snapshot"):
        select_snapshots("v3", [0, 2, 4])
    with pytest.raises(UserError, match="'latest' is not a version"):
        select_snapshots("latest", [0, 2, 4])
    with pytest.raises(UserError, match="no complete weight snapshot"):
        select_snapshots("all", [])


def test_eval_array_script(tmp_path: Path) -> None:
    from relax_hpc.launch.sbatch import render_eval_array
    from relax_hpc.rundir import RunDir

    rd = RunDir.create(tmp_path / "run")
    cfg = load_recipe(DEMO, ["mode=fully_async", "launch.rollout.gpus_per_node=1", "launch.rollout.partition=gpu",
                             "eval.data.task.name=sort_digits"])
    s = render_eval_array(rd, cfg, [0, 10, 20, 21], extra_args=["--set", "eval.n_samples=4"])
    assert "#SBATCH --array=0,10,20-21" in s.text and "#SBATCH --gpus-per-node=1" in s.text
    assert "#SBATCH --partition=gpu" in s.text
    assert ('-m relax_hpc eval "$RUN_DIR" --snapshots "v$SLURM_ARRAY_TASK_ID" --executor local --set '
            'eval.n_samples=4') in s.text
    assert s.kind == "eval_array" and s.ranks == (0, 10, 20, 21)


def test_eval_cli_bad_input(tmp_path: Path) -> None:
    out = cli("eval", str(tmp_path / "nope"))
    assert out.returncode == 2 and out.stderr.startswith("error:") and "Traceback" not in out.stderr
    import argparse

    from relax_hpc.cli.submit import prepare_run_dir

    run = tmp_path / "run"  # a submitted run dir (config.json), nothing started: no snapshot yet
    prepare_run_dir(argparse.Namespace(recipe=str(DEMO), overrides=[], run_dir=str(run)))
    out = cli("eval", str(run))  # the demo has no eval section
    assert out.returncode == 2 and "has no eval section" in out.stderr and "Traceback" not in out.stderr
    out = cli("eval", str(run), "--set", "eval.data.task.name=sort_digits", "--snapshots", "v1")
    assert out.returncode == 2 and "no complete weight snapshot" in out.stderr and "Traceback" not in out.stderr


def test_real_model_tool_checks_its_manifest(tmp_path: Path) -> None:
    import hashlib
    import subprocess
    import sys

    tool = Path(__file__).parents[2] / "tools" / "real_model.py"
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    digest = hashlib.sha256(b"{}").hexdigest()
    (folder / "relax-hpc-model.json").write_text(json.dumps({"files": {"config.json": digest}}))
    ok = subprocess.run([sys.executable, str(tool), "--check", "--out", str(folder)], capture_output=True, text=True)
    assert ok.returncode == 0 and "complete and intact" in ok.stdout
    (folder / "config.json").write_text("{ }")
    bad = subprocess.run([sys.executable, str(tool), "--check", "--out", str(folder)], capture_output=True, text=True)
    assert bad.returncode == 1 and "does not match its sha256" in bad.stdout


def test_model_path_under_home_is_expanded_for_the_preprocessor(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """``model.path: ~/...`` (the real-model recipes): the preprocessor lookup read the config of the unexpanded
    path (a hub repo id to transformers) and failed the run at its start."""
    from transformers import LlamaConfig

    from relax_hpc.config.schema import ModelConfig
    from relax_hpc.models.multimodal import build_preprocessor

    monkeypatch.setenv("HOME", str(tmp_path))
    LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                vocab_size=32).save_pretrained(tmp_path / "models" / "m")
    assert build_preprocessor(ModelConfig(path="~/models/m"), tokenizer=None) is None  # a text model: none needed


def test_bench_learning_reads_the_eval_curve(tmp_path: Path) -> None:
    from relax_hpc.bench.learning import compare, eval_figures
    from relax_hpc.eval.evaluator import EvalResult, write_result
    from relax_hpc.rundir import RunDir

    rd = RunDir.create(tmp_path / "run")
    assert eval_figures(rd) == {}
    for v, acc in ((0, 0.18), (10, 0.3), (80, 0.46)):
        write_result(rd, EvalResult(v, {"eval/accuracy": acc, "eval/accuracy_thresholded": acc - 0.01}, [], 1.0),
                     proc="colocate-0")
    f = eval_figures(rd)
    assert (f["eval_first_version"], f["eval_last_version"]) == (0, 80)
    assert (f["eval_first_accuracy"], f["eval_last_accuracy"]) == (0.18, 0.46)
    assert f["eval_curve"] == pytest.approx({"0": 0.17, "10": 0.29, "80": 0.45})
    assert compare({"colocate": [{"final_reward": 0.5}]}) == {}  # one mode: nothing to compare


def test_last_number_reward_does_not_credit_a_restated_question() -> None:
    from relax_hpc.rewards.builtin import last_number, math_answer

    restated = "To calculate 34 + 63, we simply"  # what a SmolLM2 policy learned to say against `math` in 2 steps
    assert math_answer(restated, "97") == 1.0  # math-verify evaluates the restated expression
    assert last_number(restated, "97") == 0.0
    for text in ("The answer is: 97.", "34 + 63 = 97", "97", " 97\n\nThis"):
        assert last_number(text, "97") == 1.0, text
    assert last_number("The answer is: 109.", "97") == 0.0 and last_number("no number", "97") == 0.0
    assert last_number("It is -5", -5) == 1.0 and last_number("so 1234", "#### 1,234") == 1.0
