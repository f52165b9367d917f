"""A stream prefetcher: batches copied to the GPU in the background, ahead of use.

``prefetch(loader)`` wraps any iterable (a DataLoader with workers and
``pin_memory=False`` is the main case). A background thread pulls batches,
sends them with :func:`pinxfer.to_device` with its own CUDA stream current (the
DMA runs on pinxfer's copy stream) and keeps up to ``depth`` of them ready.
Each yielded batch is

* ready on the consumer's current stream: that stream waits on an event
  recorded after the batch's copies (no host sync);
* safe from memory reuse: every device tensor of the batch is
  ``record_stream``-ed on the consumer's stream when it is handed out, so the
  caching allocator does not reuse its memory before the consumer's queued work
  is done; the staging memory of the copies is fenced by pinxfer's pool.

The thread/queue machinery does not depend on CUDA: the per-batch step is a
pluggable ``transfer`` function, and with ``device="cpu"`` batches are
prefetched by the thread and yielded unchanged.

**One road, one lease protocol.** The producer thread takes *leases* from a batch
source and never asks what a lease holds. A lease is one batch on its way:

* ``send(to)`` starts the batch's transfer as :class:`Delivery` ``to`` says (device,
  the caller's ``transfer`` or pinxfer's, staging chunks), with the producer's stream
  current, and returns the result;
* ``done(event)``: the producer is through with the batch's host memory, which may be
  reused once ``event`` has completed (recorded on the producer's stream after
  ``send``; None on the CPU, and after a failed ``send``, once the device has been
  synchronized: no copy reads it any more).

A batch source is an iterable whose passes (``iter(source)``) yield leases and have a
``close()``; the source itself has ``close()`` (and ``len()`` where its batches have one).
There are two: :class:`StagedSource` makes a :class:`StagedLease` of every batch of any
iterable (``to_device`` stages it; its staging memory is gated by pinxfer's pool, so
``done`` has nothing to give back), and :class:`pinxfer.slots.SlotSource` makes a
:class:`pinxfer.slots.SlotLease` of every batch a DataLoader worker wrote into a pinned
slot (sent as one copy of the slot; ``done`` hands the slot back after ``event``), and a
:class:`StagedLease` of a batch that did not fit. Which source a Prefetcher reads is
decided once, when it is made.

Lifetime: iterating starts a *pass* (one ``iter(source)``, one thread). The
pass stops, its thread is joined and its queued batches are freed when it is
exhausted, when the source raises, when the ``for`` loop is left early
(``break``: the loop's generator is closed), on :meth:`Prefetcher.close`, on
leaving a ``with`` block, or when the Prefetcher is garbage-collected. Iterating
again starts a new pass (a new epoch of a DataLoader). Batches pulled ahead
from the source by a pass that is stopped early are dropped.

Stopping never waits on the source for long: the producer thread is joined for
at most :data:`CLOSE_TIMEOUT_S` seconds. If it is still inside the source's
``__next__`` by then (a source blocked on I/O, say), stopping returns with a
RuntimeWarning and leaves it behind: it is a daemon thread that exits as soon as
that ``__next__`` returns, dropping what it got; the source's iterator is then
not closed (a generator that is running cannot be).

One consumer at a time: a thread that asks for a batch (``next()``, or starts a
``for`` loop) while another thread is waiting for one of the same Prefetcher
gets a RuntimeError instead of waiting for a batch that will never come. Handing
a Prefetcher from one thread to another between batches is fine.
"""

from __future__ import annotations

import itertools
import os
import queue
import sys
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn

import torch
from torch.utils.data import DataLoader

from pinxfer import _check, _ops
from pinxfer._batch import tensors_in
from pinxfer._check import DeviceLike
from pinxfer._ops import cuda_unavailable_reason
from pinxfer._plain import Layout, plain_batch, rebuilt_batch
from pinxfer.transfer import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_NUM_BUFFERS,
    NVTX_TOOL,
    profiler_range,
    profiling,
    to_device,
)

if TYPE_CHECKING:
    from pinxfer.slots import SlotSource

_ITEM, _END, _ERROR = "item", "end", "error"
#: A batch the caller's road gave its sender (payload: a _Sent), taken at the next step.
_SENT = "sent"
_pass_ids = itertools.count()

#: Longest a pass's stop (close(), leaving a loop or a ``with`` block, garbage
#: collection) waits for its producer thread, in seconds. A producer still busy
#: after that is left to exit on its own (see the module docstring).
CLOSE_TIMEOUT_S = 1.0

#: Why a pass's entry points are never traced by torch.compile (_check.never_traced): the
#: Prefetcher's iteration, and what its generator calls, each step and at its end (dynamo would
#: otherwise compile each function a step calls, the generator's own frame excepted).
_PASS_UNTRACED = "a pass runs threads and CUDA streams outside any graph"

_SECOND_CONSUMER = (
    "pinxfer.prefetch: another thread is already waiting for a batch of this Prefetcher; a "
    "Prefetcher has one consumer at a time. Give each thread its own pinxfer.prefetch(...), "
    "or have one thread consume it and pass the batches on through a queue.Queue"
)


# ---- the lease protocol ----


class Delivery(NamedTuple):
    """Where a Prefetcher sends its batches and how: what every lease's ``send`` gets."""

    device: torch.device  # resolved: cuda:N, or cpu (batches are yielded as they are)
    transfer: Callable[[Any], Any] | None  # the caller's per-batch step; None: pinxfer's
    chunk_bytes: int  # to_device's largest staging chunk
    num_buffers: int  # to_device's staging chunks in flight


class StagedLease:
    """Any batch as a lease: sent by the caller's ``transfer``, else by :func:`to_device`
    (pageable tensors through pinned staging, pinned ones directly), else (CPU) as it is."""

    __slots__ = ("batch",)

    #: Whether ``done`` uses the event after the copies. A staged batch does not (its staging
    #: blocks wait for the copy in pinxfer's pool, the batch is the caller's), so the
    #: caller's road records none for it (an event costs the step microseconds of Python).
    wants_copy_event = False

    def __init__(self, batch: Any):
        self.batch = batch

    def send(self, to: Delivery) -> Any:
        if to.transfer is not None:
            return to.transfer(self.batch)
        if to.device.type == "cpu":
            return self.batch
        return to_device(self.batch, to.device, True, to.chunk_bytes, to.num_buffers)

    def done(self, event: torch.cuda.Event | None) -> None:
        # Staging blocks wait for the copy in pinxfer's pool; the batch is the caller's.
        self.batch = None


class StagedSource:
    """Any iterable of batches as a batch source: each batch a :class:`StagedLease`."""

    def __init__(self, iterable: Iterable):
        self._iterable = iterable

    def __iter__(self) -> _StagedPass:
        return _StagedPass(iter(self._iterable))

    def __len__(self) -> int:
        return len(self._iterable)  # type: ignore[arg-type]

    def close(self) -> None:
        pass  # the iterable is the caller's


class _StagedPass:
    __slots__ = ("_it",)

    def __init__(self, it: Iterator[Any]):
        self._it = it

    def __iter__(self) -> _StagedPass:
        return self

    def __next__(self) -> StagedLease:
        return StagedLease(next(self._it))

    def close(self) -> None:
        close = getattr(self._it, "close", None)  # generators: run their finally blocks
        if callable(close):
            close()


# ---- the roads: the consumer's own thread, or one producer thread per pass ----
#
# Two roads carry leases to the consumer; both fetch, send and hand over a batch with the
# same three functions below, so a batch is treated alike on either.
#
# * The caller's road (_CallerPass): the consumer's next() hands out the batch sent at the
#   previous step and starts sending the one after it, without a Python producer thread: a
#   producer thread wakes per batch, hands it over through a queue and passes the GIL back
#   and forth while the consumer synchronizes (H100: a 4 KiB batch took 75-96 us per step
#   through the thread against 27 us for a plain loop of .to(), benchmarks/diag_batch.py).
#   A batch whose tensors are all plain CPU tensors (with pinxfer's own transfer) goes to
#   the device's BatchSender (csrc/ops/cuda/batch_sender.h): C++ threads, two per device
#   for the whole process (PINXFER_SENDER_WORKERS), that send it on streams of their own
#   while the consumer computes, holding no GIL (back to back, the next batch starts while
#   the last one is sent); after a long consumer step a host function queued after its
#   copies marks it landed, back to back taking it asks its event (PINXFER_SENDER_LANDING).
#   The pass's first batch is sent in next() itself (there is no earlier step to hide its
#   send behind, and the sender, asleep since the last pass, would add its wake-up and the
#   hand-over); the sender takes the pass from the second batch on. The pass's start (making
#   the iterator to the first batch usable) went from 0.25-0.72x the plain loop's to
#   0.40-0.90x (H200, diag_sender.py's first_ratio_median, 4 processes a side at 4 KiB -
#   1 MiB: the median higher in all 12 cells, round by round in 44 of 48;
#   results/h200/sender_2026-12-02_s26_first_inline.json); bench_loop's whole-pass rows
#   (16 batches a pass) moved within the processes' spread.
#   next() submits the next batch (a queue and a wake-up), then takes the one submitted
#   at the previous step (submitted first, the next batch is sent while the consumer
#   takes this one and synchronizes: 1 MiB back to back on the H100 1.18 -> 1.39x the
#   plain loop, medians of 6 processes). After a compute step the batch taken has landed,
#   so taking it queues no CUDA call on the consumer's stream (record_stream only, host
#   bookkeeping); one still in flight is waited for with one stream wait. Any other
#   batch (a tensor that needs grad, a mode active) is sent in next() itself, on the
#   consumer's current stream, as a plain loop of .to(non_blocking=True) would.
#   Why a thread of its own: sent in next(), after a compute step, a batch paid every slow
#   CUDA call of a cold core (diag_idle_wake.py: an event query 42 us, a synchronize with
#   nothing queued 62 us, after 20 ms of sleep), and a plain loop was as fast: 1 MiB
#   batches after a 20 ms sleep 0.88-0.93x the plain loop (H100, 6 rounds), 0.93-0.96x
#   (H200); through the sender 1.62-1.67x and 1.66-1.79x (bench_loop's prefetch rows,
#   results/<kind>/loop_prefetch_2026-11-27_s9_*). Back to back a 4 KiB step costs more
#   through the sender (0.69-0.99x the plain loop on the H100, 6 processes): the hand-over
#   costs the consumer about what sending such a batch itself does, and it is not
#   cheaper sent in next() today either (0.83-0.92x, diag_sender.py, csrc/README.md).
#   Tried and dropped: choosing per step, the sender when the consumer's last step was
#   longer than the sender's last send (with or without the hand-over's cost, or twice
#   it): back to back 4 KiB steps were no better (0.79-0.92x), and steps at 256 KiB - 1 MiB
#   lost what the sender gained there. Tried again with to_device's one C call (session
#   36): small batches (<= 256 KiB) sent in next() while the consumer's steps were shorter
#   than such a send: back to back 4 KiB 1.13 -> 0.92x the plain loop, 64 KiB 1.23 -> 1.05x
#   (H200, csrc/README.md): the batch's DMA then sits on the consumer's stream in front of
#   its work, where the sender's runs beside it. Also tried before (2026-11-26): the batch sent
#   ahead from Python on the pass's own stream with an event, wait and record_stream:
#   back to back a 4 KiB step went from 31 to 54-74 us and after a gap it was no better.
# * The thread's road (_Pass): a producer thread sends up to ``depth`` batches ahead. It is
#   the road for large batches the sender does not take (sent in next(), their host-side
#   staging would make the consumer wait), and for CPU passes and a caller's ``transfer``.
#
# producer="auto" (the default) starts on the caller's road, sends the first batch there
# and moves the rest of the pass to a thread when that batch was sent in next() (not by
# the sender) and holds more than CALLER_SENDS_BYTES of tensors; producer="caller" /
# "thread" choose one road. Large batches of plain CPU tensors stay with the sender, which
# hides their staging as the thread does, without a GIL hand-off per batch: 8 and 64 MiB
# batches through the sender against the thread (H200, bench_loop --producer caller / auto,
# 2 processes each, results/h200/loop_producer_2026-11-27_s10_*): after a GPU kernel 64 MiB
# 123-155 against 171-187 us per step, 8 MiB 1.41-1.76x the pinned copy against
# 1.44-1.48x; back to back 64 MiB 0.89-0.91x the pinned copy against 0.85-0.89x.

#: The largest first batch (bytes of its tensors) sent in next() (not by the sender) for
#: which producer="auto" keeps a pass on the caller's road. Up to 1 MiB sending a batch
#: costs the consumer less than the thread's hand-off (H100, bench_loop / diag_batch:
#: 1 MiB batches 184 us per step on the caller's road, 205 through the thread); at 4 MiB
#: and more the thread's road wins (the staging is long enough to be worth hiding from the
#: consumer).
CALLER_SENDS_BYTES = 1 << 20

PRODUCERS = ("auto", "caller", "thread")


def _refuse_under_capture(device: torch.device | None) -> None:
    # torch.cuda.is_current_stream_capturing's own call, without its Python frame: this
    # runs at every step of every road.
    if device is not None and torch._C._cuda_isCurrentStreamCapturing():
        # The batch's event was recorded outside the capture: a captured
        # wait on it would not order a replay after the next transfer.
        raise RuntimeError(
            "pinxfer.prefetch: the next batch was requested while the current CUDA stream "
            "is capturing a graph; a batch cannot be fetched inside a capture (a replay "
            "would not fetch again). Take the batch before capture or replay and copy it "
            "into the graph's static inputs: `for b in pinxfer.prefetch(loader): "
            "static_x.copy_(b); graph.replay()`."
        )


def _fetch(leases: Iterator[Any], step: int) -> Any:
    """The next lease, or an (_END | _ERROR, ...) item. A KeyboardInterrupt or SystemExit
    propagates (the caller's road is the consumer's thread: it must stop now)."""
    try:
        with profiler_range("pinxfer::prefetch::fetch"):
            return next(leases)
    except BaseException as err:  # noqa: BLE001 - _fetch_failed raises what is not an Exception
        return _fetch_failed(err, step)


def _fetch_failed(err: BaseException, step: int) -> tuple:
    """What _fetch returns when the source's next() raised ``err``: (_END, None, None) for
    its end, (_ERROR, err, None) for an error; a KeyboardInterrupt or SystemExit is
    raised again."""
    if isinstance(err, StopIteration):
        return (_END, None, None)
    if not isinstance(err, Exception):
        raise err
    _note(err, f"raised by the source of pinxfer.prefetch at batch {step}")
    return (_ERROR, err, None)


def _submit_failed(err: Exception, step: int) -> tuple:
    """The item for a batch the sender refused (its submit raised ``err`` before queuing
    anything that reads the batch): raised in the consumer at that batch's own step, after
    the batches before it, as a failed transfer is (until session 43 it was raised a step
    early, in place of the batch before it, which was dropped)."""
    return _failed(err, f"raised while pinxfer.prefetch transferred batch {step}")


def _send(lease: Any, to: Delivery, event_on: torch.cuda.Stream | None, step: int) -> tuple:
    """Sends one lease (on the current stream, which the road has chosen) and gives it back:
    (_ITEM, result, event after the copies, recorded on ``event_on``; None without one), or
    (_ERROR, err, None) once no copy reads the batch any more. A KeyboardInterrupt or
    SystemExit is cleaned up after, then raised."""
    try:
        event = None
        with profiler_range("pinxfer::prefetch::transfer"):
            out = lease.send(to)
            if event_on is not None:
                event = torch.cuda.Event()
                event.record(event_on)
        lease.done(event)
    except BaseException as err:
        if to.device.type == "cuda":
            torch.cuda.synchronize(to.device)  # no copy may still read the batch
        lease.done(None)
        if not isinstance(err, Exception):
            raise
        return _failed(err, f"raised while pinxfer.prefetch transferred batch {step}")
    return (_ITEM, out, event)


def _hand_over(payload: Any, event: torch.cuda.Event | None, device: torch.device | None) -> Any:
    """A sent batch, made safe on the consumer's current stream: that stream waits for the
    batch's copies, and the caching allocator keeps its device memory until that stream
    has used it."""
    if event is not None:
        consumer = torch.cuda.current_stream(device)
        consumer.wait_event(event)
        for t in tensors_in(payload):
            if t.is_cuda:
                t.record_stream(consumer)
    return payload


def _stream_of(ids: tuple) -> torch.cuda.Stream:
    """The Stream of torch._C._cuda_getCurrentStream's (id, device index, device type)."""
    return torch.cuda.Stream(stream_id=ids[0], device_index=ids[1], device_type=ids[2])


def _event_after(ids: tuple) -> torch.cuda.Event:
    """An event recorded now on the stream ``ids``: it completes after the work queued there."""
    event = torch.cuda.Event()
    event.record(_stream_of(ids))
    return event


#: The C++ sender of the caller's road; absent from a build without CUDA.
_HAS_SENDER = hasattr(_ops.fast, "BatchSender")


#: _Sent.layout of a batch the sender took apart itself (submit_batch_if_plain): take_batch
#: rebuilds it in C++.
_TAKEN_APART_IN_C = "taken apart in C++"


class _Sent(NamedTuple):
    """A batch of plain CPU tensors its pass's BatchSender is sending (the caller's road)."""

    batch: Any  # the source batch: referenced until taken, as the lease held it
    # plain_batch's: how the results go back; None: a bare tensor; _TAKEN_APART_IN_C
    layout: Layout | str | None
    ticket: Any  # the sender's _SendTicket
    step: int  # the batch's number in the pass


@_check.never_traced("Prefetcher's pass", _PASS_UNTRACED)
def _next_of(p: _CallerPass | _Pass) -> Any:
    """The gate of every road's next(): a finished pass ends, a capture is refused, and one
    consumer at a time (non-blocking: a second consumer waiting for a batch could wait
    forever, the pass delivers one END, so it is refused instead)."""
    if p.finished:
        raise StopIteration
    _refuse_under_capture(p.device)
    if not p.consumer.acquire(blocking=False):
        raise RuntimeError(_SECOND_CONSUMER)
    try:
        return p._next_locked()
    finally:
        p.consumer.release()


def _tensor_bytes(batch: Any) -> int:
    return sum(t.nbytes for t in tensors_in(batch))


class _CallerPass:
    """One pass on the caller's road: each next() hands out the batch sent at the previous
    step and starts the next one: the device's sender sends a batch of plain CPU tensors,
    any other is sent here, in the consumer's thread, on its current stream."""

    def __init__(self, leases: Iterator[Any], to: Delivery, depth: int, hand_off_large: bool):
        self.leases: Iterator[Any] | None = leases
        # The source's own iterator when its leases are StagedLeases (any iterable of
        # batches): the sender road's steady step fetches from it directly, the lease being
        # only its batch (a lease object costs a step two Python calls; _sender_step).
        self.source_batches: Iterator[Any] | None = (
            leases._it if type(leases) is _StagedPass else None
        )
        # False once the sender's binding declined a batch of this pass (not a collated
        # batch it takes apart: a bare tensor, say): the steady step then goes through
        # _send_lease, which asks once per batch, instead of asking twice.
        self.sender_takes_apart = True
        self.to = to
        self.depth = depth
        self.device = to.device if to.device.type == "cuda" else None  # None: a CPU pass
        self.sent_on: tuple | None = None  # the stream the batch ahead was sent on (ids)
        self.hand_off_large = hand_off_large  # producer="auto": a large first batch -> thread
        self.ahead: tuple | None = None  # the item sent one step early
        self.step = 0  # batches fetched
        self.threaded: _Pass | None = None  # the thread that took the pass over, if one did
        # Batches of plain CPU tensors go through the device's sender (the process's one,
        # looked up at the first such batch); the caller's transfer, a CPU pass and other
        # batches are sent in next() itself.
        self.sends_plain = _HAS_SENDER and self.device is not None and to.transfer is None
        self.sender: Any = None  # _ops.fast.BatchSender
        # The pass's first batch, plain or not, is sent in next(): nothing earlier could hide
        # its send, and the sender's thread, asleep since the last pass, would add its
        # wake-up and a hand-over to the step (see _send_next). True once a plain first
        # batch was sent so: the pass stays on the caller's road whatever its size.
        self.first_plain_sent_here = False
        self._finished = False
        self.stopped = False
        self.consumer = threading.Lock()  # held by the thread inside next()

    @property
    def finished(self) -> bool:
        return self.threaded.finished if self.threaded is not None else self._finished

    def next(self) -> Any:
        if self.threaded is not None:
            return self.threaded.next()
        return _next_of(self)

    def _next_locked(self) -> Any:
        if self._finished:  # stopped by another thread meanwhile
            raise StopIteration
        item, self.ahead = (self.ahead or self._send_next()), None
        if item[0] == _SENT:  # the sender's: safe on the current stream once taken
            return self._sender_step(item[1])
        if item[0] == _ITEM:
            if (
                self.step == 1
                and self.hand_off_large
                and not self.first_plain_sent_here
                and _tensor_bytes(item[1]) > CALLER_SENDS_BYTES
            ):
                # Large batches the sender does not take: a producer thread sends the
                # rest, this one first (with an event: the thread's road hands every batch
                # over with one).
                if self.device is not None:
                    item = (item[0], item[1], self._copy_event(item))
                self.threaded = _Pass(self.leases, self.to, self.depth, first=item)
                self.leases = self.source_batches = None
                return self.threaded.next()
            out = item[1]
            now = None
            if self.device is not None:
                now = self._current_stream()
                if now != self.sent_on:
                    # The consumer changed streams since the batch was sent: the new one
                    # waits for the copies (an event recorded now on the stream they were
                    # queued on comes after them).
                    out = _hand_over(out, self._copy_event(item), self.device)
            self.ahead = self._send_next(now)
            return out
        return self._end(item)

    def _end(self, item: tuple) -> NoReturn:
        """Ends the pass at an (_END | _ERROR, ...) item: raises StopIteration or the error."""
        self._finished = True
        self.shutdown()
        if item[0] == _ERROR:
            raise item[1]
        raise StopIteration

    def _sender_step(self, sent: _Sent) -> Any:
        """Hands out the batch the sender has (``sent``), having given the sender the next
        one first: the sender sends it while the consumer takes this one and synchronizes
        (the comment block above the roads has the figures).

        This is the steady step of a pass of plain batches, so its common case (no profiler
        running, a batch fetched and submitted, this one taken whole) is made here in one
        frame: back to back on the H200 the step's Python around the sender's two calls
        cost a 4 KiB step 9-15 us, spread over its dozen function calls and two profiler
        checks (diag_sender.py's pieces way, csrc/README.md). A source of plain batches
        (StagedSource's) is read directly and its batch submitted here, without a lease
        object, _send_lease and _submit: four Python calls of a step whose Python runs
        several times slower on the GPU hosts than on the 2-core machine
        (benchmarks/diag_step_python.py). Every other case goes through the functions the
        rest of the road uses."""
        # A profiler's ranges around the fetch and the wait: profiling(), its cheap half
        # asked first (with no profiler running, _ops.compiling, two Python
        # calls, need not be asked; this step is never traced: the sender's calls break a
        # graph).
        ranged = (torch.autograd._profiler_enabled() or NVTX_TOOL) and profiling()
        try:
            if ranged:
                self.ahead = self._send_next()
            elif self.source_batches is not None and self.sender_takes_apart:
                try:
                    batch = next(self.source_batches)
                except BaseException as err:  # noqa: BLE001 - as in _fetch
                    self.ahead = _fetch_failed(err, self.step)
                else:
                    to = self.to
                    refused = None
                    try:
                        ticket = self.sender.submit_batch_if_plain(
                            batch, to.chunk_bytes, to.num_buffers
                        )
                    except Exception as err:  # noqa: BLE001 - raised at this batch's step
                        refused = _submit_failed(err, self.step)
                    if refused is not None:
                        self.ahead = refused
                        self.step += 1
                    elif ticket is None:
                        self.sender_takes_apart = False
                        self.ahead = self._send_lease(StagedLease(batch))
                    else:
                        # _submit's _Sent, made without NamedTuple's Python __new__.
                        sent_ahead = (batch, _TAKEN_APART_IN_C, ticket, self.step)
                        self.ahead = (_SENT, tuple.__new__(_Sent, sent_ahead), None)
                        self.step += 1
            else:
                try:
                    lease = next(self.leases)  # type: ignore[arg-type]
                except BaseException as err:  # noqa: BLE001 - as in _fetch
                    lease = _fetch_failed(err, self.step)
                self.ahead = lease if type(lease) is tuple else self._send_lease(lease)
        except BaseException:  # KeyboardInterrupt in the source: this one is lost
            self.sender.settle(sent.ticket)
            raise
        if ranged or sent.layout is not _TAKEN_APART_IN_C:
            item = self._take(sent)
            return item[1] if item[0] == _ITEM else self._end(item)
        try:
            return self.sender.take_batch(sent.ticket)
        except Exception as err:  # noqa: BLE001 - re-raised in the consumer at this step
            return self._end(self._take_failed(err, sent))

    def _copy_event(self, item: tuple) -> torch.cuda.Event:
        """The event after the batch's copies: the one its send recorded, else one recorded
        now on the stream the copies were queued on (it comes after them)."""
        return item[2] if item[2] is not None else _event_after(self.sent_on)  # type: ignore[arg-type]

    def _current_stream(self) -> tuple:
        # (stream id, device index, device type): no Stream object (torch.cuda.current_stream()
        # builds one, ~3 us of a step that sends a small batch in ~25).
        return torch._C._cuda_getCurrentStream(self.device.index)  # type: ignore[union-attr]

    def _send_next(self, current: tuple | None = None) -> tuple:
        """Fetches and sends the next batch: a batch of plain CPU tensors to the device's
        sender, any other here; ``current``: the consumer's current stream if the caller
        has just read it."""
        lease = _fetch(self.leases, self.step)  # type: ignore[arg-type]
        if type(lease) is tuple:
            return lease
        return self._send_lease(lease, current)

    def _send_lease(self, lease: Any, current: tuple | None = None) -> tuple:
        """Sends a lease just fetched: _send_next's item for it."""
        self.step += 1
        if self.device is None:
            return _send(lease, self.to, None, self.step - 1)
        if self.sends_plain and type(lease) is StagedLease:
            if self.step == 1:
                # The first batch: sent here, on the consumer's stream, as a plain loop sends
                # it; the sender takes the pass from the second batch on (submitted when
                # this next() returns it, so the sender rises while the consumer uses it).
                self.first_plain_sent_here = self._plain_leaves(lease.batch) is not None
            else:
                try:
                    sent = self._submit(lease.batch, self.step - 1)
                except Exception as err:  # noqa: BLE001 - raised at this batch's step
                    return _submit_failed(err, self.step - 1)
                if sent is not None:
                    return (_SENT, sent, None)
        # On the consumer's current stream for the pass's device. An event after the copy
        # only for a lease whose done() waits for it (a slot goes back once the copy has
        # read it); a consumer that changes streams gets one when it takes the batch.
        self.sent_on = current or self._current_stream()
        event_on = _stream_of(self.sent_on) if lease.wants_copy_event else None
        return _send(lease, self.to, event_on, self.step - 1)

    @staticmethod
    def _plain_leaves(batch: Any) -> tuple[list[torch.Tensor], Layout | None] | None:
        """A batch the sender can take, as its leaves and layout (None: a bare tensor); None
        for any other batch (or in a mode, or traced: to_device's general path is for those)."""
        if not _ops.eager():
            return None
        if type(batch) is torch.Tensor:
            return ([batch], None) if _ops.plain_dense_cpu(batch) else None
        return plain_batch(batch, min_leaves=1)

    def _submit(self, batch: Any, step: int) -> _Sent | None:
        """Gives a batch of plain CPU tensors to the pass's sender; None for any other batch.
        A collated batch is taken apart by the sender's binding (submit_batch_if_plain) and
        rebuilt by take_batch, in C++: the Python walk and rebuild cost a small batch's step
        a few microseconds (to_device's one C call, csrc/README.md, session 34)."""
        if self.sender is None:
            if self._plain_leaves(batch) is None:
                return None  # no sender (nor its workers' warm-up) for batches it cannot take
            self.sender = _ops.fast.batch_sender(self.device)
        chunk_bytes, num_buffers = self.to.chunk_bytes, self.to.num_buffers
        ticket = self.sender.submit_batch_if_plain(batch, chunk_bytes, num_buffers)
        if ticket is not None:
            return _Sent(batch, _TAKEN_APART_IN_C, ticket, step)
        plain = self._plain_leaves(batch)
        if plain is None:
            return None
        leaves, layout = plain
        ticket = self.sender.submit(leaves, chunk_bytes, num_buffers)
        return _Sent(batch, layout, ticket, step)

    def _take(self, sent: _Sent) -> tuple:
        """A batch from the sender, safe on the current stream: (_ITEM, batch on the device,
        None), or (_ERROR, err, None) once no copy reads the batch any more."""
        whole = sent.layout is _TAKEN_APART_IN_C
        try:
            with profiler_range("pinxfer::prefetch::wait"):
                if whole:
                    results = self.sender.take_batch(sent.ticket)
                else:
                    results = self.sender.take(sent.ticket)
        except Exception as err:  # noqa: BLE001 - re-raised in the consumer at this step
            return self._take_failed(err, sent)
        if whole:
            return (_ITEM, results, None)
        if sent.layout is None:
            return (_ITEM, results[0], None)
        return (_ITEM, rebuilt_batch(sent.batch, sent.layout, results), None)

    def _take_failed(self, err: Exception, sent: _Sent) -> tuple:
        """_take's item for a batch whose take raised ``err``, once no copy reads it."""
        torch.cuda.synchronize(self.device)  # no copy may still read the batch
        return _failed(err, f"raised while pinxfer.prefetch transferred batch {sent.step}")

    def consumer_busy(self) -> bool:
        """A consumer is inside next(): this pass's, or the thread's that took it over."""
        threaded = self.threaded
        return self.consumer.locked() or (threaded is not None and threaded.consumer_busy())

    def wait_for_producer(self) -> None:
        """As _Pass.wait_for_producer, for the thread that took this pass over, if one did."""
        if self.threaded is not None:
            self.threaded.wait_for_producer()

    @_check.never_traced("Prefetcher's pass", _PASS_UNTRACED)
    def shutdown(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Stops the pass: drops the batch sent ahead, closes the source's pass. Idempotent."""
        if self.threaded is not None:
            self.threaded.shutdown(timeout)
        self._finished = True
        ahead, self.ahead = self.ahead, None  # its device memory returns to the allocator
        if ahead is not None and ahead[0] == _SENT:
            # Not taken: the sender drops it if it has not started it, else this waits until
            # its copies are queued (the source batch is referenced until then).
            self.sender.settle(ahead[1].ticket)
        leases, self.leases, self.source_batches = self.leases, None, None
        if leases is not None and not self.stopped:
            # As on the thread's road: nobody is left to catch what it raises (a generator
            # the consumer is inside of cannot be closed from another thread).
            _close_quietly(leases)
        self.stopped = True


class _Pass:
    """One pass on the thread's road: a producer thread, a queue and depth slots.

    The thread references only this object, never the Prefetcher, so dropping
    the Prefetcher lets it be collected (and its finaliser stop the pass).
    """

    def __init__(self, leases: Iterator[Any], to: Delivery, depth: int, first: tuple | None = None):
        self.leases: Iterator | None = leases  # made in the caller's thread, as DataLoader wants
        self.to = to
        self.device = to.device if to.device.type == "cuda" else None  # None: a CPU pass
        self.queue: queue.SimpleQueue[tuple[str, Any, Any]] = queue.SimpleQueue()
        self.slots = threading.Semaphore(depth)
        self.step = 0
        if first is not None:  # a batch the caller's road sent before handing the pass over
            self.slots.acquire()
            self.queue.put(first)
            self.step = 1
        self.stop = threading.Event()
        self.finished = False  # consumer side: END or ERROR delivered
        self.stopped = False  # shutdown() has joined (or given up on) the producer
        self.consumer = threading.Lock()  # held by the thread waiting in next()
        self.index = 0  # batches handed out
        self.thread = threading.Thread(
            target=_produce, args=(self,), daemon=True, name=f"pinxfer-prefetch-{next(_pass_ids)}"
        )
        self.thread.start()

    def next(self) -> Any:
        return _next_of(self)

    def _next_locked(self) -> Any:
        if self.finished:  # stopped by another thread while this one acquired the lock
            raise StopIteration
        with profiler_range("pinxfer::prefetch::wait"):
            kind, payload, event = self.queue.get()
        if kind == _ITEM:
            self.slots.release()
            self.index += 1
            return _hand_over(payload, event, self.device)
        self.finished = True
        self.shutdown()
        if kind == _ERROR:
            raise payload
        raise StopIteration

    def consumer_busy(self) -> bool:
        """A consumer is inside next()."""
        return self.consumer.locked()

    @_check.never_traced("Prefetcher's pass", _PASS_UNTRACED)
    def shutdown(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Stops the producer, joins it for at most ``timeout`` seconds, frees queued
        batches. Idempotent: a second call does not wait or warn again."""
        self.finished = True
        self.stop.set()
        self.slots.release()  # wakes a producer waiting for a slot
        thread = self.thread
        if (
            not self.stopped
            and thread.is_alive()
            and thread is not threading.current_thread()
            and not sys.is_finalizing()
        ):
            thread.join(timeout)
            if thread.is_alive():
                warnings.warn(
                    f"pinxfer.prefetch: the producer thread {thread.name} is still busy (inside "
                    f"the source's __next__ or a transfer) after {timeout} s; not waiting longer. "
                    "It exits when that call returns and drops what it got.",
                    RuntimeWarning,
                    stacklevel=3,
                )
        self.stopped = True
        # Drop queued batches (their device memory returns to the allocator).
        while True:
            try:
                self.queue.get_nowait()
            except queue.Empty:
                break
        # The drain may have taken the END meant for a consumer waiting in get() in
        # another thread (close() from a second thread): give it one back.
        self.queue.put((_END, None, None))
        self._close_leases_once_producer_gone()

    def wait_for_producer(self) -> None:
        """Joins a producer that shutdown() left inside the source (its timeout ran out),
        however long that call takes, then closes the source's pass as shutdown would have.
        The next pass calls this before it enters the source: ``iter()`` of a DataLoader with
        persistent workers resets the iterator this thread is still reading, and the reset
        then waits forever for a worker reply the thread took (found by review, session 42)."""
        thread = self.thread
        if thread.is_alive() and thread is not threading.current_thread():
            thread.join()
        self._close_leases_once_producer_gone()

    def _close_leases_once_producer_gone(self) -> None:
        if self.thread.is_alive():
            return
        leases, self.leases = self.leases, None
        if leases is not None:
            # The source's pass: a generator's finally, a slot pass's slots. At shutdown
            # what it raises has no one left to catch it.
            _close_quietly(leases)


def _produce(p: _Pass) -> None:
    """Producer thread body: take a lease, send it, give it back, enqueue the result,
    until the end or a stop."""
    try:
        stream = None
        if p.device is not None:
            torch.cuda.set_device(p.device)
            stream = torch.cuda.Stream(p.device)
            # The current stream is per thread: set once for the whole pass rather than
            # entered per batch (a stream context costs tens of microseconds of Python,
            # and every microsecond between two transfers is one the copy threads idle).
            torch.cuda.set_stream(stream)
        while True:
            while not p.slots.acquire(timeout=0.1):
                if p.stop.is_set():
                    return
            if p.stop.is_set():
                return
            lease = _fetch(p.leases, p.step)  # type: ignore[arg-type]
            if type(lease) is tuple:  # the end, or the source's error
                p.queue.put(lease)
                return
            if p.stop.is_set():
                return  # a slot lease dropped here is put back when the source's pass closes
            item = _send(lease, p.to, stream, p.step)
            del lease
            p.queue.put(item)
            if item[0] == _ERROR:
                return
            del item
            p.step += 1
    except BaseException as err:  # noqa: BLE001 - e.g. stream creation failed
        p.queue.put(_failed(err, "raised in pinxfer.prefetch's transfer thread"))
    finally:
        if p.stop.is_set():
            p.queue.put((_END, None, None))  # unblocks a consumer waiting in get()


def _close_quietly(leases: Any) -> None:
    """Closes a source's pass at shutdown. What it raises has no caller left to catch it, so
    it is a warning: a slot ring's integrity error (a worker wrote a slot the trainer held)
    was dropped without a word (found by review, session 44)."""
    try:
        leases.close()
    except Exception as err:  # noqa: BLE001 - reported as a warning
        warnings.warn(
            f"pinxfer.prefetch: closing the source's pass raised {type(err).__name__}: {err}",
            RuntimeWarning,
            stacklevel=2,
        )


def _note(err: BaseException, text: str) -> None:
    if hasattr(err, "add_note"):  # Python >= 3.11
        err.add_note(text)


def _failed(err: BaseException, text: str) -> tuple:
    """The (_ERROR, ...) item for a batch whose transfer raised ``err``, noted with ``text``.
    A StopIteration is wrapped in a RuntimeError (as PEP 479 does in generators): raised
    from the consumer's next() it would end the pass silently, dropping the batches left
    (found by review, session 44: a transfer= function that called next() on an exhausted
    iterator)."""
    if isinstance(err, StopIteration):
        wrapped = RuntimeError(f"{text}: StopIteration")
        wrapped.__cause__ = err
        err = wrapped
    _note(err, text)
    return (_ERROR, err, None)


class Prefetcher:
    """Iterates over a source with batches copied to a device ahead of time.

    Made by :func:`prefetch` (whose arguments it takes; ``slots`` defaults to False
    here); see the module docstring for the guarantees. Consume it from one thread at a
    time: a second thread asking for a batch while another waits for one raises
    RuntimeError.
    """

    def __init__(
        self,
        source: Iterable,
        device: DeviceLike | None = None,
        depth: int = 2,
        transfer: Callable[[Any], Any] | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        num_buffers: int = DEFAULT_NUM_BUFFERS,
        *,
        slots: bool | None = False,
        slot_bytes: int | None = None,
        num_slots: int | None = None,
        producer: str = "auto",
    ):
        depth = _checked_depth(depth)
        if producer not in PRODUCERS:
            raise ValueError(
                f"pinxfer.prefetch: producer must be one of {', '.join(map(repr, PRODUCERS))}, "
                f"got {producer!r}"
            )
        dev = _prefetch_device(device)
        # Checked here, as to_device checks them: otherwise they fail at the first batch of
        # a GPU pass, and never on a CPU one (found by review, session 44).
        if transfer is not None and not callable(transfer):
            raise TypeError(
                f"pinxfer.prefetch: transfer must be a callable taking a batch, got "
                f"{type(transfer).__name__}"
            )
        chunk_bytes = _check.integer(
            chunk_bytes, "prefetch", "chunk_bytes", lo=4096, hi=_check.INT64_MAX
        )
        num_buffers = _check.integer(
            num_buffers, "prefetch", "num_buffers", lo=1, hi=_check.INT64_MAX
        )
        if slots is None:
            slots = _slots_by_default(source, dev, transfer)
        self._slots: SlotSource | None = None
        if slots:
            # Imported here: the slots build on this module's StagedLease.
            from pinxfer.slots import SlotSource

            self._slots = SlotSource(
                source, depth=depth, slot_bytes=slot_bytes, num_slots=num_slots
            )
        elif slot_bytes is not None or num_slots is not None:
            raise ValueError(
                "pinxfer.prefetch: slot_bytes and num_slots are for batch slots, "
                "which this call does not use (slots=False, or the source is not a "
                "DataLoader(num_workers > 0, pin_memory=False) feeding a GPU); drop "
                "them or pass slots=True"
            )
        # The batch source, chosen here once: the road below never asks which it is.
        self._batches = self._slots if self._slots is not None else StagedSource(source)
        self._source = source
        self.device = dev
        self.depth = depth
        self._to = Delivery(dev, transfer, chunk_bytes, num_buffers)
        # "auto": the caller's road for a GPU pass with pinxfer's own transfer (a caller's
        # transfer may take long; a CPU pass wants the thread to overlap loading).
        if producer == "auto" and (dev.type != "cuda" or transfer is not None):
            producer = "thread"
        self.producer = producer
        self._pass: _Pass | _CallerPass | None = None

    def _start_pass(self) -> _Pass | _CallerPass:
        current = self._pass
        if current is not None and not current.finished and current.consumer_busy():
            raise RuntimeError(_SECOND_CONSUMER)  # a new pass would end that thread's
        self.close()
        if current is not None:
            # No producer of the last pass may still be inside the source when it is
            # entered again (_Pass.wait_for_producer says why).
            current.wait_for_producer()
        leases = iter(self._batches)  # in the caller's thread, as DataLoader wants
        if self.producer == "thread":
            self._pass = _Pass(leases, self._to, self.depth)
        else:
            self._pass = _CallerPass(
                leases, self._to, self.depth, hand_off_large=self.producer == "auto"
            )
        return self._pass

    @_check.never_traced("Prefetcher.__iter__", _PASS_UNTRACED)
    def __iter__(self) -> Iterator[Any]:
        return self._generate(self._start_pass())

    def _generate(self, p: _Pass | _CallerPass) -> Iterator[Any]:
        try:
            while True:
                try:
                    batch = p.next()
                except StopIteration:
                    return
                yield batch
                del batch
        finally:
            # Also runs when the loop is left early: the generator is closed.
            p.shutdown()

    @_check.never_traced("Prefetcher.__next__", _PASS_UNTRACED)
    def __next__(self) -> Any:
        """The next batch of the current pass (starting one if there is none)."""
        p = self._pass if self._pass is not None and not self._pass.finished else None
        if p is None:
            if self._pass is not None:  # the previous pass ended: do not restart silently
                raise StopIteration
            p = self._start_pass()
        return p.next()

    def __len__(self) -> int:
        try:
            return len(self._source)  # type: ignore[arg-type]
        except TypeError:
            raise TypeError(
                f"pinxfer.prefetch: the source ({type(self._source).__name__}) has no len()"
            ) from None

    def close(self) -> None:
        """Stops the current pass: joins its thread and frees the batches it queued.

        Waits at most :data:`CLOSE_TIMEOUT_S` seconds for the producer thread; one
        still inside the source's ``__next__`` after that is left to exit when
        that call returns (a RuntimeWarning says so). A consumer waiting for a
        batch in another thread gets StopIteration."""
        p, self._pass = self._pass, None
        if p is not None:
            p.shutdown()

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
        self._batches.close()  # a slot ring is freed; an iterable is the caller's

    @property
    def slots(self) -> SlotSource | None:
        """The slot ring's source with ``prefetch(..., slots=True)`` (``stats()``,
        ``close()``), else None."""
        return self._slots

    def __del__(self) -> None:
        p = getattr(self, "_pass", None)
        if p is not None:
            p.shutdown()

    def __repr__(self) -> str:
        return (
            f"Prefetcher(source={type(self._source).__name__}, device={self.device}, "
            f"depth={self.depth}, producer={self.producer!r})"
        )


def _checked_depth(depth: Any) -> int:
    return _check.integer(
        depth,
        "prefetch",
        "depth",
        lo=1,
        hi=_check.INT64_MAX,
        hint=" (batches kept ready ahead of the consumer)",
    )


def _requested_device(device: DeviceLike | None) -> torch.device:
    """The device prefetch was asked for, not yet resolved: None is the current GPU, or the
    CPU without CUDA; an int is that GPU."""
    if device is None:
        device = "cpu" if cuda_unavailable_reason() is not None else "cuda"
    return _check.as_device(device)


def _prefetch_device(device: DeviceLike | None) -> torch.device:
    """The one resolution of prefetch's device: cuda:N (usable) or cpu."""
    requested = _requested_device(device)
    if requested.type not in ("cuda", "cpu"):
        raise ValueError(f"pinxfer.prefetch: expected a CUDA device or 'cpu', got {requested}")
    dev = _check.device(requested, "prefetch", " Pass device='cpu' to prefetch on the host only.")
    if dev.type == "cuda":
        # torch's CUDA state made here, on the caller's thread, before a pass's other threads
        # (the producer thread, the C++ sender's workers) make CUDA calls: torch's lazy init
        # on one thread beside another's first CUDA calls deadlocked (csrc/README.md, "The
        # sender road", session 35). A device with an index asks torch nothing above.
        _ops.ensure_torch_cuda()
    return dev


def _slots_by_default(
    iterable: Iterable, device: DeviceLike | None, transfer: Callable[[Any], Any] | None
) -> bool:
    """Whether ``prefetch(..., slots=None)`` uses batch slots: a DataLoader whose workers
    can write them (num_workers > 0, pin_memory=False), copied to a GPU by the default
    transfer (a custom one may keep views of a slot past its copy; on the CPU a slot
    only adds a copy), where memfd_create exists (Linux)."""
    if transfer is not None or not hasattr(os, "memfd_create"):
        return False
    if not isinstance(iterable, DataLoader):
        return False
    if iterable.num_workers < 1 or iterable.pin_memory:
        return False
    return _requested_device(device).type == "cuda"


@_check.never_traced(
    "prefetch", "it makes a Prefetcher, whose passes run threads and CUDA streams outside any graph"
)
def prefetch(
    iterable: Iterable,
    device: DeviceLike | None = None,
    depth: int = 2,
    *,
    transfer: Callable[[Any], Any] | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    num_buffers: int = DEFAULT_NUM_BUFFERS,
    slots: bool | None = None,
    slot_bytes: int | None = None,
    num_slots: int | None = None,
    producer: str = "auto",
) -> Prefetcher:
    """Wraps an iterable so that its batches reach the GPU ahead of use.

    Batches are pulled from ``iterable`` and sent to ``device`` as :func:`pinxfer.to_device`
    sends them, ahead of use: batches of plain CPU tensors one step ahead (each ``next()``
    hands out the batch sent at the previous step and starts the next, which pinxfer's
    per-device C++ sender threads send during the consumer's step;
    ``PINXFER_SENDER_WORKERS``), other small ones one step ahead from ``next()`` itself,
    other large ones by a background thread that keeps at most ``depth`` batches fetched
    ahead (``producer``). Each yielded batch is ready on the consumer's current stream and
    its device memory is not reused before that stream is done with it -- no
    ``record_stream`` or sync needed by the caller. Already-pinned tensors
    (``DataLoader(pin_memory=True)``) are sent directly, without staging. Nested structures
    (dict, list, tuple, namedtuple, dataclass) and non-tensor fields pass through. An
    exception raised by the source is raised by the consumer's ``next()`` at the same step,
    after the batches before it.

    Reading ahead means the source is asked for the next batch before the last one has been
    read: a batch's staging (sender threads) or its copy from pinned memory may still be
    reading its tensors. So a source must not refill tensors it has yielded (a generator
    that reuses one buffer): the batch would arrive with later bytes, unnoticed. Yield new
    tensors (as a DataLoader does) or copies.

    Without CUDA: ``device=None`` means ``"cpu"``: batches are prefetched by the
    thread and yielded unchanged (so loading still overlaps the consumer). Asking
    for a CUDA device when none is usable raises RuntimeError here.

    Args:
        iterable: any iterable of batches (DataLoader, list, generator, ...).
        device: target device; None: the current GPU, or "cpu" without CUDA.
        depth: batches kept ready ahead of the consumer (>= 1).
        transfer: replaces the per-batch step (default: ``to_device`` to
            ``device``); it runs in the producer thread, with the producer's
            stream current when ``device`` is a GPU. Return the device tensors inside
            tensors, dicts, lists, tuples, namedtuples or dataclasses: those are the
            tensors that are ``record_stream``-ed on the consumer's stream when a batch
            is handed out (an object of another class is handed out as it is, its
            tensors unmarked, so their memory could be reused while the consumer's
            queued work still reads it). With ``slots=True`` it must not return a view
            of the slot (a CPU tensor over the slot's memory): the slot is reused.
        chunk_bytes: largest staging chunk of ``to_device``.
        num_buffers: staging chunks of ``to_device``'s ring.
        slots: batch slots (see :mod:`pinxfer.slots`): the DataLoader's workers
            write each batch straight into a ring of pinned shared-memory slots and
            the copy reads it there -- no pin thread, no staging copy. None (the
            default): used when ``iterable`` is a ``DataLoader(num_workers > 0,
            pin_memory=False)``, the device is a GPU and ``transfer`` is not given;
            False: never (the opt-out); True: required (``iterable`` must be such a
            DataLoader; with ``device="cpu"`` the default transfer copies each batch
            out of its slot). The ring lives until the Prefetcher is collected,
            leaves a ``with`` block, or ``.slots.close()``; ``.slots.stats()`` counts
            slot batches and fallbacks (batches that do not fit take the staging path).
        slot_bytes: bytes per slot; None: 1.25x the first batch.
        num_slots: slots in the ring; None: ``num_workers * prefetch_factor``
            (twice that with persistent workers) ``+ depth + 2``.
        producer: who sends the batches. ``"auto"`` (default): for a GPU with the
            default transfer, one batch ahead from the consumer's ``next()`` (batches
            of plain CPU tensors by the C++ sender, of any size) while the batches that
            ``next()`` sends itself are small (the first holds at most
            :data:`CALLER_SENDS_BYTES` of tensors: a Python thread's hand-off per batch
            would cost more), else a background thread, ``depth`` batches ahead; a CPU
            pass or a custom ``transfer``: the thread.
            ``"caller"``: always one batch ahead from ``next()`` (the source's
            ``__next__`` then runs in the consumer's thread; batches of plain CPU
            tensors are sent by the C++ sender, others in ``next()``). ``"thread"``:
            always the background thread, ``depth`` batches ahead.

    Returns:
        A :class:`Prefetcher`: iterate over it (each ``for`` loop is one pass),
        ``len()`` it when the source has a length, ``close()`` it or use it as a
        context manager.
    """
    return Prefetcher(
        iterable,
        device=device,
        depth=depth,
        transfer=transfer,
        chunk_bytes=chunk_bytes,
        num_buffers=num_buffers,
        slots=slots,
        slot_bytes=slot_bytes,
        num_slots=num_slots,
        producer=producer,
    )
