"""Host <-> device transfers: ``to_device`` (pipelined H2D) and ``to_host`` (safe D2H).

``to_device`` sends pageable tensors through a ring of pinned staging chunks
(host threads fill one chunk while the DMA engine sends the previous ones), so
nothing is pinned whole and the bus runs near its limit; pinned tensors go with
one DMA. Many small tensors of a batch are packed into one staging buffer and
sent with one copy. The copies run on a per-device copy stream and the caller's
current stream waits for them, so the results are safe to use right away on
that stream. The design note is csrc/README.md, "Transfers" (and csrc/transfer/'s headers).

``to_host`` returns a :class:`HostTransfer`: the pinned host tensor is reachable
only through ``wait()``/``tensor``, which wait for the copy first. That closes
the hazard of ``cuda_tensor.to("cpu", non_blocking=True)``, whose result can be
read before the copy has landed.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch

from pinxfer import _check, _ops
from pinxfer._batch import map_tensors, tensors_in
from pinxfer._check import DeviceLike
from pinxfer._ops import plain_dense_cpu
from pinxfer._plain import plain_batch, rebuilt_batch
from pinxfer.memory import empty

#: "cuda" without an index: the operators read it as the caller's current device.
_CURRENT_CUDA = torch.device("cuda")

#: Tensors of at most this many bytes in a batch are packed together (to_device_many): the
#: size up to which the kernel stages a tensor with the calling thread alone (kSerialBytes,
#: csrc/transfer/chunk_plan.h, the one place it is written). A larger leaf gets the
#: pipeline's threads: packed, it was copied by one thread (H100: a 1 MiB batch 97 us
#: packed, its 1 MiB leaf alone 58 us).
SMALL_TENSOR_BYTES = int(_ops.fast.small_leaf_bytes)
#: The kernel's fast call; absent from a build without CUDA (the op then says why).
_FAST_TO_DEVICE = hasattr(_ops.fast, "to_device")

#: Largest staging chunk of the pipeline, and staging chunks in the ring. A tensor of up to
#: their product (64 MiB) is staged in one block, whose chunks are about a sixteenth of it
#: (at most 4 MiB); a larger one in a ring of 16 slots of 4 MiB, whose slots come free after
#: a 4 MiB DMA (the ring of 4 slots of 16 MiB before it was slower past 64 MiB: the figures
#: are in csrc/README.md, "The ring's geometry").
DEFAULT_CHUNK_BYTES = 4 << 20
DEFAULT_NUM_BUFFERS = 16


@_check.never_traced("copy_stream", "it returns a CUDA stream, made outside any graph")
def copy_stream(device: DeviceLike | None = None) -> torch.cuda.Stream:
    """The CUDA stream pinxfer's host -> device copies to ``device`` run on.

    One dedicated non-blocking stream per device, created on first use, for
    ``to_device``'s copies of more than 256 KiB (smaller ones run on your current
    stream; ``prefetch``'s batch sender copies on streams of its own workers). You
    never need it for correctness (``to_device`` makes your current stream wait for
    its copies); it is there to find the copies in a profile, or to order other work
    after them.

    Args:
        device: the CUDA device (None: the current one).

    Returns:
        The stream, as a ``torch.cuda.Stream``.
    """
    dev = _check.device(device, "copy_stream")
    if dev.type != "cuda":
        raise ValueError(f"pinxfer.copy_stream: expected a CUDA device, got {dev}")
    stream_id, device_index, device_type = _ops.copy_stream(dev)
    return torch.cuda.Stream(
        stream_id=stream_id, device_index=device_index, device_type=device_type
    )


# ---- helpers ----


# NVTX calls do something only when a tool injected its library (nsys sets
# NVTX_INJECTION64_PATH in the processes it starts); otherwise they are no-ops
# that still cost a Python call each.
NVTX_TOOL = bool(os.environ.get("NVTX_INJECTION64_PATH"))
_NO_RANGE = contextlib.nullcontext()


def profiler_range(name: str) -> contextlib.AbstractContextManager:
    """A torch.profiler range while a profiler runs, and an NVTX range under nsys.

    Neither costs anything when no profiler runs: a 4 KiB to_device takes a few
    microseconds, and a context manager generator alone costs one of them."""
    return _profiled_range(name) if profiling() else _NO_RANGE


def profiling() -> bool:
    """Whether profiler_range records a range now: a torch profiler runs or nsys does, and
    the code is not being traced (the compiled graph runs no Python to bracket)."""
    if _ops.compiling():
        return False  # checked first: tracing the profiler's query would break the graph
    return torch.autograd._profiler_enabled() or NVTX_TOOL


@contextlib.contextmanager
def _profiled_range(name: str) -> Iterator[None]:
    nvtx = NVTX_TOOL and torch.cuda.is_initialized()
    ctx = (
        torch.profiler.record_function(name)
        if torch.autograd._profiler_enabled()
        else contextlib.nullcontext()
    )
    with ctx:
        if nvtx:
            torch.cuda.nvtx.range_push(name)
        try:
            yield
        finally:
            if nvtx:
                torch.cuda.nvtx.range_pop()


def _leaf_sent_apart(sizes: list[int]) -> int:
    """Which of a batch's small leaves (their bytes, in order) is sent alone, or -1: the
    largest, where the others then pack into at most SMALL_TENSOR_BYTES and all of them
    together do not, so both sends stay on the current stream (the one rule, with its
    reasons: csrc/transfer/chunk_plan.h's leaf_sent_apart, which the fast path runs)."""
    if len(sizes) < 2:
        return -1
    align = _ops._PACK_ALIGN
    rounded = [(n + align - 1) // align * align for n in sizes]
    largest = max(range(len(sizes)), key=lambda i: (sizes[i], -i))
    total = sum(rounded)
    if total <= SMALL_TENSOR_BYTES or total - rounded[largest] > SMALL_TENSOR_BYTES:
        return -1
    return largest


def _send_leaves(
    tensors: list[torch.Tensor],
    device: torch.device,
    non_blocking: bool,
    chunk_bytes: int,
    num_buffers: int,
    staging: str = "auto",
) -> list[torch.Tensor]:
    """Each leaf to ``device``: plain CPU ones of at most SMALL_TENSOR_BYTES packed into one
    copy (the largest alone where _leaf_sent_apart says), larger ones by to_device one by
    one, the rest by ``Tensor.to``. Through the operators, so traced code sees them; a
    batch of plain CPU tensors in eager mode takes the same rule in one C++ call instead
    (``_C.send_batch_leaves``)."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    small: list[int] = []
    for i, t in enumerate(tensors):
        if t.device == device:
            out[i] = t
        elif plain_dense_cpu(t):
            if t.nbytes <= SMALL_TENSOR_BYTES:
                small.append(i)
            else:
                out[i] = _ops.to_device(t, device, chunk_bytes, num_buffers, staging)
        else:
            out[i] = t.to(device, non_blocking=non_blocking)
    apart = _leaf_sent_apart([tensors[i].nbytes for i in small])
    if apart >= 0:
        i = small.pop(apart)
        out[i] = _ops.to_device(tensors[i], device, chunk_bytes, num_buffers, staging)
    if len(small) == 1:
        out[small[0]] = _ops.to_device(tensors[small[0]], device, chunk_bytes, num_buffers, staging)
    elif small:
        packed = _ops.to_device_many([tensors[i] for i in small], device)
        for i, t in zip(small, packed):
            out[i] = t
    return out  # type: ignore[return-value]


# ---- public API ----


def to_device(
    obj: Any,
    device: DeviceLike | None = None,
    non_blocking: bool = True,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    num_buffers: int = DEFAULT_NUM_BUFFERS,
    *,
    staging: str = "auto",
) -> Any:
    """Copies a tensor or a nested batch to a GPU at bus speed.

    Pageable CPU tensors of >= 1 MiB go through a pipeline: host threads copy
    chunks (at most ``chunk_bytes`` each) into pinned staging memory while a copy
    stream sends the chunks already staged. A tensor of up to ``num_buffers *
    chunk_bytes`` is staged in one pooled block; a larger one through a ring of
    ``num_buffers`` chunks, so it is never pinned whole. Pinned CPU tensors
    (pinxfer's pool or torch's) go with one DMA. In a batch, the CPU tensors of at most
    256 KiB are packed into one staging buffer and sent with one copy; they come back
    as slices of one device allocation (where they pack into more than 256 KiB and
    would fit without the largest, that one is sent alone, so that both copies stay
    small). Non-contiguous CPU tensors are made contiguous
    on the host first, and results are contiguous. Tensors already on ``device``
    are returned as they are; tensors on another GPU, sparse, nested, quantized,
    subclassed or ``requires_grad`` tensors use ``tensor.to(device)``. Other leaves
    (numbers, strings, None, ...) pass through.

    Copies of more than 256 KiB run on pinxfer's copy stream (:func:`copy_stream`)
    and do not wait for work already queued on the caller's current stream, so they
    overlap it; the current stream waits for the copies, so the results can be used
    on it at once. Smaller ones (and each packed buffer of a batch's small tensors
    up to that size) go on the current stream itself: such a copy takes less time
    than the cross-stream hand-over would cost. To use them on another stream, make
    that stream wait on the current one and ``record_stream`` them there (as with
    any tensor). Pageable sources may be modified or freed as soon as this returns
    (they have been copied into staging memory by then). Pinned sources are read by
    the DMA engine later: they may be freed at once (their memory is kept from reuse
    until the copy is done), but writing to them before the current stream has
    passed the copy changes what is sent, as with ``tensor.to(device,
    non_blocking=True)``.

    Args:
        obj: a tensor, or a nested batch (dict/Mapping, list, tuple, namedtuple,
            dataclass) holding tensors.
        device: the target CUDA device (None: the current one). ``"cpu"`` moves
            tensors to the CPU with ``tensor.to("cpu")`` (blocking).
        non_blocking: if False, wait for the copies to finish before returning.
        chunk_bytes: largest staging chunk (default 4 MiB).
        num_buffers: staging chunks in the ring (default 16); a tensor of up to
            ``chunk_bytes * num_buffers`` is staged in one block.
        staging: how pageable bytes are staged: ``"auto"`` (per chunk: cached
            stores, nontemporal for the last 16 MiB; a tensor of up to 256 KiB, which
            the calling thread stages alone, cached above 4 KiB), ``"nt"`` (all nontemporal) or
            ``"movsb"`` (all cached). For benchmarks; ``PINXFER_STAGE_COPY``
            overrides ``"auto"``.

    Returns:
        The same structure with tensors on ``device``.

    Raises:
        RuntimeError: if pinxfer was built without CUDA or no GPU is usable.
    """
    if (
        _FAST_TO_DEVICE
        and chunk_bytes is DEFAULT_CHUNK_BYTES
        and num_buffers is DEFAULT_NUM_BUFFERS
        and staging == "auto"
        and (device is None or (type(device) is torch.device and device.type == "cuda"))
        and not _ops.compiling()
    ):
        # The hot cases, with the default settings in eager mode: straight to the kernel's
        # fast call. Their Python cost is most of a small transfer's
        # (benchmarks/diag_small_calls.py, diag_batch.py: the general path below costs a
        # 4-tensor batch about 15 us more on the H100), so nothing here that the kernel
        # checks anyway: it resolves a device without an index to the current one and
        # raises if CUDA is unusable or the stream is capturing.
        dev = _CURRENT_CUDA if device is None else device
        if type(obj) is torch.Tensor:
            # One plain CPU tensor, no mode active, no profiler running: checked in C++
            # (csrc/python/plain_calls.cpp); None otherwise, and the paths below take it,
            # the profiler's range included. Under nsys the NVTX range needs this side.
            out = (
                None
                if NVTX_TOOL
                else _ops.fast.to_device_if_plain(obj, dev, chunk_bytes, num_buffers)
            )
            if out is not None:
                if not non_blocking:
                    torch.cuda.current_stream(out.device).synchronize()
                return out
        else:
            # A batch of plain CPU tensors (a collated batch, per-step inputs): one fast call
            # sends them (the small ones packed into one copy, the others one by one;
            # prefetch's sender sends a batch with the same call) without the argument checks
            # of the general path below (which cost a batch microseconds). A flat or one-level
            # batch (a dict, list or tuple of tensors and of lists of tensors) is taken apart,
            # sent and rebuilt in one C call (to_device_batch_if_plain: None while a mode is
            # active or the profiler runs; under nsys the NVTX range needs this side): in
            # Python that was about 3.5 us on the project's machine, and Python's steps run
            # several times slower after an idle gap.
            out = (
                None
                if NVTX_TOOL
                else _ops.fast.to_device_batch_if_plain(obj, dev, chunk_bytes, num_buffers)
            )
            if out is not None:
                if not non_blocking:
                    torch.cuda.current_stream(device).synchronize()
                return out
            if _ops.eager():
                # Other batches of plain CPU tensors (deeper ones): plain_batch finds them.
                plain = plain_batch(obj)
                if plain is not None:
                    leaves, layout = plain
                    with profiler_range("pinxfer::to_device"):
                        results = _ops.fast.send_batch_leaves(
                            leaves, dev, chunk_bytes, num_buffers, staging
                        )
                    out = rebuilt_batch(obj, layout, results)
                    if not non_blocking:
                        torch.cuda.current_stream(device).synchronize()
                    return out
    chunk_bytes = _check.integer(
        chunk_bytes, "to_device", "chunk_bytes", lo=4096, hi=_check.INT64_MAX
    )
    num_buffers = _check.integer(num_buffers, "to_device", "num_buffers", lo=1, hi=_check.INT64_MAX)
    if type(obj) is torch.Tensor and plain_dense_cpu(obj):
        # One plain CPU tensor with other settings: no batch machinery either.
        dev = (
            _CURRENT_CUDA
            if device is None
            else device
            if type(device) is torch.device
            else _check.device(device, "to_device")
        )
        if dev.type == "cuda":
            _check.require_cuda("to_device")
            with profiler_range("pinxfer::to_device"):
                out = _ops.to_device(obj, dev, chunk_bytes, num_buffers, staging)
            if not non_blocking:
                torch.cuda.current_stream(out.device).synchronize()
            return out
    dev = _check.device(device, "to_device")  # a CUDA device: resolved and usable
    if dev.type == "cpu":
        return map_tensors(obj, lambda t: t.to("cpu"))
    if dev.type != "cuda":
        raise ValueError(f"pinxfer.to_device: expected a CUDA device or 'cpu', got {dev}")
    with profiler_range("pinxfer::to_device"):
        if isinstance(obj, torch.Tensor):
            out = _send_leaves([obj], dev, non_blocking, chunk_bytes, num_buffers, staging)[0]
        else:
            results = iter(
                _send_leaves(tensors_in(obj), dev, non_blocking, chunk_bytes, num_buffers, staging)
            )
            out = map_tensors(obj, lambda _t: next(results))
    if not non_blocking:
        torch.cuda.current_stream(dev).synchronize()
    return out


class HostTransfer:
    """Device -> host copies in flight, into pinned host memory.

    The host tensors are reachable only through :meth:`wait` or :attr:`tensor`,
    which first wait until the copies have finished, so they can never be read
    half-written. The pinned memory returns to pinxfer's pool when the tensors
    are freed, and is not reused before the copies are done even if this handle
    is dropped unwaited.
    """

    __slots__ = ("_done", "_events", "_result")

    def __init__(self, result: Any, events: list[torch.cuda.Event]):
        self._result = result
        self._events = events
        self._done = not events

    # Never traced, like to_host. Traced, dynamo (torch 2.11 and 2.14; variables/streams.py)
    # records an event's query as a graph node but takes the answer it got while tracing for
    # a constant in the Python around it, so a compiled ready() answered as the copies stood
    # at trace time (tests/test_transfer_gpu.py).
    @_check.never_traced("HostTransfer.ready", "it queries CUDA events when it runs")
    def ready(self) -> bool:
        """True once every copy has finished (never blocks)."""
        if not self._done:
            self._done = all(e.query() for e in self._events)
        return self._done

    @_check.never_traced("HostTransfer.wait", "it waits on CUDA events when it runs")
    def wait(self) -> Any:
        """Blocks until the copies have finished; returns the host tensor (or batch).

        Returns:
            The pinned CPU tensor, or the batch structure holding them.
        """
        if not self._done:
            with profiler_range("pinxfer::d2h_wait"):
                for e in self._events:
                    e.synchronize()
            self._done = True
        return self._result

    @property
    def tensor(self) -> Any:
        """The host result, after waiting for the copies (same as :meth:`wait`).

        Under ``torch.compile`` call :meth:`wait` instead: dynamo cannot break a graph at a
        property read, so reading ``.tensor`` in a compiled function runs that whole function
        uncompiled (correctly, in eager)."""
        return self.wait()

    def __repr__(self) -> str:
        return f"HostTransfer(ready={self.ready()})"


@_check.never_traced("to_host", "its handle waits on a CUDA event, which a graph cannot hold")
def to_host(obj: Any) -> HostTransfer:
    """Starts copying GPU tensors to pinned host memory; returns a handle to wait on.

    Each CUDA tensor is copied with ``copy_(non_blocking=True)`` on its device's
    current stream into a tensor from pinxfer's pinned pool (contiguous, same
    shape and dtype); an event recorded after the copies tells when they are done.
    CPU tensors and other leaves pass through.

    Args:
        obj: a CUDA tensor or a nested batch holding them.

    Returns:
        A :class:`HostTransfer`; call ``.wait()`` (or read ``.tensor``) to get the
        host result once it is complete.

    Under ``torch.compile`` it is not traced: its handle waits on a CUDA event, which a
    graph cannot hold. Without ``fullgraph=True`` the graph breaks at the call, which runs
    as in eager; with it, the compile raises, naming this function.

    Raises:
        RuntimeError: if pinxfer was built without CUDA or no GPU is usable, or a
            tensor's device is capturing a CUDA graph, or when traced (above).
        ValueError: for a sparse, nested or quantized CUDA tensor (``t.to("cpu")``
            copies those), before any copy is queued.
    """
    _check.require_cuda("to_host")
    leaves = tensors_in(obj)
    devices: set[torch.device] = set()
    for t in leaves:
        if t.device.type != "cuda":
            continue
        if t.layout != torch.strided or t.is_nested or t.is_quantized:
            kind = "nested" if t.is_nested else "quantized" if t.is_quantized else t.layout
            raise ValueError(
                f"pinxfer.to_host: expected dense CUDA tensors, got a {kind} one "
                f"({tuple(t.shape) if not t.is_nested else 'nested'}, {t.dtype}); copy "
                "it with t.to('cpu') instead"
            )
        devices.add(t.device)
    # Every device's current stream is asked before any copy is queued (the current device's
    # alone let a tensor of another GPU whose stream captured be copied into the capture).
    for d in devices:
        with torch.cuda.device(d):
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"pinxfer.to_host: called while {d}'s current stream is capturing a graph; "
                    "its handle waits on an event that a capture never records, so it cannot "
                    "be captured. Inside the capture copy into a pinned buffer allocated "
                    "before it (`host_buf.copy_(t, non_blocking=True)`), and read host_buf "
                    "after `graph.replay()` and `torch.cuda.current_stream().synchronize()`."
                )
    streams: dict[torch.device, torch.cuda.Stream] = {}

    def copy_one(t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "cuda":
            return t
        with torch.cuda.device(t.device):
            # torch's copy_ into pinned memory with non_blocking=True applies a conjugate or
            # negative bit on the host right after queuing the copy, before its bytes land,
            # which then overwrite it (pytorch issue 146286; found by review, session 43):
            # resolved here on the GPU, in the stream's order, the copy moves final values.
            if t.is_conj():
                t = t.resolve_conj()
            if t.is_neg():
                t = t.resolve_neg()
            # numa_node=None: the pool of this GPU's node (the current device now).
            host = empty(tuple(t.shape), dtype=t.dtype)
            stream = torch.cuda.current_stream(t.device)
            if host.numel() > 0:
                # Before the copy is queued, so no interrupt between them frees the block
                # with its use unrecorded. The op itself: host is a pool tensor made just
                # above and stream a torch.cuda.Stream, what the public record_stream checks,
                # and to_host already runs outside dynamo (never_traced), which record_stream
                # would enter again for each leaf.
                _ops.record_stream(host, stream.stream_id, stream.device_index, stream.device_type)
            host.copy_(t, non_blocking=True)
        streams[t.device] = stream
        return host

    with profiler_range("pinxfer::d2h"):
        # The batch is walked once more only to rebuild it around the copies.
        copies = iter([copy_one(t) for t in leaves])
        result = map_tensors(obj, lambda _t: next(copies))
        events = []
        for stream in streams.values():
            ev = torch.cuda.Event()
            ev.record(stream)
            events.append(ev)
    return HostTransfer(result, events)
