"""The torch trainer: packing without padding, exact equivalence of packed/streamed/accumulated updates,
checkpoints (safetensors + JSON) that restore model, optimizer and RNG."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch

from relax_hpc.config.load import validate_dict
from relax_hpc.models.tiny import build_digits_tokenizer, build_tiny_model
from relax_hpc.rundir import RunDir
from relax_hpc.trainer.batch import TrainItem, pack, plan_packs
from relax_hpc.trainer.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from relax_hpc.trainer.torch_trainer import TorchTrainer


def make_cfg(**trainer):
    return validate_dict({"data": {"task": {"name": "reverse_digits"}}, "model": {"path": "tiny"},
                          "trainer": {"lr": 1e-2, "micro_batch_tokens": 32, "device": "cpu", **trainer},
                          "rollout": {"sampling": {"max_new_tokens": 8}}})


def make_model(seed: int = 0):
    tok = build_digits_tokenizer()
    cfg = make_cfg()
    return build_tiny_model(cfg.model.tiny, len(tok), seed=seed, pad_token_id=tok.pad_token_id), tok


def make_items(n: int = 12, seed: int = 0) -> list[TrainItem]:
    rng = np.random.default_rng(seed)
    items = []
    for i in range(n):
        p = rng.integers(4, 18, size=rng.integers(3, 9))
        r = rng.integers(4, 18, size=rng.integers(1, 9))
        mask = np.ones(len(r))
        if len(r) > 2:
            mask[1] = 0  # a tool token
        items.append(TrainItem.of(prompt_ids=p, response_ids=r, logprobs=-np.abs(rng.normal(2.5, 0.3, len(r))),
                               loss_mask=mask, advantage=float(rng.normal()), reward=float(rng.random()),
                               group_id=f"g{i // 4}"))
    return items


def test_row_width_trades_padding_against_attention() -> None:
    from relax_hpc.trainer.batch import choose_row_width

    rng = np.random.default_rng(0)
    lengths = [int(x) for x in rng.integers(9, 18, size=128)]
    width, rows = choose_row_width(lengths, sum(lengths))
    assert sorted(i for r in rows for i in r) == list(range(128))
    assert all(sum(lengths[i] for i in r) <= width for r in rows)
    assert 1 - sum(lengths) / (len(rows) * width) <= 0.10
    assert width < sum(lengths)  # several rows, not one quadratic row
    # a small model: rows (one row of ~1400 tokens trained 3x slower than rows of ~60 on the demo model)
    lengths = [11] * 100 + [12] * 28
    width, rows = choose_row_width(lengths, sum(lengths), attn_scale=384)
    assert len(rows) > 1
    # the cost model: a large model (attention cheap next to the matmuls) takes the padding-free single row
    width, rows = choose_row_width(lengths, sum(lengths), attn_scale=1e9)
    assert len(rows) == 1 and width == sum(lengths)


def test_plan_packs_first_fit_and_no_overflow() -> None:
    lengths = [30, 5, 12, 20, 7, 40, 3]
    packs = plan_packs(lengths, 32)
    assert sorted(i for p in packs for i in p) == list(range(len(lengths)))
    for p in packs:
        assert len(p) == 1 or sum(lengths[i] for i in p) <= 32
    assert [5] in packs  # longer than the budget: alone


def test_packed_logprobs_equal_unpacked() -> None:
    model, _ = make_model()
    cfg = make_cfg()
    from relax_hpc.algorithms.registry import get_algorithm

    tr = TorchTrainer(cfg, model, device="cpu", dtype=torch.float32, algorithm=get_algorithm("grpo"))
    items = make_items(8)
    one_row = pack(items, 64, rows=False)
    assert len(one_row) < len(items)  # really packed
    assert all(mb.input_ids.shape[0] == 1 and mb.num_tokens == mb.real_tokens for mb in one_row)  # no padding
    rows = pack(items, 64, rows=True)
    assert all(mb.real_tokens == sum(it.num_tokens for it in mb.items) for mb in rows)
    for mb in one_row + rows:
        logp, _ = tr.sequence_logprobs(model, mb)
        for s, it in enumerate(mb.items):
            ids = torch.tensor(np.concatenate([it.sample.prompt_ids, it.sample.response_ids]))[None]
            ref = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[0].float(), -1)
            p = len(it.sample.prompt_ids)
            want = ref[p - 1:-1].gather(-1, torch.tensor(it.sample.response_ids)[:, None])[:, 0]
            torch.testing.assert_close(logp[mb.seq_ids == s], want, atol=1e-5, rtol=1e-5)


def test_packed_fields_follow_their_sequence() -> None:
    """Every per-token field lands on its own sequence's tokens, in order; the layout holds each sequence once, with
    positions restarting at 0, and nothing else but padding."""
    items = make_items(40, seed=3)
    for k, it in enumerate(items):
        it.weight = 0.5 + k
        if k % 7 == 0:  # distillation-style per-token advantages on some items
            it.token_advantages = np.arange(len(it.sample.response_ids), dtype=np.float32) + 100 * k
    for rows in (True, False):
        for mb in pack(items, 120, rows=rows):
            ids, pos = mb.input_ids.reshape(-1), mb.position_ids.reshape(-1)
            for s, it in enumerate(mb.items):
                sel = mb.seq_ids == s
                np.testing.assert_array_equal(mb.targets[sel].numpy(), it.sample.response_ids)
                np.testing.assert_allclose(mb.rollout_logprobs[sel].numpy(), it.sample.logprobs.astype(np.float32))
                np.testing.assert_array_equal(mb.loss_mask[sel].numpy(), it.sample.loss_mask.astype(np.float32))
                want = it.token_advantages if it.token_advantages is not None else np.full(len(it.sample.response_ids),
                                                                                            it.advantage)
                np.testing.assert_allclose(mb.advantages[sel].numpy(), np.asarray(want, dtype=np.float32))
                assert bool((mb.weights[sel] == np.float32(it.weight)).all())
                # the logits that predict the response sit just before each response token, in its own sequence
                first = int(mb.logit_index[sel][0]) - (len(it.sample.prompt_ids) - 1)
                seq = np.concatenate([it.sample.prompt_ids, it.sample.response_ids])
                np.testing.assert_array_equal(ids[first:first + len(seq)].numpy(), seq)
                np.testing.assert_array_equal(pos[first:first + len(seq)].numpy(), np.arange(len(seq)))
            assert int((ids != 0).sum()) <= mb.real_tokens <= ids.numel()


def _run_update(items_parts: list[list[TrainItem]], micro_batch_tokens: int) -> dict[str, torch.Tensor]:
    from relax_hpc.algorithms.registry import get_algorithm

    model, _ = make_model()
    tr = TorchTrainer(make_cfg(micro_batch_tokens=micro_batch_tokens), model, device="cpu", dtype=torch.float32,
                      algorithm=get_algorithm("grpo"))
    tr.begin_step()
    for part in items_parts:
        tr.accumulate(copy.deepcopy(part))
    tr.finish_step()  # rows with padding tails (the cost model's choice): the updates must still be equal
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_streamed_and_micro_batched_updates_equal_one_big_batch() -> None:
    items = make_items(12)
    one = _run_update([items], 10_000)
    micro = _run_update([items], 24)  # many micro-batches
    streamed = _run_update([items[:4], items[4:8], items[8:]], 24)  # groups arriving over time
    for k in one:
        torch.testing.assert_close(micro[k], one[k], atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(streamed[k], one[k], atol=2e-5, rtol=1e-4)
    base, _ = make_model()
    assert any(not torch.equal(base.state_dict()[k], one[k]) for k in one)  # it did update


def test_checkpoint_roundtrip_restores_model_optimizer_and_rng(tmp_path) -> None:
    from relax_hpc.algorithms.registry import get_algorithm

    rd = RunDir.create(tmp_path / "run")
    model, _ = make_model()
    tr = TorchTrainer(make_cfg(), model, device="cpu", dtype=torch.float32, algorithm=get_algorithm("grpo"))
    tr.train_step(make_items(8, seed=1))
    save_checkpoint(rd, 1, model_sd=tr.full_state_dict(), optim_sd=tr.full_optimizer_state(),
                    state={"data": {"epoch": 0, "index": 16}, "store_position": {"writers": {}}})
    after_rng = torch.rand(3)
    path = latest_checkpoint(rd)
    assert path is not None and path.name == "step_00000001"
    assert not list(path.glob("*.pt")) and not list(path.glob("*.pkl"))  # no pickles on the shared filesystem
    model2, _ = make_model(seed=5)
    tr2 = TorchTrainer(make_cfg(), model2, device="cpu", dtype=torch.float32, algorithm=get_algorithm("grpo"))
    msd, osd, state = load_checkpoint(path)
    tr2.load_full_state(msd, osd)
    assert state["data"] == {"epoch": 0, "index": 16}
    torch.testing.assert_close(torch.rand(3), after_rng)  # RNG restored to the saved point
    for k, v in model.state_dict().items():
        assert torch.equal(model2.state_dict()[k], v)
    # the same next update from both
    items = make_items(8, seed=2)
    tr.train_step(copy.deepcopy(items))
    tr2.train_step(copy.deepcopy(items))
    for k, v in model.state_dict().items():
        torch.testing.assert_close(model2.state_dict()[k], v, atol=1e-6, rtol=1e-5)


def test_checkpoint_retention_and_latest(tmp_path) -> None:
    rd = RunDir.create(tmp_path / "run")
    model, _ = make_model()
    for step in (1, 2, 3):
        save_checkpoint(rd, step, model_sd=model.state_dict(), optim_sd=None, state={}, keep=2)
    names = sorted(p.name for p in rd.checkpoints.glob("step_*"))
    assert names == ["step_00000002", "step_00000003"]
    assert latest_checkpoint(rd).name == "step_00000003"


@pytest.mark.parametrize("bad", ["cuda"])
def test_gpu_requested_without_gpu_is_user_error(bad: str) -> None:
    from relax_hpc.errors import UserError
    from relax_hpc.models.load import resolve_device

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(UserError, match="no CUDA device"):
        resolve_device(bad)


def test_missing_model_path_is_user_error(tmp_path) -> None:
    from relax_hpc.config.schema import ModelConfig
    from relax_hpc.errors import UserError
    from relax_hpc.models.load import load_model, load_tokenizer

    with pytest.raises(UserError, match="does not exist"):
        load_tokenizer(ModelConfig(path=str(tmp_path / "no-model")))
    tok = build_digits_tokenizer()
    with pytest.raises(UserError, match="does not exist"):
        load_model(ModelConfig(path=str(tmp_path / "no-model")), tok, device="cpu", dtype=torch.float32)


def test_background_checkpoint_holds_the_state_of_its_step(tmp_path: Path) -> None:
    from relax_hpc.algorithms.registry import get_algorithm
    from relax_hpc.events import EventLog
    from relax_hpc.trainer.session import TrainerSession

    model, tok = make_model()
    cfg = make_cfg()
    tr = TorchTrainer(cfg, model, device="cpu", dtype=torch.float32, algorithm=get_algorithm("grpo"))
    rd = RunDir.create(tmp_path / "run")
    session = TrainerSession(rd, cfg, tr, tok, EventLog(rd, "trainer", 0))
    tr.train_step(make_items(8))
    want = {k: v.detach().clone() for k, v in model.state_dict().items()}
    saved: list[int] = []
    session.checkpoint({"note": "bg"}, on_saved=lambda: saved.append(1), background=True)
    assert session.last_checkpoint_step == 1
    tr.train_step(make_items(8))  # training goes on while the write runs: the checkpoint keeps step 1's weights
    assert any(not torch.equal(want[k], v) for k, v in model.state_dict().items())
    session.drain()
    assert saved == [1]  # on_saved ran on this thread, once, after the write
    session.drain()
    assert saved == [1]
    path = latest_checkpoint(rd)
    assert path is not None and path.name.endswith("1")
    model_sd, optim_sd, state = load_checkpoint(path)
    assert state["step"] == 1 and state["note"] == "bg" and optim_sd is not None
    assert all(torch.equal(model_sd[k], want[k]) for k in want if k in model_sd)
    session.close()
