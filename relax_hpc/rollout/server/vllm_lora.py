"""The ``vllm`` engine of a LoRA run (``model.lora``): the server serves the base model with LoRA enabled and loads
each adapter version from its snapshot folder (a PEFT adapter folder, a few MB) by path.

* start: ``--enable-lora --max-loras K --max-lora-rank R`` with ``K = max_staleness + 1`` (the versions a request
  may still be generating with) and ``R`` the smallest rank vLLM takes (1, 8, 16, ..., 512) that holds
  ``model.lora.rank``; ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` in the server's environment (vLLM serves
  ``/v1/load_lora_adapter`` only then).
* a version: ``POST /v1/load_lora_adapter {"lora_name": "v000007", "lora_path": SNAPSHOT_FOLDER}``, then the
  oldest loaded versions beyond ``K`` go (``POST /v1/unload_lora_adapter``). No prefix-cache reset: vLLM keys cached
  blocks by adapter, so two versions never share KV.
* requests name the adapter of the engine's version (``model: v000007``); before the first version arrives, the base
  (``policy``: version 0 of a LoRA run is the base, its adapter's ``B`` being zero).
* a restarted server has no adapter: the engine forgets what it loaded and the catch-up loads the newest version.

vLLM trains nothing fully: ``modules_to_save`` (other than classifier heads) are refused by vLLM's PEFT check, so
the recipe check refuses them with this engine. The adapter travels as files only (vLLM's weight-transfer engine
moves base weights, not adapters).
"""

from __future__ import annotations

from pathlib import Path

from relax_hpc.rollout.server.lora import LoraAdapters
from relax_hpc.rollout.server.vllm import SERVED_NAME, VLLMEngine

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""``--max-lora-rank`` values vLLM 0.32 takes (``vllm/config/lora.py``, ``MaxLoRARanks``)."""


def max_lora_rank(rank: int) -> int:
    """The smallest ``--max-lora-rank`` vLLM takes that holds ``rank`` (ValueError above 512)."""
    for r in VLLM_LORA_RANKS:
        if r >= rank:
            return r
    raise ValueError(f"model.lora.rank {rank}: vLLM serves ranks up to {VLLM_LORA_RANKS[-1]}")


class VLLMLoraEngine(LoraAdapters, VLLMEngine):
    def server_args(self, model_dir: Path, port: int) -> list[str]:
        return [*super().server_args(self.setup.model_dir, port), "--enable-lora", "--max-loras", str(self.keep),
                "--max-lora-rank", str(max_lora_rank(self.lora.rank))]

    def server_env(self) -> dict[str, str]:
        return {**super().server_env(), "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}

    def served_model(self) -> str:
        return self.current_adapter() or SERVED_NAME

    async def _load_folder(self, path: Path, version: int) -> None:
        await super()._load_folder(path, version)
        await self._json("POST", "/update_weight_version", json={"new_version": str(version)})

    async def _load_adapter(self, name: str, path: Path) -> None:
        await self._json("POST", "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)},
                         timeout=self.cfg.sync_timeout_s)

    async def _unload_adapter(self, name: str) -> None:
        await self._json("POST", "/v1/unload_lora_adapter", json={"lora_name": name})
