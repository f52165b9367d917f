"""Batch slots: DataLoader workers write batches straight into pinned shared memory.

``pinxfer.prefetch(loader)`` on a ``DataLoader(num_workers > 0, pin_memory=False)``
feeding a GPU (the default there; ``slots=False`` opts out, ``slots=True`` also on the
CPU). Without slots a worker-built batch is copied twice on the host before its DMA: into
shared memory by the worker, then into pinned staging by the trainer. With slots it is
written once, by the worker, into memory the trainer has already page-locked, and the DMA
reads it there.

**The ring.** One memfd (``os.memfd_create``: no name in /dev/shm, so nothing is left
behind if the trainer dies; the memory goes when the last process holding it exits) holds
a header and ``num_slots`` slots of ``slot_bytes`` each. The trainer maps it once and
page-locks the mapping once with :func:`pinxfer.pin_` (``cudaHostRegister`` with CUDA,
``mlock`` without; if locking fails, e.g. over ``ulimit -l``, it warns once and goes on
with pageable memory, ``stats()['pinned']`` False). No pin thread, no staging copy, no
per-batch registration.

**Fallback.** A batch that does not fit -- larger than a slot, a tensor that is not plain
dense CPU (sparse, nested, quantized, a subclass, requiring grad), no slot free within
``wait_s`` (cannot happen with the default count, but a worker never waits forever), or
the ring not sized yet -- takes torch's path: the worker returns the batch itself (torch's
shared memory) with the reason, the trainer counts it in ``stats()['fallbacks']`` and
prefetch stages it as any other batch. Non-tensor leaves are pickled in the descriptor.

Nothing here needs CUDA; the views are CPU tensors of the pinned mapping, and
:func:`pinxfer.to_device` sends a pinned source with one direct copy.

The modules, in the order one batch meets them (read them in this order):

* :mod:`~pinxfer.slots.layout` -- the ring's bytes: the shared header, one function per
  field, and where a tensor lies in a slot;
* :mod:`~pinxfer.slots.worker` -- in a worker: take a slot, collate into it, return a
  descriptor (:class:`SlotBatch`) or a fallback;
* :mod:`~pinxfer.slots.loader` -- the copy of the caller's DataLoader that runs those
  workers; the only module that touches DataLoader internals;
* :mod:`~pinxfer.slots.source` -- :class:`SlotSource`, the batch source prefetch iterates:
  descriptors become leases, fallbacks are counted and size the ring;
* :mod:`~pinxfer.slots.ring` -- the trainer's ring: free queue, held slots, the one queue
  where a slot waits for its copy; :class:`SlotLease` sends a slot as one copy and hands
  it back.

The lease protocol itself (``send``, ``done``) is prefetch's (:mod:`pinxfer.prefetch`).
"""

from pinxfer.slots.ring import SlotLease
from pinxfer.slots.source import SlotSource
from pinxfer.slots.worker import FALLBACK_REASONS, SlotBatch

__all__ = ["FALLBACK_REASONS", "SlotBatch", "SlotLease", "SlotSource"]
