"""The bad-input battery: recipes, values, preflight problems and CLI flags, each through the real CLI.

Every case must end with exit code 2 and exactly one short ``error:`` line (no traceback), and ``submit`` must
create no run dir and start no process. Cases are listed as data; each one is a test.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.helpers.badinput import assert_one_error, run_cli

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "recipes" / "demo.yaml"
DEMO_TEXT = DEMO.read_text()


# ------------------------------------------------------------------------------------------------- recipe files
def _alias_bomb() -> bytes:
    lines = ['a: &a ["x","x","x","x","x","x","x","x","x"]']
    prev = "a"
    for name in "bcdefghi":
        lines.append(f"{name}: &{name} [" + ",".join([f"*{prev}"] * 9) + "]")
        prev = name
    return ("\n".join(lines) + f"\nname: *{prev}\n").encode()


RECIPE_FILES: dict[str, tuple[bytes, str]] = {
    "random-bytes": (bytes(range(128, 256)) * 4, "not UTF-8"),
    "utf16-bom": (DEMO_TEXT.encode("utf-16"), "UTF-16"),
    "utf16-be-no-bom": (DEMO_TEXT.encode("utf-16-be"), "UTF-16"),
    "latin1": ("name: caf\xe9\n".encode("latin-1") + DEMO_TEXT.encode(), "not UTF-8"),
    "nul-bytes": (b"name: demo\x00\x00\n", "NUL"),
    "deep-flow-nesting": (("a: " + "[" * 5000 + "]" * 5000 + "\n").encode(), "nested deeper"),
    "deep-block-nesting": ("".join(" " * i + f"k{i}:\n" for i in range(300)).encode(), "nested deeper"),
    "deep-flow-mapping": (("a: " + "{b: " * 100 + "1" + "}" * 100 + "\n").encode(), "nested deeper"),
    "duplicate-top-key": ((DEMO_TEXT + "\nname: other\n").encode(), "duplicate key 'name'"),
    "duplicate-nested-key": (b"data:\n  task: {name: reverse_digits}\n  task: {name: sort_digits}\n",
                             "duplicate key 'task'"),
    "alias-bomb": (_alias_bomb(), "aliases expand"),
    "5MB-scalar": ((DEMO_TEXT + "\nnote: " + "x" * 5_000_000 + "\n").encode(), "too large for a recipe"),
    "900KB-name": (DEMO_TEXT.replace("name: demo", "name: " + "y" * 900_000).encode(), "not a safe run name"),
    "not-a-mapping": (b"- 1\n- 2\n", "must be a mapping"),
    "scalar-document": (b"just a string\n", "must be a mapping"),
    "malformed-yaml": (b"name: [unclosed\n", "malformed YAML"),
    "tab-indent": (b"data:\n\ttask: {}\n", "malformed YAML"),
    "two-documents": (DEMO_TEXT.encode() + b"\n---\nname: second\n", "malformed YAML"),
    "python-tag": (b"name: !!python/object/apply:os.system ['true']\n", "malformed YAML"),
    "empty-file": (b"", "data: Field required"),
    "unknown-section": ((DEMO_TEXT + "\nbogus_section: {}\n").encode(), "bogus_section: unknown key"),
}


@pytest.mark.parametrize("case", sorted(RECIPE_FILES))
def test_bad_recipe_file(case: str, tmp_path: Path) -> None:
    content, needle = RECIPE_FILES[case]
    path = tmp_path / "recipe.yaml"
    path.write_bytes(content)
    assert_one_error(run_cli("validate", str(path)), needle)
    run_dir = tmp_path / "run"
    assert_one_error(run_cli("submit", str(path), "--executor", "local", "--run-dir", str(run_dir)), needle)
    assert not run_dir.exists()


def test_recipe_path_problems(tmp_path: Path) -> None:
    assert_one_error(run_cli("validate", str(tmp_path / "missing.yaml")), "does not exist")
    assert_one_error(run_cli("validate", str(tmp_path)), "is a folder")
    assert_one_error(run_cli("validate", "x" * 5000), "cannot be read", "5000 chars")


# -------------------------------------------------------------------------------------------- schema values
BAD_VALUES: list[tuple[str, str]] = [
    ("algorithm.clip_low=.nan", "finite"),
    ("algorithm.clip_high=.inf", "finite"),
    ("trainer.lr=.nan", "finite"),
    ("trainer.lr=-.inf", "finite"),
    ("trainer.grad_clip=.inf", "finite"),
    ("algorithm.entropy_coef=.nan", "finite"),
    ("algorithm.kl_coef=.inf", "finite"),
    ("rollout.sampling.temperature=.nan", "finite"),
    ("monitor.stall_minutes=.nan", "finite"),
    ("reward.timeout_s=.inf", "finite"),
    ("weights.files_every_s=.nan", "finite"),
    ("store.wait_timeout_s=.inf", "finite"),
    ("launch.trainer.mem_gb=.nan", "finite"),
    ("seed=99999999999999999999999", "seed"),
    ("seed=4294967296", "seed"),
    ("seed=-1", "seed"),
    ("model.init_seed=18446744073709551616", "model.init_seed"),
    ("num_steps=99999999999999999999999", "64-bit"),
    ("rollout.n_samples=9223372036854775808", "64-bit"),
    ("trainer.micro_batch_tokens=100000000000000000000", "64-bit"),
    ("data.task.num_prompts=1e400", "data.task.num_prompts"),
    ("trainer.betas=[0.9, 1.0]", "[0, 1)"),
    ("trainer.betas=[-0.1, 0.9]", "[0, 1)"),
    ("trainer.betas=[1.5, 0.999]", "[0, 1)"),
    ("trainer.betas=[0.9]", "trainer.betas"),
    ("launch.trainer.mem_gb=-4", "launch.trainer.mem_gb"),
    ("launch.rollout.mem_gb=0", "launch.rollout.mem_gb"),
    ("model.tiny.num_kv_heads=3", "must divide num_heads"),
    ("model.tiny.num_heads=5", "must divide"),
    ("model.tiny.hidden_size=66", "must divide hidden_size"),
    ('rollout.sampling.stop=[""]', "stop string must not be empty"),
    ('rollout.sampling.stop=["</s>", ""]', "stop string must not be empty"),
    ("name=../evil", "not a safe run name"),
    ("name=a/b", "not a safe run name"),
    ("name=..", "not a safe run name"),
    ("name=/abs", "not a safe run name"),
    ('name=""', "not a safe run name"),
    ("name=" + "n" * 5000, "not a safe run name"),
    ("name=with space", "not a safe run name"),
    ("data.task.min_len=9", "min_len=9 is larger than max_len=4"),
    ('data.prompt_key=""', "data.prompt_key"),
    ("trainer.lr=-1", "trainer.lr"),
    ("trainer.lr=" + "9" * 400, "trainer.lr"),
    ("mode=bogus", "mode"),
    ("rollout.device=tpu", "rollout.device"),
    ("launch.trainer.cpu_affinity=[-1]", "cpu_affinity"),
    ("launch.trainer.slurm={nosuch: 1}", "nosuch"),
    ("algorithm.name=nosuchalgo", "nosuchalgo"),
    ("reward.name=nosuchreward", "nosuchreward"),
    ("trainer.lr=" + "x" * 100_000, "trainer.lr"),
]


@pytest.mark.parametrize("override,needle", BAD_VALUES, ids=[o[:40] for o, _ in BAD_VALUES])
def test_schema_refuses(override: str, needle: str) -> None:
    line = assert_one_error(run_cli("validate", str(DEMO), "--set", override), needle)
    assert len(line) < 400


BAD_OVERRIDES: list[tuple[str, str]] = [
    ("noequals", "not of the form"),
    ("=5", "empty key"),
    ("a..b=1", "empty key"),
    ("data.task.name.x=1", "is not a section"),
    ("x" * 10_000, "not of the form"),
]


@pytest.mark.parametrize("override,needle", BAD_OVERRIDES, ids=[o[:20] for o, _ in BAD_OVERRIDES])
def test_bad_override_syntax(override: str, needle: str) -> None:
    assert_one_error(run_cli("validate", str(DEMO), "--set", override), needle)


def test_good_values_still_pass() -> None:
    for override in ("trainer.betas=[0.0, 0.99]", "seed=4294967295", "name=demo-2.run_x",
                     "model.tiny.num_kv_heads=4", "rollout.sampling.stop=[\"=\"]"):
        res = run_cli("validate", str(DEMO), "--set", override, "--executor", "local")
        assert res.rc == 0, (override, res.err)


# ------------------------------------------------------------------------------------------------- preflight
@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("preflight")
    (d / "bad_line.jsonl").write_text('{"prompt": "123", "answer": "321"}\n{"prompt": broken\n')
    (d / "bad_late_line.jsonl").write_text('{"prompt": "1", "answer": "1"}\n' * 500 + "{oops\n")
    (d / "empty.jsonl").write_text("")
    (d / "blank_lines.jsonl").write_text("\n\n\n")
    (d / "no_prompt.jsonl").write_text('{"question": "123", "answer": "321"}\n')
    (d / "no_answer.jsonl").write_text('{"prompt": "123", "solution": "321"}\n')
    (d / "not_utf8.jsonl").write_bytes(b'{"prompt": "\xff\xfe", "answer": "1"}\n')
    (d / "array_rows.jsonl").write_text("[1, 2]\n")
    (d / "data.csv").write_text("prompt,answer\n1,1\n")
    (d / "bad.parquet").write_bytes(b"PAR1 not really parquet")
    (d / "empty_dir").mkdir()
    for name, cfg in (("garbage_config", "{garbage"), ("no_model_type", "{}"), ("array_config", "[1]")):
        (d / name).mkdir()
        (d / name / "config.json").write_text(cfg)
    (d / "no_config").mkdir()
    (d / "bad_tokenizer").mkdir()
    (d / "bad_tokenizer" / "config.json").write_text('{"model_type": "qwen3"}')
    (d / "bad_tokenizer" / "tokenizer.json").write_text("garbage{")
    (d / "bad_tokenizer" / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast"}')
    (d / "model_file").write_text("not a folder")
    return d


PREFLIGHT: list[tuple[list[str], str]] = [
    (["data.path={d}/missing.jsonl"], "does not exist"),
    (["data.path={d}/bad_line.jsonl"], "bad_line.jsonl:2"),
    (["data.path={d}/bad_late_line.jsonl"], "bad_late_line.jsonl:501"),
    (["data.path={d}/empty.jsonl"], "holds no rows"),
    (["data.path={d}/blank_lines.jsonl"], "holds no rows"),
    (["data.path={d}/no_prompt.jsonl"], "no field 'prompt'"),
    (["data.path={d}/no_answer.jsonl"], "no field 'answer'"),
    (["data.path={d}/no_prompt.jsonl", "data.prompt_key=question", "data.answer_key=nope"], "no field 'nope'"),
    (["data.path={d}/not_utf8.jsonl"], "not UTF-8"),
    (["data.path={d}/array_rows.jsonl"], "must be a JSON object"),
    (["data.path={d}/data.csv"], "is not a"),
    (["data.path={d}/bad.parquet"], "not a readable Parquet"),
    (["data.path={d}/empty_dir"], "holds no"),
    (["model.path={d}/nonexistent"], "does not exist"),
    (["model.path={d}/garbage_config"], "not readable JSON"),
    (["model.path={d}/array_config"], "names no model_type"),
    (["model.path={d}/no_model_type"], "names no model_type"),
    (["model.path={d}/no_config"], "holds no config.json"),
    (["model.path={d}/model_file"], "is not a folder"),
    (["model.path={d}/bad_tokenizer"], "cannot load tokenizer"),
    (["model.tokenizer={d}/bad_tokenizer"], "cannot load tokenizer"),
    (["model.tokenizer={d}/nonexistent_tok"], "does not exist"),
    (["trainer.device=cuda"], "trainer.device is cuda"),
    (["mode=fully_async", "rollout.device=cuda"], "rollout.device is cuda"),
    (["rollout.device=cuda"], "colocate generates with the trainer's model"),
    (["algorithm.name=distill", "algorithm.distill.teacher={d}/nonexistent_teacher"], "distill.teacher"),
    (["algorithm.name=distill"], "distill.teacher is not set"),
]


def _needs_no_gpu(overrides: list[str]) -> None:
    if any("cuda" in o for o in overrides):
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has a GPU: device: cuda is valid here")


@pytest.mark.parametrize("overrides,needle", PREFLIGHT, ids=[" ".join(o)[:50] for o, _ in PREFLIGHT])
def test_preflight_in_validate_and_submit(overrides: list[str], needle: str, files: Path, tmp_path: Path) -> None:
    _needs_no_gpu(overrides)
    sets = [x for o in overrides for x in ("--set", o.format(d=files))]
    assert_one_error(run_cli("validate", str(DEMO), "--executor", "local", *sets), needle)
    run_dir = tmp_path / "run"
    before = set(os.listdir("/proc"))
    res = run_cli("submit", str(DEMO), "--executor", "local", "--run-dir", str(run_dir), *sets)
    assert_one_error(res, needle)
    assert not run_dir.exists(), "preflight must run before the run dir is created"
    assert "started" not in res.out
    assert not {p for p in set(os.listdir("/proc")) - before if p.isdigit() and _is_role(p)}


def _is_role(pid: str) -> bool:
    try:
        return b"relax_hpc\x00role" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def test_slurm_device_check_needs_gpus_in_resources() -> None:
    assert_one_error(run_cli("validate", str(DEMO), "--executor", "slurm", "--set", "trainer.device=cuda"),
                     "launch.trainer.gpus_per_node is 0")
    assert_one_error(run_cli("validate", str(DEMO), "--executor", "slurm", "--set", "mode=fully_async",
                             "--set", "rollout.device=cuda", "--set", "trainer.device=cpu"),
                     "launch.rollout.gpus_per_node is 0")
    res = run_cli("validate", str(DEMO), "--executor", "slurm", "--set", "trainer.device=cuda",
                  "--set", "launch.trainer.gpus_per_node=1")
    assert res.rc == 0, res.err


def test_preflight_accepts_good_data(files: Path, tmp_path: Path) -> None:
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps({"prompt": "R123", "answer": "321"}) + "\n" for _ in range(10)))
    res = run_cli("validate", str(DEMO), "--executor", "local", "--set", f"data.path={good}")
    assert res.rc == 0, res.err


# ------------------------------------------------------------------------------------------------- CLI flags
BAD_FLAGS: list[tuple[list[str], str]] = [
    (["monitor", "{run}", "--interval", "nan"], "--interval"),
    (["monitor", "{run}", "--interval", "inf"], "--interval"),
    (["monitor", "{run}", "--interval", "0"], "--interval"),
    (["monitor", "{run}", "--interval", "-1"], "--interval"),
    (["monitor", "{run}", "--interval", "1e400"], "--interval"),
    (["monitor", "{run}", "--interval", "abc"], "--interval"),
    (["monitor", "{run}", "--duration", "nan"], "--duration"),
    (["monitor", "{run}", "--duration", "-5"], "--duration"),
    (["cancel", "{run}", "--timeout", "nan"], "--timeout"),
    (["cancel", "{run}", "--timeout", "-1"], "--timeout"),
    (["cancel", "{run}", "--timeout", "inf"], "--timeout"),
    (["scale", "{run}", "--rollout", "+1", "--timeout", "nan"], "--timeout"),
    (["nosuchcommand"], "invalid choice"),
    (["validate"], "required: recipe"),
    (["status", "{run}", "--bogus"], "unrecognized arguments"),
    (["submit", str(DEMO), "--executor", "mars"], "--executor"),
    (["plot", "{run}", "-o", ""], "empty"),
    (["plot", "{run}", "-o", "{tmp}/curves.txt"], "supported image suffix"),
    (["plot", "{run}", "-o", "{tmp}/curves"], "supported image suffix"),
    (["plot", "{run}", "-o", "{tmp}/"], "is a folder"),
    (["plot", "{run}", "-o", "{tmp}/missing/curves.png"], "does not exist"),
    (["status", "{tmp}/nope"], "does not exist"),
    (["monitor", "{tmp}/nope", "--once"], "does not exist"),
    (["plot", "{tmp}/nope"], "does not exist"),
    (["cancel", "{tmp}/nope"], "does not exist"),
    (["resume", "{tmp}/nope"], "does not exist"),
    (["sweep-status", "{tmp}/nope"], "not a sweep dir"),
    (["status", "{tmp}"], "not a relax-hpc run dir"),
    (["resume", "{tmp}"], "not a relax-hpc run dir"),
]


@pytest.mark.parametrize("argv,needle", BAD_FLAGS, ids=[" ".join(a)[:45] for a, _ in BAD_FLAGS])
def test_bad_flags(argv: list[str], needle: str, tmp_path: Path) -> None:
    run = tmp_path / "stuff"
    run.mkdir()
    (run / "junk.txt").write_text("x")
    args = [a.format(run=run, tmp=tmp_path) for a in argv]
    assert_one_error(run_cli(*args), needle)
