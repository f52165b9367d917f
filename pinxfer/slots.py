"""Batch slots: DataLoader workers write batches straight into pinned shared memory.

``pinxfer.prefetch(loader)`` on a ``DataLoader(num_workers > 0, pin_memory=False)``
feeding a GPU (the default there; ``slots=False`` opts out, ``slots=True`` also on the
CPU). Without slots a worker-built
batch is copied twice on the host before its DMA: into shared memory by the worker,
then into pinned staging by the trainer. With slots it is written once, by the
worker, into memory the trainer has already page-locked, and the DMA reads it there.

**The ring.** One memfd (``os.memfd_create``: no name in /dev/shm, so nothing is left
behind if the trainer dies; the memory goes when the last process holding it exits)
holds a header and ``num_slots`` slots of ``slot_bytes`` each. The trainer maps it
once and page-locks the mapping once with :func:`pinxfer.pin_` (``cudaHostRegister``
with CUDA, ``mlock`` without; if locking fails, e.g. over ``ulimit -l``, it warns
once and goes on with pageable memory, ``stats()['pinned']`` False). No pin thread,
no staging copy, no per-batch registration.

**How workers get it.** ``prefetch`` iterates a shallow copy of the loader (the
caller's loader is untouched) whose ``collate_fn`` and ``worker_init_fn`` are
wrapped. Both wrappers hold one picklable handle: with ``fork`` the workers
inherit the memfd's descriptor, with ``spawn``/``forkserver`` pickling the handle
passes it with :func:`multiprocessing.reduction.DupFd`. Each worker maps the file
itself (never relying on the trainer's inherited mapping).

**Collate into the slot.** With the default collate (``batch_size`` set) the worker
runs torch's own ``collate`` with the tensor rule replaced: ``torch.stack(..., out=)``
into a view of its slot instead of a fresh shared-memory tensor. With
``batch_size=None`` (``default_convert``) and with a custom ``collate_fn``, the
result's tensors are copied once into the slot. Tensors are stored contiguous at
64-byte aligned offsets (strides are not kept: values, dtype and shape are).
The worker then returns a small descriptor (:class:`SlotBatch`: ring id, slot id,
the writer's pid and sequence number, and the batch's nested structure with each
tensor replaced by (offset, dtype, shape); non-tensor leaves are pickled as usual).
The trainer rebuilds the tensors as views of its pinned mapping.

**The copy.** By default (:class:`SlotTransfer`) a slot batch leaves its slot as ONE
copy of the slot's used bytes -- :func:`pinxfer.to_device` of a pinned uint8 range, a
single direct DMA, on a GPU; a clone on the CPU -- and the yielded tensors are views
of that one buffer at their offsets (as with ``to_device_many``'s packed small
tensors). A custom ``transfer`` gets the views of the pinned slot instead.

**Fallback.** A batch that does not fit -- larger than a slot, a tensor that is not
plain dense CPU (sparse, nested, quantized, a subclass, requiring grad), no slot
free within ``wait_s`` (cannot happen with the default count, see below, but a
worker never waits forever), or the ring not sized yet -- takes today's path: the
worker returns the batch itself (torch's shared memory) wrapped with the reason,
and the trainer counts it in ``stats()['fallbacks']``.

**Slot size.** ``slot_bytes`` if given (rounded up to 4 KiB); else the first batch
(the first batches, those collated before the ring is sized, take the fallback
path, reason ``'sizing'``) is measured by the trainer and the slots get 1.25x its
bytes (its tensors at their aligned offsets), rounded up to 64 KiB. There is no
growth: a later, larger batch falls back (``'too_big'``). Pass ``slot_bytes`` for
batches whose size varies.

**Slot count.** At any moment slots are held by (a) the loader: at most
``num_workers * prefetch_factor`` batches are dispatched and not yet yielded (being
written, in the result queue, or in the in-order reorder buffer), and (b) the
trainer: before it asks the loader for a batch it releases every slot whose copy
has finished and waits for the oldest copies until at most ``depth`` remain. So
``num_workers * prefetch_factor + depth + 2`` slots (the default) mean a worker
never waits for a slot. With ``persistent_workers`` an epoch left early strands up
to ``num_workers * prefetch_factor`` slots in results the DataLoader discards; they
are reclaimed (below), but meanwhile they count, so the default doubles that term.

**Free-slot protocol.** Free slot ids travel in a ``multiprocessing`` Queue of the
loader's context; a worker takes one (``get`` with a timeout, checking that the
trainer is alive), the trainer puts it back. The header holds, per slot, a state
(FREE / TAKEN / HELD) and its writer (pass epoch, pid, per-process sequence number),
written by the worker after it takes the slot (state last) and by the trainer when
it receives the descriptor (HELD) and before it puts the slot back (FREE). The
trainer checks on receipt and on release that the slot's writer is the descriptor's:
a slot handed to two batches at once raises. The slot is put back

* with CUDA: when the event recorded after the batch's copy has completed;
* on the CPU (``device='cpu'``): right after the transfer step, which by default
  clones the slot's bytes (a custom ``transfer`` must not return views of the slot:
  checked);
* when the worker fails to fill it (error in collate, batch does not fit): at once, by
  the worker.

Slots of results the DataLoader never yields (an epoch left early, a killed
worker) are reclaimed: at the start of a pass with fresh workers (not persistent,
or the persistent iterator died) every slot not HELD goes into a new queue, after
the previous pass's workers were joined; with persistent workers, every TAKEN slot
of an earlier pass epoch once the DataLoader's reset has drained the previous
epoch, and every TAKEN slot of a worker older than a batch the trainer has since
received from that worker (each worker's results arrive in order).

Nothing here needs CUDA; the views are CPU tensors of the pinned mapping, and
:func:`pinxfer.to_device` sends a pinned source with one direct copy.
"""
from __future__ import annotations

import collections
import mmap
import multiprocessing
import os
import queue
import threading
import uuid
import warnings
import weakref
from multiprocessing import reduction
from typing import Any, Callable, Optional

import torch
from torch.utils.data import DataLoader
from torch.utils.data._utils.collate import collate, default_collate, default_collate_fn_map, default_convert

from pinxfer import _batch, _check
from pinxfer._ops import inplace_lock_kind, plain_dense_cpu, release_finished_sources
from pinxfer.pin import pin_, unpin_

__all__ = ["SlotBatch", "SlotLease", "SlotSource", "SlotTransfer"]

_MAGIC = 0x746F6C73786E6970  # b"pinxslot" little-endian
_ALIGN = 64
_PAGE = 4096
_HEADROOM = 1.25
_SIZE_ROUND = 64 << 10
# Header words (int64): 0 magic, 1 generation (0: not sized), 2 slot_bytes,
# 3 num_slots, 4 data_offset, 5 pass epoch; slot i at _SLOT0 + 4*i: state, epoch, pid, seq.
_W_MAGIC, _W_GEN, _W_SLOT_BYTES, _W_NUM, _W_DATA, _W_EPOCH, _SLOT0 = 0, 1, 2, 3, 4, 5, 8
FREE, TAKEN, HELD = 0, 1, 2
FALLBACK_REASONS = ("sizing", "too_big", "unsupported", "no_free_slot")


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def _header_bytes(num_slots: int) -> int:
    return _round_up(8 * (_SLOT0 + 4 * num_slots), _PAGE)


class _TensorRef:
    """A tensor of a descriptor: where it lies in its slot."""

    __slots__ = ("offset", "dtype", "shape")

    def __init__(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]):
        self.offset, self.dtype, self.shape = offset, dtype, shape

    def __reduce__(self):
        return (_TensorRef, (self.offset, self.dtype, self.shape))

    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


class SlotBatch:
    """What a worker returns instead of a batch: the slot and the batch's structure."""

    __slots__ = ("ring_id", "slot", "pid", "seq", "structure")

    def __init__(self, ring_id: str, slot: int, pid: int, seq: int, structure: Any):
        self.ring_id, self.slot, self.pid, self.seq, self.structure = ring_id, slot, pid, seq, structure

    def __reduce__(self):
        return (SlotBatch, (self.ring_id, self.slot, self.pid, self.seq, self.structure))


class _Fallback:
    """A batch that took today's path (torch's shared memory), and why."""

    __slots__ = ("batch", "reason")

    def __init__(self, batch: Any, reason: str):
        self.batch, self.reason = batch, reason

    def __reduce__(self):
        return (_Fallback, (self.batch, self.reason))


class _NoFit(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


# ---- the worker side ----


class _RingHandle:
    """What a worker needs to reach the ring; pickled into spawned workers (the memfd
    goes with DupFd), inherited as is by forked ones."""

    def __init__(self, ring_id: str, fd: int, num_slots: int, free_q: Any, wait_s: float,
                 ppid: int):
        self.ring_id, self.fd, self.num_slots = ring_id, fd, num_slots
        self.free_q, self.wait_s, self.ppid = free_q, wait_s, ppid

    def __reduce__(self):
        return (_rebuild_handle, (self.ring_id, reduction.DupFd(self.fd), self.num_slots,
                                  self.free_q, self.wait_s, self.ppid))


def _rebuild_handle(ring_id: str, dup: Any, num_slots: int, free_q: Any, wait_s: float,
                    ppid: int) -> _RingHandle:
    return _RingHandle(ring_id, dup.detach(), num_slots, free_q, wait_s, ppid)


_worker_rings: dict[tuple[int, str], "_WorkerRing"] = {}


def _worker_ring(handle: _RingHandle) -> "_WorkerRing":
    key = (os.getpid(), handle.ring_id)
    ring = _worker_rings.get(key)
    if ring is None:
        ring = _worker_rings[key] = _WorkerRing(handle)
    return ring


class _WorkerRing:
    """A worker's own mapping of the ring, and the slot it is filling."""

    def __init__(self, handle: _RingHandle):
        self.handle = handle
        self.pid = os.getpid()
        self.seq = 0
        self._hmap = mmap.mmap(handle.fd, _header_bytes(handle.num_slots))
        self.words = memoryview(self._hmap).cast("q")
        if self.words[_W_MAGIC] != _MAGIC:
            raise RuntimeError("pinxfer slots: the shared ring's header is not pinxfer's "
                               f"(magic {self.words[_W_MAGIC]:#x})")
        self.generation = 0
        self.base: Optional[torch.Tensor] = None
        self.slot_bytes = 0
        self.data_offset = 0
        # the slot being written: index, bytes used, views handed out (data_ptr -> ref)
        self.slot = -1
        self.used = 0
        self.views: dict[int, _TensorRef] = {}

    def sized(self) -> bool:
        gen = self.words[_W_GEN]
        if gen == 0:
            return False
        if gen != self.generation:
            slot_bytes, data_offset = self.words[_W_SLOT_BYTES], self.words[_W_DATA]
            # The trainer writes these before the generation, but with plain stores: a
            # weakly ordered CPU (arm64) may show this process the generation first. Each
            # word goes once from 0 to its final value (aligned 8-byte stores are atomic),
            # so a zero means "not visible yet": not sized for now, asked again next batch.
            if slot_bytes == 0 or data_offset == 0:
                return False
            self.slot_bytes, self.data_offset = slot_bytes, data_offset
            total = self.data_offset + self.handle.num_slots * self.slot_bytes
            self.base = torch.frombuffer(mmap.mmap(self.handle.fd, total), dtype=torch.uint8)
            self.generation = gen
        return True

    def take(self) -> Optional[int]:
        """A free slot id, or None after ``wait_s`` seconds without one."""
        import time

        deadline = time.monotonic() + self.handle.wait_s
        while True:
            left = deadline - time.monotonic()
            try:
                slot = self.handle.free_q.get(timeout=max(0.0, min(0.5, left)))
                break
            except queue.Empty:
                if os.getppid() != self.handle.ppid:
                    raise RuntimeError("pinxfer slots: the trainer process is gone") from None
                if left <= 0:
                    return None
        self.seq += 1
        w, i = self.words, _SLOT0 + 4 * slot
        w[i + 1] = w[_W_EPOCH]
        w[i + 2] = self.pid
        w[i + 3] = self.seq
        w[i] = TAKEN  # last: the trainer reads the state first
        self.slot, self.used, self.views = slot, 0, {}
        return slot

    def give_back(self) -> None:
        """The worker could not fill its slot: it goes back to the queue at once."""
        slot, self.slot = self.slot, -1
        self.views = {}
        self.words[_SLOT0 + 4 * slot] = FREE
        self.handle.free_q.put(slot)

    def alloc(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        ref = _TensorRef(_round_up(self.used, _ALIGN), dtype, tuple(shape))
        nbytes = ref.nbytes()
        if ref.offset + nbytes > self.slot_bytes:
            raise _NoFit("too_big")
        self.used = ref.offset + nbytes
        start = self.data_offset + self.slot * self.slot_bytes + ref.offset
        view = self.base.narrow(0, start, nbytes).view(dtype).view(ref.shape)
        if nbytes:
            self.views[view.data_ptr()] = ref
        return view

    def ref_for(self, t: torch.Tensor) -> _TensorRef:
        """The descriptor entry of a batch tensor: its place if the collate wrote it
        into the slot, else a place it is copied to now."""
        if not plain_dense_cpu(t):
            raise _NoFit("unsupported")
        if t.numel() == 0:
            return _TensorRef(0, t.dtype, tuple(t.shape))  # no bytes to place
        ref = self.views.get(t.data_ptr())
        if ref is None or ref.dtype != t.dtype or ref.shape != tuple(t.shape) \
                or not t.is_contiguous():
            dst = self.alloc(tuple(t.shape), t.dtype)
            dst.copy_(t)
            ref = self.views[dst.data_ptr()]
        return ref


def _stack_into_slot(batch: list, *, collate_fn_map: Optional[dict] = None) -> torch.Tensor:
    """torch's collate rule for tensors, with the output in the worker's slot."""
    elem = batch[0]
    ring = _filling
    if ring is None or not all(plain_dense_cpu(t) for t in batch):
        raise _NoFit("unsupported")
    out = ring.alloc((len(batch),) + tuple(elem.shape), elem.dtype)
    return torch.stack(batch, 0, out=out)


_filling: Optional[_WorkerRing] = None  # the ring _stack_into_slot writes to (worker main thread)
_slot_collate_map = {**default_collate_fn_map, torch.Tensor: _stack_into_slot}


class _SlotCollate:
    """The loader copy's collate_fn: fills a slot and returns a SlotBatch, or falls back."""

    def __init__(self, handle: _RingHandle, inner: Callable[[Any], Any]):
        self.handle = handle
        self.inner = inner
        self.mode = ("collate" if inner is default_collate else
                     "convert" if inner is default_convert else "custom")

    def __call__(self, batch: Any) -> Any:
        global _filling
        if torch.utils.data.get_worker_info() is None:  # not in a worker: nothing to do
            return self.inner(batch)
        ring = _worker_ring(self.handle)
        if not ring.sized():
            return _Fallback(self.inner(batch), "sizing")
        out = None
        if self.mode != "collate":
            out = self.inner(batch)  # convert / custom collate: its output is copied once
        slot = ring.take()
        if slot is None:
            return _Fallback(self.inner(batch) if out is None else out, "no_free_slot")
        try:
            if out is None:
                _filling = ring
                try:
                    out = collate(batch, collate_fn_map=_slot_collate_map)
                finally:
                    _filling = None
            structure = _batch.map_tensors(out, ring.ref_for)
        except _NoFit as nofit:
            ring.give_back()
            if self.mode == "collate":
                out = self.inner(batch)  # torch's own collate: its result, or its error
            return _Fallback(out, nofit.reason)
        except BaseException:
            ring.give_back()
            raise
        ring.views = {}
        return SlotBatch(self.handle.ring_id, slot, ring.pid, ring.seq, structure)


class _SlotWorkerInit:
    """The loader copy's worker_init_fn: maps the ring, then runs the loader's own."""

    def __init__(self, handle: _RingHandle, inner: Optional[Callable[[int], None]]):
        self.handle, self.inner = handle, inner

    def __call__(self, worker_id: int) -> None:
        _worker_ring(self.handle).sized()
        if self.inner is not None:
            self.inner(worker_id)


# ---- the trainer side ----


class _Ring:
    """The trainer's side of the ring: the memfd, its pinned mapping, the free queue,
    the slots it holds. Methods take ``lock`` (the prefetch producer thread and the
    consumer thread both call in)."""

    def __init__(self, ctx: Any, num_slots: int, wait_s: float):
        self.ctx = ctx
        self.num_slots = num_slots
        self.ring_id = uuid.uuid4().hex
        self.lock = threading.RLock()
        self.fd = os.memfd_create("pinxfer-slots", os.MFD_CLOEXEC)
        self.header_bytes = _header_bytes(num_slots)
        os.ftruncate(self.fd, self.header_bytes)
        self._hmap = mmap.mmap(self.fd, self.header_bytes)
        self.words = memoryview(self._hmap).cast("q")
        self.words[_W_NUM] = num_slots
        self.words[_W_MAGIC] = _MAGIC
        self.handle = _RingHandle(self.ring_id, self.fd, num_slots, ctx.Queue(), wait_s,
                                  os.getpid())
        self.slot_bytes = 0
        self.data_offset = self.header_bytes
        self.base: Optional[torch.Tensor] = None
        self.pinned = False
        self.epoch = 0
        self.pending: collections.deque = collections.deque()  # (event, slot)
        # CUDA devices the slots were copied to: close() asks each to drop its references
        # to finished pinned sources, which would otherwise keep the mapping (and the
        # memfd mmap holds) until the next transfer to that device.
        self.copy_devices: set[torch.device] = set()
        self.held: dict[int, tuple[int, int]] = {}  # slot -> (pid, seq) of its batch
        self.last_seq: dict[int, int] = {}
        self.stats = {"batches": 0, "slot_batches": 0, "reclaimed": 0,
                      "fallbacks": dict.fromkeys(FALLBACK_REASONS, 0)}
        self.closed = False

    # -- layout --

    def size(self, slot_bytes: int) -> None:
        """Gives the ring its slots (once): maps, page-locks, publishes the layout."""
        with self.lock:
            if self.slot_bytes:
                return
            slot_bytes = _round_up(max(int(slot_bytes), _PAGE), _PAGE)
            total = self.data_offset + self.num_slots * slot_bytes
            os.ftruncate(self.fd, total)
            base = torch.frombuffer(mmap.mmap(self.fd, total), dtype=torch.uint8)
            try:
                pin_(base)
                self.pinned = True
            except RuntimeError as err:
                warnings.warn(f"pinxfer.prefetch(slots=True): could not page-lock the "
                              f"{total} B slot ring ({err}); its batches are copied from "
                              "pageable memory", RuntimeWarning, stacklevel=3)
            self.base, self.slot_bytes = base, slot_bytes
            w = self.words
            w[_W_SLOT_BYTES] = slot_bytes
            w[_W_DATA] = self.data_offset
            w[_W_GEN] = 1  # last: workers read it first
            for slot in range(self.num_slots):
                self._put_free(slot)

    def contains(self, t: torch.Tensor) -> bool:
        if self.base is None or t.device.type != "cpu":
            return False
        lo = self.base.data_ptr()
        return lo <= t.data_ptr() < lo + self.base.numel()

    # -- passes and reclaim --

    def begin_pass(self, fresh_workers: bool) -> int:
        """Before ``iter(loader)``: a new pass epoch; with fresh workers (none of an
        earlier pass alive) every slot not held by the trainer goes into a new queue."""
        with self.lock:
            self.epoch += 1
            self.words[_W_EPOCH] = self.epoch
            if fresh_workers:
                self.reset_free()
            return self.epoch

    def reset_free(self) -> None:
        """Once the workers that took slots are gone: a new free queue (a worker killed
        inside ``get`` may have left the old one locked) with every slot that is not
        held by the trainer and not taken by a process still alive."""
        with self.lock:
            old, self.handle.free_q = self.handle.free_q, self.ctx.Queue()
            old.close()
            old.cancel_join_thread()
            self.last_seq.clear()
            if not self.slot_bytes:
                return
            for slot in range(self.num_slots):
                if slot in self.held:
                    continue
                i = _SLOT0 + 4 * slot
                if self.words[i] == TAKEN:
                    if _process_alive(self.words[i + 2]):
                        continue  # a worker that did not stop: its slot stays out
                    self.stats["reclaimed"] += 1
                self._put_free(slot)

    def reclaim_earlier_epochs(self, epoch: int) -> None:
        """After ``iter(loader)`` reset persistent workers: the previous epoch's results
        were drained, so its TAKEN slots will never be received."""
        with self.lock:
            for slot in range(self.num_slots):
                i = _SLOT0 + 4 * slot
                if self.words[i] == TAKEN and self.words[i + 1] < epoch and slot not in self.held:
                    self.stats["reclaimed"] += 1
                    self._put_free(slot)

    def _state(self, slot: int) -> int:
        return self.words[_SLOT0 + 4 * slot]

    def _put_free(self, slot: int) -> None:
        self.words[_SLOT0 + 4 * slot] = FREE
        self.handle.free_q.put(slot)

    # -- batches --

    def receive(self, desc: SlotBatch) -> None:
        with self.lock:
            slot, i = desc.slot, _SLOT0 + 4 * desc.slot
            w = self.words
            if desc.ring_id != self.ring_id:
                raise RuntimeError(f"pinxfer slots: a batch of ring {desc.ring_id} reached ring "
                                   f"{self.ring_id}")
            if slot in self.held or w[i] != TAKEN or w[i + 2] != desc.pid or w[i + 3] != desc.seq:
                raise RuntimeError(
                    f"pinxfer slots: slot {slot} is not the batch's: the batch was written by pid "
                    f"{desc.pid} #{desc.seq}, the slot says state {w[i]} pid {w[i + 2]} "
                    f"#{w[i + 3]}{' and the trainer still holds it' if slot in self.held else ''}")
            w[i] = HELD
            self.held[slot] = (desc.pid, desc.seq)
            self.stats["slot_batches"] += 1
            # Each worker's results arrive in its order: its older TAKEN slots are lost.
            if desc.seq != self.last_seq.get(desc.pid, 0) + 1:
                for other in range(self.num_slots):
                    j = _SLOT0 + 4 * other
                    if w[j] == TAKEN and w[j + 2] == desc.pid and w[j + 3] < desc.seq \
                            and other not in self.held:
                        self.stats["reclaimed"] += 1
                        self._put_free(other)
            self.last_seq[desc.pid] = desc.seq

    def view_of(self, slot: int, ref: _TensorRef) -> torch.Tensor:
        start = self.data_offset + slot * self.slot_bytes + ref.offset
        return self.base.narrow(0, start, ref.nbytes()).view(ref.dtype).view(ref.shape)

    def release(self, slot: int, event: Any = None, tag: Optional[tuple[int, int]] = None) -> None:
        """The batch ``tag`` (pid, seq; None: whichever) in ``slot`` is done with once
        ``event`` (None: now) has completed. A slot the trainer no longer holds for
        that batch (its pass was closed) is left alone."""
        with self.lock:
            if slot not in self.held or (tag is not None and self.held[slot] != tag):
                return
            if event is not None:
                self.pending.append((event, slot))
                return
            pid, seq = self.held.pop(slot)
            i = _SLOT0 + 4 * slot
            if self.words[i] != HELD or self.words[i + 2] != pid or self.words[i + 3] != seq:
                raise RuntimeError(
                    f"pinxfer slots: slot {slot} was written while the trainer held it (batch of "
                    f"pid {pid} #{seq}; now state {self.words[i]} pid {self.words[i + 2]} "
                    f"#{self.words[i + 3]})")
            self._put_free(slot)

    def release_finished(self, keep: int) -> None:
        """Puts back every slot whose copy finished; waits for the oldest copies
        until at most ``keep`` are in flight."""
        with self.lock:
            while self.pending:
                event, slot = self.pending[0]
                if len(self.pending) > keep:
                    event.synchronize()
                elif not event.query():
                    break
                self.pending.popleft()
                self.release(slot)

    def release_all(self) -> None:
        """End of a pass: every copy waited for, every held slot put back."""
        with self.lock:
            self.release_finished(0)
            for slot in list(self.held):
                self.release(slot)

    def note_copies_to(self, out: Any) -> None:
        """Remembers the CUDA devices of a transfer's result (see ``copy_devices``)."""
        devices = {t.device for t in _batch.tensors_in(out) if t.is_cuda}
        if devices:
            with self.lock:
                self.copy_devices |= devices

    def close(self) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
            # The finaliser can get here while copies still read slots: wait for them
            # before the memory is unregistered and unmapped.
            for event, _ in self.pending:
                event.synchronize()
            self.pending.clear()
            self.held.clear()
            for device in self.copy_devices:
                release_finished_sources(device)
            base, self.base = self.base, None
            if base is not None and self.pinned:
                try:
                    unpin_(base)
                except RuntimeError:
                    pass
            del base
            self.words.release()
            self._hmap.close()
            os.close(self.fd)
            q = self.handle.free_q
            q.close()
            q.cancel_join_thread()


class SlotLease:
    """A batch whose tensors are views of a slot; the prefetcher calls :meth:`done`
    once its transfer is queued (CUDA: with the event after the copy) or finished."""

    __slots__ = ("batch", "structure", "nbytes", "_ring", "_slot", "_tag")

    def __init__(self, batch: Any, structure: Any, nbytes: int, ring: _Ring, slot: int,
                 tag: tuple[int, int]):
        self.batch, self.structure, self.nbytes = batch, structure, nbytes
        self._ring, self._slot, self._tag = ring, slot, tag

    def send(self, copy: Callable[[torch.Tensor], torch.Tensor]) -> Any:
        """The batch rebuilt from ONE copy of the slot's used bytes: ``copy`` gets them as
        a pinned uint8 tensor and returns its copy (on a GPU, or cloned); the batch's
        tensors are views of that one buffer (64-byte aligned offsets)."""
        region = self._ring.view_of(self._slot, _TensorRef(0, torch.uint8, (self.nbytes,)))
        buf = copy(region)
        self._ring.note_copies_to(buf)
        return _rebuild(self.structure, buf)

    def done(self, event: Any = None, out: Any = None) -> None:
        """Hands the slot back once ``event`` has completed (None: now). ``out``, the
        transfer's result, must not be views of the slot when it is handed back now."""
        ring, self._ring = self._ring, None
        if ring is None:
            return
        if out is not None:
            ring.note_copies_to(out)
        try:
            if event is None and out is not None:
                for t in _batch.tensors_in(out):
                    if ring.contains(t):
                        raise RuntimeError(
                            "pinxfer.prefetch(slots=True): the transfer returned a view of a batch "
                            "slot, which is reused as soon as the transfer returns on the CPU; "
                            "return copies (the default transfer clones the slot)")
        finally:
            ring.release(self._slot, event, self._tag)


class SlotSource:
    """Iterates a DataLoader whose workers write batches into the pinned slot ring.

    Made by ``pinxfer.prefetch(loader, slots=True)``; see the module docstring.
    Yields :class:`SlotLease` for batches in slots and plain batches for fallbacks.
    """

    def __init__(self, loader: DataLoader, depth: int = 2, slot_bytes: Optional[int] = None,
                 num_slots: Optional[int] = None, wait_s: float = 5.0):
        if not isinstance(loader, DataLoader):
            raise TypeError("pinxfer.prefetch(slots=True): expected a torch.utils.data.DataLoader, "
                            f"got {type(loader).__name__}")
        if loader.num_workers < 1:
            raise ValueError("pinxfer.prefetch(slots=True): the DataLoader needs num_workers > 0 "
                             "(the workers write the slots); got num_workers=0")
        if loader.pin_memory:
            raise ValueError("pinxfer.prefetch(slots=True): build the DataLoader with "
                             "pin_memory=False: the slots are pinned already")
        per_worker = loader.prefetch_factor if loader.prefetch_factor is not None else 2
        in_loader = loader.num_workers * per_worker
        self.persistent = bool(loader.persistent_workers)
        if num_slots is None:
            num_slots = in_loader * (2 if self.persistent else 1) + depth + 2
        if not isinstance(num_slots, int) or num_slots < in_loader + depth + 2:
            raise ValueError(
                f"pinxfer.prefetch(slots=True): num_slots must be at least num_workers * "
                f"prefetch_factor + depth + 2 = {in_loader + depth + 2}, got {num_slots!r}")
        if slot_bytes is not None:
            slot_bytes = _check.integer(slot_bytes, "prefetch(slots=True)", "slot_bytes", lo=1,
                                        hi=_check.INT64_MAX)
            # The ring is page-locked whole: checked here, before os.ftruncate and mmap
            # meet a size no machine has.
            ring_bytes = _header_bytes(num_slots) + num_slots * _round_up(slot_bytes, _PAGE)
            ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            if ring_bytes > ram:
                raise ValueError(
                    f"pinxfer.prefetch(slots=True): {num_slots} slots of slot_bytes={slot_bytes} "
                    f"make a {ring_bytes} B ring, more than this machine's {ram} B of memory (the "
                    "ring is pinned whole); pass slot_bytes= the largest batch's bytes, or fewer "
                    "num_slots")
        self.depth = depth
        ctx = loader.multiprocessing_context or multiprocessing.get_context()
        self._ring = ring = _Ring(ctx, num_slots, wait_s)
        if slot_bytes is not None:
            ring.size(slot_bytes)
        # A shallow copy: the caller's loader keeps its own collate_fn and worker_init_fn.
        import copy

        self._loader = copy.copy(loader)
        self._loader.__dict__["_iterator"] = None
        self._loader.__dict__["collate_fn"] = _SlotCollate(ring.handle, loader.collate_fn)
        self._loader.__dict__["worker_init_fn"] = _SlotWorkerInit(ring.handle, loader.worker_init_fn)
        self._pass: Optional[_SlotPass] = None
        self._warned_too_big = False
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
            out.update(num_slots=r.num_slots, slot_bytes=r.slot_bytes, pinned=r.pinned,
                       lock_kind=inplace_lock_kind(r.base) if r.base is not None else None,
                       held=len(r.held), pending=len(r.pending))
        return out

    def __len__(self) -> int:
        return len(self._loader)

    def __iter__(self) -> "_SlotPass":
        if self._pass is not None:
            self._pass.close()
        loader, ring = self._loader, self._ring
        it = loader.__dict__.get("_iterator")
        if it is not None and getattr(it, "_shutdown", False):
            loader.__dict__["_iterator"] = it = None  # a persistent iterator that died
        fresh = not self.persistent or it is None
        epoch = ring.begin_pass(fresh)
        it = iter(loader)
        if not fresh:
            ring.reclaim_earlier_epochs(epoch)
        self._pass = _SlotPass(self, it)
        return self._pass

    def _decode(self, item: Any) -> Any:
        ring = self._ring
        if ring.closed:
            raise RuntimeError("pinxfer.prefetch(slots=True): the slot ring was closed while its "
                               "loader was still being iterated; close the Prefetcher (or leave "
                               "its `with` block) before calling slots.close()")
        with ring.lock:
            ring.stats["batches"] += 1
        if isinstance(item, SlotBatch):
            ring.receive(item)
            start = ring.data_offset + item.slot * ring.slot_bytes
            slot_bytes = ring.base.narrow(0, start, ring.slot_bytes)
            batch = _rebuild(item.structure, slot_bytes)
            nbytes = max((r.offset + r.nbytes() for r in _refs_in(item.structure)), default=0)
            return SlotLease(batch, item.structure, nbytes, ring, item.slot, (item.pid, item.seq))
        if isinstance(item, _Fallback):
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
                    "slots=False)", RuntimeWarning, stacklevel=2)
            if item.reason == "sizing" and not ring.slot_bytes:
                need = _bytes_in_slot(item.batch)
                if need:
                    ring.size(_round_up(int(need * _HEADROOM), _SIZE_ROUND))
            return item.batch
        return item

    def close(self) -> None:
        """Stops the workers and frees the ring (also done when collected, and at exit)."""
        if self._pass is not None:
            self._pass.close()
            self._pass = None
        self._finalizer()


def _rebuild(structure: Any, buf: torch.Tensor) -> Any:
    """A descriptor's structure with each tensor a view of ``buf`` (uint8) at its offset."""
    def view(o: Any) -> Any:
        if not isinstance(o, _TensorRef):
            return _batch.PASS
        return buf.narrow(0, o.offset, o.nbytes()).view(o.dtype).view(o.shape)

    return _batch.map_tensors(structure, lambda t: t, other=view)


def _refs_in(structure: Any) -> list[_TensorRef]:
    found: list[_TensorRef] = []

    def note(o: Any) -> Any:
        if isinstance(o, _TensorRef):
            found.append(o)
            return o
        return _batch.PASS

    _batch.map_tensors(structure, lambda t: t, other=note)
    return found


class SlotTransfer:
    """The prefetcher's default transfer with slots: a slot batch goes as one copy of
    its slot (:meth:`SlotLease.send`), a fallback batch through ``fallback``."""

    takes_slot_lease = True

    def __init__(self, copy: Callable[[torch.Tensor], torch.Tensor], fallback: Callable[[Any], Any]):
        self.copy, self.fallback = copy, fallback

    def __call__(self, item: Any) -> Any:
        if isinstance(item, SlotLease):
            return item.send(self.copy)
        return self.fallback(item)


def _bytes_in_slot(batch: Any) -> int:
    used = 0
    for t in _batch.tensors_in(batch):
        if not plain_dense_cpu(t):
            return 0
        used = _round_up(used, _ALIGN) + t.numel() * t.element_size()
    return used


def _close(loader: DataLoader, ring: _Ring) -> None:
    it = loader.__dict__.get("_iterator")
    loader.__dict__["_iterator"] = None
    if it is not None:
        _stop_workers(it)
    ring.close()


def _process_alive(pid: int) -> bool:
    """False for a pid that is gone or a zombie (it can write no memory)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _stop_workers(it: Any) -> None:
    """Shuts a multiprocessing DataLoader iterator's workers down and joins them."""
    shutdown = getattr(it, "_shutdown_workers", None)
    if callable(shutdown):
        shutdown()
    for w in getattr(it, "_workers", ()):
        w.join(timeout=10)


class _SlotPass:
    """One pass over the loader copy, for the prefetch producer thread."""

    def __init__(self, source: SlotSource, it: Any):
        self.source, self.it = source, it

    def __iter__(self) -> "_SlotPass":
        return self

    def __next__(self) -> Any:
        if self.it is None:
            raise StopIteration
        self.source._ring.release_finished(self.source.depth)
        return self.source._decode(next(self.it))

    def close(self) -> None:
        """End of the pass: copies waited for, slots back; workers stopped unless persistent."""
        it, self.it = self.it, None
        ring = self.source._ring
        if ring.closed:
            return  # the ring's finaliser stopped the workers
        ring.release_all()
        if it is None:
            return
        if not self.source.persistent:
            _stop_workers(it)
            ring.reset_free()  # slots of batches the workers never delivered
        elif any(not w.is_alive() for w in getattr(it, "_workers", ())):
            # A worker died: torch's persistent iterator cannot go on; the next pass
            # starts fresh workers (and reclaims every slot).
            _stop_workers(it)
            self.source._loader.__dict__["_iterator"] = None
            ring.reset_free()
