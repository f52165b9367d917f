"""The ring's bytes: the shared header (one function per field) and where a tensor lies in a slot.

The trainer and every worker map the same memfd. It starts with a header of int64 words,
then ``num_slots`` slots of ``slot_bytes`` each from ``data_offset``::

    word 0  magic ("pinxslot": the file is pinxfer's ring)
    word 1  generation (0: no slots yet; the trainer sets it last, after the layout)
    word 2  slot_bytes
    word 3  num_slots
    word 4  data_offset (first slot's byte offset, a page boundary)
    word 5  pass epoch (the trainer's pass; a worker stamps it on the slot it takes)
    words 8 + 4*i .. 11 + 4*i   slot i: state, epoch, pid, seq of its writer

A slot's state is FREE (in the free queue), TAKEN (a worker took it and writes it) or HELD
(the trainer received its batch). Its writer (pass epoch, pid, that process's sequence
number) tags the batch; the trainer checks the tag on receipt and on release, so a slot
handed to two batches at once raises instead of mixing their bytes.

Aligned 8-byte stores are atomic, but plain stores are not ordered on a weakly ordered CPU
(arm64): a reader that checks a word written "last" may still see an earlier word at 0.
Each layout word goes once from 0 to its final value, so a zero reads as "not yet".

Inside a slot, tensors are stored contiguous at :data:`ALIGN`-byte aligned offsets, in
the order the batch's walk visits them (:class:`TensorRef` is one tensor's place).
"""

from __future__ import annotations

import mmap
from typing import Any

import torch

from pinxfer import _batch

MAGIC = 0x746F6C73786E6970  # b"pinxslot" little-endian
#: Offsets of tensors inside a slot are multiples of this (a cache line).
ALIGN = 64
PAGE = 4096

FREE, TAKEN, HELD = 0, 1, 2

_MAGIC, _GENERATION, _SLOT_BYTES, _NUM_SLOTS, _DATA_OFFSET, _EPOCH = 0, 1, 2, 3, 4, 5
_FIRST_SLOT_WORD = 8
_WORDS_PER_SLOT = 4
_STATE, _WRITER_EPOCH, _WRITER_PID, _WRITER_SEQ = 0, 1, 2, 3


def round_up(n: int, to: int) -> int:
    """``n`` rounded up to a multiple of ``to``."""
    return (n + to - 1) // to * to


def header_bytes(num_slots: int) -> int:
    """Bytes of the header for ``num_slots`` slots (whole pages: the first slot starts on one)."""
    return round_up(8 * (_FIRST_SLOT_WORD + _WORDS_PER_SLOT * num_slots), PAGE)


def _slot_word(slot: int, field: int) -> int:
    return _FIRST_SLOT_WORD + _WORDS_PER_SLOT * slot + field


class Header:
    """The shared header of one mapping of the ring (trainer's or a worker's)."""

    def __init__(self, fd: int, num_slots: int):
        self._map = mmap.mmap(fd, header_bytes(num_slots))
        self._words = memoryview(self._map).cast("q")

    def close(self) -> None:
        self._words.release()
        self._map.close()

    # -- written once by the trainer --

    def create(self, num_slots: int) -> None:
        """A new ring: its slot count and the magic."""
        self._words[_NUM_SLOTS] = num_slots
        self._words[_MAGIC] = MAGIC

    def check_magic(self) -> None:
        if self._words[_MAGIC] != MAGIC:
            raise RuntimeError(
                "pinxfer slots: the shared ring's header is not pinxfer's "
                f"(magic {self._words[_MAGIC]:#x})"
            )

    def publish_layout(self, slot_bytes: int, data_offset: int) -> None:
        """The slots exist: their size and offset, then the generation last (workers read it
        first)."""
        self._words[_SLOT_BYTES] = slot_bytes
        self._words[_DATA_OFFSET] = data_offset
        self._words[_GENERATION] = 1

    def layout(self) -> tuple[int, int, int] | None:
        """(generation, slot_bytes, data_offset) once all three are visible, else None."""
        generation = self._words[_GENERATION]
        if generation == 0:
            return None
        slot_bytes, data_offset = self._words[_SLOT_BYTES], self._words[_DATA_OFFSET]
        if slot_bytes == 0 or data_offset == 0:
            return None  # the generation is visible before the layout (see the module docstring)
        return generation, slot_bytes, data_offset

    # -- the pass epoch --

    def epoch(self) -> int:
        return self._words[_EPOCH]

    def set_epoch(self, epoch: int) -> None:
        self._words[_EPOCH] = epoch

    # -- per slot --

    def state(self, slot: int) -> int:
        return self._words[_slot_word(slot, _STATE)]

    def set_state(self, slot: int, state: int) -> None:
        self._words[_slot_word(slot, _STATE)] = state

    def writer(self, slot: int) -> tuple[int, int]:
        """(pid, seq) of the process that last took ``slot``."""
        return self._words[_slot_word(slot, _WRITER_PID)], self._words[
            _slot_word(slot, _WRITER_SEQ)
        ]

    def writer_epoch(self, slot: int) -> int:
        return self._words[_slot_word(slot, _WRITER_EPOCH)]

    def take(self, slot: int, pid: int, seq: int) -> None:
        """A worker took ``slot``: the current pass epoch and its tag, then TAKEN last (the
        trainer reads the state first)."""
        self._words[_slot_word(slot, _WRITER_EPOCH)] = self._words[_EPOCH]
        self._words[_slot_word(slot, _WRITER_PID)] = pid
        self._words[_slot_word(slot, _WRITER_SEQ)] = seq
        self.set_state(slot, TAKEN)

    def describe(self, slot: int) -> str:
        pid, seq = self.writer(slot)
        return f"state {self.state(slot)} pid {pid} #{seq}"


class TensorRef:
    """One tensor of a batch in its slot: byte offset in the slot, dtype, shape."""

    __slots__ = ("dtype", "offset", "shape")

    def __init__(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]):
        self.offset, self.dtype, self.shape = offset, dtype, shape

    def __reduce__(self):
        return (TensorRef, (self.offset, self.dtype, self.shape))

    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize

    def end(self) -> int:
        return self.offset + self.nbytes()

    def view_in(self, slot: torch.Tensor) -> torch.Tensor:
        """The tensor as a view of ``slot`` (uint8 bytes of the slot, or a copy of them)."""
        return slot.narrow(0, self.offset, self.nbytes()).view(self.dtype).view(self.shape)


def next_ref(used: int, dtype: torch.dtype, shape: tuple[int, ...]) -> TensorRef:
    """The place of the next tensor after ``used`` bytes of a slot."""
    return TensorRef(round_up(used, ALIGN), dtype, tuple(shape))


def bytes_in_slot(tensors: list[torch.Tensor]) -> int:
    """Bytes ``tensors`` take in a slot, in this order at their aligned offsets."""
    used = 0
    for t in tensors:
        used = next_ref(used, t.dtype, tuple(t.shape)).end()
    return used


def rebuild(structure: Any, slot: torch.Tensor) -> Any:
    """A descriptor's structure with each :class:`TensorRef` replaced by its view of ``slot``
    (the slot's uint8 bytes, pinned, or one copy of them)."""

    def view(o: Any) -> Any:
        return o.view_in(slot) if isinstance(o, TensorRef) else _batch.PASS

    return _batch.map_tensors(structure, _no_tensor, other=view)


def refs_in(structure: Any) -> list[TensorRef]:
    """The TensorRefs of a descriptor's structure."""
    found: list[TensorRef] = []

    def note(o: Any) -> Any:
        if isinstance(o, TensorRef):
            found.append(o)
            return o
        return _batch.PASS

    _batch.map_tensors(structure, _no_tensor, other=note)
    return found


def _no_tensor(t: torch.Tensor) -> torch.Tensor:
    return t  # a descriptor holds TensorRefs, never tensors
