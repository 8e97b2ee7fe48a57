"""Epochs over a :class:`PromptDataset` in a deterministic order, with an exactly resumable position.

Epoch ``e`` visits every prompt once, in ``range(len)`` order or, with ``shuffle``, in a permutation that depends
only on ``(seed, e)`` (Python's ``random.Random`` seeded with a string, stable across Python and NumPy versions).
The position is ``{"epoch": e, "index": i}``: ``i`` prompts of epoch ``e`` are taken; restoring it with
:meth:`PromptStream.load_state` continues with exactly the prompts an uninterrupted run would have taken.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator
from typing import Any

from relax_hpc.data.dataset import Prompt, PromptDataset
from relax_hpc.data.media import MediaError
from relax_hpc.errors import UserError

log = logging.getLogger(__name__)


class PromptStream:
    """Batches of prompts across epochs, until ``num_epochs`` passes are done. ``seed``, ``shuffle`` and
    ``num_epochs`` default to the dataset's seed and its config's ``shuffle`` / ``num_epochs``."""

    def __init__(self, dataset: PromptDataset, *, seed: int | None = None, shuffle: bool | None = None,
                 num_epochs: int | None = None):
        self.dataset = dataset
        self.seed = dataset.seed if seed is None else seed
        self.shuffle = dataset.cfg.shuffle if shuffle is None else shuffle
        self.num_epochs = dataset.cfg.num_epochs if num_epochs is None else num_epochs
        self.epoch = 0
        self.index = 0
        self._order: tuple[int, list[int]] | None = None
        self.num_media_skipped = 0
        """Prompts skipped when taken because their media failed."""

    def order(self, epoch: int) -> list[int]:
        """The dataset indices of epoch ``epoch``, in the order they are taken."""
        if self._order is not None and self._order[0] == epoch:
            return self._order[1]
        idx = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(f"relax-hpc-data:{self.seed}:{epoch}").shuffle(idx)
        self._order = (epoch, idx)
        return idx

    @property
    def exhausted(self) -> bool:
        """Whether all ``num_epochs`` epochs have been taken."""
        return self.epoch >= self.num_epochs

    def next_batch(self, n: int, *, tensors: bool = True) -> list[Prompt]:
        """The next ``n`` prompts (crossing into the next epoch as needed); fewer, possibly none, once the last
        epoch runs out. Each prompt's meta gets ``epoch``. A prompt whose media fails now (:class:`MediaError`) is
        skipped with one log line and counted in ``num_media_skipped``; the batch is filled from the next ones.
        ``tensors=False`` leaves media as references (``Prompt.media``) for a processor pool."""
        out: list[Prompt] = []
        while len(out) < n and not self.exhausted:
            order = self.order(self.epoch)
            take = order[self.index:self.index + n - len(out)]
            for i in take:
                try:
                    p = self.dataset.prompt(i, tensors=tensors)
                except MediaError as exc:
                    self.num_media_skipped += 1
                    log.warning("data: skipped prompt %d (%d skipped so far): %s", i, self.num_media_skipped, exc)
                    continue
                p.meta["epoch"] = self.epoch
                out.append(p)
            self.index += len(take)
            if self.index >= len(order):
                self.epoch, self.index = self.epoch + 1, 0
        return out

    def stats(self) -> dict[str, float]:
        """``data/media_skipped``: prompts skipped when taken because their media failed."""
        return {"data/media_skipped": float(self.num_media_skipped)}

    def close(self) -> None:
        """Nothing to stop (a :class:`~relax_hpc.data.pool.PrefetchingStream` stops its thread and pool)."""

    def __iter__(self) -> Iterator[Prompt]:
        return self

    def __next__(self) -> Prompt:
        batch = self.next_batch(1)
        if not batch:
            raise StopIteration
        return batch[0]

    # ------------------------------------------------------------------------------------------------ resume
    def state(self) -> dict[str, int]:
        """The position to checkpoint (``num_prompts`` lets a resume notice that the data changed)."""
        return {"epoch": self.epoch, "index": self.index, "num_prompts": len(self.dataset)}

    def load_state(self, state: dict[str, Any]) -> None:
        """Continue from a position saved by :meth:`state`."""
        epoch, index = (state.get("epoch"), state.get("index")) if isinstance(state, dict) else (None, None)
        if not (isinstance(epoch, int) and isinstance(index, int) and epoch >= 0 and index >= 0):
            raise UserError(f"data position {state!r} is not {{'epoch': int >= 0, 'index': int >= 0}}")
        size = state.get("num_prompts", len(self.dataset))
        if size != len(self.dataset):
            log.warning("data: the checkpoint was taken with %s prompts, the data now has %d: the order after "
                        "resuming differs from the original run's", size, len(self.dataset))
        if index >= len(self.dataset):
            epoch, index = epoch + 1, 0
        self.epoch, self.index = epoch, index



def make_stream(dataset: PromptDataset) -> PromptStream:
    """The stream a recipe's data section asks for (the dataset's seed, its config's ``shuffle`` and ``num_epochs``);
    the same as ``PromptStream(dataset)``."""
    return PromptStream(dataset)
