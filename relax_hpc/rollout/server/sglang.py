"""The ``sglang`` engine: an SGLang server (HTTP API of release 0.5.10 and newer) per engine.

Endpoints used, with the fields sent (nothing else):

* ``POST /generate``: ``rid``, ``input_ids``, ``sampling_params`` (``max_new_tokens``, ``temperature``, ``top_p``,
  ``top_k`` (-1 = off), ``stop``, ``stop_token_ids``, ``sampling_seed``, ``no_stop_trim``, ``skip_special_tokens``),
  ``return_logprob: true``, and for a prompt with media ``image_data`` / ``audio_data`` / ``video_data`` (data URLs,
  :mod:`.media`; ``input_ids`` then hold one placeholder per item, SGLang expands them). The reply's
  ``output_ids`` are the tokens, ``meta_info.output_token_logprobs`` their
  ``[logprob, token_id, text]`` triples (``log_softmax(logits / temperature)``, SGLang's default), and
  ``meta_info.weight_version`` the version that produced them; ``meta_info.finish_reason.type`` is ``stop``,
  ``length`` or ``abort``.
* ``POST /abort_request`` (``rid`` or ``abort_all``), ``POST /pause_generation`` (``mode``: ``abort`` or
  ``in_place``), ``POST /continue_generation``.
* files: ``POST /update_weights_from_disk`` (``model_path``, ``weight_version``, ``flush_cache``).
* fast path: ``POST /init_weights_update_group`` once (``master_address``, ``master_port``, ``rank_offset``,
  ``world_size``, ``group_name``, ``backend``), then per bucket ``POST /update_weights_from_distributed``
  (``names``, ``dtypes``, ``shapes``, ``group_name``, ``flush_cache``, ``weight_version``), fired before the
  trainer broadcasts that bucket; its reply comes after the broadcast.
* ``GET /health``, ``GET /model_info`` (``weight_version``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from relax_hpc.rollout.engine import SamplingParams
from relax_hpc.rollout.server.base import DistributedSource, GroupInfo, ServerEngine, ServerError

SGLANG_MODULE = "sglang.launch_server"


class SGLangEngine(ServerEngine):
    kind = "sglang"
    health_path = "/health"

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._group: GroupInfo | None = None

    def default_command(self) -> str:
        return f"{sys.executable} -m {SGLANG_MODULE}"

    def server_args(self, model_dir: Path, port: int) -> list[str]:
        s = self.setup
        args = ["--model-path", str(model_dir), "--host", self.cfg.host, "--port", str(port), "--dtype", s.dtype,
                "--context-length", str(s.max_model_len), "--tp-size", str(self.cfg.tp_size),
                "--random-seed", str(s.seed), "--weight-version", str(s.version), "--skip-server-warmup"]
        if model_dir != s.model_dir:
            args += ["--tokenizer-path", str(s.model_dir)]
        for key, value in s.extra_server_args.items():
            flag = "--" + key.replace("_", "-")
            args += [flag] if value is True else ([] if value is False else [flag, str(value)])
        return args

    # ----------------------------------------------------------------------------------------- generation
    async def _post_generate(self, rid: str, ids: list[int], sp: SamplingParams, max_new: int, n: int,
                             media: dict[str, Any] | None = None
                             ) -> list[tuple[list[int], list[float], str, int | None]]:
        assert n == 1, "the sglang adapter sends one request per sample"
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
        out = await self._json("POST", "/generate", timeout=self.cfg.request_timeout_s,
                               json=self.generate_body(rid, ids, params, media))
        meta = out["meta_info"]
        triples = meta.get("output_token_logprobs") or []
        toks = [int(t) for t in out.get("output_ids") or [tr[1] for tr in triples]]
        lps = [float(tr[0]) for tr in triples]
        if len(lps) != len(toks) or any(int(tr[1]) != t for tr, t in zip(triples, toks)):
            raise ServerError(f"sglang server {self.setup.name}: output_ids and output_token_logprobs disagree")
        reason = (meta.get("finish_reason") or {}).get("type", "stop")
        version = meta.get("weight_version")
        return [(toks, lps, reason if reason in ("stop", "length", "abort") else "stop", _as_version(version))]

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
        await self._json("POST", "/pause_generation", json={"mode": "abort" if abort else "in_place"})

    async def _server_resume(self) -> None:
        await self._json("POST", "/continue_generation", json={})

    # ----------------------------------------------------------------------------------------- weights
    async def _load_folder(self, path: Path, version: int) -> None:
        out = await self._json("POST", "/update_weights_from_disk", timeout=self.cfg.sync_timeout_s, json={
            "model_path": str(path), "weight_version": str(version), "flush_cache": True})
        if not (out or {}).get("success", False):
            raise ServerError(f"sglang server {self.setup.name}: update_weights_from_disk failed: "
                              f"{(out or {}).get('message')}")

    async def _load_distributed(self, source: DistributedSource, version: int) -> None:
        import asyncio

        g = source.group
        if self._group != g:
            out = await self._json("POST", "/init_weights_update_group", timeout=self.cfg.sync_timeout_s, json={
                "master_address": g.master_address, "master_port": g.master_port, "rank_offset": g.rank_offset,
                "world_size": g.world_size, "group_name": g.group_name, "backend": g.backend})
            if not (out or {}).get("success", False):
                raise ServerError(f"sglang init_weights_update_group failed: {(out or {}).get('message')}")
            self._group = g
        last = len(source.metas) - 1
        for k, bucket in enumerate(source.metas):
            out = await asyncio.wait_for(self._json("POST", "/update_weights_from_distributed", json={
                "names": [n for n, _, _ in bucket], "dtypes": [d for _, d, _ in bucket],
                "shapes": [s for _, _, s in bucket], "group_name": g.group_name, "flush_cache": k == last,
                "weight_version": str(version) if k == last else None}), timeout=self.cfg.sync_timeout_s)
            if not (out or {}).get("success", False):
                self._group = None
                raise ServerError(f"sglang update_weights_from_distributed failed: {(out or {}).get('message')}")


def _as_version(value: object) -> int | None:
    try:
        return int(str(value))
    except (TypeError, ValueError):
        return None
