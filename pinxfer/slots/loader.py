"""The DataLoader side: the only module of pinxfer that touches a DataLoader's internals.

``prefetch`` never modifies the caller's loader. It iterates a :class:`LoaderCopy`: a
shallow copy whose ``collate_fn`` and ``worker_init_fn`` are the slot wrappers of
:mod:`pinxfer.slots.worker`. The copy is edited through ``__dict__``: DataLoader's
``__setattr__`` refuses some attributes once it is built, and these are plain fields.

What the slots need from torch's multiprocessing iterator, all here: its cached
persistent iterator (``_iterator``), whether it was shut down (``_shutdown``), its
worker processes (``_workers``) and its shutdown (``_shutdown_workers``).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader

from pinxfer.slots.worker import RingHandle, SlotCollate, SlotWorkerInit


def check_loader(loader: Any) -> None:
    """The DataLoader slots can serve: workers write the slots, and nothing pins again."""
    if not isinstance(loader, DataLoader):
        raise TypeError(
            "pinxfer.prefetch(slots=True): expected a torch.utils.data.DataLoader, "
            f"got {type(loader).__name__}"
        )
    if loader.num_workers < 1:
        raise ValueError(
            "pinxfer.prefetch(slots=True): the DataLoader needs num_workers > 0 "
            "(the workers write the slots); got num_workers=0"
        )
    if loader.pin_memory:
        raise ValueError(
            "pinxfer.prefetch(slots=True): build the DataLoader with "
            "pin_memory=False: the slots are pinned already"
        )


def batches_in_loader(loader: DataLoader) -> int:
    """At most this many batches are dispatched to the workers and not yet yielded."""
    per_worker = loader.prefetch_factor if loader.prefetch_factor is not None else 2
    return loader.num_workers * per_worker


class LoaderCopy:
    """The caller's DataLoader, copied, with its workers writing into the ring."""

    def __init__(self, loader: DataLoader, handle: RingHandle):
        self.persistent = bool(loader.persistent_workers)
        self._loader = copy.copy(loader)
        fields = self._loader.__dict__
        fields["_iterator"] = None
        fields["collate_fn"] = SlotCollate(handle, loader.collate_fn)
        fields["worker_init_fn"] = SlotWorkerInit(handle, loader.worker_init_fn)

    def __len__(self) -> int:
        return len(self._loader)

    def has_live_workers(self) -> bool:
        """True if the next pass reuses workers of an earlier one (persistent workers
        whose iterator is alive). A persistent iterator that died is forgotten."""
        it = self._loader.__dict__.get("_iterator")
        if it is not None and getattr(it, "_shutdown", False):
            self._loader.__dict__["_iterator"] = it = None
        return self.persistent and it is not None

    def start_pass(self) -> Iterator[Any]:
        return iter(self._loader)

    def end_pass(self, it: Iterator[Any]) -> bool:
        """After a pass: stops its workers unless they persist and are all alive (a
        persistent iterator with a dead worker cannot go on: it is stopped and forgotten,
        and the next pass starts fresh workers). True if no worker of the pass is left."""
        if self.persistent and all(w.is_alive() for w in getattr(it, "_workers", ())):
            return False
        _stop_workers(it)
        self._loader.__dict__["_iterator"] = None
        return True

    def close(self) -> None:
        """Stops the workers of the cached (persistent) iterator, if any."""
        it: Any | None = self._loader.__dict__.get("_iterator")
        self._loader.__dict__["_iterator"] = None
        if it is not None:
            _stop_workers(it)


def _stop_workers(it: Any) -> None:
    """Shuts a multiprocessing DataLoader iterator's workers down and joins them."""
    shutdown = getattr(it, "_shutdown_workers", None)
    if callable(shutdown):
        shutdown()
    for w in getattr(it, "_workers", ()):
        w.join(timeout=10)
