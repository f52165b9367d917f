"""The pinned staging allocator: pool tensors, stream marks, cap, stats.

The functions that are an operator as they stand come from pinxfer/_ops.py;
those with Python-side argument handling are here. The design note is
``csrc/README.md``.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import torch

from pinxfer import _check, _ops

# The functions that are their operator, re-exported as the public API (build_info and
# cuda_unavailable_reason answer at trace time: _ops.py). empty's hot path reads compiling and
# fast as module globals: one lookup each.
from pinxfer._ops import BuildInfo, build_info, compiling, cuda_unavailable_reason, fast

__all__ = [
    "BuildInfo",
    "build_info",
    "cuda_unavailable_reason",
    "empty",
    "empty_cache",
    "get_max_pinned_bytes",
    "install",
    "is_installed",
    "is_pool_tensor",
    "lock_kind",
    "memory_stats",
    "record_stream",
    "reset_accumulated_memory_stats",
    "reset_peak_memory_stats",
    "set_max_pinned_bytes",
    "uninstall",
]

StreamLike = torch.cuda.Stream | torch.Stream

# The pool's state calls act on the process's pools (or torch's allocator) when they run, so
# torch.compile calls them and never traces them (_check.never_traced): fullgraph=True fails
# naming the call and why, and without it the graph breaks at the call. (Until session 55 each
# failed under fullgraph with dynamo's "Attempted to call function marked as skipped" and its
# advice to wrap a C extension in a custom operator, and warned so without it.) Each is a def
# of this module, so that pickle finds it here (a DataLoader's worker_init_fn, spawn).
_RESETS_COUNTERS = "it resets the pools' counters when it runs"


def _sizes(size: tuple) -> Sequence[int]:
    """``empty``'s sizes (``*size``: ints, or one sequence of them) as one sequence of
    non-negative ints. Checked in one pass without a copy when every size is an exact int
    (the usual call: a few hundred ns less per ``empty``); anything else, int subclasses
    included, goes to :func:`_checked_sizes`."""
    if (
        len(size) == 1
        and type(size[0]) is not int
        and isinstance(size[0], (tuple, list, torch.Size))
    ):
        size = size[0]
    for d in size:
        if type(d) is not int or not 0 <= d <= _check.INT64_MAX:
            return _checked_sizes(size)
    return size


def _checked_sizes(size: Sequence) -> list[int]:
    out = []
    for d in size:
        if not isinstance(d, int) or isinstance(d, bool):
            raise TypeError(
                f"pinxfer.empty: sizes must be ints, got {type(d).__name__} in {size!r}"
            )
        if not 0 <= d <= _check.INT64_MAX:
            raise ValueError(
                f"pinxfer.empty: sizes must be non-negative and at most 2**63 - 1, got {list(size)}"
            )
        out.append(int(d))
    return out


def empty(
    *size: int, dtype: torch.dtype | None = None, numa_node: int | None = None
) -> torch.Tensor:
    """A CPU tensor whose memory comes from pinxfer's page-locked pool.

    Like ``torch.empty(size, pin_memory=True)``: contents are uninitialised,
    ``is_pinned()`` is True when a CUDA device is usable (the memory is
    cudaHostRegister'ed; without CUDA it is mlock'ed), and, as torch's pinned
    factory does, the first call initialises torch's CUDA state where CUDA is
    usable (``torch.cuda.init()``). The memory returns to the
    pool when the tensor is freed, and is reused only after the CUDA work
    recorded against it has finished (see :func:`record_stream`).

    Args:
        size: the shape, as ints or one sequence.
        dtype: element type (default: ``torch.get_default_dtype()``); not a quantized one.
        numa_node: NUMA node for the pages. None: the current GPU's node; -1: no binding;
            else a node of this machine (:func:`pinxfer.numa_nodes`).

    Raises:
        TypeError: a size is not an int, ``dtype`` is not a plain torch.dtype, or
            ``numa_node`` is not an int.
        ValueError: a size is negative, the byte count exceeds 2**63 - 1, or
            ``numa_node`` names no node of this machine.
        torch.OutOfMemoryError: the memory cannot be had (cap, OS).
    """
    eager = not compiling()
    if eager and numa_node is None:
        # The usual call, checked in C++ (empty_hot, csrc/python/plain_calls.cpp): None
        # before torch's CUDA state is ready, in a forked child, while a mode is active, or
        # where a size or the dtype needs the checks below.
        out = fast.empty_hot(size, dtype)
        if out is not None:
            return out
    # Traced (torch.compile), torch's CUDA state is not initialised here: dynamo cannot trace
    # the C call that opens the hot paths after it, and a compiled program that uses CUDA has
    # initialised it.
    if eager and not _ops.torch_cuda_ready and not _ops.traced():
        _ops.ensure_torch_cuda()
    dims = _sizes(size)
    dt = torch.get_default_dtype() if dtype is None else _check.dtype(dtype, "empty")
    if numa_node is not None:
        numa_node = _check.numa_node(numa_node, "empty")
    out = fast.empty_if_eager(dims, dt, numa_node) if eager else None
    return _ops.empty(dims, dt, numa_node) if out is None else out


def is_pool_tensor(tensor: torch.Tensor) -> bool:
    """True if ``tensor``'s storage is a live block of pinxfer's pool.

    Raises:
        TypeError: ``tensor`` is not a tensor.
        ValueError: ``tensor`` is sparse, nested or meta (no storage of its own to ask about).
    """
    return _ops.is_pool_tensor(_check.tensor(tensor, "is_pool_tensor"))


def lock_kind(tensor: torch.Tensor) -> str:
    """How a pool tensor's memory is locked: ``cuda_registered``, ``mlocked`` or ``pageable``.

    Raises:
        TypeError: ``tensor`` is not a tensor.
        ValueError: ``tensor`` is sparse, nested or meta.
        RuntimeError: ``tensor`` is not a pool tensor.
    """
    return _ops.lock_kind(_check.tensor(tensor, "lock_kind"))


@_check.never_traced("memory_stats", "it reads the pools' counters when it runs")
def memory_stats(numa_node: int | None = None) -> collections.OrderedDict[str, int]:
    """Counters of the pinned pool, shaped like ``torch.cuda.memory_stats()``.

    Keys (bytes are exact): ``requested_bytes`` (what live tensors asked for),
    ``allocated_bytes`` (their rounded blocks), ``reserved_bytes`` (pinned from
    the OS), ``cached_bytes`` (reserved but not allocated), ``active_blocks``,
    ``pending_blocks`` (freed, waiting on CUDA events), ``segments``, each with
    ``.current`` and ``.peak``; ``reserved_bytes.{cuda_registered,mlocked,pageable}``;
    counts ``num_allocs``, ``num_frees``, ``num_cache_hits``, ``num_cache_misses``,
    ``num_segment_maps``, ``num_segment_unmaps``, ``num_ooms``, ``num_event_waits``,
    ``num_fenced_frees``, ``num_fence_markers`` (one event per fence batch of up to 8
    fenced small frees, or small staging blocks sent on the default stream),
    ``num_idle_reclaims`` (fence batches ``pin_memory`` took back at once, their stream
    found idle), ``num_event_errors``; times in ns ``pin_time_ns`` (=
    ``map_time_ns`` + ``touch_time_ns`` + ``lock_time_ns``) and ``unpin_time_ns``.

    Args:
        numa_node: one node's pool (-1: the unbound pool; else a node of this
            machine); None sums all pools (peaks then add up per pool, an upper
            bound of the process peak).
    """
    return _ops.memory_stats(_check.numa_node(numa_node, "memory_stats"))


@_check.never_traced("reset_peak_memory_stats", _RESETS_COUNTERS)
def reset_peak_memory_stats() -> None:
    """Sets every ``.peak`` counter to its ``.current`` value."""
    _ops.reset_peak_memory_stats()


@_check.never_traced("reset_accumulated_memory_stats", _RESETS_COUNTERS)
def reset_accumulated_memory_stats() -> None:
    """Zeroes the ``num_*`` counters and the timers."""
    _ops.reset_accumulated_memory_stats()


@_check.never_traced("empty_cache", "it returns cached memory to the OS when it runs")
def empty_cache() -> int:
    """Returns every fully free cached segment to the OS; returns the bytes released.
    Blocks still in use, or waiting on CUDA events, are kept. Small blocks freed with no
    recorded use (without ``install()``) wait in their stream's fence batch: this call
    records the batches' events and waits for them first, so it returns once the work
    queued on those streams before it is done."""
    return _ops.empty_cache()


@_check.never_traced("install", "it replaces torch's host allocator when it runs")
def install() -> None:
    """Makes pinxfer's pool torch's CUDA host allocator.

    Afterwards ``Tensor.pin_memory()``, ``torch.empty(..., pin_memory=True)``, the
    DataLoader's pin thread and the event that ``copy_(non_blocking=True)``
    records all go to pinxfer's pool. Undo with :func:`uninstall`. Tensors
    allocated before either call stay valid, and copies of tensors that torch's
    own allocator pinned before ``install()`` are still reported to it.

    Call it at start-up, before other threads copy: torch swaps its allocator
    pointer without a lock. After :func:`uninstall`, torch reports copies only to
    its own allocator again, so a pool tensor made while installed is then
    protected like any pool tensor (fence on free; :func:`record_stream` for
    copies on side streams).

    Raises:
        RuntimeError: this pinxfer was built without CUDA (no CUDA host allocator to replace),
            or the current stream is capturing a CUDA graph (install before capturing).
    """
    _ops.install()


@_check.never_traced("uninstall", "it gives torch its host allocator back when it runs")
def uninstall() -> None:
    """Gives torch its own CUDA host allocator back."""
    _ops.uninstall()


@_check.never_traced("is_installed", "it answers for torch's host allocator as it is when it runs")
def is_installed() -> bool:
    """True while pinxfer's pool is torch's CUDA host allocator."""
    return _ops.is_installed()


@_check.never_traced(
    "record_stream", "it records the stream current when it runs, not when a graph was traced"
)
def record_stream(tensor: torch.Tensor, stream: StreamLike | None = None) -> None:
    """Marks that CUDA work queued on ``stream`` (default: the current stream) reads
    or writes ``tensor``, a pool tensor. Its block is not handed out again before
    that work completes. pinxfer's own copies call this themselves; call it when
    you copy with torch on a side stream (torch tells only its installed host
    allocator about ``copy_(non_blocking=True)``; see :func:`install`).

    Raises:
        TypeError: ``tensor`` is not a tensor, or ``stream`` is not a stream.
        ValueError: ``tensor`` is sparse, nested or meta.
        RuntimeError: no CUDA device is usable, or ``tensor`` is not a pool tensor.
    """
    _check.tensor(tensor, "record_stream")
    if stream is None:
        _check.require_cuda("record_stream")
        stream = torch.cuda.current_stream()
    elif not isinstance(stream, (torch.cuda.Stream, torch.Stream)):
        raise TypeError(
            f"pinxfer.record_stream: stream must be a torch.cuda.Stream (or None: "
            f"the current stream), got {type(stream).__name__}"
        )
    _ops.record_stream(tensor, stream.stream_id, stream.device_index, stream.device_type)


@_check.never_traced("set_max_pinned_bytes", "it sets the cap when it runs")
def set_max_pinned_bytes(limit: int | str) -> None:
    """Hard cap on pinned bytes reserved by all pools (0: no cap). Accepts ints or
    strings like ``"8GiB"``. Past the cap an allocation first frees cached
    segments, then waits for in-flight copies, then raises
    ``torch.OutOfMemoryError``. Default: ``PINXFER_MAX_PINNED_BYTES`` or no cap.

    Raises:
        TypeError: ``limit`` is not an int or a string (a float or bool is refused:
            ``0.5`` or ``True`` would otherwise mean a cap nobody asked for).
        ValueError: ``limit`` is negative, above 2**63 - 1, malformed, or a string
            that rounds to 0 bytes.
    """
    _ops.set_max_pinned_bytes(_check.byte_count(limit, "set_max_pinned_bytes", "limit"))


@_check.never_traced(
    "get_max_pinned_bytes", "it reads the cap, which set_max_pinned_bytes changes, when it runs"
)
def get_max_pinned_bytes() -> int:
    """The cap in bytes (0: no cap)."""
    return _ops.get_max_pinned_bytes()
