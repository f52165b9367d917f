"""The trainer's side of the ring, and a slot batch as prefetch's lease (:class:`SlotLease`).

:class:`Ring` owns the memfd, the trainer's pinned mapping of it, the free-slot queue and
the slots the trainer holds. Its methods take ``lock``: the prefetch producer thread and
the consumer thread both call in.

**A slot's round trip.** The trainer puts every slot id in the free queue (a
``multiprocessing`` Queue of the loader's context) once the ring is sized. A worker takes
one and marks it TAKEN (:mod:`pinxfer.slots.worker`). When its descriptor arrives the
trainer marks the slot HELD (:meth:`Ring.lease`, checking the writer's tag) and hands prefetch
a :class:`SlotLease`. prefetch's producer calls :meth:`SlotLease.send`: the slot's used
bytes leave as ONE copy -- :func:`pinxfer.to_device` of a pinned uint8 range, a single
direct DMA, on a GPU; a clone on the CPU -- and the batch's tensors are views of that one
buffer at their offsets (a custom ``transfer`` gets the views of the pinned slot instead).
Then :meth:`SlotLease.done` gives the slot back with the event recorded after the copy.

**The one event gate of the ring.** A slot whose copy may still run waits in
``Ring.copies``, a FIFO of (event, slot, batch tag) in the order the copies were queued (they run on
the producer's stream, so they complete in that order). It is the only place a slot waits
for a copy: the pool's per-stream FIFOs (csrc/README.md, "One event gate") hold pinned
*storage* until a copy ends, but have no way to hand a slot id back to a queue that
workers read. Before the source asks the loader for a batch it calls
:meth:`Ring.return_finished`: every slot whose copy completed goes back, and the oldest
copies are waited for until at most ``depth`` remain in flight, so that
``num_workers * prefetch_factor + depth + 2`` slots mean a worker never waits.

**On the CPU** (``device='cpu'``) a slot goes back as soon as the transfer returns; the
default transfer cloned the slot's bytes, and a custom one must not return views of the
slot (checked). A worker that fails to fill its slot gives it back itself.

**Reclaim.** Slots of results the DataLoader never yields (an epoch left early, a killed
worker) are put back: at the start of a pass with fresh workers (:meth:`Ring.reset_free`:
every slot not HELD and not TAKEN by a live process, into a new queue); with persistent
workers, every TAKEN slot of an earlier pass epoch once the DataLoader's reset has drained
the previous epoch (:meth:`Ring.reclaim_earlier_epochs`); and every TAKEN slot of a
worker older than a batch the trainer has since received from that worker (each
worker's results arrive in order).
"""

from __future__ import annotations

import collections
import contextlib
import mmap
import os
import threading
import uuid
import warnings
from typing import TYPE_CHECKING, Any

import torch

from pinxfer import _batch
from pinxfer._ops import release_finished_sources
from pinxfer.pin import pin_, unpin_
from pinxfer.slots.layout import (
    FREE,
    HELD,
    PAGE,
    TAKEN,
    Header,
    header_bytes,
    rebuild,
    refs_in,
    round_up,
)
from pinxfer.slots.worker import FALLBACK_REASONS, RingHandle, SlotBatch, process_alive
from pinxfer.transfer import to_device

if TYPE_CHECKING:
    from pinxfer.prefetch import Delivery


class Ring:
    """The trainer's side of the ring: the memfd, its pinned mapping, the free queue,
    the slots it holds, the slots waiting for their copy."""

    def __init__(self, ctx: Any, num_slots: int, wait_s: float):
        self.ctx = ctx
        self.num_slots = num_slots
        self.ring_id = uuid.uuid4().hex
        self.lock = threading.RLock()
        self.fd = os.memfd_create("pinxfer-slots", os.MFD_CLOEXEC)
        self.data_offset = header_bytes(num_slots)
        os.ftruncate(self.fd, self.data_offset)
        self.header = Header(self.fd, num_slots)
        self.header.create(num_slots)
        self.handle = RingHandle(self.ring_id, self.fd, num_slots, ctx.Queue(), wait_s, os.getpid())
        self.slot_bytes = 0
        self.base: torch.Tensor | None = None
        self.pinned = False
        self.epoch = 0
        self.copies: collections.deque = collections.deque()  # (event, slot, tag): the event gate
        # CUDA devices the slots were copied to: close() asks each to drop its references
        # to finished pinned sources, which would otherwise keep the mapping (and the
        # memfd mmap holds) until the next transfer to that device.
        self.copy_devices: set[torch.device] = set()
        self.held: dict[int, tuple[int, int]] = {}  # slot -> (pid, seq) of its batch
        self.last_seq: dict[int, int] = {}  # worker pid -> seq of its last batch received
        self.stats = {
            "batches": 0,
            "slot_batches": 0,
            "reclaimed": 0,
            "fallbacks": dict.fromkeys(FALLBACK_REASONS, 0),
        }
        self.closed = False

    # -- layout --

    def size(self, slot_bytes: int) -> None:
        """Gives the ring its slots (once): maps, page-locks, publishes the layout."""
        with self.lock:
            if self.slot_bytes:
                return
            slot_bytes = round_up(max(int(slot_bytes), PAGE), PAGE)
            total = self.data_offset + self.num_slots * slot_bytes
            os.ftruncate(self.fd, total)
            base = torch.frombuffer(mmap.mmap(self.fd, total), dtype=torch.uint8)
            try:
                pin_(base)
                self.pinned = True
            except RuntimeError as err:
                warnings.warn(
                    f"pinxfer.prefetch(slots=True): could not page-lock the "
                    f"{total} B slot ring ({err}); its batches are copied from "
                    "pageable memory",
                    RuntimeWarning,
                    stacklevel=3,
                )
            self.base, self.slot_bytes = base, slot_bytes
            self.header.publish_layout(slot_bytes, self.data_offset)
            for slot in range(self.num_slots):
                self._put_free(slot)

    def bytes_of(self, slot: int, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of ``slot``: a uint8 view of the pinned mapping."""
        return self.base.narrow(0, self.data_offset + slot * self.slot_bytes, nbytes)

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
            self.header.set_epoch(self.epoch)
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
                if self.header.state(slot) == TAKEN:
                    if process_alive(self.header.writer(slot)[0]):
                        continue  # a worker that did not stop: its slot stays out
                    self.stats["reclaimed"] += 1
                self._put_free(slot)

    def reclaim_earlier_epochs(self, epoch: int) -> None:
        """After ``iter(loader)`` reset persistent workers: the previous epoch's results
        were drained, so its TAKEN slots will never be received."""
        with self.lock:
            for slot in range(self.num_slots):
                if (
                    self.header.state(slot) == TAKEN
                    and self.header.writer_epoch(slot) < epoch
                    and slot not in self.held
                ):
                    self.stats["reclaimed"] += 1
                    self._put_free(slot)

    def _put_free(self, slot: int) -> None:
        self.header.set_state(slot, FREE)
        self.handle.free_q.put(slot)

    # -- batches --

    def lease(self, desc: SlotBatch) -> SlotLease:
        """A worker's descriptor received: its slot becomes HELD, the batch a lease."""
        with self.lock:
            slot, header = desc.slot, self.header
            if desc.ring_id != self.ring_id:
                raise RuntimeError(
                    f"pinxfer slots: a batch of ring {desc.ring_id} reached ring {self.ring_id}"
                )
            if (
                slot in self.held
                or header.state(slot) != TAKEN
                or header.writer(slot) != (desc.pid, desc.seq)
            ):
                raise RuntimeError(
                    f"pinxfer slots: slot {slot} is not the batch's: the batch was written by pid "
                    f"{desc.pid} #{desc.seq}, the slot says {header.describe(slot)}"
                    f"{' and the trainer still holds it' if slot in self.held else ''}"
                )
            header.set_state(slot, HELD)
            self.held[slot] = (desc.pid, desc.seq)
            self.stats["slot_batches"] += 1
            # Each worker's results arrive in its order: its older TAKEN slots are lost.
            if desc.seq != self.last_seq.get(desc.pid, 0) + 1:
                for other in range(self.num_slots):
                    pid, seq = header.writer(other)
                    if (
                        header.state(other) == TAKEN
                        and pid == desc.pid
                        and seq < desc.seq
                        and other not in self.held
                    ):
                        self.stats["reclaimed"] += 1
                        self._put_free(other)
            self.last_seq[desc.pid] = desc.seq
        return SlotLease(self, desc)

    def release(self, slot: int, tag: tuple[int, int], event: torch.cuda.Event | None) -> None:
        """The batch ``tag`` (pid, seq) in ``slot`` is done with once ``event`` (None: now)
        has completed. A slot the trainer no longer holds for that batch (its pass was
        closed) is left alone."""
        with self.lock:
            if self.held.get(slot) != tag:
                return
            if event is not None:
                self.copies.append((event, slot, tag))
                return
            self._put_back(slot)

    def _put_back(self, slot: int) -> None:
        pid, seq = self.held.pop(slot)
        if self.header.state(slot) != HELD or self.header.writer(slot) != (pid, seq):
            raise RuntimeError(
                f"pinxfer slots: slot {slot} was written while the trainer held it (batch of "
                f"pid {pid} #{seq}; now {self.header.describe(slot)})"
            )
        self._put_free(slot)

    def return_finished(self, keep: int) -> None:
        """Puts back every slot whose copy finished; waits for the oldest copies
        until at most ``keep`` are in flight."""
        with self.lock:
            while self.copies:
                event, slot, tag = self.copies[0]
                if len(self.copies) > keep:
                    event.synchronize()
                elif not event.query():
                    break
                self.copies.popleft()
                if self.held.get(slot) == tag:
                    self._put_back(slot)

    def return_all(self) -> None:
        """End of a pass: every copy waited for, every held slot put back."""
        with self.lock:
            self.return_finished(0)
            for slot in list(self.held):
                self._put_back(slot)

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
            for event, _, _ in self.copies:
                event.synchronize()
            self.copies.clear()
            self.held.clear()
            for device in self.copy_devices:
                release_finished_sources(device)
            base, self.base = self.base, None
            if base is not None and self.pinned:
                with contextlib.suppress(RuntimeError):
                    unpin_(base)
            del base
            self.header.close()
            os.close(self.fd)
            q = self.handle.free_q
            q.close()
            q.cancel_join_thread()


class SlotLease:
    """A batch in a slot of the ring, as prefetch's lease (``send``, ``done``).

    ``batch`` is the batch with its tensors as views of the pinned slot (what a custom
    ``transfer`` gets)."""

    __slots__ = ("_nbytes", "_ring", "_slot", "_structure", "_tag", "batch")

    #: done() gives the slot back only once the event after the copies has completed.
    wants_copy_event = True

    def __init__(self, ring: Ring, desc: SlotBatch):
        slot_bytes = ring.bytes_of(desc.slot, ring.slot_bytes)
        self.batch = rebuild(desc.structure, slot_bytes)
        self._structure = desc.structure
        self._nbytes = max((ref.end() for ref in refs_in(desc.structure)), default=0)
        self._ring, self._slot, self._tag = ring, desc.slot, (desc.pid, desc.seq)

    def send(self, to: Delivery) -> Any:
        """The batch on ``to.device``. Default transfer: ONE copy of the slot's used bytes
        (a direct DMA from the pinned slot on a GPU, a clone on the CPU) and the batch's
        tensors views of that one buffer. A custom transfer gets :attr:`batch`."""
        ring = self._ring
        if to.transfer is None:
            used = ring.bytes_of(self._slot, self._nbytes)
            buf = (
                used.clone()
                if to.device.type == "cpu"
                else to_device(used, to.device, True, to.chunk_bytes, to.num_buffers)
            )
            ring.note_copies_to(buf)
            return rebuild(self._structure, buf)
        out = to.transfer(self.batch)
        # The slot is reused as soon as this returns on the CPU (done() gets no event), once
        # the copies are done on a GPU: a tensor of the batch still over the slot's memory
        # (a leaf the transfer kept on the CPU, e.g. lengths) would change under the consumer.
        # (Checked on the CPU only until session 42, found by review.)
        for t in _batch.tensors_in(out):
            if ring.contains(t):
                raise RuntimeError(
                    "pinxfer.prefetch(slots=True): the transfer returned a view of a batch "
                    "slot (a CPU tensor over the slot's memory), which is reused once the "
                    "batch is handed out; return copies of the leaves it keeps on the CPU "
                    "(t.clone()), as the default transfer does"
                )
        ring.note_copies_to(out)
        return out

    def done(self, event: torch.cuda.Event | None) -> None:
        """The slot goes back once ``event`` has completed (None: now)."""
        ring, self._ring = self._ring, None
        if ring is not None:
            ring.release(self._slot, self._tag, event)
