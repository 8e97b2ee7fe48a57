"""Prompt data: tasks, JSONL/Parquet/folders, chat template, length filter, errors, shuffling, resume."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from relax_hpc.config.schema import DataConfig, TaskConfig
from relax_hpc.data import PromptDataset, PromptStream, generate_task
from relax_hpc.errors import ConfigError, UserError
from relax_hpc.models.multimodal import build_tiny_bpe_tokenizer
from relax_hpc.models.tiny import build_digits_tokenizer

ARITHMETIC = Path(__file__).resolve().parents[2] / "recipes" / "data" / "arithmetic.jsonl"


@pytest.fixture(scope="module")
def digits():
    return build_digits_tokenizer()


@pytest.fixture(scope="module")
def bpe():
    return build_tiny_bpe_tokenizer()


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ------------------------------------------------------------------------------------------------ tasks
@pytest.mark.parametrize(("name", "letter", "target"), [("reverse_digits", "R", lambda d: d[::-1]),
                                                        ("sort_digits", "S", lambda d: "".join(sorted(d))),
                                                        ("copy_digits", "C", lambda d: d)])
def test_tasks_generate_distinct_correct_prompts(name, letter, target):
    task = TaskConfig(name=name, min_len=2, max_len=6, num_prompts=500)
    rows = generate_task(task, seed=3)
    assert len(rows) == 500 and len({r["prompt"] for r in rows}) == 500
    for r in rows:
        digits = r["prompt"][1:]
        assert r["prompt"][0] == letter and digits.isdigit() and 2 <= len(digits) <= 6
        assert r["answer"] == target(digits)
    assert {len(r["prompt"]) - 1 for r in rows} == {2, 3, 4, 5, 6}
    assert generate_task(task, seed=3) == rows
    assert generate_task(task, seed=4) != rows


def test_task_dense_and_impossible_sizes():
    every = generate_task(TaskConfig(min_len=1, max_len=2, num_prompts=110), seed=0)
    assert sorted(r["prompt"][1:] for r in every) == sorted([str(i) for i in range(10)] +
                                                            [f"{i:02d}" for i in range(100)])
    with pytest.raises(ConfigError, match=r"data.task.num_prompts=111: only 110 distinct"):
        generate_task(TaskConfig(min_len=1, max_len=2, num_prompts=111), seed=0)
    with pytest.raises(ValueError, match=r"min_len=3 is larger than max_len=2"):
        TaskConfig(min_len=3, max_len=2)  # the schema refuses it when the recipe is validated
    with pytest.raises(ConfigError, match=r"data.task.max_len=2 is smaller than min_len=3"):
        generate_task(TaskConfig.model_construct(name="reverse_digits", min_len=3, max_len=2, num_prompts=10),
                      seed=0)


def test_task_dataset_uses_the_digits_chat_template(digits):
    ds = PromptDataset(DataConfig(task=TaskConfig(name="sort_digits", num_prompts=20)), digits, seed=0)
    assert len(ds) == 20
    p = ds[0]
    text = digits.decode(p.prompt_ids)
    assert text.startswith("<bos>S") and text.endswith("=") and "".join(sorted(text[6:-1])) == p.answer
    assert p.prompt_ids == digits.apply_chat_template([{"role": "user", "content": text[5:-1]}],
                                                      add_generation_prompt=True, tokenize=True, return_dict=False)


# ------------------------------------------------------------------------------------------------ files
def test_jsonl_with_chat_template_and_system_prompt(bpe):
    cfg = DataConfig(path=str(ARITHMETIC), system_prompt="Put the answer in \\boxed{}.", max_prompt_tokens=4096)
    ds = PromptDataset(cfg, bpe, seed=0)
    assert len(ds) == 200 and ds.stats() == {"data/rows": 200, "data/prompts": 200, "data/too_long": 0,
                                             "data/bad_media": 0}
    first = json.loads(ARITHMETIC.read_text().splitlines()[0])
    p = ds[0]
    expected = bpe.apply_chat_template(
        [{"role": "system", "content": cfg.system_prompt}, {"role": "user", "content": first["prompt"]}],
        add_generation_prompt=True, tokenize=True, return_dict=False)
    assert p.prompt_ids == expected
    assert bpe.decode(p.prompt_ids).endswith("<|im_start|>assistant\n")
    assert p.answer == first["answer"] and p.multimodal is None
    assert p.meta == {"op": first["op"], "source": f"{ARITHMETIC}:1", "index": 0}


def test_chat_messages_prompt_keeps_its_own_system_message(bpe, tmp_path):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    path = write_jsonl(tmp_path / "m.jsonl", [{"q": msgs, "a": 4}])
    ds = PromptDataset(DataConfig(path=str(path), prompt_key="q", answer_key="a", system_prompt="ignored"), bpe, 0)
    assert ds[0].prompt_ids == bpe.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                                       return_dict=False)
    assert ds[0].answer == 4


def test_raw_text_without_chat_template(bpe, tmp_path):
    path = write_jsonl(tmp_path / "r.jsonl", [{"prompt": "What is 3*4?", "answer": "12"}])
    ds = PromptDataset(DataConfig(path=str(path), chat_template=False, system_prompt="Solve."), bpe, 0)
    assert ds[0].prompt_ids == bpe("Solve.\nWhat is 3*4?")["input_ids"]
    msgs = write_jsonl(tmp_path / "m.jsonl", [{"prompt": [{"role": "user", "content": "x"}], "answer": "1"}])
    with pytest.raises(UserError, match=r"need data\.chat_template: true"):
        PromptDataset(DataConfig(path=str(msgs), chat_template=False), bpe, 0)


def test_parquet_folder_and_saved_dataset_give_the_same_prompts(bpe, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in ARITHMETIC.read_text().splitlines()]
    jsonl = PromptDataset(DataConfig(path=str(ARITHMETIC)), bpe, 0)
    reference = [jsonl[i].prompt_ids for i in range(len(jsonl))]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "a.parquet")
    ds = PromptDataset(DataConfig(path=str(tmp_path / "a.parquet")), bpe, 0)
    assert [ds[i].prompt_ids for i in range(len(ds))] == reference
    assert ds[5].answer == rows[5]["answer"] and ds[5].meta["source"].endswith("a.parquet#5")

    folder = tmp_path / "folder"
    folder.mkdir()
    write_jsonl(folder / "b.jsonl", rows[100:])
    pq.write_table(pa.Table.from_pylist(rows[:100]), folder / "a.parquet")
    (folder / "notes.txt").write_text("ignored")
    ds = PromptDataset(DataConfig(path=str(folder)), bpe, 0)
    assert [ds[i].prompt_ids for i in range(len(ds))] == reference

    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    ds = PromptDataset(DataConfig(path=str(tmp_path / "saved")), bpe, 0)
    assert [ds[i].prompt_ids for i in range(len(ds))] == reference


def test_too_long_prompts_are_skipped_and_counted(bpe, tmp_path, caplog):
    rows = [{"prompt": "1 + 1", "answer": "2"}, {"prompt": "word " * 200, "answer": "x"},
            {"prompt": "2 + 2", "answer": "4"}, {"prompt": "more " * 300, "answer": "y"}]
    path = write_jsonl(tmp_path / "l.jsonl", rows)
    with caplog.at_level(logging.WARNING):
        ds = PromptDataset(DataConfig(path=str(path), max_prompt_tokens=64), bpe, 0)
    assert len(ds) == 2 and ds.num_too_long == 2
    assert [ds[i].answer for i in range(2)] == ["2", "4"] and [ds[i].meta["index"] for i in range(2)] == [0, 1]
    assert all(len(ds[i].prompt_ids) <= 64 for i in range(2))
    assert "skipped 2 of 4 prompts longer than data.max_prompt_tokens=64" in caplog.text
    with pytest.raises(UserError, match=r"all 1 prompts .* are longer than data\.max_prompt_tokens=3"):
        PromptDataset(DataConfig(path=str(write_jsonl(tmp_path / "one.jsonl", rows[1:2])), max_prompt_tokens=3),
                      bpe, 0)


def test_bad_inputs_give_one_clear_error(bpe, tmp_path):
    def err(path: Path, **kw) -> str:
        with pytest.raises(UserError) as info:
            PromptDataset(DataConfig(path=str(path), **kw), bpe, 0)
        msg = str(info.value)
        assert "\n" not in msg
        return msg

    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    assert "holds no rows" in err(empty)
    assert "does not exist" in err(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "answer": 1}\n{"prompt": oops}\n')
    assert f"{bad}:2: not valid JSON" in err(bad)
    nokey = write_jsonl(tmp_path / "nokey.jsonl", [{"question": "a", "answer": 1}])
    assert f"{nokey}:1: no field 'prompt' (data.prompt_key); fields: ['answer', 'question']" == err(nokey)
    assert "no field 'solution' (data.answer_key)" in err(nokey, prompt_key="question", answer_key="solution")
    (tmp_path / "dir").mkdir()
    assert "holds no .jsonl/.json/.parquet files" in err(tmp_path / "dir")
    (tmp_path / "x.csv").write_text("a,b\n")
    assert "is not a .jsonl/.json/.parquet file" in err(tmp_path / "x.csv")
    badparquet = tmp_path / "bad.parquet"
    badparquet.write_text("not parquet")
    assert "not a readable Parquet file" in err(badparquet)
    notmsgs = write_jsonl(tmp_path / "n.jsonl", [{"prompt": [{"text": "a"}], "answer": 1}])
    assert "prompt[0] is not a chat message" in err(notmsgs)
    with pytest.raises(ConfigError, match="tokenizer has no chat template"):
        tok = build_tiny_bpe_tokenizer()
        tok.chat_template = None
        PromptDataset(DataConfig(path=str(ARITHMETIC)), tok, 0)


# ------------------------------------------------------------------------------------------------ stream
def _answers(stream: PromptStream, n: int) -> list[str]:
    return [p.answer for p in stream.next_batch(n)]


def test_shuffling_is_deterministic_per_seed_and_epoch(digits):
    ds = PromptDataset(DataConfig(task=TaskConfig(num_prompts=50)), digits, seed=0)
    a, b = PromptStream(ds, seed=7, num_epochs=3), PromptStream(ds, seed=7, num_epochs=3)
    assert a.order(0) == b.order(0) and sorted(a.order(0)) == list(range(50))
    assert a.order(0) != a.order(1) and a.order(0) != PromptStream(ds, seed=8).order(0)
    assert _answers(a, 120) == _answers(b, 120)
    assert PromptStream(ds, seed=7, shuffle=False).order(0) == list(range(50))


def test_epochs_and_exhaustion(digits):
    ds = PromptDataset(DataConfig(task=TaskConfig(num_prompts=10)), digits, seed=0)
    s = PromptStream(ds, seed=1, num_epochs=2)
    batches = [s.next_batch(4) for _ in range(6)]
    assert [len(b) for b in batches] == [4, 4, 4, 4, 4, 0] and s.exhausted
    flat = [p for b in batches for p in b]
    assert [p.meta["epoch"] for p in flat] == [0] * 10 + [1] * 10
    assert sorted(p.meta["index"] for p in flat[:10]) == list(range(10))
    assert [p.meta["index"] for p in flat[:10]] == s.order(0)
    assert list(PromptStream(ds, seed=1, num_epochs=1)) != [] and len(list(PromptStream(ds, num_epochs=1))) == 10


@pytest.mark.parametrize("taken", [0, 3, 9, 10, 13, 27])
def test_resume_continues_exactly(digits, taken):
    cfg = DataConfig(task=TaskConfig(num_prompts=10), num_epochs=4)
    ds = PromptDataset(cfg, digits, seed=0)
    full = PromptStream(ds)
    reference = _answers(full, 40)
    first = PromptStream(ds)
    head = _answers(first, taken)
    state = json.loads(json.dumps(first.state()))  # as the trainer's checkpoint stores it
    assert state["epoch"] == taken // 10 and state["index"] == taken % 10
    resumed = PromptStream(PromptDataset(cfg, digits, seed=0))  # a new process: rebuilt from the recipe
    resumed.load_state(state)
    assert head + _answers(resumed, 40 - taken) == reference
    assert resumed.exhausted


def test_load_state_rejects_garbage_and_warns_on_changed_data(digits, caplog):
    ds = PromptDataset(DataConfig(task=TaskConfig(num_prompts=10)), digits, seed=0)
    s = PromptStream(ds)
    for bad in ({"epoch": "1", "index": 0}, {"index": 2}, {"epoch": -1, "index": 0}, [1, 2]):
        with pytest.raises(UserError, match="data position"):
            s.load_state(bad)  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING):
        s.load_state({"epoch": 0, "index": 12, "num_prompts": 20})
    assert "the data now has 10" in caplog.text and s.state()["epoch"] == 1 and s.state()["index"] == 0
