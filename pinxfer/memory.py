"""The pinned staging allocator: pool tensors, stream marks, cap, stats.

Thin typed wrappers over ``torch.ops.pinxfer``; the design note is
``csrc/README.md``.
"""
from __future__ import annotations

import collections
from typing import NamedTuple, Optional, Sequence, Union

import torch

from pinxfer._ops import eager as _eager
from pinxfer._ops import fast as _fast
from pinxfer._ops import ops as _ops

StreamLike = Union[torch.cuda.Stream, torch.Stream]


class BuildInfo(NamedTuple):
    with_cuda: bool  # compiled with the CUDA paths
    cuda_version: str  # toolkit the extension was compiled with, "" if none
    cuda_usable: bool  # a CUDA device can be used by this process right now


def build_info() -> BuildInfo:
    """What the extension was built with and whether CUDA is usable now."""
    return BuildInfo(*_ops.build_info())


# True once torch's CUDA state is initialised, or once pinxfer knows it cannot use
# CUDA in this process (then nothing is registered with CUDA and there is nothing to
# initialise). Checked on every pinning call; _ensure_torch_cuda() runs once.
_torch_cuda_ready = False


def _ensure_torch_cuda() -> None:
    """Leaves torch in the state its own pinning leaves it in.

    torch answers ``Tensor.is_pinned()`` (``Context::isPinnedPtr``) False for every
    pointer until its CUDA state is initialised, and ``Tensor.pin_memory()`` /
    ``torch.empty(pin_memory=True)`` initialise it. pinxfer registers memory with
    CUDA itself, so in a fresh process its tensors would read as not pinned. The
    first pinxfer call that pins while CUDA is usable therefore runs
    ``torch.cuda.init()``: torch's Python lazy init, which also arms torch's
    checks against using CUDA in a forked child. ``import pinxfer`` never gets here;
    a forked child (where pinxfer never uses CUDA) never initialises it.
    """
    global _torch_cuda_ready
    if _ops.build_info()[2] and not torch.cuda.is_initialized():
        torch.cuda.init()
    _torch_cuda_ready = True


def _size_tuple(size: Sequence[int] | tuple) -> list[int]:
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = size[0]
    out = []
    for d in size:
        if not isinstance(d, int) or isinstance(d, bool):
            raise TypeError(f"pinxfer.empty: sizes must be ints, got {type(d).__name__} in {size!r}")
        if d < 0:
            raise ValueError(f"pinxfer.empty: sizes must be non-negative, got {list(size)}")
        out.append(int(d))
    return out


def empty(*size: int, dtype: Optional[torch.dtype] = None, numa_node: Optional[int] = None) -> torch.Tensor:
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
        dtype: element type (default: ``torch.get_default_dtype()``).
        numa_node: NUMA node for the pages. None: the current GPU's node; -1: no binding.
    """
    dims = _size_tuple(size)
    if not _torch_cuda_ready:
        _ensure_torch_cuda()
    if _eager():
        return _fast.empty(dims, dtype or torch.get_default_dtype(), numa_node)
    return _ops.empty(dims, dtype or torch.get_default_dtype(), numa_node)


def record_stream(tensor: torch.Tensor, stream: Optional[StreamLike] = None) -> None:
    """Marks that CUDA work queued on ``stream`` (default: the current stream) reads
    or writes ``tensor``, a pool tensor. Its block is not handed out again before
    that work completes. pinxfer's own copies call this themselves; call it when
    you copy with torch on a side stream (torch tells only its installed host
    allocator about ``copy_(non_blocking=True)``; see :func:`install`)."""
    if stream is None:
        stream = torch.cuda.current_stream()
    _ops.record_stream(tensor, stream.stream_id, stream.device_index, stream.device_type)


def is_pool_tensor(tensor: torch.Tensor) -> bool:
    """True if ``tensor``'s storage is a live block of pinxfer's pool."""
    return bool(_ops.is_pool_tensor(tensor))


def lock_kind(tensor: torch.Tensor) -> str:
    """How a pool tensor's memory is locked: ``cuda_registered``, ``mlocked`` or ``pageable``."""
    return str(_ops.lock_kind(tensor))


def memory_stats(numa_node: Optional[int] = None) -> "collections.OrderedDict[str, int]":
    """Counters of the pinned pool, shaped like ``torch.cuda.memory_stats()``.

    Keys (bytes are exact): ``requested_bytes`` (what live tensors asked for),
    ``allocated_bytes`` (their rounded blocks), ``reserved_bytes`` (pinned from
    the OS), ``cached_bytes`` (reserved but not allocated), ``active_blocks``,
    ``pending_blocks`` (freed, waiting on CUDA events), ``segments``, each with
    ``.current`` and ``.peak``; ``reserved_bytes.{cuda_registered,mlocked,pageable}``;
    counts ``num_allocs``, ``num_frees``, ``num_cache_hits``, ``num_cache_misses``,
    ``num_segment_maps``, ``num_segment_unmaps``, ``num_ooms``, ``num_event_waits``,
    ``num_fenced_frees``, ``num_event_errors``; times in ns ``pin_time_ns`` (=
    ``map_time_ns`` + ``touch_time_ns`` + ``lock_time_ns``) and ``unpin_time_ns``.

    Args:
        numa_node: one node's pool; None sums all pools (peaks then add up per
            pool, an upper bound of the process peak).
    """
    names, values = _ops.memory_stats(numa_node)
    return collections.OrderedDict(zip(names, values))


def reset_peak_memory_stats() -> None:
    """Sets every ``.peak`` counter to its ``.current`` value."""
    _ops.reset_peak_stats()


def reset_accumulated_memory_stats() -> None:
    """Zeroes the ``num_*`` counters and the timers."""
    _ops.reset_accumulated_stats()


def empty_cache() -> int:
    """Returns every fully free cached segment to the OS; returns the bytes released.
    Blocks still in use, or waiting on CUDA events, are kept."""
    return int(_ops.empty_cache())


def set_max_pinned_bytes(limit: Union[int, str]) -> None:
    """Hard cap on pinned bytes reserved by all pools (0: no cap). Accepts ints or
    strings like ``"8GiB"``. Past the cap an allocation first frees cached
    segments, then waits for in-flight copies, then raises
    ``torch.OutOfMemoryError``. Default: ``PINXFER_MAX_PINNED_BYTES`` or no cap."""
    if isinstance(limit, str):
        from pinxfer._util import parse_bytes

        limit = parse_bytes(limit)
    _ops.set_max_pinned_bytes(int(limit))


def get_max_pinned_bytes() -> int:
    """The cap in bytes (0: no cap)."""
    return int(_ops.max_pinned_bytes())


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
    copies on side streams)."""
    if not _ops.install_host_allocator(True):
        raise RuntimeError(
            "pinxfer.install(): this pinxfer was built without CUDA, so there is no CUDA host "
            "allocator to replace. Rebuild against a CUDA build of torch with a CUDA toolkit."
        )


def uninstall() -> None:
    """Gives torch its own CUDA host allocator back."""
    _ops.install_host_allocator(False)


def is_installed() -> bool:
    """True while pinxfer's pool is torch's CUDA host allocator."""
    return bool(_ops.host_allocator_installed())
