"""Exact tokens across turns: the stored sequence is what the model generated plus the environment's tokens, byte
for byte, the loss mask covers exactly the generated tokens, and the loss ignores the masked ones."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from relax_hpc.config.load import validate_dict
from relax_hpc.envs.api import Task
from relax_hpc.envs.builtin.calculator import CalculatorEnv
from relax_hpc.envs.builtin.guessing import GuessNumberEnv
from relax_hpc.envs.builtin.lookup import DigitCallParser, DigitLookupEnv
from relax_hpc.envs.episode import run_episode
from relax_hpc.envs.parsers import HermesParser
from relax_hpc.models.tiny import build_digits_tokenizer, build_tiny_model
from relax_hpc.rollout.engine import SamplingParams
from tests.helpers.agentic_helpers import ModelEngine, ScriptedEngine, qwen_style_tokenizer


def env_cfg(**kw):
    return validate_dict({"data": {"task": {"name": "copy_digits"}},
                          "rollout": {"env": {"name": "calculator", **kw}}}).rollout.env


class Recording(ModelEngine):
    """The real tiny model; remembers every sample it returned, by request id."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.outputs: dict[str, np.ndarray] = {}

    def _finish(self, a, reason):
        self.outputs[a.req.request_id] = np.asarray(a.ids, dtype=np.int32)
        super()._finish(a, reason)


@pytest.fixture(scope="module")
def qwen_tok():
    return qwen_style_tokenizer()


def check_sample(tok, sample, generated: list[np.ndarray]) -> None:
    """The response is generated turns and environment tokens interleaved; the mask is 1 exactly on the turns."""
    r, m = sample.response_ids, sample.loss_mask
    assert len(sample.turns) == len(generated)
    for (a, b), g in zip(sample.turns, generated):
        assert np.array_equal(r[a:b], g)
        assert m[a:b].all()
        assert (sample.logprobs[a:b] != 0).any() or len(g) == 0
    gen = np.zeros(len(r), dtype=bool)
    for a, b in sample.turns:
        gen[a:b] = True
    assert np.array_equal(m.astype(bool), gen)
    assert (sample.versions[~gen] == -1).all() and (sample.logprobs[~gen] == 0).all()


def test_digits_template_real_model_concurrent_episodes() -> None:
    tok = build_digits_tokenizer()
    torch.manual_seed(0)
    cfg0 = validate_dict({"data": {"task": {"name": "copy_digits"}}})
    model = build_tiny_model(cfg0.model.tiny, len(tok), pad_token_id=tok.pad_token_id)
    engine = Recording(model, tok, chunk=3)
    cfg = env_cfg(max_turns=3, max_total_tokens=40, max_turn_tokens=6)

    async def main():
        eps = [run_episode(engine, DigitLookupEnv(length=2), Task(f"{i % 10}{i % 7}"), tokenizer=tok, cfg=cfg,
                           sampling=SamplingParams(temperature=1.0, max_new_tokens=6), parser=DigitCallParser(),
                           seed=i, request_id=f"ep{i}") for i in range(24)]
        return await asyncio.gather(*eps)

    results = asyncio.run(main())
    assert max(engine.batches) > 1  # concurrent episodes shared engine passes
    turns = 0
    for i, res in enumerate(results):
        assert res.stats.error is None and len(res.samples) == 1
        s = res.samples[0]
        gen = [engine.outputs[f"ep{i}/e0.t{k}/1"] for k in range(len(s.turns))]
        check_sample(tok, s, gen)
        # the whole stream decodes to the template's rendering of the conversation (special tokens included)
        text = tok.decode(list(s.prompt_ids) + list(s.response_ids), skip_special_tokens=False)
        msgs = res.messages
        rendered = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
        if s.finish_reason == "stop":
            assert text.replace(" ", "") == rendered
        turns += len(s.turns)
        assert len(s.prompt_ids) + len(s.response_ids) <= 40
    assert turns > len(results)  # some episodes called the tool and went on


def test_qwen_template_tool_calls_byte_for_byte(qwen_tok) -> None:
    tok = qwen_tok
    call = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "4*21"}}\n</tool_call>'
    turns = ["Let me compute.\n" + call, '<tool_call>{"name": "calc", "arguments": {}}</tool_call>',
             '<tool_call>{"name": "calculate", "arguments": {"expression": 4}</tool_call>', "The answer is\n84"]
    engine = ScriptedEngine(tok, turns)
    cfg = env_cfg(max_turns=6)
    task = Task("Fatima fills 4 boxes with 21 pencils each. How many pencils is that in total?", "84")
    res = asyncio.run(run_episode(engine, CalculatorEnv(), task, tokenizer=tok, cfg=cfg,
                                  sampling=SamplingParams(max_new_tokens=64), parser=HermesParser(), seed=0,
                                  request_id="q"))
    st = res.stats
    assert st.error is None and st.reward == 1.0 and st.turns == 4
    assert st.tool_calls == 3 and st.tool_errors == 2  # unknown tool, malformed JSON
    s = res.samples[0]
    gen = [np.asarray(tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]) for t in turns]
    check_sample(tok, s, gen)
    # the environment's tokens are exactly the template's delta, starting with the newline after <|im_end|>
    a, b = s.turns[0][1], s.turns[1][0]
    env_text = tok.decode(list(s.response_ids[a:b]), skip_special_tokens=False)
    assert env_text == "\n<|im_start|>user\n<tool_response>\n84\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    a, b = s.turns[1][1], s.turns[2][0]
    assert "unknown tool 'calc'" in tok.decode(list(s.response_ids[a:b]))
    # what each engine request read is the stream so far (never a re-tokenized conversation)
    stream = list(s.prompt_ids) + list(s.response_ids)
    for req, (start, _) in zip(engine.requests, s.turns):
        assert list(req.prompt_ids) == stream[:len(s.prompt_ids) + start]
    text = tok.decode(stream, skip_special_tokens=False)
    rendered = tok.apply_chat_template(res.messages, tools=[_calc_schema()], tokenize=False)
    assert rendered == text + "\n"  # the template's newline after the last <|im_end|> was never generated


def test_template_that_drops_earlier_reasoning_starts_a_new_sample(qwen_tok) -> None:
    tok = qwen_tok
    turns = ["<think>\nmiddle\n</think>\n\n50", "<think>\nhigher\n</think>\n\n75", "<think>\nok\n</think>\n\n62"]
    engine = ScriptedEngine(tok, turns)
    cfg = env_cfg(max_turns=5, tool_parser="none")
    res = asyncio.run(run_episode(engine, GuessNumberEnv(1, 100, use_answer=True), Task("", 62), tokenizer=tok, cfg=cfg,
                                  sampling=SamplingParams(max_new_tokens=64), parser=HermesParser(), seed=0,
                                  request_id="g"))
    assert res.stats.reward == pytest.approx(0.9) and res.stats.samples == 3
    for k, s in enumerate(res.samples):
        check_sample(tok, s, [np.asarray(tok(turns[k], add_special_tokens=False)["input_ids"] + [tok.eos_token_id])])
        # each new prompt is the template's rendering (earlier reasoning dropped), as the model then read it
        prompt = tok.decode(list(s.prompt_ids), skip_special_tokens=False)
        assert "<think>" not in prompt
    assert "50 is wrong: higher." in tok.decode(list(res.samples[1].prompt_ids))


def test_tool_output_cut_and_token_budget(qwen_tok) -> None:
    tok = qwen_tok
    call = '<tool_call>{"name": "calculate", "arguments": {"expression": "7**60"}}</tool_call>'
    engine = ScriptedEngine(tok, [call, "done 1"])
    cfg = env_cfg(max_turns=4, max_tool_output_tokens=5, truncation_marker="[cut]")
    res = asyncio.run(run_episode(engine, CalculatorEnv(), Task("x", "1"), tokenizer=tok, cfg=cfg,
                                  sampling=SamplingParams(max_new_tokens=64), parser=HermesParser(), seed=0,
                                  request_id="c"))
    assert res.stats.truncated_outputs == 1
    assert "[cut]" in tok.decode(list(res.samples[0].response_ids))
    # total budget: the second turn gets only what is left of max_total_tokens
    small = '<tool_call>{"name": "calculate", "arguments": {"expression": "2+3"}}</tool_call>'
    engine = ScriptedEngine(tok, [small, "the answer is five, which is 5 and nothing else at all. " * 3])
    n_prompt = len(tok(tok.apply_chat_template(CalculatorEnv().first_messages(Task("x")), tokenize=False,
                                               tools=[_calc_schema()], add_generation_prompt=True),
                       add_special_tokens=False)["input_ids"])
    cfg = env_cfg(max_turns=4, max_total_tokens=n_prompt + 60)
    res = asyncio.run(run_episode(engine, CalculatorEnv(), Task("x", "5"), tokenizer=tok, cfg=cfg,
                                  sampling=SamplingParams(max_new_tokens=64), parser=HermesParser(), seed=0,
                                  request_id="c2"))
    first, second = engine.requests
    assert first.sampling.max_new_tokens == 60
    assert second.sampling.max_new_tokens == n_prompt + 60 - len(second.prompt_ids) > 0
    s = res.samples[0]
    assert len(s.prompt_ids) + len(s.response_ids) == n_prompt + 60 and s.finish_reason == "length"
    assert res.stats.truncated == "max_total_tokens"


def _calc_schema():
    from relax_hpc.envs.builtin.calculator import calculate
    from relax_hpc.envs.tools import Tool

    return Tool.from_callable(calculate).schema


def test_loss_ignores_masked_tokens() -> None:
    """Gradient check with the real trainer: the gradient reaching the logits of environment tokens is exactly 0."""
    from relax_hpc.algorithms.registry import get_algorithm
    from relax_hpc.trainer.batch import TrainItem
    from relax_hpc.trainer.torch_trainer import TorchTrainer

    tok = build_digits_tokenizer()
    # no clipping (the scripted samples' made-up log-probs would clip): every generated token gets a gradient
    rcfg = validate_dict({"data": {"task": {"name": "copy_digits"}}, "trainer": {"device": "cpu", "lr": 1e-3},
                          "algorithm": {"clip_low": 1.0, "clip_high": 1e9, "tis_cap": None}})
    torch.manual_seed(0)
    model = build_tiny_model(rcfg.model.tiny, len(tok), pad_token_id=tok.pad_token_id)
    engine = ModelEngine(model, tok, chunk=4)
    cfg = env_cfg(max_turns=3, max_turn_tokens=4)
    parser = DigitCallParser()

    async def main():
        return await asyncio.gather(*(run_episode(engine, DigitLookupEnv(2), Task(f"{i}{i}"), tokenizer=tok, cfg=cfg,
                                                  sampling=SamplingParams(temperature=1.0, max_new_tokens=4),
                                                  parser=parser, seed=i, request_id=f"e{i}") for i in range(8)))

    samples = [r.samples[0] for r in asyncio.run(main())]
    scripted = ScriptedEngine(tok, ["C", "12", "C", "7", "C", "C", "99"])  # episodes that surely call the tool
    for i in range(3):
        samples += asyncio.run(run_episode(scripted, DigitLookupEnv(2), Task(f"{i}"), tokenizer=tok, cfg=cfg,
                                           sampling=SamplingParams(max_new_tokens=4), parser=parser, seed=i,
                                           request_id=f"s{i}")).samples
    assert sum(int((s.loss_mask == 0).sum()) for s in samples) >= 6
    items = [TrainItem.of(prompt_ids=s.prompt_ids, response_ids=s.response_ids, logprobs=s.logprobs,
                       loss_mask=s.loss_mask.astype(np.float32), advantage=1.0 if i % 2 else -1.0, group_id="g")
             for i, s in enumerate(samples)]
    trainer = TorchTrainer(rcfg, model, device="cpu", dtype=torch.float32, algorithm=get_algorithm("grpo"))
    captured = []

    def keep(_mod, _inp, out):  # the final hidden state of a position feeds only that position's logits
        hidden = out.last_hidden_state
        hidden.retain_grad()
        captured.append(hidden)

    handle = model.model.register_forward_hook(keep)
    try:
        trainer.begin_step()
        trainer.accumulate(items)
    finally:
        handle.remove()
    from relax_hpc.trainer.batch import pack

    mbs = pack(items, rcfg.trainer.micro_batch_tokens, device="cpu", rows=trainer._use_rows(items))
    assert len(mbs) == len(captured)
    zero = nonzero = 0
    for mb, logits in zip(mbs, captured):
        g = logits.grad.reshape(-1, logits.shape[-1])[mb.logit_index]  # [T, H] grad at each target's position
        norms = g.abs().sum(-1)
        mask = mb.loss_mask.bool()
        assert (norms[~mask] == 0).all()
        assert (norms[mask] > 0).all()
        zero += int((~mask).sum())
        nonzero += int(mask.sum())
    assert zero > 0 and nonzero > 0


LLAMA_STYLE_TEMPLATE = (
    "{% if tools %}<|start_header_id|>system<|end_header_id|>\n\nTools (answer with a JSON call in <tool_call>):"
    "{% for t in tools %}\n{{ t | tojson }}{% endfor %}<|im_end|>{% endif %}"
    "{% for m in messages %}<|start_header_id|>{{ 'ipython' if m.role == 'tool' else m.role }}<|end_header_id|>"
    "\n\n{{ m.content | trim }}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
"""A Llama-3-style template over the Qwen vocabulary: header lines, the tool role rendered as ``ipython``, contents
trimmed, and nothing after the end-of-turn token (the environment's tokens start right after the model's own)."""


def test_llama_style_template_byte_for_byte(qwen_tok) -> None:
    import copy

    tok = copy.deepcopy(qwen_tok)
    tok.chat_template = LLAMA_STYLE_TEMPLATE
    turns = ['<tool_call>{"name": "calculate", "arguments": {"expression": "6*7"}}</tool_call>', "42"]
    engine = ScriptedEngine(tok, turns)
    task = Task("What is 6 times 7?", "42")
    res = asyncio.run(run_episode(engine, CalculatorEnv(), task, tokenizer=tok, cfg=env_cfg(max_turns=4),
                                  sampling=SamplingParams(max_new_tokens=64), parser=HermesParser(), seed=0,
                                  request_id="l"))
    assert res.stats.error is None and res.stats.reward == 1.0 and res.stats.tool_calls == 1
    (s,) = res.samples
    gen = [np.asarray(tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]) for t in turns]
    check_sample(tok, s, gen)
    a, b = s.turns[0][1], s.turns[1][0]
    env_text = tok.decode(list(s.response_ids[a:b]), skip_special_tokens=False)
    assert env_text == ("<|start_header_id|>ipython<|end_header_id|>\n\n42<|im_end|>"
                        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    stream = list(s.prompt_ids) + list(s.response_ids)
    rendered = tok.apply_chat_template(res.messages, tools=[_calc_schema()], tokenize=False)
    assert rendered == tok.decode(stream, skip_special_tokens=False)  # nothing after the last end-of-turn
    for req, (start, _) in zip(engine.requests, s.turns):
        assert list(req.prompt_ids) == stream[:len(s.prompt_ids) + start]
