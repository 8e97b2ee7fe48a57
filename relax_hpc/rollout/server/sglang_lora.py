"""The ``sglang`` engine of a LoRA run (``model.lora``): the server serves the base model with LoRA enabled and
loads each adapter version from its snapshot folder (a PEFT adapter folder) by path (SGLang 0.5.10's API).

* start: ``--enable-lora --max-lora-rank R --lora-target-modules ... --max-loras-per-batch K`` with ``R`` =
  ``model.lora.rank``, the targets of ``model.lora`` and ``K = max_staleness + 1`` (SGLang needs rank and targets at
  start when no adapter is given then; ``server_args.py``).
* a version: ``POST /load_lora_adapter {"lora_name": "v000007", "lora_path": SNAPSHOT_FOLDER}`` (answered
  ``LoRAUpdateOutput``: ``success``, ``error_message``), then the oldest loaded versions beyond ``K`` go
  (``POST /unload_lora_adapter {"lora_name"}``; SGLang waits for the requests still using one).
* ``/generate`` names the adapter of the engine's version in ``lora_path`` (SGLang resolves that field as an
  adapter *name*); before the first version, none (the base: version 0 of a LoRA run, its adapter's ``B`` being
  zero). The server's own ``weight_version`` does not move with adapters, so a sample's tokens carry the version
  whose adapter the request named.
* a restarted server has no adapter: the engine forgets what it loaded and the catch-up loads the newest version.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from relax_hpc.rollout.engine import SamplingParams
from relax_hpc.rollout.server.base import ServerError
from relax_hpc.rollout.server.lora import LoraAdapters
from relax_hpc.rollout.server.sglang import SGLangEngine


class SGLangLoraEngine(LoraAdapters, SGLangEngine):
    def server_args(self, model_dir: Path, port: int) -> list[str]:
        return [*super().server_args(self.setup.model_dir, port), "--enable-lora", "--max-lora-rank",
                str(self.lora.rank), "--lora-target-modules", *self.lora.target_modules,
                "--max-loras-per-batch", str(self.keep)]

    def adapter_fields(self) -> dict[str, Any]:
        name = self.current_adapter()
        return {"lora_path": name} if name else {}

    async def _post_generate(self, rid: str, ids: list[int], sp: SamplingParams, max_new: int, n: int,
                             media: dict[str, Any] | None = None
                             ) -> list[tuple[list[int], list[float], str, int | None]]:
        got = await super()._post_generate(rid, ids, sp, max_new, n, media)
        return [(toks, lps, reason, None) for toks, lps, reason, _ in got]  # the version the request named

    async def _load_adapter(self, name: str, path: Path) -> None:
        await self._lora_call("/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})

    async def _unload_adapter(self, name: str) -> None:
        await self._lora_call("/unload_lora_adapter", {"lora_name": name})

    async def _lora_call(self, path: str, body: dict[str, Any]) -> None:
        try:
            out = await self._json("POST", path, json=body, timeout=self.cfg.sync_timeout_s)
        except ServerError as exc:  # HTTP 400 with LoRAUpdateOutput (success false)
            raise ServerError(f"sglang server {self.setup.name}: {path} {body['lora_name']} failed: {exc}") from exc
        if not (out or {}).get("success", False):
            raise ServerError(f"sglang server {self.setup.name}: {path} {body['lora_name']} failed: "
                              f"{(out or {}).get('error_message')}")
