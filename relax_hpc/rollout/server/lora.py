"""The adapter versions a LoRA run's server engine keeps loaded (``model.lora``), for every server engine: each
version's adapter loaded from its snapshot folder by path under the name ``v000007``, the oldest beyond ``keep``
(``max_staleness + 1``: the versions a request may still be generating with) unloaded, none on a restarted server
(the catch-up then loads the newest version). The engines supply the two endpoints (:meth:`_load_adapter`,
:meth:`_unload_adapter`) and how a request names an adapter."""

from __future__ import annotations

from pathlib import Path

from relax_hpc.config.model import LoraConfig
from relax_hpc.models.lora import adapter_name
from relax_hpc.rollout.server.base import ServerConfig, ServerEngine, ServerSetup


class LoraAdapters(ServerEngine):
    """Mixed in before a server engine's class: ``class VLLMLoraEngine(LoraAdapters, VLLMEngine)``."""

    def __init__(self, cfg: ServerConfig, setup: ServerSetup, *, lora: LoraConfig, keep: int) -> None:
        super().__init__(cfg, setup)
        self.lora = lora
        self.keep = keep
        """Adapter versions kept loaded (``max_staleness + 1``)."""
        self._loaded: list[str] = []
        """Adapter names loaded on the running server, oldest first."""

    @property
    def loaded(self) -> list[str]:
        """The adapter versions loaded on the running server, oldest first."""
        return list(self._loaded)

    def current_adapter(self) -> str | None:
        """The adapter of the engine's version when the server holds it, else None (the base: version 0 of a LoRA
        run, its adapter's ``B`` being zero)."""
        name = adapter_name(self.version)
        return name if name in self._loaded else None

    def _on_start(self) -> None:
        super()._on_start()
        self._loaded = []  # a fresh server holds no adapter

    def _loadable(self, folder: Path) -> Path:
        return folder  # an adapter folder is what the server loads (no HF view of it)

    async def _load_folder(self, path: Path, version: int) -> None:
        name = adapter_name(version)
        if name not in self._loaded:
            await self._load_adapter(name, path)
            self._loaded.append(name)
        for old in self._loaded[:-self.keep]:
            await self._unload_adapter(old)
            self._loaded.remove(old)

    async def _load_adapter(self, name: str, path: Path) -> None:
        raise NotImplementedError

    async def _unload_adapter(self, name: str) -> None:
        raise NotImplementedError
