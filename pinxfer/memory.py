"""The pinned staging allocator: pool tensors, stream marks, cap, stats.

The functions that are an operator as they stand come from pinxfer/_ops.py;
those with Python-side argument handling are here. The design note is
``csrc/README.md``.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from pinxfer import _ops

# The functions that are their operator, re-exported as the public API.
from pinxfer._ops import (  # noqa: F401
    BuildInfo,
    build_info,
    cuda_unavailable_reason,
    empty_cache,
    get_max_pinned_bytes,
    install,
    is_installed,
    is_pool_tensor,
    lock_kind,
    memory_stats,
    reset_accumulated_memory_stats,
    reset_peak_memory_stats,
    uninstall,
)
from pinxfer._ops import parse_byte_size as parse_bytes

__all__ = [
    "BuildInfo", "build_info", "cuda_unavailable_reason", "empty", "empty_cache",
    "get_max_pinned_bytes", "install", "is_installed", "is_pool_tensor", "lock_kind",
    "memory_stats", "record_stream", "reset_accumulated_memory_stats", "reset_peak_memory_stats",
    "set_max_pinned_bytes", "uninstall",
]

StreamLike = Union[torch.cuda.Stream, torch.Stream]


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
    if not _ops.torch_cuda_ready:
        _ops.ensure_torch_cuda()
    if _ops.eager():
        return _ops.fast.empty(dims, dtype or torch.get_default_dtype(), numa_node)
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


def set_max_pinned_bytes(limit: Union[int, str]) -> None:
    """Hard cap on pinned bytes reserved by all pools (0: no cap). Accepts ints or
    strings like ``"8GiB"``. Past the cap an allocation first frees cached
    segments, then waits for in-flight copies, then raises
    ``torch.OutOfMemoryError``. Default: ``PINXFER_MAX_PINNED_BYTES`` or no cap."""
    if isinstance(limit, str):
        limit = parse_bytes(limit)
    _ops.set_max_pinned_bytes(int(limit))
