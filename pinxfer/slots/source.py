"""SlotSource: the batch source ``prefetch`` iterates when a DataLoader's workers write slots.

It implements prefetch's lease protocol (:mod:`pinxfer.prefetch`): each pass yields one
lease per batch -- a :class:`~pinxfer.slots.ring.SlotLease` for a batch in a slot, a
:class:`~pinxfer.prefetch.StagedLease` for a batch that fell back to torch's path -- and
prefetch's producer calls ``send`` and ``done`` on each without asking which it is.

One batch, in order: the pass asks the ring to put back slots whose copies finished
(:meth:`Ring.return_finished`), takes the next item from the loader copy
(:mod:`pinxfer.slots.loader`), and turns it into a lease (:meth:`SlotSource._lease_for`):
a :class:`~pinxfer.slots.worker.SlotBatch` through :meth:`Ring.lease`, a
:class:`~pinxfer.slots.worker.Fallback` counted (and, for the first batches, used to size
the ring).

**Slot size.** ``slot_bytes`` if given (rounded up to 4 KiB); else the first batch (the
batches collated before the ring is sized take the fallback path, reason ``'sizing'``) is
measured and the slots get 1.25x its bytes at their aligned offsets, rounded up to 64 KiB.
There is no growth: a later, larger batch falls back (``'too_big'``); when more than half of
the first 16 or more batches do, a warning says to pass ``slot_bytes``.

**Slot count.** At any moment slots are held by (a) the loader: at most ``num_workers *
prefetch_factor`` batches are dispatched and not yet yielded (being written, in the result
queue, or in the in-order reorder buffer), and (b) the trainer: before it asks the loader
for a batch it puts back every slot whose copy has finished and waits for the oldest copies
until at most ``depth`` remain. So ``num_workers * prefetch_factor + depth + 2`` slots (the
default) mean a worker never waits for a slot. With ``persistent_workers`` an epoch left
early strands up to ``num_workers * prefetch_factor`` slots in results the DataLoader
discards; they are reclaimed, but meanwhile they count, so the default doubles that term.
"""

from __future__ import annotations

import multiprocessing
import os
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader

from pinxfer import _batch, _check
from pinxfer._ops import inplace_lock_kind, plain_dense_cpu
from pinxfer.prefetch import StagedLease
from pinxfer.slots.layout import PAGE, bytes_in_slot, header_bytes, round_up
from pinxfer.slots.loader import LoaderCopy, batches_in_loader, check_loader
from pinxfer.slots.ring import Ring
from pinxfer.slots.worker import Fallback, SlotBatch

_HEADROOM = 1.25
_SIZE_ROUND = 64 << 10


class SlotSource:
    """Iterates a DataLoader whose workers write batches into the pinned slot ring.

    Made by ``pinxfer.prefetch(loader, slots=True)``; see :mod:`pinxfer.slots`. Each pass
    yields prefetch's leases: :class:`SlotLease` for batches in slots,
    :class:`~pinxfer.prefetch.StagedLease` for fallbacks.
    """

    def __init__(
        self,
        loader: DataLoader,
        depth: int = 2,
        slot_bytes: int | None = None,
        num_slots: int | None = None,
        wait_s: float = 5.0,
    ):
        check_loader(loader)
        in_loader = batches_in_loader(loader)
        persistent = bool(loader.persistent_workers)
        if num_slots is None:
            num_slots = in_loader * (2 if persistent else 1) + depth + 2
        if not isinstance(num_slots, int) or num_slots < in_loader + depth + 2:
            raise ValueError(
                f"pinxfer.prefetch(slots=True): num_slots must be at least num_workers * "
                f"prefetch_factor + depth + 2 = {in_loader + depth + 2}, got {num_slots!r}"
            )
        if slot_bytes is not None:
            slot_bytes = _check.integer(
                slot_bytes, "prefetch(slots=True)", "slot_bytes", lo=1, hi=_check.INT64_MAX
            )
            if (too_big := _ring_past_ram(num_slots, slot_bytes)) is not None:
                raise ValueError(
                    f"{too_big}; pass slot_bytes= the largest batch's bytes, or fewer num_slots"
                )
        self.depth = depth
        ctx = loader.multiprocessing_context or multiprocessing.get_context()
        self._ring = ring = Ring(ctx, num_slots, wait_s)
        if slot_bytes is not None:
            ring.size(slot_bytes)
        self._loader = LoaderCopy(loader, ring.handle)
        self._pass: _SlotPass | None = None
        self._warned_too_big = False
        self._sizing_refused = False  # the first batch's size made a ring past the memory
        self._finalizer = weakref.finalize(self, _close, self._loader, ring)

    @property
    def ring_bytes(self) -> int:
        return self._ring.data_offset + self._ring.num_slots * self._ring.slot_bytes

    def stats(self) -> dict:
        """Counters: batches, slot_batches, fallbacks by reason, reclaimed; the layout
        (num_slots, slot_bytes) and whether the ring is page-locked (pinned, lock_kind)."""
        r = self._ring
        with r.lock:
            out = {**r.stats, "fallbacks": dict(r.stats["fallbacks"])}
            out.update(
                num_slots=r.num_slots,
                slot_bytes=r.slot_bytes,
                pinned=r.pinned,
                lock_kind=inplace_lock_kind(r.base) if r.base is not None else None,
                held=len(r.held),
                pending=len(r.copies),
            )
        return out

    def __len__(self) -> int:
        return len(self._loader)

    def __iter__(self) -> _SlotPass:
        """A pass: one lease per batch."""
        if self._ring.closed:
            raise RuntimeError(
                "pinxfer.prefetch(slots=True): this Prefetcher's slot ring is closed (its "
                "`with` block ended, or slots.close() was called); make a new Prefetcher to "
                "iterate the loader again"
            )
        if self._pass is not None:
            self._pass.close()
        fresh = not self._loader.has_live_workers()
        epoch = self._ring.begin_pass(fresh)
        it = self._loader.start_pass()
        if not fresh:
            self._ring.reclaim_earlier_epochs(epoch)
        self._pass = _SlotPass(self, it)
        return self._pass

    def _lease_for(self, item: Any) -> Any:
        """The lease of one item the loader delivered."""
        ring = self._ring
        if ring.closed:
            raise RuntimeError(
                "pinxfer.prefetch(slots=True): the slot ring was closed while its "
                "loader was still being iterated; close the Prefetcher (or leave "
                "its `with` block) before calling slots.close()"
            )
        with ring.lock:
            ring.stats["batches"] += 1
        if type(item) is SlotBatch:
            return ring.lease(item)
        if type(item) is Fallback:
            self._count_fallback(item)
            return StagedLease(item.batch)
        return StagedLease(item)  # collated outside a worker (never with num_workers > 0)

    def _count_fallback(self, item: Fallback) -> None:
        ring = self._ring
        with ring.lock:
            ring.stats["fallbacks"][item.reason] += 1
            too_big, seen = ring.stats["fallbacks"]["too_big"], ring.stats["batches"]
            warn = not self._warned_too_big and seen >= 16 and too_big * 2 > seen
            self._warned_too_big |= warn
        if warn:
            warnings.warn(
                f"pinxfer.prefetch: {too_big} of the first {seen} batches did not fit the "
                f"batch slots ({ring.slot_bytes} B each, sized from the first batch) and "
                "took the staging path; pass slot_bytes= the largest batch's bytes (or "
                "slots=False)",
                RuntimeWarning,
                stacklevel=2,
            )
        if item.reason == "sizing" and not ring.slot_bytes and not self._sizing_refused:
            tensors = _batch.tensors_in(item.batch)
            if all(plain_dense_cpu(t) for t in tensors):
                need = bytes_in_slot(tensors)
                if need:
                    slot_bytes = round_up(int(need * _HEADROOM), _SIZE_ROUND)
                    # Sized from the first batch, the ring is checked as a given slot_bytes
                    # is: pinned whole, a ring past the machine's memory would meet the OOM
                    # killer (found by review, session 44). The batches then take torch's path.
                    too_big = _ring_past_ram(ring.num_slots, slot_bytes)
                    if too_big is None:
                        ring.size(slot_bytes)
                    else:
                        self._sizing_refused = True
                        warnings.warn(
                            f"{too_big}, sized from the first batch: the batches take the "
                            "staging path instead (pass slots=False, or a loader with smaller "
                            "batches or fewer workers)",
                            RuntimeWarning,
                            stacklevel=2,
                        )

    def close(self) -> None:
        """Stops the workers and frees the ring (also done when collected, and at exit)."""
        if self._pass is not None:
            self._pass.close()
            self._pass = None
        self._finalizer()


def _ring_past_ram(num_slots: int, slot_bytes: int) -> str | None:
    """Why a ring of ``num_slots`` slots of ``slot_bytes`` cannot be pinned here (it is
    page-locked whole: more than the machine's memory), or None if it can be tried. Checked
    before os.ftruncate and mmap meet a size no machine has."""
    ring_bytes = header_bytes(num_slots) + num_slots * round_up(slot_bytes, PAGE)
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if ring_bytes <= ram:
        return None
    return (
        f"pinxfer.prefetch(slots=True): {num_slots} slots of slot_bytes={slot_bytes} make a "
        f"{ring_bytes} B ring, more than this machine's {ram} B of memory (the ring is pinned "
        "whole)"
    )


def _close(loader: LoaderCopy, ring: Ring) -> None:
    loader.close()
    ring.close()


class _SlotPass:
    """One pass over the loader copy, for the prefetch producer thread."""

    def __init__(self, source: SlotSource, it: Iterator[Any]):
        # Weak: the source holds its pass, and a strong reference back made a cycle that kept
        # the ring (page-locked memory, file descriptors, persistent workers) alive after
        # the Prefetcher was dropped, until Python's cyclic collector ran (found by review,
        # session 44: 15 descriptors more per epoch with gc disabled).
        self._source = weakref.ref(source)
        self.it = it

    def __iter__(self) -> _SlotPass:
        return self

    def _source_or_raise(self) -> SlotSource:
        source = self._source()
        if source is None:
            raise RuntimeError(
                "pinxfer.prefetch(slots=True): the Prefetcher of this pass was collected, "
                "and its slot ring closed with it; keep the Prefetcher while iterating"
            )
        return source

    def __next__(self) -> Any:
        if self.it is None:
            raise StopIteration
        source = self._source_or_raise()
        source._ring.return_finished(source.depth)
        return source._lease_for(next(self.it))

    def close(self) -> None:
        """End of the pass: copies waited for, slots back; workers stopped unless persistent."""
        it, self.it = self.it, None
        source = self._source()
        if source is None or source._ring.closed:
            return  # the ring's finaliser stopped the workers
        ring = source._ring
        try:
            ring.return_all()  # raises if a worker wrote a slot the trainer held
        finally:
            if it is not None and source._loader.end_pass(it):
                ring.reset_free()  # slots of batches the workers never delivered
