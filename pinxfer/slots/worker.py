"""The worker side: a DataLoader worker collates its batch straight into a slot.

The loader copy's ``collate_fn`` is a :class:`SlotCollate` and its ``worker_init_fn`` a
:class:`SlotWorkerInit` (set by :mod:`pinxfer.slots.loader`). Both hold one picklable
:class:`RingHandle`: with ``fork`` a worker inherits the memfd's descriptor, with
``spawn``/``forkserver`` pickling the handle passes it with
:func:`multiprocessing.reduction.DupFd`. Each worker maps the file itself
(:class:`WorkerRing`), never relying on a mapping inherited from the trainer.

Per batch, in the worker (:meth:`SlotCollate.__call__`):

1. the ring not sized yet: the batch takes torch's path, reason ``'sizing'``;
2. take a free slot id from the queue (:meth:`WorkerRing.take`; none within ``wait_s``:
   ``'no_free_slot'``) and tag it in the header (TAKEN, pass epoch, pid, seq);
3. collate into the slot: with the default collate, torch's own ``collate`` with the
   tensor rule replaced by :meth:`WorkerRing.stack_into_slot` (``torch.stack(out=)`` into
   a view of the slot); with ``default_convert`` or a custom ``collate_fn``, its result's
   tensors are copied once into the slot (:meth:`WorkerRing.ref_for`);
4. return a :class:`SlotBatch` (ring id, slot, pid, seq, the batch's structure with each
   tensor replaced by its :class:`~pinxfer.slots.layout.TensorRef`), which the DataLoader
   pickles to the trainer instead of the batch. A batch that does not fit (too big, a
   tensor that is not plain dense CPU) gives its slot back at once and returns a
   :class:`Fallback`: torch's own batch and the reason.
"""

from __future__ import annotations

import mmap
import os
import queue
import time
from collections.abc import Callable
from multiprocessing import reduction
from typing import Any

import torch
from torch.utils.data import get_worker_info
from torch.utils.data._utils.collate import (
    collate,
    default_collate,
    default_collate_fn_map,
    default_convert,
)

from pinxfer import _batch
from pinxfer._ops import plain_dense_cpu
from pinxfer.slots.layout import FREE, Header, TensorRef, next_ref

FALLBACK_REASONS = ("sizing", "too_big", "unsupported", "no_free_slot")


def process_alive(pid: int) -> bool:
    """False for a pid that is gone or a zombie (it can write no memory, and a trainer that
    is one has exited). Asked by pid, not by parentage alone: under the forkserver start
    method (Python 3.14's default on Linux) a worker's parent is the fork server, and a
    parentage check reported the trainer gone at every wait for a slot longer than 0.5 s
    (found by review, session 44)."""
    if os.getppid() == pid:
        return True  # a parent that had exited would have handed its children on
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


class RingHandle:
    """What a worker needs to reach the ring; pickled into spawned workers (the memfd
    goes with DupFd), inherited as is by forked ones. ``free_q`` is replaced by the
    trainer when it resets the queue (before new workers start)."""

    def __init__(
        self, ring_id: str, fd: int, num_slots: int, free_q: Any, wait_s: float, trainer_pid: int
    ):
        self.ring_id, self.fd, self.num_slots = ring_id, fd, num_slots
        self.free_q, self.wait_s, self.trainer_pid = free_q, wait_s, trainer_pid

    def __reduce__(self):
        return (
            _handle_from_pickle,
            (
                self.ring_id,
                reduction.DupFd(self.fd),
                self.num_slots,
                self.free_q,
                self.wait_s,
                self.trainer_pid,
            ),
        )


def _handle_from_pickle(
    ring_id: str, dup: Any, num_slots: int, free_q: Any, wait_s: float, trainer_pid: int
) -> RingHandle:
    return RingHandle(ring_id, dup.detach(), num_slots, free_q, wait_s, trainer_pid)


class SlotBatch:
    """What a worker returns instead of a batch: the slot and the batch's structure."""

    __slots__ = ("pid", "ring_id", "seq", "slot", "structure")

    def __init__(self, ring_id: str, slot: int, pid: int, seq: int, structure: Any):
        self.ring_id, self.slot, self.pid, self.seq, self.structure = (
            ring_id,
            slot,
            pid,
            seq,
            structure,
        )

    def __reduce__(self):
        return (SlotBatch, (self.ring_id, self.slot, self.pid, self.seq, self.structure))


class Fallback:
    """A batch that took torch's path (its shared memory), and why."""

    __slots__ = ("batch", "reason")

    def __init__(self, batch: Any, reason: str):
        self.batch, self.reason = batch, reason

    def __reduce__(self):
        return (Fallback, (self.batch, self.reason))


class _NoFit(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class WorkerRing:
    """A worker's own mapping of the ring, and the slot it is filling."""

    def __init__(self, handle: RingHandle):
        self.handle = handle
        self.pid = os.getpid()
        self.seq = 0
        self.header = Header(handle.fd, handle.num_slots)
        self.header.check_magic()
        self.generation = 0
        self.base: torch.Tensor | None = None
        self.slot_bytes = 0
        self.data_offset = 0
        # The slot being written: index, bytes used, views handed out (data_ptr -> ref).
        self.slot = -1
        self.used = 0
        self.views: dict[int, TensorRef] = {}
        # torch's collate rules with the tensor rule writing into this ring's slot: collate()
        # passes the map to the rule, so the rule is this ring's bound method.
        self.collate_map = {**default_collate_fn_map, torch.Tensor: self.stack_into_slot}

    def sized(self) -> bool:
        """True once the trainer has sized the ring (then its slots are mapped here)."""
        layout = self.header.layout()
        if layout is None:
            return False  # not sized, or not visible yet: asked again next batch
        generation, slot_bytes, data_offset = layout
        if generation != self.generation:
            self.slot_bytes, self.data_offset = slot_bytes, data_offset
            total = data_offset + self.handle.num_slots * slot_bytes
            self.base = torch.frombuffer(mmap.mmap(self.handle.fd, total), dtype=torch.uint8)
            self.generation = generation
        return True

    def take(self) -> int | None:
        """A free slot id, tagged as this worker's, or None after ``wait_s`` seconds without one."""
        deadline = time.monotonic() + self.handle.wait_s
        while True:
            left = deadline - time.monotonic()
            try:
                slot = self.handle.free_q.get(timeout=max(0.0, min(0.5, left)))
                break
            except queue.Empty:
                if not process_alive(self.handle.trainer_pid):
                    raise RuntimeError("pinxfer slots: the trainer process is gone") from None
                if left <= 0:
                    return None
        self.seq += 1
        self.header.take(slot, self.pid, self.seq)
        self.slot, self.used, self.views = slot, 0, {}
        return slot

    def give_back(self) -> None:
        """The worker could not fill its slot: it goes back to the queue at once."""
        slot, self.slot = self.slot, -1
        self.views = {}
        self.header.set_state(slot, FREE)
        self.handle.free_q.put(slot)

    def alloc(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Room for the next tensor of the batch in the slot, as a view of it."""
        ref = next_ref(self.used, dtype, shape)
        nbytes = ref.nbytes()
        if ref.end() > self.slot_bytes:
            raise _NoFit("too_big")
        self.used = ref.end()
        start = self.data_offset + self.slot * self.slot_bytes
        view = ref.view_in(self.base.narrow(0, start, self.slot_bytes))
        if nbytes:
            self.views[view.data_ptr()] = ref
        return view

    def stack_into_slot(self, batch: list, *, collate_fn_map: dict | None = None) -> torch.Tensor:
        """torch's collate rule for tensors, with the output in this worker's slot."""
        if not all(plain_dense_cpu(t) for t in batch):
            raise _NoFit("unsupported")
        out = self.alloc((len(batch), *tuple(batch[0].shape)), batch[0].dtype)
        return torch.stack(batch, 0, out=out)

    def ref_for(self, t: torch.Tensor) -> TensorRef:
        """The descriptor entry of a batch tensor: its place if the collate wrote it
        into the slot, else a place it is copied to now."""
        if not plain_dense_cpu(t):
            raise _NoFit("unsupported")
        if t.numel() == 0:
            return TensorRef(0, t.dtype, tuple(t.shape))  # no bytes to place
        ref = self.views.get(t.data_ptr())
        if (
            ref is None
            or ref.dtype != t.dtype
            or ref.shape != tuple(t.shape)
            or not t.is_contiguous()
        ):
            dst = self.alloc(tuple(t.shape), t.dtype)
            dst.copy_(t)
            ref = self.views[dst.data_ptr()]
        return ref


# One mapping per ring per process: a worker maps the ring on its first batch (or in
# worker_init_fn); a forked worker finds its parent's entries under another pid.
_worker_rings: dict[tuple[int, str], WorkerRing] = {}


def worker_ring(handle: RingHandle) -> WorkerRing:
    key = (os.getpid(), handle.ring_id)
    ring = _worker_rings.get(key)
    if ring is None:
        ring = _worker_rings[key] = WorkerRing(handle)
    return ring


class SlotCollate:
    """The loader copy's collate_fn: fills a slot and returns a SlotBatch, or falls back."""

    def __init__(self, handle: RingHandle, inner: Callable[[Any], Any]):
        self.handle = handle
        self.inner = inner
        self.mode = (
            "collate"
            if inner is default_collate
            else "convert"
            if inner is default_convert
            else "custom"
        )

    def __call__(self, batch: Any) -> Any:
        if get_worker_info() is None:  # not in a worker: nothing to do
            return self.inner(batch)
        ring = worker_ring(self.handle)
        if not ring.sized():
            return Fallback(self.inner(batch), "sizing")
        out = None
        if self.mode != "collate":
            out = self.inner(batch)  # convert / custom collate: its output is copied once
        slot = ring.take()
        if slot is None:
            return Fallback(self.inner(batch) if out is None else out, "no_free_slot")
        try:
            if out is None:
                out = collate(batch, collate_fn_map=ring.collate_map)
            structure = _batch.map_tensors(out, ring.ref_for)
        except _NoFit as nofit:
            ring.give_back()
            if self.mode == "collate":
                out = self.inner(batch)  # torch's own collate: its result, or its error
            return Fallback(out, nofit.reason)
        except BaseException:
            ring.give_back()
            raise
        ring.views = {}
        return SlotBatch(self.handle.ring_id, slot, ring.pid, ring.seq, structure)


class SlotWorkerInit:
    """The loader copy's worker_init_fn: maps the ring, then runs the loader's own."""

    def __init__(self, handle: RingHandle, inner: Callable[[int], None] | None):
        self.handle, self.inner = handle, inner

    def __call__(self, worker_id: int) -> None:
        worker_ring(self.handle).sized()
        if self.inner is not None:
            self.inner(worker_id)
