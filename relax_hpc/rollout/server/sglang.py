"""The ``sglang`` engine: an SGLang server (HTTP API of releases 0.5.10 to 0.5.23) per engine.

Endpoints used, with the fields sent (nothing else):

* ``POST /generate``: ``rid``, ``input_ids``, ``sampling_params`` (``max_new_tokens``, ``temperature``, ``top_p``,
  ``top_k`` (-1 = off), ``stop``, ``stop_token_ids``, ``sampling_seed``, ``no_stop_trim``, ``skip_special_tokens``),
  ``return_logprob: true``, and for a prompt with media ``image_data`` / ``audio_data`` / ``video_data`` (data URLs,
  :mod:`.media`; ``input_ids`` then hold one placeholder per item, SGLang expands them). The reply's
  ``output_ids`` are the tokens, ``meta_info.output_token_logprobs`` their
  ``[logprob, token_id, text]`` triples (``log_softmax(logits / temperature)``, SGLang's default), and
  ``meta_info.weight_version`` the version that produced them; ``meta_info.finish_reason.type`` is ``stop``,
  ``length`` or ``abort``.
* ``POST /abort_request`` (``rid`` or ``abort_all``), ``POST /pause_generation`` (``mode: abort``; it returns once
  the requests in flight are back), ``POST /continue_generation``. The ``in_place`` pause is never used: requests it
  holds stay in the running batch, and the cache flush of the next weight update then fails an assert that takes the
  scheduler down.
* files: ``POST /update_weights_from_disk`` (``model_path``, ``weight_version``, ``flush_cache``).
* fast path: ``POST /init_weights_update_group`` once per group and server process (``master_address``,
  ``master_port``, ``rank_offset``, ``world_size``, ``group_name``, ``backend``), then per bucket
  ``POST /update_weights_from_distributed`` (``names``, ``dtypes``, ``shapes``, ``group_name``, ``flush_cache``,
  ``weight_version``), fired before the trainer broadcasts that bucket; its reply comes after the broadcast. A
  restarted server has no group (an update without one fails an assert that kills SGLang), so the group is
  initialised again; after a failure of the fast path the group is released (``/destroy_weights_update_group``).
* sleep (colocate): ``POST /release_memory_occupation`` (every tag; SGLang asserts the scheduler is idle, so only
  between steps), then ``POST /resume_memory_occupation`` with ``tags: [weights]``, the new weights (files, above),
  ``tags: [kv_cache, cuda_graph]`` (``managers/scheduler_update_weights_mixin.py``). The server is started with
  ``--enable-memory-saver`` (without it both calls free nothing), at level 1 also ``--enable-weights-cpu-backup``
  (the weights come back from host memory; at level 2 their contents are gone until the new ones are loaded).
* ``GET /health`` (a one-token generation, which waits while generation is paused: while paused ``GET /model_info``
  tells whether the server answers), ``GET /server_info`` (``version``, read and checked at start).

The server refuses a request whose input + ``max_new_tokens`` reaches its context length (``>=``), so the server is
given one more token of context than the longest sample needs (where the model's positions allow), and a request's
``max_new_tokens`` is capped to what fits. ``sampling_seed`` is honoured only by a server started with
``--enable-deterministic-inference`` (``rollout.sglang.server_args: {enable_deterministic_inference: true}``); a
seeded request to a server without it is refused in one line; an unseeded request to a server with it gets a seed
from the engine's own generator (SGLang would give every unseeded request seed 42, and the n samples of a prompt
would be one sample n times).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

from relax_hpc.rollout.engine import SamplingParams
from relax_hpc.rollout.server.base import DistributedSource, GroupInfo, ServerEngine, ServerError

SGLANG_MODULE = "sglang.launch_server"


class SGLangEngine(ServerEngine):
    kind = "sglang"
    can_sleep = True
    health_path = "/health"
    paused_health_path = "/model_info"  # answered by the HTTP process, no generation
    version_path = "/server_info"
    checked_versions = ">=0.5.10,<=0.5.23"

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._group: GroupInfo | None = None
        """The weight-update group the running server holds (None: none, or not known to be whole)."""
        self._group_asked: GroupInfo | None = None
        """The group last asked for (its init may have failed half-way on the server)."""
        self._seeds = random.Random(self.setup.seed)
        """Seeds for unseeded requests to a deterministic server, which would otherwise give every one seed 42
        (``sampling_batch_info.py``), so the n samples of a prompt would all be the same."""

    def default_command(self) -> str:
        return f"{sys.executable} -m {SGLANG_MODULE}"

    @property
    def context_length(self) -> int:
        """The ``--context-length`` given to the server: one more than the longest sample (prompt + new tokens),
        since SGLang refuses input + ``max_new_tokens`` >= the context length; at most the model's positions."""
        limit = _max_positions(self.setup.model_dir)
        want = self.setup.max_model_len + 1
        return want if limit is None else min(want, limit)

    @property
    def deterministic(self) -> bool:
        """Whether the server honours ``sampling_seed`` (started with ``--enable-deterministic-inference``)."""
        return bool(self.setup.extra_server_args.get("enable_deterministic_inference")) or \
            "--enable-deterministic-inference" in self.cfg.extra_args

    def server_args(self, model_dir: Path, port: int) -> list[str]:
        s = self.setup
        args = ["--model-path", str(model_dir), "--host", self.cfg.host, "--port", str(port), "--dtype", s.dtype,
                "--context-length", str(self.context_length), "--tp-size", str(self.cfg.tp_size),
                "--random-seed", str(s.seed), "--weight-version", str(s.version), "--skip-server-warmup"]
        if model_dir != s.model_dir:
            args += ["--tokenizer-path", str(s.model_dir)]
        if s.sleep_level:  # torch_memory_saver regions; weights kept in host memory only at level 1
            args += ["--enable-memory-saver"] + (["--enable-weights-cpu-backup"] if s.sleep_level == 1 else [])
        if s.gpu_memory_utilization is not None:
            args += ["--mem-fraction-static", str(s.gpu_memory_utilization)]
        for key, value in s.extra_server_args.items():
            flag = "--" + key.replace("_", "-")
            args += [flag] if value is True else ([] if value is False else [flag, str(value)])
        return args

    # ----------------------------------------------------------------------------------------- generation
    async def _post_generate(self, rid: str, ids: list[int], sp: SamplingParams, max_new: int, n: int,
                             media: dict[str, Any] | None = None
                             ) -> list[tuple[list[int], list[float], str, int | None]]:
        assert n == 1, "the sglang adapter sends one request per sample"
        if sp.seed is not None and not self.deterministic:
            raise ServerError("sglang engine: a seeded request needs a server started with "
                              "--enable-deterministic-inference (rollout.sglang.server_args: "
                              "{enable_deterministic_inference: true}); SGLang ignores sampling_seed without it")
        max_new = min(max_new, self.context_length - 1 - len(ids))
        if max_new <= 0:  # the prompt (with its prefix) fills the context: nothing more fits
            return [([], [], "length", None)]
        params: dict[str, object] = {
            "max_new_tokens": max_new, "temperature": sp.temperature, "top_p": sp.top_p,
            "top_k": sp.top_k if sp.top_k > 0 else -1, "no_stop_trim": True, "skip_special_tokens": False,
        }
        if sp.stop:
            params["stop"] = list(sp.stop)
        if sp.stop_token_ids:
            params["stop_token_ids"] = list(sp.stop_token_ids)
        if sp.seed is not None:
            params["sampling_seed"] = sp.seed
        elif self.deterministic:
            params["sampling_seed"] = self._seeds.getrandbits(31)
        out = await self._json("POST", "/generate", timeout=self.cfg.request_timeout_s,
                               json={**self.generate_body(rid, ids, params, media), **self.adapter_fields()})
        meta = out["meta_info"]
        triples = meta.get("output_token_logprobs") or []
        toks = [int(t) for t in out.get("output_ids") or [tr[1] for tr in triples]]
        lps = [float(tr[0]) for tr in triples]
        if len(lps) != len(toks) or any(int(tr[1]) != t for tr, t in zip(triples, toks)):
            raise ServerError(f"sglang server {self.setup.name}: output_ids and output_token_logprobs disagree")
        reason = (meta.get("finish_reason") or {}).get("type", "stop")
        version = meta.get("weight_version")
        return [(toks, lps, reason if reason in ("stop", "length", "abort") else "stop", _as_version(version))]

    def adapter_fields(self) -> dict[str, Any]:
        """Fields naming the LoRA adapter a request uses (none: the served model itself)."""
        return {}

    @staticmethod
    def generate_body(rid: str, ids: list[int], params: dict[str, object], media: dict[str, Any] | None
                      ) -> dict[str, Any]:
        """The ``/generate`` body; a prompt's media go as ``image_data`` / ``audio_data`` / ``video_data``."""
        from relax_hpc.rollout.server.media import sglang_fields

        return {"rid": rid, "input_ids": ids, "sampling_params": params, "return_logprob": True,
                **sglang_fields(media)}

    async def _server_abort(self, rids: list[str] | None) -> None:
        if rids is None:
            await self._json("POST", "/abort_request", json={"abort_all": True})
            return
        for rid in rids:
            await self._json("POST", "/abort_request", json={"rid": rid})

    async def _server_pause(self, abort: bool) -> None:
        # always abort: the engine holds requests itself (pause(abort=False) cuts them and continues them after the
        # resume); SGLang's in_place pause would leave them in the running batch, where the cache flush of a weight
        # update fails an assert that kills the scheduler (scheduler_update_weights_mixin.py, 0.5.10)
        await self._json("POST", "/pause_generation", json={"mode": "abort"})

    async def _server_resume(self) -> None:
        await self._json("POST", "/continue_generation", json={})

    # ----------------------------------------------------------------------------------------- sleep
    async def _server_sleep(self, level: int) -> None:
        # every tag (weights, kv_cache, cuda_graph); whether the weights survive is fixed at start (level 1:
        # --enable-weights-cpu-backup)
        await self._json("POST", "/release_memory_occupation", json={})

    async def _server_wake(self, part: str) -> None:
        tags = {"weights": ["weights"], "rest": ["kv_cache", "cuda_graph"], "all": None}[part]
        await self._json("POST", "/resume_memory_occupation", json={} if tags is None else {"tags": tags})

    # ----------------------------------------------------------------------------------------- weights
    async def _load_folder(self, path: Path, version: int) -> None:
        out = await self._json("POST", "/update_weights_from_disk", timeout=self.cfg.sync_timeout_s, json={
            "model_path": str(path), "weight_version": str(version), "flush_cache": True})
        if not (out or {}).get("success", False):
            raise ServerError(f"sglang server {self.setup.name}: update_weights_from_disk failed: "
                              f"{(out or {}).get('message')}")

    def _on_start(self) -> None:
        self._group = self._group_asked = None  # a new server process holds no group

    async def _fast_path_failed(self) -> None:
        """Forget the group and release it on the server (a group left behind holds a dead communicator)."""
        asked, self._group, self._group_asked = self._group_asked, None, None
        if asked is None or self.server is None or not self.server.alive():
            return
        try:
            await self._json("POST", "/destroy_weights_update_group", json={"group_name": asked.group_name},
                             timeout=10.0)
        except Exception as exc:  # the group may not exist (its init failed): nothing to release
            self._event("weight_group_destroy", f"sglang server {self.setup.name}: destroy_weights_update_group "
                        f"{asked.group_name}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")

    async def _load_distributed(self, source: DistributedSource, version: int) -> None:
        import asyncio

        g = source.group
        if self._group != g:
            if self._group is not None:  # a new group (a new generation of the link): release the old one
                await self._fast_path_failed()
            self._group_asked = g
            out = await self._json("POST", "/init_weights_update_group", timeout=self.cfg.sync_timeout_s, json={
                "master_address": g.master_address, "master_port": g.master_port, "rank_offset": g.rank_offset,
                "world_size": g.world_size, "group_name": g.group_name, "backend": g.backend})
            if not (out or {}).get("success", False):
                raise ServerError(f"sglang init_weights_update_group failed: {(out or {}).get('message')}")
            self._group = g
        self._group = None  # until the whole version arrived: a failure half-way leaves the group unusable
        last = len(source.metas) - 1
        for k, bucket in enumerate(source.metas):
            out = await asyncio.wait_for(self._json("POST", "/update_weights_from_distributed", json={
                "names": [n for n, _, _ in bucket], "dtypes": [d for _, d, _ in bucket],
                "shapes": [s for _, _, s in bucket], "group_name": g.group_name, "flush_cache": k == last,
                "weight_version": str(version) if k == last else None}), timeout=self.cfg.sync_timeout_s)
            if not (out or {}).get("success", False):
                raise ServerError(f"sglang update_weights_from_distributed failed: {(out or {}).get('message')}")
        self._group = g


def _max_positions(model_dir: Path) -> int | None:
    """The model's ``max_position_embeddings`` (SGLang's derived context length), None when the config has none."""
    import json

    try:
        conf = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    value = conf.get("max_position_embeddings") or (conf.get("text_config") or {}).get("max_position_embeddings")
    return int(value) if value else None


def _as_version(value: object) -> int | None:
    try:
        return int(str(value))
    except (TypeError, ValueError):
        return None
