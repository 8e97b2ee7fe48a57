"""Helpers of the server-engine tests: an event loop on its own thread (an engine and its HTTP client live in one
loop across the tests of a module), a tiny untied Qwen3 recipe, HF reference computations."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

# A Qwen3 shape vLLM's CPU backend accepts (head_dim 64), untied (see model.tiny.tie_embeddings), float32.
TINY = {"hidden_size": 128, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 256,
        "max_position": 256, "tie_embeddings": False}


class LoopThread:
    """Runs coroutines on one event loop in a daemon thread; every call has a timeout."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 300.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def submit(self, coro: Coroutine[Any, Any, T]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def recipe(engine: str, run_dir: Path, **server: Any) -> Any:
    from relax_hpc.config.load import validate_dict

    return validate_dict({
        "name": "srv", "mode": "fully_async", "model": {"path": "tiny", "tiny": TINY, "dtype": "float32"},
        "data": {"task": {"name": "reverse_digits", "min_len": 2, "max_len": 4, "num_prompts": 64},
                 "max_prompt_tokens": 16},
        "rollout": {"engine": engine, "sampling": {"temperature": 1.0, "max_new_tokens": 240},
                    "server": {"startup_timeout_s": 300, "stop_grace_s": 5, **server}},
    })


def hf_model(state: dict[str, Any] | None = None, *, folder: Path) -> Any:
    """The HF model in ``folder`` (optionally with ``state`` loaded), eval mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype="float32")
    if state is not None:
        model.load_state_dict(state, strict=False)
    return model.eval()


def recompute_logprobs(model: Any, prompt: list[int], tokens: list[int], temperature: float) -> Any:
    """What the trainer recomputes (relax_hpc.trainer.torch_trainer.sequence_logprobs): log_softmax(logits / T) of
    each response token, T = 1 for greedy."""
    import torch

    t = temperature if temperature > 0 else 1.0
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float() / t
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0].numpy()


def hf_greedy(model: Any, prompt: list[int], n: int, eos: int) -> list[int]:
    """Greedy continuation (stops after EOS), as transformers generates it."""
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=eos,
                             pad_token_id=0)
    toks = out[0, len(prompt):].tolist()
    return toks[:toks.index(eos) + 1] if eos in toks else toks


def publish_adapter(rd: Any, model_dir: Path, lora: Any, version: int, seed: int) -> tuple[Path, Any]:
    """A LoRA adapter version (``lora``: a ``model.lora`` section) on the HF model in ``model_dir``, its ``lora_B``
    made non-zero, published into run dir ``rd`` as the trainer publishes one; (folder, the PEFT model, eval mode)."""
    import json

    import torch

    from relax_hpc.models.lora import adapter_config, adapter_state, apply_lora, base_identity
    from relax_hpc.weights.publisher import SnapshotPublisher

    base = hf_model(folder=model_dir)
    ident = base_identity(base, str(model_dir))
    peft = apply_lora(base, lora)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    conf = json.loads((model_dir / "config.json").read_text())
    folder = SnapshotPublisher(rd, keep_last=10).publish(
        adapter_state(peft), version, version, model_config=conf,
        adapter={"config": adapter_config(peft), "base": ident})
    return folder, peft.eval()


def skip_module_without_vllm() -> None:
    """At a vLLM test module's top: skip the module when the vLLM server venv is missing (tools/install.sh --vllm),
    or fail under ``RELAX_REQUIRE_VLLM=1``."""
    import os

    import pytest

    from relax_hpc.rollout.server.vllm import vllm_venv_python

    if vllm_venv_python() is None:
        if os.environ.get("RELAX_REQUIRE_VLLM") == "1":
            raise RuntimeError("RELAX_REQUIRE_VLLM=1 but the vLLM venv is missing: bash tools/install.sh --vllm")
        pytest.skip("no vLLM venv (bash tools/install.sh --vllm)", allow_module_level=True)
