"""pinxfer: move data between host memory and NVIDIA GPUs at the speed of the bus.

Importing pinxfer loads its C++ operators (``torch.ops.pinxfer.*``) and never
initialises CUDA; it does not import the command line (``pinxfer.cli``). The first call that pins (``empty``, ``pin_memory``, ``pin_``)
where CUDA is usable initialises torch's CUDA state, as torch's own pinning does,
so that ``Tensor.is_pinned()`` answers True for pinxfer's memory.
"""
from __future__ import annotations

import torch


def _load_extension() -> None:
    try:
        from pinxfer import _C  # noqa: F401  (registers torch.ops.pinxfer)
    except ImportError as err:  # pragma: no cover - exercised by broken installs only
        raise ImportError(
            f"pinxfer could not load its compiled extension pinxfer._C: {err}. "
            f"Running torch {torch.__version__} (CUDA {torch.version.cuda}). The extension must be "
            "built against the torch you run: reinstall with "
            "`pip install --no-build-isolation .` in the pinxfer checkout."
        ) from err


_load_extension()

from pinxfer.memory import (  # noqa: E402
    build_info,
    cuda_unavailable_reason,
    empty,
    empty_cache,
    get_max_pinned_bytes,
    install,
    is_installed,
    is_pool_tensor,
    lock_kind,
    memory_stats,
    record_stream,
    reset_accumulated_memory_stats,
    reset_peak_memory_stats,
    set_max_pinned_bytes,
    uninstall,
)
from pinxfer.pin import is_pinned, pin_, pin_memory, unpin_  # noqa: E402
from pinxfer.topology import GpuTopology, numa_nodes, topology  # noqa: E402

from pinxfer.prefetch import Prefetcher, prefetch  # noqa: E402
from pinxfer.transfer import HostTransfer, to_device, to_host  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "HostTransfer",
    "Prefetcher",
    "build_info",
    "cuda_unavailable_reason",
    "empty",
    "empty_cache",
    "GpuTopology",
    "numa_nodes",
    "pin_",
    "pin_memory",
    "topology",
    "unpin_",
    "get_max_pinned_bytes",
    "install",
    "is_installed",
    "is_pinned",
    "is_pool_tensor",
    "lock_kind",
    "memory_stats",
    "prefetch",
    "record_stream",
    "reset_accumulated_memory_stats",
    "reset_peak_memory_stats",
    "set_max_pinned_bytes",
    "to_device",
    "to_host",
    "uninstall",
]
