"""The boundary between pinxfer's Python and its C++.

``ops`` is ``torch.ops.pinxfer``: every operator (schemas in csrc/module.cpp).
The fakes of the operators that return tensors are registered here, so
``torch.compile``, FakeTensor and ``torch.library.opcheck`` see them.

``fast`` is the extension module ``pinxfer._C``: eager fast calls into the same
C++ kernels (csrc/python/fast_calls.cpp) for the small-call hot paths
(``pin_memory`` of a tensor or a batch, ``empty``). A ``torch.ops`` call costs
about 3 µs of Python-side dispatch, more than pinning a 64 KiB tensor; a fast
call costs a fraction of a microsecond. They bypass the dispatcher, so callers
use them only where the dispatcher would add nothing: :func:`eager` must be
true (no tracing, no ``__torch_function__`` or ``__torch_dispatch__`` mode) and
the tensors are plain (``type(t) is torch.Tensor``), dense, on the CPU and need
no autograd (:func:`plain_dense_cpu`). Everything else takes ``ops``.
"""
from __future__ import annotations

from typing import Optional

import torch

from pinxfer import _C as fast  # noqa: F401  (loading it registers torch.ops.pinxfer)

ops = torch.ops.pinxfer

_len_dispatch_modes = torch._C._len_torch_dispatch_stack
_function_mode_on = torch._C._is_torch_function_mode_enabled
_compiling = torch.compiler.is_compiling

# True in a forked child of a process that initialised CUDA: torch can no longer
# query CUDA there (Tensor.is_pinned() may raise), and nothing is pinned for this
# process's CUDA context (it has none).
in_bad_fork = getattr(torch._C, "_cuda_isInBadFork", lambda: False)


def eager() -> bool:
    """True where a fast call is equivalent to its operator: not tracing, no mode active."""
    return not (_len_dispatch_modes() or _function_mode_on() or _compiling())


def plain_dense_cpu(t: torch.Tensor) -> bool:
    """A plain dense CPU tensor that needs no autograd: what the fast calls take."""
    return (type(t) is torch.Tensor and t.layout is torch.strided and not t.requires_grad
            and not t.is_nested and not t.is_quantized and t.is_cpu)


# ---- fakes (shape, dtype and strides of the results, no data) ----


@torch.library.register_fake("pinxfer::empty")
def _empty_fake(size: list[int], dtype: torch.dtype, numa_node: Optional[int] = None) -> torch.Tensor:
    return torch.empty(size, dtype=dtype, device="cpu")


@torch.library.register_fake("pinxfer::pin_memory")
def _pin_memory_fake(self: torch.Tensor, numa_node: Optional[int] = None,
                     num_threads: int = 0) -> torch.Tensor:
    if torch._debug_has_internal_overlap(self) == 1:
        return torch.empty(self.shape, dtype=self.dtype, device=self.device)
    return torch.empty_strided(self.shape, self.stride(), dtype=self.dtype, device=self.device)


@torch.library.register_fake("pinxfer::to_device")
def _to_device_fake(tensor: torch.Tensor, device: torch.device, chunk_bytes: int,
                    num_buffers: int, staging: str = "auto", cached_tail: int = -1) -> torch.Tensor:
    return torch.empty(tensor.shape, dtype=tensor.dtype, device=device)


@torch.library.register_fake("pinxfer::to_device_many")
def _to_device_many_fake(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    return [torch.empty(t.shape, dtype=t.dtype, device=device) for t in tensors]


# Queries about a tensor's memory: a fake tensor has none, so it is neither a pool
# block nor pinned in place (pinxfer.pin_memory of a fake tensor then traces the copy).
@torch.library.register_fake("pinxfer::is_pool_tensor")
def _is_pool_tensor_fake(self: torch.Tensor) -> bool:
    return False


@torch.library.register_fake("pinxfer::inplace_lock_kind")
def _inplace_lock_kind_fake(self: torch.Tensor) -> Optional[str]:
    return None
