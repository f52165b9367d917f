"""Host topology as plain data: which NUMA node each GPU sits on, and its CPUs.

The answers come from the same C++ code (``csrc/runtime/topology.cpp``) that
places pinxfer's pools and binds its threads, so what this reports is what
placement uses. Every function takes the sysfs root, so fake trees can be
inspected too; None means ``PINXFER_SYSFS_ROOT``, else ``/sys``.

GPU bus ids come from the CUDA runtime (``cudaDeviceGetPCIBusId``) through
pinxfer's own op, which needs no CUDA context and leaves torch's CUDA state
uninitialised (DataLoader workers can still fork). Note that placement may be
overridden with ``PINXFER_NUMA_NODE``; this module reports sysfs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from pinxfer import _check, _ops

# The CPU-list parser is its operator as it stands.
from pinxfer._ops import parse_cpulist

__all__ = [
    "GpuTopology",
    "node_cpus",
    "numa_nodes",
    "parse_cpulist",
    "resolve_sysfs_root",
    "topology",
]


#: Why the sysfs queries are never traced by torch.compile (_check.never_traced): the tree
#: they read is the one there when they run.
_READS_SYSFS = "it reads sysfs when it runs"


@dataclasses.dataclass(frozen=True)
class GpuTopology:
    index: int  # CUDA device index (or position in the bus ids given)
    pci_bus_id: str  # as CUDA reports it, e.g. "00000000:1B:00.0"
    numa_node: int  # -1: unknown or no affinity (no binding is done)
    cpus: tuple[int, ...]  # CPUs of that node; () when numa_node is -1 or unreadable


def resolve_sysfs_root(sysfs_root: str | None = None) -> str:
    """The sysfs root a query reads: ``sysfs_root`` if given, else the one C++ reads
    by default (``PINXFER_SYSFS_ROOT``, else ``/sys``)."""
    return str(sysfs_root) if sysfs_root is not None else _ops.sysfs_root()


@_check.never_traced("topology.node_cpus", _READS_SYSFS)
def node_cpus(node: int, sysfs_root: str | None = None) -> list[int]:
    """CPUs of NUMA node ``node``; ``[]`` when the node is unknown (-1), absent or has no
    readable cpulist.

    Raises:
        ValueError: the node's cpulist is malformed (the message names the file).
    """
    return _cpus_of(node, resolve_sysfs_root(sysfs_root))


def _cpus_of(node: int, root: str) -> list[int]:
    return _ops.node_cpus(node, root) if node >= 0 else []


@_check.never_traced("numa_nodes", _READS_SYSFS)
def numa_nodes(sysfs_root: str | None = None) -> dict[int, list[int]]:
    """NUMA nodes present and their CPUs, e.g. ``{0: [0, 1, ...], 1: [...]}``.

    Args:
        sysfs_root: root of the sysfs tree to read (None: ``PINXFER_SYSFS_ROOT`` or ``/sys``).

    Returns:
        node -> CPU ids; a node without a readable cpulist maps to ``[]``;
        ``{}`` when the tree has no NUMA information.

    Raises:
        ValueError: a node's cpulist is malformed (the message names the file).
    """
    root = resolve_sysfs_root(sysfs_root)
    return {node: _cpus_of(node, root) for node in _ops.online_nodes(root)}


@_check.never_traced("topology", "it reads sysfs and asks CUDA for the GPUs' bus ids when it runs")
def topology(
    sysfs_root: str | None = None, *, pci_bus_ids: Sequence[str] | None = None
) -> list[GpuTopology]:
    """Per GPU: PCI bus id, NUMA node, and that node's CPUs.

    Args:
        sysfs_root: root of the sysfs tree to read (None: ``PINXFER_SYSFS_ROOT`` or ``/sys``).
        pci_bus_ids: describe these PCI devices instead of the visible CUDA devices
            (for inspecting other machines' trees, and tests): a list of strings such
            as ``["0000:1b:00.0"]`` (a single string is refused, not read per character).

    Returns:
        One :class:`GpuTopology` per device, in device order; ``[]`` without CUDA.

    Raises:
        TypeError: ``pci_bus_ids`` is a string, or holds something other than strings.
        ValueError: a node's cpulist is malformed (the message names the file).
    """
    root = resolve_sysfs_root(sysfs_root)
    if pci_bus_ids is None:
        pci_bus_ids = [_ops.cuda_pci_bus_id(i) for i in range(_ops.cuda_device_count())]
    else:
        pci_bus_ids = _check.pci_bus_ids(pci_bus_ids, "topology")
    out = []
    for index, bus_id in enumerate(pci_bus_ids):
        node = _ops.pci_numa_node(bus_id, root)
        cpus = tuple(_cpus_of(node, root))
        out.append(GpuTopology(index=index, pci_bus_id=bus_id, numa_node=node, cpus=cpus))
    return out
