"""A stand-in for an SGLang server (HTTP API of SGLang 0.5.10), used by the ``sglang`` engine tests because SGLang
cannot run on these machines (no CPU kernels for this processor; its GPU wheels pin torch 2.9.1).

A real HTTP server process (stdlib ``http.server``, one thread per request) with a HF causal LM behind SGLang's
endpoints. It behaves as the released server does where the engine's correctness depends on it; each such behaviour
below names the SGLang 0.5.10 source it follows (read from the ``sglang-0.5.10`` wheel on PyPI, ``sglang/srt/...``):

* request bodies: SGLang's request structs are dataclasses in ``managers/io_struct.py`` that FastAPI validates:
  unknown fields are *ignored*, a missing field without a default is HTTP 400 (``entrypoints/http_server.py``,
  ``validation_exception_handler`` turns FastAPI's 422 into 400). ``FIELDS`` records the accepted fields.
  ``sampling_params`` becomes ``SamplingParams(**sampling_params)`` (``managers/tokenizer_manager.py``,
  ``_create_tokenized_object``): an unknown key is a ``TypeError`` nobody catches, HTTP 500.
* strict mode (environment ``SGLANG_STANDIN_STRICT=1``): unknown fields (body or sampling_params) are answered 400,
  so a test can prove the engine never sends a misspelled field. Not SGLang's behaviour; a check of our own.
* context check (``tokenizer_manager.py``, ``_validate_one_request``): the input alone must be shorter than the
  context length, and input + ``max_new_tokens`` too (``>=`` refuses): HTTP 400.
* failures of the weight endpoints are HTTP 400 with ``{"success": false, "message"}`` (``http_server.py``,
  ``update_weights_from_disk``, ``init_weights_update_group``, ``update_weights_from_distributed``,
  ``destroy_weights_update_group``); errors of ``/generate`` are 400 ``{"error": {"message"}}``
  (``_create_error_response``).
* ``/pause_generation`` with ``mode: abort`` aborts everything and returns only once no request is in flight
  (``tokenizer_manager.py``, ``pause_generation``: abort, check ``model_update_lock``, sleep 1 s, repeat).
  ``mode: in_place`` leaves requests in the running batch; a weight update with ``flush_cache`` then fails the
  scheduler's assert (``managers/scheduler_update_weights_mixin.py``: "Cache flush failed after updating weights";
  ``scheduler.py``, ``flush_cache`` needs an idle scheduler) and the server dies.
* ``/health`` runs a one-token generation (``http_server.py``, ``health_generate``; ``environ.py``:
  ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION`` defaults to true), which waits while generation is paused: the
  endpoint answers 503 after ``SGLANG_HEALTH_CHECK_TIMEOUT`` (20 s) seconds, checking once a second.
* ``/update_weights_from_distributed`` for a group never initialised: ``model_executor/model_runner.py``,
  ``update_weights_from_distributed``, asserts the group exists outside any ``try``; the scheduler process raises and
  SGLang takes the whole server down. The stand-in exits at once (the HTTP request gets no answer).
* ``sampling_seed`` is used only with ``--enable-deterministic-inference`` (``sampling/sampling_batch_info.py``,
  ``from_schedule_batch``: seeds are gathered only when ``enable_deterministic_inference``; then a request without
  one gets 42). Without the flag all requests draw from the server's generator.
* ``/release_memory_occupation`` and ``/resume_memory_occupation`` (``http_server.py``; the scheduler's side is
  ``managers/scheduler_update_weights_mixin.py``): ``tags`` (``io_struct.py``, ``Release``/
  ``ResumeMemoryOccupationReqInput``) empty or None = every tag (``constants.py``, ``GPU_MEMORY_ALL_TYPES``:
  ``kv_cache``, ``weights``, ``cuda_graph``). Release asserts an idle scheduler (``is_fully_idle``; an assert kills
  the server) and adds the tags to ``offload_tags``; resume removes them (``set.remove``: a tag not released is a
  ``KeyError`` in the scheduler, which takes the server down). The memory is freed only with
  ``--enable-memory-saver`` (``utils/torch_memory_saver_adapter.py``: otherwise a no-op adapter). Released weights
  lose their contents unless the server runs with ``--enable-weights-cpu-backup`` (``model_executor/
  model_runner.py``, the weights' region ``enable_cpu_backup``); the stand-in fills them with NaN then. Buffers
  survive (``_export_static_state`` / ``_import_static_state``). The HTTP reply of success is ``null`` (the handler
  returns nothing); an exception outside the scheduler is 400 ``{"error": {"message"}}`` (``_create_error_response``).
  ``--mem-fraction-static`` is accepted and has no effect here (no GPU).
* ``/server_info`` and ``/get_server_info`` report the server arguments and ``version`` (``http_server.py``,
  ``server_info``); the stand-in reports 0.5.10 (``SGLANG_STANDIN_VERSION`` overrides it, for tests).

* LoRA (``--enable-lora``, ``--max-lora-rank``, ``--lora-target-modules``; without ``--lora-paths`` both are required
  at start, ``server_args.py``): ``/load_lora_adapter`` (``lora_name``, ``lora_path``: a PEFT adapter folder) and
  ``/unload_lora_adapter`` (``lora_name``) answer ``LoRAUpdateOutput`` (``success``, ``error_message``,
  ``loaded_adapters``), HTTP 400 when ``success`` is false (``http_server.py``); refused: LoRA not enabled, a name
  already loaded, a rank above ``--max-lora-rank`` or a target outside ``--lora-target-modules``
  (``lora/lora_manager.py``, ``validate_new_adapter``), unloading a name not loaded (``lora/lora_registry.py``,
  ``unregister``). An unload waits for the requests using that adapter (``wait_for_unload``). ``/generate``'s
  ``lora_path`` names a loaded adapter *by its name*; a name loaded once and unloaded since is loaded again from its
  path, a name never loaded is 400 (``tokenizer_manager.py``, ``_resolve_lora_path``); without ``--enable-lora``,
  400. The adapter is applied with PEFT on the stand-in's model; ``max_loaded_loras`` eviction is not modelled.

Not modelled: SGLang's scheduler runs control calls one at a time; here they run on their own threads (generation is
still one forward at a time under a lock, so pause/abort/weight updates land between tokens as in SGLang).
Generation while memory is released (on a GPU it would touch unmapped memory; the engine refuses to ask for it)
and the memory itself (nothing is freed: the stand-in has no GPU).

    python tests/helpers/sglang_standin.py --model-path DIR --port 30000 [--host ...] [--weight-version 0] ...
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch

VERSION = os.environ.get("SGLANG_STANDIN_VERSION", "0.5.10")
STRICT = os.environ.get("SGLANG_STANDIN_STRICT") == "1"
HEALTH_CHECK_TIMEOUT = int(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", 20))
HEALTH_GENERATES = os.environ.get("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "1").lower() not in ("0", "false")

_BASE = ["rid", "http_worker_ipc"]  # io_struct.py, BaseReq (every request struct below derives from it)
# endpoint -> the fields of its request struct in SGLang 0.5.10's io_struct.py, in declaration order (recorded from
# the release; tests/integration/test_engine_sglang.py holds the stand-in to this list, so drift is a deliberate edit)
FIELDS: dict[str, list[str]] = {
    "/generate": [  # GenerateReqInput
        *_BASE, "text", "input_ids", "input_embeds", "image_data", "video_data", "audio_data", "sampling_params",
        "return_logprob", "logprob_start_len", "top_logprobs_num", "token_ids_logprob", "return_text_in_logprobs",
        "stream", "log_metrics", "return_hidden_states", "return_routed_experts", "routed_experts_start_len",
        "modalities", "session_params", "lora_path", "lora_id", "custom_logit_processor", "bootstrap_host",
        "bootstrap_port", "bootstrap_room", "bootstrap_pair_key", "decode_tp_size", "require_reasoning",
        "routed_dp_rank", "disagg_prefill_dp_rank", "data_parallel_rank", "background", "conversation_id",
        "priority", "extra_key", "routing_key", "no_logs", "custom_labels", "return_bytes", "return_entropy",
        "external_trace_header", "received_time", "need_wait_for_mm_inputs", "num_items_assigned",
        "max_dynamic_patch", "min_dynamic_patch", "image_max_dynamic_patch", "video_max_dynamic_patch"],
    "/abort_request": [*_BASE, "abort_all", "finished_reason", "abort_message"],  # AbortReq
    "/pause_generation": [*_BASE, "mode"],  # PauseGenerationReqInput
    "/continue_generation": _BASE,  # ContinueGenerationReqInput
    "/update_weights_from_disk": [  # UpdateWeightFromDiskReqInput
        *_BASE, "model_path", "load_format", "abort_all_requests", "weight_version", "is_async", "torch_empty_cache",
        "keep_pause", "recapture_cuda_graph", "token_step", "flush_cache", "manifest"],
    "/init_weights_update_group": [  # InitWeightsUpdateGroupReqInput
        *_BASE, "master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"],
    "/destroy_weights_update_group": [*_BASE, "group_name"],  # DestroyWeightsUpdateGroupReqInput
    "/release_memory_occupation": [*_BASE, "tags"],  # ReleaseMemoryOccupationReqInput
    "/resume_memory_occupation": [*_BASE, "tags"],  # ResumeMemoryOccupationReqInput
    "/update_weights_from_distributed": [  # UpdateWeightsFromDistributedReqInput
        *_BASE, "names", "dtypes", "shapes", "group_name", "flush_cache", "abort_all_requests", "weight_version",
        "load_format"],
    "/load_lora_adapter": [*_BASE, "lora_name", "lora_path", "pinned", "lora_id"],  # LoadLoRAAdapterReqInput
    "/unload_lora_adapter": [*_BASE, "lora_name", "lora_id"],  # UnloadLoRAAdapterReqInput
}
# the fields of those structs without a default (GenerateReqInput has none: it checks text/input_ids itself)
REQUIRED: dict[str, set[str]] = {
    "/update_weights_from_disk": {"model_path"},
    "/init_weights_update_group": {"master_address", "master_port", "rank_offset", "world_size"},
    "/update_weights_from_distributed": {"names", "dtypes", "shapes"},
    "/load_lora_adapter": {"lora_name", "lora_path"},
    "/unload_lora_adapter": {"lora_name"},
}
# sampling/sampling_params.py, SamplingParams.__init__ (0.5.10)
SAMPLING = ["max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
            "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema",
            "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
            "no_stop_trim", "custom_params", "stream_interval", "logit_bias", "sampling_seed"]
DEFAULT_GROUP = "weight_update_group"
GPU_MEMORY_ALL_TYPES = ["kv_cache", "weights", "cuda_graph"]  # constants.py (0.5.10)
_SAY = threading.Lock()


class ServerError500(Exception):
    """An exception SGLang does not catch: FastAPI answers 500 Internal Server Error."""


class Fatal(Exception):
    """What kills SGLang's scheduler (an assert): the whole server goes down."""


def _say(line: str) -> None:
    """One log line in one write: print() writes the text and its newline separately, so lines of two request
    threads could interleave."""
    import sys

    with _SAY:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


class State:
    def __init__(self, args: argparse.Namespace):
        from transformers import AutoModelForCausalLM

        self.args = args
        self.model = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=torch.float32).eval()
        conf = json.loads((Path(args.model_path) / "config.json").read_text())
        self.eos = conf.get("eos_token_id")
        self.context = _context_len(args, conf)
        self.weight_version = args.weight_version
        self.deterministic = args.enable_deterministic_inference
        self.lock = threading.Lock()  # one forward (or weight update) at a time
        self.cond = threading.Condition()
        self.paused = False
        self.in_place = False  # paused with mode=in_place: requests stay in the running batch
        self.abort_epoch = 0  # bumped by pause(mode=abort) / abort_all: in-flight requests return
        self.aborted: set[str] = set()
        self.inflight: dict[str, int] = {}
        self.gen = torch.Generator().manual_seed(args.random_seed)
        self.groups: dict[str, Any] = {}  # weight update groups by name
        self.offload_tags: set[str] = set()  # released memory (scheduler.offload_tags)
        self.weights_backup: dict[str, torch.Tensor] | None = None  # --enable-weights-cpu-backup: the host copy
        self.peft: Any = None  # the model wrapped by PEFT once an adapter is loaded
        self.loras: dict[str, str] = {}  # loaded adapters: name -> path (lora_registry)
        self.lora_cache: dict[str, str] = {}  # every adapter ever loaded: name -> path (lora_ref_cache)
        self.lora_users: dict[str, int] = {}  # requests in flight per adapter

    def wait_running(self, rid: str | None = None, epoch: int | None = None) -> None:
        """Until generation is resumed (or, for a request in flight, it is aborted)."""
        with self.cond:
            self.cond.wait_for(lambda: not self.paused or (epoch is not None and self.abort_epoch != epoch)
                               or rid in self.aborted, timeout=600)

    def abort_all(self) -> None:
        with self.cond:
            self.abort_epoch += 1
            self.cond.notify_all()

    def abort_one(self, rid: str) -> None:
        with self.cond:
            self.aborted.add(rid)
            self.cond.notify_all()


def _context_len(args: argparse.Namespace, conf: dict[str, Any]) -> int:
    """``configs/model_config.py`` (0.5.10), ``ModelConfig.__init__``: a ``--context-length`` above the model's
    derived length (``max_position_embeddings``) stops the server at start unless
    ``SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN`` is set."""
    derived = int(conf.get("max_position_embeddings") or 2048)
    if args.context_length is None:
        return derived
    if args.context_length > derived and os.environ.get("SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN") != "1":
        raise SystemExit(f"ValueError: User-specified context_length ({args.context_length}) is greater than the "
                         f"derived context_length ({derived}). To allow overriding this maximum, set the env var "
                         "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1")
    return int(args.context_length)


def _sample(logits: torch.Tensor, sp: dict[str, Any], gen: torch.Generator) -> tuple[int, float]:
    temp = float(sp.get("temperature", 1.0))
    t = temp if temp > 0 else 1.0
    logp = torch.log_softmax(logits.float() / t, -1)  # SGLang's default: log-probs of logits / temperature
    if temp <= 0:
        tok = int(torch.argmax(logits))
        return tok, float(logp[tok])
    cut = logp.clone()
    top_k = int(sp.get("top_k", -1))
    if 0 < top_k < cut.numel():
        kth = torch.topk(cut, top_k).values[-1]
        cut[cut < kth] = -float("inf")
    top_p = float(sp.get("top_p", 1.0))
    if top_p < 1.0:
        probs, order = torch.sort(cut.softmax(-1), descending=True)
        drop = probs.cumsum(-1) - probs > top_p
        cut[order[drop]] = -float("inf")
    tok = int(torch.multinomial(cut.softmax(-1), 1, generator=gen))
    return tok, float(logp[tok])


def check_media(body: dict[str, Any]) -> str:
    """SGLang 0.5.10 takes ``image_data`` / ``audio_data`` / ``video_data`` as one item or a list of items, each a
    path, URL or base64 data (``data:<mime>;base64,...``); the stand-in's model is text-only, so it decodes each data
    URL (images with PIL, as SGLang's loader does) and reports what it got. Anything else: 400."""
    import base64
    import binascii
    import io

    seen = []
    for kind in ("image", "audio", "video"):
        items = body.get(f"{kind}_data")
        if items is None:
            continue
        items = items if isinstance(items, list) else [items]
        for item in items:
            if not isinstance(item, str) or not item.startswith("data:") or ";base64," not in item:
                raise ValueError(f"{kind}_data: expected data URLs (data:<mime>;base64,...), got {str(item)[:40]!r}")
            mime, b64 = item[5:].split(";base64,", 1)
            try:
                raw = base64.b64decode(b64, validate=True)
            except binascii.Error as exc:
                raise ValueError(f"{kind}_data: bad base64 ({exc})") from None
            if not mime.startswith(f"{kind}/"):
                raise ValueError(f"{kind}_data: mime type {mime!r} is not an {kind}")
            if kind == "image":
                from PIL import Image

                try:
                    Image.open(io.BytesIO(raw)).load()
                except Exception as exc:  # PIL raises OSError subclasses on undecodable data
                    raise ValueError(f"image_data: cannot decode the image ({exc})") from None
            seen.append(f"{kind} {mime} {len(raw)} bytes")
    return ", ".join(seen)


def _check_length(st: State, n_input: int, max_new: int) -> None:
    """tokenizer_manager.py (0.5.10), ``_validate_one_request``: ``>=`` refuses."""
    if n_input >= st.context:
        raise ValueError(f"The input ({n_input} tokens) is longer than the model's context length "
                         f"({st.context} tokens).")
    if max_new + n_input >= st.context:
        raise ValueError(f"Requested token count exceeds the model's maximum context length of {st.context} tokens. "
                         f"You requested a total of {max_new + n_input} tokens: {n_input} tokens from the input "
                         f"messages and {max_new} tokens for the completion.")


def _generator(st: State, sp: dict[str, Any]) -> torch.Generator:
    """sampling_batch_info.py (0.5.10): per-request seeds (42 when a request has none) only with
    ``--enable-deterministic-inference``; otherwise the server's generator, advanced by every request."""
    if st.deterministic:
        seed = sp.get("sampling_seed")
        return torch.Generator().manual_seed(int(seed) if seed is not None else 42)
    return st.gen


def generate(st: State, body: dict[str, Any]) -> dict[str, Any]:
    media = check_media(body)
    if media:
        _say(f"media of {body.get('rid')}: {media}; prompt ids {list(body['input_ids'])}")
    sp = body.get("sampling_params") or {}
    unknown = sorted(set(sp) - set(SAMPLING))
    if unknown:  # SamplingParams(**sampling_params): a TypeError, HTTP 500 (strict mode: 400)
        msg = f"SamplingParams.__init__() got an unexpected keyword argument {unknown[0]!r}"
        if STRICT:
            raise ValueError(f"unknown sampling_params {unknown}")
        raise ServerError500(msg)
    if body.get("input_ids") is None:
        raise ValueError("Either text, input_ids or input_embeds should be provided.")
    rid = body.get("rid") or f"anon-{time.monotonic_ns()}"
    ids = [int(t) for t in body["input_ids"]]
    max_new = int(sp.get("max_new_tokens", 128))
    _check_length(st, len(ids), max_new)
    gen = _generator(st, sp)
    lora = resolve_lora(st, body.get("lora_path"))
    stops = set(sp.get("stop_token_ids") or []) | ({st.eos} if isinstance(st.eos, int) else set())
    st.wait_running()  # tokenizer_manager.generate_request waits on is_pause_cond before anything
    epoch = st.abort_epoch
    out: list[int] = []
    lps: list[float] = []
    reason: dict[str, Any] = {"type": "length", "length": max_new}
    version = st.weight_version
    st.inflight[rid] = 0
    if lora is not None:
        st.lora_users[lora] = st.lora_users.get(lora, 0) + 1
    try:
        while len(out) < max_new:
            if rid in st.aborted or st.abort_epoch != epoch:
                reason = {"type": "abort", "message": "Abort before weight update."}
                break
            st.wait_running(rid, epoch)
            if st.abort_epoch != epoch or rid in st.aborted:
                continue
            with st.lock, torch.no_grad():
                logits = _forward(st, lora, ids + out)
                version = st.weight_version
            tok, lp = _sample(logits, sp, gen)
            out.append(tok)
            lps.append(lp)
            st.inflight[rid] = len(out)
            if tok in stops and not sp.get("ignore_eos"):
                reason = {"type": "stop", "matched": tok}
                break
    finally:
        st.inflight.pop(rid, None)
        st.aborted.discard(rid)
        if lora is not None:
            st.lora_users[lora] -= 1
    triples = [[lp, t, None] for lp, t in zip(lps, out)] if body.get("return_logprob") else []
    return {"text": "", "output_ids": out, "meta_info": {
        "id": rid, "finish_reason": reason, "prompt_tokens": len(ids), "completion_tokens": len(out),
        "output_token_logprobs": triples, "weight_version": version}}


def _forward(st: State, lora: str | None, ids: list[int]) -> torch.Tensor:
    """The last position's logits of ``ids``, with adapter ``lora`` (None: the base model)."""
    x = torch.tensor([ids])
    if st.peft is None:
        return st.model(input_ids=x).logits[0, -1]
    if lora is None:
        with st.peft.disable_adapter():
            return st.peft(input_ids=x).logits[0, -1]
    st.peft.set_adapter(lora)
    return st.peft(input_ids=x).logits[0, -1]


def resolve_lora(st: State, name: Any) -> str | None:
    """tokenizer_manager.py (0.5.10), ``_validate_and_resolve_lora`` / ``_resolve_lora_path``: ``lora_path`` names an
    adapter; one unloaded since it was loaded is loaded again from its path, one never loaded is an error."""
    if not name:
        return None
    if not st.args.enable_lora:
        raise ValueError(f"LoRA adapter '{name}' was requested, but LoRA is not enabled. Please launch the server "
                         "with --enable-lora flag and preload adapters using --lora-paths or /load_lora_adapter "
                         "endpoint.")
    name = str(name)
    if name not in st.loras:
        if name not in st.lora_cache:
            raise ValueError(f"Got LoRA adapter that has never been loaded: {name}\n"
                             f"All loaded adapters: {st.lora_cache.keys()}.")
        code, out = load_lora(st, {"lora_name": name, "lora_path": st.lora_cache[name]})
        if code != 200 and "already loaded" not in str(out.get("error_message")):
            raise ValueError(f"Failed to implicitly load LoRA adapter {name}: {out.get('error_message')}")
    return name


def _lora_out(st: State, error: str | None = None) -> tuple[int, dict[str, Any]]:
    """io_struct.py (0.5.10), ``LoRAUpdateOutput``; http_server.py answers 400 when it is not a success."""
    refs = {n: {"lora_id": n, "lora_name": n, "lora_path": p, "pinned": False} for n, p in st.loras.items()}
    return (400 if error else 200), {"rid": None, "http_worker_ipc": None, "success": error is None,
                                     "error_message": error, "loaded_adapters": None if error else refs}


def load_lora(st: State, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """tokenizer_communicator_mixin.py (0.5.10), ``load_lora_adapter``; lora_manager.py, ``validate_new_adapter``."""
    from peft import PeftConfig, PeftModel

    if not st.args.enable_lora:
        return _lora_out(st, "LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
    name, path = str(body["lora_name"]), str(body["lora_path"])
    if name in st.loras:
        return _lora_out(st, f"Failed to load LoRA adapter {name} because it is already loaded")
    try:
        conf = PeftConfig.from_pretrained(path)
    except Exception as exc:  # SGLang's LoRAConfig reads adapter_config.json the same way
        return _lora_out(st, f"Failed to load LoRA adapter {name}: {exc}")
    targets = set(conf.target_modules or [])
    if conf.r > st.args.max_lora_rank or not targets <= set(st.args.lora_target_modules):
        return _lora_out(st, f"LoRA adapter {name} with rank {conf.r} is incompatible with the current LoRA memory "
                         "pool configuration. Please ensure that the LoRA adapter's rank is within the configured "
                         "`--max-lora-rank` and that the target modules are included in `--lora-target-modules`.")
    with st.lock:
        if st.peft is None:
            st.peft = PeftModel.from_pretrained(st.model, path, adapter_name=name).eval()
        else:
            st.peft.load_adapter(path, adapter_name=name)
    st.loras[name] = st.lora_cache[name] = path
    return _lora_out(st)


def unload_lora(st: State, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """tokenizer_communicator_mixin.py (0.5.10), ``unload_lora_adapter``: unregistered at once, unloaded once the
    requests using it are done (``lora_registry.py``, ``unregister``, ``wait_for_unload``)."""
    if not st.args.enable_lora:
        return _lora_out(st, "LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
    name = str(body["lora_name"])
    if name not in st.loras:
        return _lora_out(st, f"LoRA with name {name} does not exist. Loaded LoRAs: {st.loras.keys()}")
    del st.loras[name]
    deadline = time.monotonic() + 600
    while st.lora_users.get(name, 0) and time.monotonic() < deadline:
        time.sleep(0.01)
    with st.lock:
        st.peft.delete_adapter(name)
    return _lora_out(st)


def _before_update(st: State, body: dict[str, Any]) -> None:
    """tokenizer_manager.update_weights_from_disk / update_weights_from_distributed (0.5.10): ``abort_all_requests``
    aborts first; when not paused the update waits for the requests in flight (``model_update_lock.writer_lock``)."""
    if body.get("abort_all_requests"):
        st.abort_all()
    deadline = time.monotonic() + 600
    while not st.paused and st.inflight and time.monotonic() < deadline:
        time.sleep(0.01)


def _flush_cache(st: State, body: dict[str, Any]) -> None:
    """scheduler_update_weights_mixin.py (0.5.10): after a successful update, ``flush_cache`` (default true) needs an
    idle scheduler, else ``assert flush_cache_success`` kills the scheduler. Requests held by an ``in_place`` pause
    are still in the running batch."""
    if body.get("flush_cache", True) and st.inflight:
        raise Fatal(f"AssertionError: Cache flush failed after updating weights ({len(st.inflight)} requests in the "
                    "running batch)")


def _fail(message: str) -> tuple[int, dict[str, Any]]:
    return 400, {"success": False, "message": message}


def load_disk(st: State, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    from safetensors.torch import load_file

    _before_update(st, body)
    folder = Path(body["model_path"])
    if not (folder / "config.json").exists():  # SGLang builds a ModelConfig from the folder first
        return 400, {"success": False, "message": f"{folder}: no config.json", "num_paused_requests": 0}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return 400, {"success": False, "message": f"no safetensors in {folder}", "num_paused_requests": 0}
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(f))
    with st.lock:
        _, unexpected = st.model.load_state_dict(state, strict=False)
        if unexpected:
            return 400, {"success": False, "message": f"unexpected tensors {unexpected[:3]}", "num_paused_requests": 0}
        _flush_cache(st, body)
        if body.get("weight_version") is not None:
            st.weight_version = str(body["weight_version"])
    return 200, {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}


def init_group(st: State, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """model_runner.py (0.5.10), ``init_weights_update_group``: a ``tcp://`` rendezvous with the trainer (rank 0,
    which hosts the store), the store prefixed with the group name, the group made by torch's group helper
    (``utils/common.py``, ``init_custom_process_group``), this server's rank = ``rank_offset`` + its TP rank (0 here).
    A failure is ``success: false``, HTTP 400."""
    import inspect
    from datetime import timedelta

    from torch.distributed import distributed_c10d as c10d

    name = body.get("group_name") or DEFAULT_GROUP
    try:
        timeout = timedelta(seconds=float(os.environ.get("SGLANG_STANDIN_GROUP_TIMEOUT_S", 120)))
        store, rank, world = next(c10d.rendezvous(f"tcp://{body['master_address']}:{body['master_port']}",
                                                  int(body["rank_offset"]), int(body["world_size"]), timeout=timeout))
        store.set_timeout(timeout)
        params = inspect.signature(c10d._new_process_group_helper).parameters
        opts = "backend_options" if "backend_options" in params else "pg_options"
        pg, _ = c10d._new_process_group_helper(world, rank, [], c10d.Backend(body.get("backend") or "nccl"),
                                               c10d.PrefixStore(name, store), group_name=name, timeout=timeout,
                                               **{opts: None})
        c10d._world.pg_group_ranks[pg] = {i: i for i in range(world)}
    except Exception as exc:
        return _fail(f"Failed to initialize custom process group: {exc}.")
    st.groups[name] = pg
    return 200, {"success": True, "message": "Succeeded to initialize custom process group."}


def destroy_group(st: State, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """model_runner.py (0.5.10), ``destroy_weights_update_group``."""
    import torch.distributed as dist

    name = body.get("group_name") or DEFAULT_GROUP
    pg = st.groups.pop(name, None)
    if pg is None:
        return _fail("The group to be destroyed does not exist.")
    try:
        dist.destroy_process_group(pg)
    except Exception as exc:
        return _fail(f"Failed to destroy custom process group: {exc}.")
    return 200, {"success": True, "message": "Succeeded to destroy custom process group."}


def load_distributed(st: State, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """model_runner.py (0.5.10), ``update_weights_from_distributed``: the group must exist (an assert outside any
    ``try``: the server dies), then one broadcast per tensor; a failure is ``success: false``, HTTP 400."""
    import torch.distributed as dist

    name = body.get("group_name") or DEFAULT_GROUP
    if name not in st.groups:
        raise Fatal(f"AssertionError: Group {name} not in {list(st.groups)}. Please call `init_weights_update_group` "
                    "first.")
    _before_update(st, body)
    pg = st.groups[name]
    params = dict(st.model.named_parameters())
    with st.lock:
        try:
            bufs = []
            for pname, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"], strict=True):
                buf = torch.empty(shape, dtype=getattr(torch, dtype))
                dist.broadcast(buf, src=0, group=pg)
                bufs.append((pname, buf))
            for pname, buf in bufs:
                if pname not in params:
                    raise KeyError(f"unknown parameter {pname}")
                params[pname].data.copy_(buf)
        except Exception as exc:
            return _fail(f"Failed to update parameter online: {exc}. The full weights of the ModelRunner are "
                         "partially updated. Please discard the whole weights.")
        _flush_cache(st, body)
        if body.get("weight_version") is not None:
            st.weight_version = str(body["weight_version"])
    return 200, {"success": True, "message": "Succeeded to update parameter online."}


def pause(st: State, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """tokenizer_manager.py (0.5.10), ``pause_generation``: ``abort`` aborts all and returns once no request is in
    flight (checked once a second); other modes go to the scheduler (``scheduler.py``, ``pause_generation``)."""
    mode = body.get("mode") or "abort"
    if mode not in ("abort", "retract", "in_place"):
        raise ValueError(f"Invalid mode: {mode!r}")
    with st.cond:
        st.paused = True
        st.in_place = mode == "in_place"
    if mode == "abort":
        deadline = time.monotonic() + 600
        while True:
            st.abort_all()
            if not st.inflight or time.monotonic() > deadline:
                break
            time.sleep(1.0)
    return 200, {"message": "Generation paused successfully.", "status": "ok"}


def resume(st: State, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    with st.cond:
        st.paused = False
        st.in_place = False
        st.cond.notify_all()
    return 200, {"message": "Generation continued successfully.", "status": "ok"}


def abort(st: State, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    if body.get("abort_all"):
        st.abort_all()
    elif body.get("rid") and str(body["rid"]) in st.inflight:  # an unknown rid is ignored (tokenizer_manager.py)
        st.abort_one(str(body["rid"]))
    return 200, {}


def release_memory(st: State, body: dict[str, Any]) -> tuple[int, Any]:
    """scheduler_update_weights_mixin.py (0.5.10), ``release_memory_occupation``."""
    if st.inflight:
        raise Fatal("AssertionError: release_memory_occupation should be called only when server is idle.")
    tags = body.get("tags") or GPU_MEMORY_ALL_TYPES
    st.offload_tags.update(tags)
    if "weights" in tags and st.args.enable_memory_saver:
        with st.lock, torch.no_grad():
            params = dict(st.model.named_parameters())
            st.weights_backup = {k: v.detach().clone() for k, v in params.items()} \
                if st.args.enable_weights_cpu_backup else None
            for v in params.values():
                v.fill_(float("nan"))  # the physical memory is gone; what the pages hold on resume is garbage
    _say(f"released memory {sorted(tags)} (memory saver {'on' if st.args.enable_memory_saver else 'off'})")
    return 200, None


def resume_memory(st: State, body: dict[str, Any]) -> tuple[int, Any]:
    """scheduler_update_weights_mixin.py (0.5.10), ``resume_memory_occupation``."""
    tags = body.get("tags") or GPU_MEMORY_ALL_TYPES
    for tag in tags:
        if tag not in st.offload_tags:  # offload_tags.remove(tag): a KeyError in the scheduler
            raise Fatal(f"KeyError: {tag!r}")
        st.offload_tags.remove(tag)
    if "weights" in tags and st.weights_backup is not None:
        with st.lock, torch.no_grad():
            params = dict(st.model.named_parameters())
            for k, v in st.weights_backup.items():
                params[k].copy_(v)
        st.weights_backup = None
    _say(f"resumed memory {sorted(tags)}")
    return 200, None


def health(st: State) -> int:
    """http_server.py (0.5.10), ``health_generate``: a one-token generation, waited for up to
    ``HEALTH_CHECK_TIMEOUT`` s in 1 s steps; it cannot run while generation is paused."""
    if not HEALTH_GENERATES:
        return 200
    tic = time.monotonic()
    while time.monotonic() < tic + HEALTH_CHECK_TIMEOUT:
        time.sleep(1.0)
        if not st.paused:
            return 200
    return 503


def server_info(st: State) -> dict[str, Any]:
    """http_server.py (0.5.10), ``server_info``: the server arguments, scheduler info and ``version``."""
    a = st.args
    return {"model_path": a.model_path, "tokenizer_path": a.tokenizer_path, "host": a.host, "port": a.port,
            "dtype": a.dtype, "context_length": st.context, "tp_size": a.tp_size, "dp_size": 1, "pp_size": 1,
            "random_seed": a.random_seed, "enable_deterministic_inference": a.enable_deterministic_inference,
            "weight_version": st.weight_version, "internal_states": [{}], "version": VERSION}


ROUTES = {"/generate": generate, "/update_weights_from_disk": load_disk, "/init_weights_update_group": init_group,
          "/update_weights_from_distributed": load_distributed, "/destroy_weights_update_group": destroy_group,
          "/pause_generation": pause, "/continue_generation": resume, "/abort_request": abort,
          "/release_memory_occupation": release_memory, "/resume_memory_occupation": resume_memory,
          "/load_lora_adapter": load_lora, "/unload_lora_adapter": unload_lora}


def make_handler(st: State) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt: str, *args: Any) -> None:
            _say(f"{self.address_string()} {fmt % args}")

        def _send(self, code: int, payload: Any) -> None:
            data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json" if not isinstance(payload, bytes) else "text/plain")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            path = self.path.split("?")[0]
            if path in ("/health", "/health_generate"):
                code = health(st)
                self._send(code, b"")
            elif path in ("/model_info", "/get_model_info"):
                self._send(200, {"model_path": st.args.model_path, "is_generation": True,
                                 "weight_version": st.weight_version})
            elif path in ("/server_info", "/get_server_info"):
                self._send(200, server_info(st))
            else:
                self._send(404, {"detail": "Not Found"})

        def do_POST(self) -> None:
            path = self.path.split("?")[0]
            route = ROUTES.get(path)
            raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if route is None:
                return self._send(404, {"detail": "Not Found"})
            try:
                body = json.loads(raw or b"{}")
            except ValueError as exc:
                return self._send(400, {"error": {"message": f"JSON decode error: {exc}"}})
            problems = [f"missing field {k!r}" for k in sorted(REQUIRED.get(path, set()) - set(body))]
            if STRICT:
                problems += [f"unknown field {k!r}" for k in sorted(set(body) - set(FIELDS[path]))]
            if problems:  # FastAPI's RequestValidationError, turned into 400 by SGLang's handler
                return self._send(400, {"error": {"message": "; ".join(problems)}})
            body = {k: v for k, v in body.items() if k in FIELDS[path]}  # the dataclass ignores the rest
            try:
                out = route(st, body)
            except Fatal as exc:  # the scheduler died: SGLang kills the server's process tree
                _say(f"scheduler exception on {path}: {exc}; the server exits")
                os._exit(1)
            except ServerError500 as exc:
                _say(f"exception on {path}: TypeError: {exc}")
                return self._send(500, b"Internal Server Error")
            except (ValueError, KeyError, TypeError) as exc:
                return self._send(400, {"error": {"message": str(exc)}})
            code, payload = out if isinstance(out, tuple) else (200, out)
            self._send(code, payload)

    return Handler


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--tokenizer-path")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--random-seed", type=int, default=0)
    p.add_argument("--weight-version", default="default")
    p.add_argument("--skip-server-warmup", action="store_true")
    p.add_argument("--enable-deterministic-inference", action="store_true")
    p.add_argument("--enable-memory-saver", action="store_true")
    p.add_argument("--enable-weights-cpu-backup", action="store_true")
    p.add_argument("--mem-fraction-static", type=float, default=None)
    p.add_argument("--enable-lora", action="store_true")
    p.add_argument("--max-lora-rank", type=int, default=None)
    p.add_argument("--lora-target-modules", nargs="*", default=None)
    p.add_argument("--max-loras-per-batch", type=int, default=8)
    args = p.parse_args()  # unknown flags: exit 2 at start, as SGLang's parser does
    if args.enable_lora and not (args.max_lora_rank and args.lora_target_modules):  # server_args.py (0.5.10)
        raise SystemExit("AssertionError: When no initial --lora-paths is provided, you need to specify both "
                         "--max-lora-rank and --lora-target-modules for LoRA initialization.")
    torch.set_num_threads(1)
    st = State(args)
    server = ThreadingHTTPServer((args.host, args.port), make_handler(st))
    server.daemon_threads = True
    print(f"sglang stand-in {VERSION} serving {args.model_path} on {args.host}:{args.port}"
          f"{' (strict fields)' if STRICT else ''}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
