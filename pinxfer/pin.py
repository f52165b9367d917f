"""NUMA-aware, multi-threaded ``pin_memory`` and in-place pinning.

:func:`pin_memory` is a drop-in for ``Tensor.pin_memory()`` and for the
DataLoader's batch pinning: the copy runs in C++ on the persistent thread pool
of the target NUMA node, outside the GIL (``torch.ops`` releases it), into
memory from pinxfer's pool bound to that node. :func:`pin_` / :func:`unpin_`
page-lock an existing tensor's memory without copying.
"""

from __future__ import annotations

from typing import Any

import torch

from pinxfer import _batch, _check, _ops
from pinxfer._check import DeviceLike

# The in-place query is its operator as it stands.
from pinxfer._ops import (
    compiling,
    dense_layout,
    eager,
    fast,
    in_bad_fork,
    inplace_lock_kind,
    plain_dense_cpu,
)
from pinxfer._plain import plain_batch, rebuilt_batch

__all__ = ["inplace_lock_kind", "is_pinned", "pin_", "pin_memory", "unpin_"]


def _node_for(device: DeviceLike | None, numa_node: int | None) -> int | None:
    if device is not None and numa_node is not None:
        raise ValueError(
            f"pinxfer.pin_memory: pass device or numa_node, not both (got device={device!r}, "
            f"numa_node={numa_node!r})"
        )
    if numa_node is not None:
        return _check.numa_node(numa_node, "pin_memory")
    if device is None:
        return None  # C++ resolves the current GPU's node
    dev = _check.as_device(device)
    if dev.type != "cuda":
        raise ValueError(
            f"pinxfer.pin_memory: device names the GPU the batch is going to, so it must be a "
            f"CUDA device (e.g. 0, 'cuda:1'); got {dev}"
        )
    if dev.index is None:
        return None
    return _ops.numa_node_for_device(dev.index)


def _threads(num_threads: int | None) -> int:
    if num_threads is None:
        return 0
    return _check.integer(
        num_threads,
        "pin_memory",
        "num_threads",
        lo=0,
        hi=_check.INT64_MAX,
        hint=" (0 or None: the pool's default)",
    )


def _torch_is_pinned(tensor: torch.Tensor) -> bool:
    return False if in_bad_fork() else bool(tensor.is_pinned())


def is_pinned(tensor: torch.Tensor) -> bool:
    """True if ``tensor``'s memory is page-locked by torch, CUDA, pinxfer's pool or
    :func:`pin_`.

    Unlike ``Tensor.is_pinned()`` this also counts memory pinxfer mlock'ed where
    no CUDA device is usable; a pool block that could not be locked at all (the
    memlock limit refused, see :func:`pinxfer.lock_kind`) answers False. Tensors
    on a device answer False. For layouts pinxfer hands to torch (sparse, nested,
    quantized) this is ``Tensor.is_pinned()``. In a forked child of a process that
    used CUDA, torch's answer is taken as False (torch cannot query CUDA there).

    Raises:
        TypeError: ``tensor`` is not a tensor.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"pinxfer.is_pinned: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        return False
    if not dense_layout(tensor):
        return _torch_is_pinned(tensor)
    if type(tensor) is torch.Tensor and eager():
        return fast.is_pinned(tensor, not in_bad_fork())
    if _torch_is_pinned(tensor):
        return True
    if _ops.is_pool_tensor(tensor):
        # A pool block is locked unless locking failed (memlock limit): 'pageable'.
        return _ops.lock_kind(tensor) != "pageable"
    return _ops.inplace_lock_kind(tensor) is not None


class _PinMemoryGrad(torch.autograd.Function):
    """Keeps ``pin_memory`` differentiable, as ``Tensor.pin_memory()`` is: the
    gradient passes through unchanged."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, node: int | None, threads: int) -> torch.Tensor:
        return _ops.pin_memory(tensor, node, threads)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # type: ignore[override]
        return grad, None, None


def _torch_refusal(tensor: torch.Tensor) -> str:
    """torch's own error for pinning this tensor, word for word: code written against
    ``Tensor.pin_memory()`` matches it ("cannot pin 'torch.cuda.FloatTensor' only dense CPU
    tensors can be pinned"). torch refuses every tensor that is not on the CPU, before any
    copy; the fallback spells the same words should a torch ever not refuse."""
    try:
        tensor.pin_memory()
    except Exception as err:  # noqa: BLE001 - whatever torch raises, its words are wanted
        return str(err).strip()
    return f"cannot pin '{tensor.type()}' only dense CPU tensors can be pinned"


def _pin_tensor(tensor: torch.Tensor, node: int | None, threads: int) -> torch.Tensor:
    if tensor.device.type != "cpu":
        raise RuntimeError(
            f"pinxfer.pin_memory: expected a CPU tensor, got a tensor on {tensor.device}. Only "
            "host memory can be pinned; a tensor already on a device needs no pinning. "
            f"torch says: {_torch_refusal(tensor)}"
        )
    if not dense_layout(tensor):
        # torch's own pin: same result, and where torch raises, torch's error. It
        # returns the tensor itself if it is already pinned.
        return _torch_pin(tensor)
    # Traced (torch.compile), a graph cannot branch on whether this memory is pinned (its
    # state when the graph runs, not when it is traced): the result is always a pinned copy,
    # and torch's CUDA state is not initialised here (memory.empty says why).
    if not _ops.traced():
        if is_pinned(tensor):
            return tensor
        if not _ops.torch_cuda_ready:
            _ops.ensure_torch_cuda()
    if tensor.requires_grad and torch.is_grad_enabled():
        return _PinMemoryGrad.apply(tensor, node, threads)
    return _ops.pin_memory(tensor, node, threads)


def _torch_pin(tensor: torch.Tensor) -> torch.Tensor:
    """``Tensor.pin_memory()`` for the layouts pinxfer hands to torch. Without a
    usable CUDA device torch's refusal talks about drivers ("Found no NVIDIA
    driver"); it is raised as a RuntimeError that says which tensor needed what."""
    try:
        return tensor.pin_memory()
    except RuntimeError as err:
        reason = _ops.cuda_unavailable_reason()
        if reason is None:
            raise
        kind = (
            "nested"
            if tensor.is_nested
            else "quantized"
            if tensor.is_quantized
            else str(tensor.layout).replace("torch.", "")
        )
        raise RuntimeError(
            f"pinxfer.pin_memory: a {kind} tensor is pinned by torch's Tensor.pin_memory(), "
            f"which needs a usable CUDA device, but {reason}. Leave it unpinned here, or pin "
            f"a dense tensor (e.g. t.to_dense()); torch said: {err}"
        ) from err


def _has_own_pin(obj: Any) -> bool:
    return not isinstance(obj, torch.Tensor) and callable(getattr(type(obj), "pin_memory", None))


def _pin_by_itself(obj: Any) -> Any:
    """Objects with their own ``pin_memory()`` are asked to pin themselves."""
    return obj.pin_memory() if _has_own_pin(obj) else _batch.PASS


def _pin_many(dense: list, node: int | None, threads: int) -> list | None:
    """Plain dense CPU tensors pinned in one C++ call; None if that raised (the caller then
    pins them one by one, for an error that names the tensor's place in the batch)."""
    if not _ops.torch_cuda_ready:
        _ops.ensure_torch_cuda()
    try:
        return fast.pin_memory_many(dense, node, threads, not in_bad_fork())
    except Exception:  # noqa: BLE001 - pinned one by one by the caller
        return None


def _pin_batch(obj: Any, node: int | None, threads: int) -> Any:
    """Pins every tensor of a batch. The plain dense CPU tensors go to C++ in one
    call (fast path); the rest one by one through :func:`_pin_tensor`."""
    if eager():
        # A flat or one-level batch of plain CPU tensors (most collated batches): found
        # and rebuilt without the walker (pinxfer/_plain.py). Not a batch the walker
        # must take (walk=False): pinning asks an object with its own pin_memory() to pin
        # itself, where plain_batch's walk would look into it.
        # If that one call raises, the tensors are pinned one by one below (not offered to
        # the walker's call, which would raise again).
        plain = plain_batch(obj, min_leaves=1, walk=False)
        if plain is not None:
            pinned = _pin_many(plain[0], node, threads)
            if pinned is not None:
                return rebuilt_batch(obj, plain[1], pinned)
        else:
            leaves = _batch.tensors_in(obj, other=_has_own_pin)
            # Per leaf, in the order map_tensors visits them: one C++ call when all are
            # plain (the Python predicate costs about 0.6 us a leaf), else leaf by leaf.
            if fast.plain_leaves_max_bytes(leaves) >= 0:
                is_dense = [True] * len(leaves)
                dense = leaves
            else:
                is_dense = [plain_dense_cpu(t) for t in leaves]
                dense = [t for t, d in zip(leaves, is_dense) if d]
            pinned = _pin_many(dense, node, threads) if dense else None
            if pinned is not None:
                pinned_in_order = iter(pinned)
                dense_flags = iter(is_dense)

                def take(t: torch.Tensor) -> torch.Tensor:
                    if next(dense_flags):
                        return next(pinned_in_order)
                    return _pin_tensor(t, node, threads)

                return _batch.map_tensors(obj, take, other=_pin_by_itself, describe=_with_path)
    return _batch.map_tensors(
        obj, lambda t: _pin_tensor(t, node, threads), other=_pin_by_itself, describe=_with_path
    )


def _with_path(err: Exception, path: str) -> Exception:
    inner = str(err)
    prefix = "pinxfer.pin_memory: "
    if inner.startswith(prefix):
        inner = inner[len(prefix) :]
    text = f"pinxfer.pin_memory: cannot pin {path}: {inner}"
    try:
        return type(err)(text)
    except Exception:  # noqa: BLE001 - exception types with unusual constructors
        return RuntimeError(text)


def pin_memory(
    obj: Any,
    device: DeviceLike | None = None,
    num_threads: int | None = None,
    *,
    numa_node: int | None = None,
) -> Any:
    """Copies a tensor, or every tensor of a nested batch, into page-locked memory.

    Same results as ``Tensor.pin_memory()``: equal values bit for bit, same sizes
    and strides (storage offset 0), an already-pinned tensor comes back as the
    same object, and ``Tensor.is_pinned()`` is True for the result where CUDA is
    usable (the first call initialises torch's CUDA state there, as torch's own
    pin does). Tensors pinxfer does not pin itself -- sparse (COO, CSR, CSC, BSR,
    BSC), nested (strided or jagged) and quantized ones -- are pinned by
    ``Tensor.pin_memory()`` (torch's allocator; ``device``, ``numa_node`` and
    ``num_threads`` do not apply), with torch's result or torch's error.
    Differences for dense tensors: the memory comes from pinxfer's pool on the GPU's NUMA
    node; the copy is split over that node's persistent threads (fast from a
    DataLoader pin thread with ``torch.set_num_threads(1)``); an internally
    overlapping view (e.g. ``expand``), which torch refuses, gives a contiguous
    copy.

    Under ``torch.compile`` the result is always a pinned copy, an already-pinned
    input included: a graph cannot branch on the memory's state when it runs.

    Batches: Mappings (type kept, e.g. OrderedDict, defaultdict), namedtuples,
    tuples, lists, dataclasses (frozen ones too; torch's DataLoader skips them)
    are rebuilt around pinned tensors; objects with their own ``pin_memory()``
    method are asked to pin themselves; other leaves come back untouched. An
    error inside a batch names where it happened, e.g. ``batch['x'][2]``.

    Args:
        obj: a CPU tensor or a nested batch of them.
        device: the CUDA device (index, ``'cuda:1'``, ``torch.device``) the batch is
            going to; memory goes to its NUMA node. None: the current device.
        num_threads: most threads for each copy; None or 0: the pool's default
            (the node's share of the process's copy threads: ``PINXFER_NUM_THREADS``,
            else 3/4 of its CPUs, at most 16, split among the NUMA nodes by their CPUs).
        numa_node: place memory on this NUMA node instead (-1: no binding).
            Exclusive with ``device``.

    Returns:
        The same structure with every tensor pinned.
    """
    if device is None and num_threads is None and numa_node is None and not compiling():
        # The usual call (one plain dense CPU tensor, defaults, eager, torch's CUDA state
        # initialised, no mode active): straight to C++, which decides (pin_memory_hot,
        # csrc/python/plain_calls.cpp; None for any other call). The path below costs it
        # 0.1-0.2 us more, about what x.pin_memory() of 64 KiB was ahead by.
        out = fast.pin_memory_hot(obj)
        if out is not None:
            return out
    node = None if device is None and numa_node is None else _node_for(device, numa_node)
    threads = 0 if num_threads is None else _threads(num_threads)
    if type(obj) is torch.Tensor:
        if not _ops.traced():
            if not _ops.torch_cuda_ready:
                _ops.ensure_torch_cuda()
            # None unless a plain dense CPU tensor with no mode active: the checks of
            # plain_dense_cpu and eager() made in C++ (csrc/python/plain_calls.cpp).
            out = fast.pin_memory_if_plain(obj, node, threads, not in_bad_fork())
            if out is not None:
                return out
        return _pin_tensor(obj, node, threads)
    if isinstance(obj, torch.Tensor):
        return _pin_tensor(obj, node, threads)
    return _pin_batch(obj, node, threads)


@_check.never_traced(
    "pin_", "it page-locks the memory of the tensor it is given, in place, when it runs"
)
def pin_(tensor: torch.Tensor) -> torch.Tensor:
    """Page-locks ``tensor``'s memory in place, without copying.

    The whole storage is registered (so every view of it is pinned):
    ``cudaHostRegister`` where a CUDA device is usable (``is_pinned()`` becomes
    True and copies are DMA transfers; torch's CUDA state is initialised for
    that, once), else ``mlock``. Until :func:`unpin_`,
    pinxfer keeps the storage alive and non-resizable. If torch moves the
    storage to other memory meanwhile (``share_memory_()`` copies it into shared
    memory, also for a storage already there: torch does not see a pinned storage
    as shared), the old memory is unpinned before it is freed and the tensor is no
    longer pinned. A lazy clone (copy-on-write) is copied first, so the clone's own
    memory is pinned.

    Raises RuntimeError, saying why, for memory that cannot be registered: not
    on the CPU, empty, already pinned (by torch, by pinxfer's pool, by an
    earlier ``pin_``, or sharing a page with CUDA-registered memory), or over
    the memlock limit. TypeError for a non-tensor and ValueError for a sparse,
    nested, meta or quantized tensor (pin those with :func:`pin_memory`).

    Args:
        tensor: a dense CPU tensor.

    Returns:
        ``tensor`` itself.
    """
    _check.tensor(tensor, "pin_")
    if tensor.is_quantized:
        # torch answers is_pinned() for a quantized tensor itself, and would say
        # False about memory pin_ had locked.
        raise ValueError(
            "pinxfer.pin_: expected a plain dense tensor, got a quantized one; "
            "pin a copy with pinxfer.pin_memory(t) instead"
        )
    if not _ops.torch_cuda_ready:
        _ops.ensure_torch_cuda()
    _ops.pin_(tensor)
    return tensor


@_check.never_traced("unpin_", "it unlocks the memory of the tensor it is given, when it runs")
def unpin_(tensor: torch.Tensor) -> torch.Tensor:
    """Undoes :func:`pin_` on ``tensor``'s storage (``cudaHostUnregister`` or
    ``munlock`` of exactly what ``pin_`` locked). Raises RuntimeError if ``pin_``
    did not pin it.

    Args:
        tensor: the tensor given to :func:`pin_`, or any view of its storage.

    Returns:
        ``tensor`` itself.
    """
    _ops.unpin_(_check.tensor(tensor, "unpin_"))
    return tensor
