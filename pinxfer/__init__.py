"""pinxfer: move data between host memory and NVIDIA GPUs at the speed of the bus.

Importing pinxfer loads its C++ operators (``torch.ops.pinxfer.*``) and never
initialises CUDA; it does not import the command line (``pinxfer.cli``). The first
call that pins (``empty``, ``pin_memory``, ``pin_``) where CUDA is usable initialises
torch's CUDA state, as torch's own pinning does, so that ``Tensor.is_pinned()``
answers True for pinxfer's memory.
"""

from __future__ import annotations

import torch


def _load_extension() -> None:
    # Before loading _C (which registers its operators with this torch): is there one, and
    # was it built for this torch? pinxfer/_build_check.py says why it must be first.
    from pinxfer import _build_check

    global _C
    path = _build_check.check_before_loading()
    try:
        # Exactly the file checked (registers torch.ops.pinxfer).
        _C = _build_check.load_extension(path)
    except ImportError as err:  # pragma: no cover - exercised by broken installs only
        raise ImportError(
            f"pinxfer could not load its compiled extension {path}: {err}. Running torch "
            f"{torch.__version__} (CUDA {torch.version.cuda}). Rebuild it: "
            f"{_build_check.rebuild_command()}."
        ) from err
    # The module says it again once loaded (the stamp and these come from the same defines).
    built = {
        "torch": getattr(_C, "built_with_torch", "unknown"),
        "cuda": getattr(_C, "built_with_torch_cuda", "unknown"),
    }
    message = _build_check.mismatch_message(built, path)
    if message is not None:
        raise ImportError(message)


_load_extension()

from pinxfer import slots  # noqa: F401  (pinxfer.slots after import pinxfer)
from pinxfer.memory import (
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
from pinxfer.pin import is_pinned, pin_, pin_memory, unpin_
from pinxfer.prefetch import Prefetcher, prefetch
from pinxfer.topology import GpuTopology, numa_nodes, topology
from pinxfer.transfer import HostTransfer, to_device, to_host

# The one place the version is written: pyproject.toml reads it (dynamic version), so the
# installed metadata and a source checkout agree. CHANGELOG.md says what each one holds.
__version__ = "0.1.0"

__all__ = [
    "GpuTopology",
    "HostTransfer",
    "Prefetcher",
    "build_info",
    "cuda_unavailable_reason",
    "empty",
    "empty_cache",
    "get_max_pinned_bytes",
    "install",
    "is_installed",
    "is_pinned",
    "is_pool_tensor",
    "lock_kind",
    "memory_stats",
    "numa_nodes",
    "pin_",
    "pin_memory",
    "prefetch",
    "record_stream",
    "reset_accumulated_memory_stats",
    "reset_peak_memory_stats",
    "set_max_pinned_bytes",
    "to_device",
    "to_host",
    "topology",
    "uninstall",
    "unpin_",
]
