"""``pinxfer doctor``: what on this machine decides host<->GPU transfer speed.

Reads the GPU topology (NUMA node, CPUs, PCIe link), the memlock limit,
transparent huge pages, huge pages and pinxfer's own settings, then lists
actionable warnings. Every file is read below a sysfs root and a proc root that
are parameters, so tests point them at fixture trees. Nothing here initialises
CUDA unless ``torch.cuda`` is already usable (then only to read device names).

JSON (``pinxfer doctor --json FILE``)::

    {"pinxfer": str, "torch": str, "sysfs_root": str, "proc_root": str,
     "gpus": [{"index": int | null,         # CUDA index here (null: not visible to this
                                            # process); PCI bus order when CUDA is not usable
               "name": str | null, "pci_bus_id": str,
               "numa_node": int,            # -1: unknown / single node
               "cpus": [int],               # CPUs of that node ([] if unknown)
               "pcie": {"current_gen": int | null, "current_width": int | null,
                        "max_gen": int | null, "max_width": int | null,
                        "current_speed_gts": float | null, "max_speed_gts": float | null,
                        "under_load": bool},   # read while the GPU was copying
               "source": "nvml" | "sysfs"}],   # where the PCIe figures came from
     "process": {"affinity": [int], "uid": int, "cap_ipc_lock": bool},
     "memlock": {"soft": int | null, "hard": int | null},   # null: unlimited
     "thp": {"enabled": str | null, "defrag": str | null},
     "hugepages": {"total": int | null, "free": int | null, "size_bytes": int | null},
     "settings": {"env": {NAME: str | null},        # every variable of the settings table
                  "values": {NAME: {"value": str, "source": str, "doc": str}},
                  "max_pinned_bytes": int,
                  "build_info": {"with_cuda": bool, "cuda_version": str, "cuda_usable": bool},
                  "installed": bool},
     "warnings": [{"code": str, "message": str}]}
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

import pinxfer
from pinxfer import _ops
from pinxfer.cli.table import format_bytes, format_table
from pinxfer.topology import node_cpus, resolve_sysfs_root


def pinxfer_settings() -> dict[str, dict[str, str]]:
    """The settings table of csrc/runtime/settings.cpp as read by this process:
    {name: {"value", "source", "doc"}}. Raises ValueError, naming the variable and what it
    expects, when one is malformed (every pinxfer call would, so doctor says that first)."""
    return {s.name: {"value": s.value, "source": s.source, "doc": s.doc} for s in _ops.settings()}


def env_vars() -> tuple[str, ...]:
    """Every variable the settings object reads."""
    return tuple(pinxfer_settings())


NVIDIA_VENDOR = "0x10de"
# PCI class codes of GPUs: VGA controller (0x0300xx) and 3D controller (0x0302xx).
GPU_CLASSES = ("0x0300", "0x0302")
CAP_IPC_LOCK = 14
# Transfer rate per lane (GT/s) -> PCIe generation.
GTS_TO_GEN = {2.5: 1, 5.0: 2, 8.0: 3, 16.0: 4, 32.0: 5, 64.0: 6}
GIB = 1 << 30


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _read_int(path: Path) -> int | None:
    text = _read(path)
    if text is None:
        return None
    try:
        return int(text, 0)
    except ValueError:
        return None


def _speed_gts(text: str | None) -> float | None:
    # "16.0 GT/s PCIe", "8 GT/s", "Unknown" (older kernels: "8.0 GT/s")
    if not text:
        return None
    m = re.match(r"\s*([0-9.]+)\s*GT/s", text)
    return float(m.group(1)) if m else None


def _gen(gts: float | None) -> int | None:
    if gts is None:
        return None
    return GTS_TO_GEN.get(round(gts, 1))


def pcie_link_sysfs(pci_bus_id: str, sysfs_root: str) -> dict[str, Any]:
    """The PCIe link of a device from sysfs. The effective maximum is the lower
    of the device's and its upstream port's (a Gen5 GPU in a Gen4 slot runs
    correctly at Gen4), when the upstream port is visible."""
    dev = Path(sysfs_root) / "bus" / "pci" / "devices" / pci_bus_id.lower()
    cur = _speed_gts(_read(dev / "current_link_speed"))
    mx = _speed_gts(_read(dev / "max_link_speed"))
    cur_w = _read_int(dev / "current_link_width")
    max_w = _read_int(dev / "max_link_width")
    try:
        parent = dev.resolve().parent
    except OSError:
        parent = None
    if parent is not None:
        up_speed = _speed_gts(_read(parent / "max_link_speed"))
        up_width = _read_int(parent / "max_link_width")
        if up_speed is not None and mx is not None:
            mx = min(mx, up_speed)
        if up_width is not None and max_w is not None:
            max_w = min(max_w, up_width)
    return {
        "current_gen": _gen(cur),
        "current_width": cur_w,
        "max_gen": _gen(mx),
        "max_width": max_w,
        "current_speed_gts": cur,
        "max_speed_gts": mx,
    }


def _normalise_bus_id(bus_id: str) -> str:
    # NVML reports "00000000:41:00.0" (8-digit domain); sysfs uses "0000:41:00.0".
    bus_id = bus_id.strip().lower()
    m = re.fullmatch(r"([0-9a-f]+):([0-9a-f]{2}):([0-9a-f]{2})\.([0-7])", bus_id)
    if not m:
        return bus_id
    return f"{int(m.group(1), 16):04x}:{m.group(2)}:{m.group(3)}.{m.group(4)}"


def _sysfs_gpus(sysfs_root: str) -> list[str]:
    """PCI bus ids of NVIDIA display/3D controllers, in bus order (nvidia-smi's order)."""
    devices = Path(sysfs_root) / "bus" / "pci" / "devices"
    found = []
    try:
        entries = sorted(p.name for p in devices.iterdir())
    except OSError:
        return []
    for name in entries:
        vendor = (_read(devices / name / "vendor") or "").lower()
        cls = (_read(devices / name / "class") or "").lower()
        if vendor == NVIDIA_VENDOR and cls.startswith(GPU_CLASSES):
            found.append(name.lower())
    return found


def _record_field(rec: Any, *names: str) -> Any:
    for name in names:
        if isinstance(rec, dict) and name in rec:
            return rec[name]
        if hasattr(rec, name):
            return getattr(rec, name)
    return None


def _from_topology(sysfs_root: str, pci_bus_ids: list[str] | None = None) -> list[dict[str, Any]]:
    """Records from pinxfer.topology(): the CUDA devices of this process, or the
    given bus ids. Its NUMA answers come from the C++ code that places pinxfer's
    memory, so doctor reports what placement uses. [] if the API is missing."""
    topo = getattr(pinxfer, "topology", None)
    if topo is None:
        return []
    try:
        if pci_bus_ids is None:
            records = topo(sysfs_root)
        else:
            records = topo(sysfs_root, pci_bus_ids=pci_bus_ids)
    except Exception:  # e.g. a malformed cpulist: fall back to reading sysfs here
        return []
    out = []
    for rec in records or []:
        bus = _record_field(rec, "pci_bus_id", "bus_id", "pci")
        if not bus:
            continue
        out.append(
            {
                "index": _record_field(rec, "index", "device", "device_index"),
                "pci_bus_id": _normalise_bus_id(str(bus)),
                "numa_node": _record_field(rec, "numa_node", "node"),
                "cpus": list(_record_field(rec, "cpus", "node_cpus") or []),
                "name": _record_field(rec, "name"),
            }
        )
    return out


def _from_nvml() -> list[dict[str, Any]]:
    """Name, bus id and PCIe link per GPU through NVML (nvidia-ml-py), if installed."""
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except Exception:
        return []
    out = []
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            bus = pynvml.nvmlDeviceGetPciInfo(h).busId
            name = name.decode() if isinstance(name, bytes) else name
            bus = bus.decode() if isinstance(bus, bytes) else bus

            def q(fn: str, handle: Any = h) -> int | None:  # handle=h: this GPU, bound now
                try:
                    return int(getattr(pynvml, fn)(handle))
                except Exception:
                    return None

            out.append(
                {
                    "index": i,
                    "name": name,
                    "pci_bus_id": _normalise_bus_id(bus),
                    "pcie": {
                        "current_gen": q("nvmlDeviceGetCurrPcieLinkGeneration"),
                        "current_width": q("nvmlDeviceGetCurrPcieLinkWidth"),
                        "max_gen": q("nvmlDeviceGetMaxPcieLinkGeneration"),
                        "max_width": q("nvmlDeviceGetMaxPcieLinkWidth"),
                        "current_speed_gts": None,
                        "max_speed_gts": None,
                    },
                }
            )
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()
    return out


def _from_torch() -> list[dict[str, Any]]:
    """Names and bus ids of the CUDA devices torch sees (only when CUDA is usable)."""
    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        bus = None
        if hasattr(p, "pci_bus_id") and hasattr(p, "pci_domain_id"):
            bus = f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
        out.append({"index": i, "name": p.name, "pci_bus_id": bus})
    return out


@contextlib.contextmanager
def _links_busy(seconds: float = 0.05) -> Iterator[bool]:
    """Keeps every visible GPU copying from pinned memory while the block runs,
    yielding True if that worked. GPUs lower their PCIe link speed when idle, so
    an idle read would report e.g. Gen1 on a healthy Gen5 link."""
    if not torch.cuda.is_available():
        yield False
        return
    streams = []
    try:
        chunk = 64 << 20
        # ~`seconds` of copies at 55 GB/s per GPU, queued without waiting.
        copies = max(1, int(seconds * 55e9 / chunk))
        for i in range(torch.cuda.device_count()):
            with torch.cuda.device(i):
                src = torch.empty(chunk, dtype=torch.uint8, pin_memory=True)
                dst = torch.empty(chunk, dtype=torch.uint8, device=i)
                stream = torch.cuda.Stream(i)
                with torch.cuda.stream(stream):
                    for _ in range(copies):
                        dst.copy_(src, non_blocking=True)
                streams.append((stream, src, dst))
        time.sleep(0.005)  # let the links retrain to full speed
    except Exception:  # no memory, a busy device...: read the links idle
        for stream, _, _ in streams:
            stream.synchronize()
        yield False
        return
    try:
        yield True
    finally:
        for stream, _, _ in streams:
            stream.synchronize()


def gpu_records(sysfs_root: str, live: bool = True) -> list[dict[str, Any]]:
    """One record per GPU, merged by PCI bus id from sysfs and, when `live`,
    pinxfer.topology(), NVML and torch (each fills what it knows). Indices follow
    CUDA/NVML where known, else PCI bus order. `live` is False for fixture trees:
    those sources enumerate this machine's real GPUs."""
    merged: dict[str, dict[str, Any]] = {}
    order: list[str] = []
    cuda_index: dict[str, int] = {}  # bus id -> CUDA device index in this process

    def add(rec: dict[str, Any], source: str) -> None:
        bus = rec.get("pci_bus_id")
        if not bus:
            return
        if bus not in merged:
            merged[bus] = {
                "index": None,
                "name": None,
                "pci_bus_id": bus,
                "numa_node": None,
                "cpus": [],
                "pcie": None,
                "source": "sysfs",
            }
            order.append(bus)
        cur = merged[bus]
        for key, value in rec.items():
            if key != "index" and value is not None and value != [] and cur.get(key) in (None, []):
                cur[key] = value
        if source in ("topology", "torch") and rec.get("index") is not None:
            cuda_index[bus] = int(rec["index"])
        if source == "nvml" and rec.get("pcie"):
            cur["source"] = "nvml"

    for bus in _sysfs_gpus(sysfs_root):
        add({"pci_bus_id": bus}, "sysfs")
    busy = False
    if live:
        for rec in _from_topology(sysfs_root):
            add(rec, "topology")
        for rec in _from_torch():
            add(rec, "torch")
        # Link speeds are read while the GPUs copy: idle GPUs train their links down.
        with _links_busy() as busy:
            nvml = _from_nvml()
            sys_links = {b: pcie_link_sysfs(b, sysfs_root) for b in order}
        for rec in nvml:
            add(rec, "nvml")
    else:
        sys_links = {}

    order.sort()  # PCI bus order: nvidia-smi's and NVML's numbering
    if order:  # NUMA node and CPUs as pinxfer's placement sees them
        for rec in _from_topology(sysfs_root, pci_bus_ids=list(order)):
            merged[rec["pci_bus_id"]]["numa_node"] = rec["numa_node"]
            if rec["cpus"]:
                merged[rec["pci_bus_id"]]["cpus"] = rec["cpus"]
    gpus = [merged[b] for b in order]
    for pos, g in enumerate(gpus):
        # The CUDA index where this process sees CUDA devices (None: not visible
        # to it, e.g. CUDA_VISIBLE_DEVICES); else the PCI bus order.
        g["index"] = cuda_index.get(g["pci_bus_id"]) if cuda_index else pos
        if g["numa_node"] is None:
            node = _read_int(
                Path(sysfs_root) / "bus" / "pci" / "devices" / g["pci_bus_id"] / "numa_node"
            )
            g["numa_node"] = node if node is not None else -1
        if not g["cpus"]:
            g["cpus"] = node_cpus(int(g["numa_node"]), sysfs_root)
        sys_link = sys_links.get(g["pci_bus_id"]) or pcie_link_sysfs(g["pci_bus_id"], sysfs_root)
        sys_link["under_load"] = busy
        if g["pcie"] is None:
            g["pcie"] = sys_link
        else:  # NVML gives generations; sysfs adds GT/s and the upstream-port cap
            for key, value in sys_link.items():
                if g["pcie"].get(key) is None:
                    g["pcie"][key] = value
    gpus.sort(key=lambda g: (g["index"] is None, g["index"] or 0, g["pci_bus_id"]))
    return gpus


def cap_ipc_lock(proc_root: str) -> bool:
    """Whether this process holds CAP_IPC_LOCK (mlock without a limit)."""
    text = _read(Path(proc_root) / "self" / "status") or ""
    m = re.search(r"^CapEff:\s*([0-9a-fA-F]+)", text, re.M)
    return bool(m) and bool(int(m.group(1), 16) >> CAP_IPC_LOCK & 1)


def meminfo(proc_root: str) -> dict[str, int | None]:
    text = _read(Path(proc_root) / "meminfo") or ""
    values = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts:
            values[key.strip()] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return {
        "total": values.get("HugePages_Total"),
        "free": values.get("HugePages_Free"),
        "size_bytes": values.get("Hugepagesize"),
    }


def _bracketed(text: str | None) -> str | None:
    # "always [madvise] never" -> "madvise"
    if not text:
        return None
    m = re.search(r"\[([^\]]+)\]", text)
    return m.group(1) if m else text.strip()


def collect(
    sysfs_root: str | None = None,
    proc_root: str = "/proc",
    affinity: set[int] | None = None,
    live: bool | None = None,
) -> dict[str, Any]:
    """Everything doctor reports, as a JSON-ready dict (see the module docstring).

    Args:
        sysfs_root: root of sysfs (default ``PINXFER_SYSFS_ROOT`` or ``/sys``, as pinxfer reads it).
        proc_root: root of procfs.
        affinity: the CPUs to check against GPU nodes (default: this process's).
        live: also ask pinxfer.topology(), NVML and torch about this machine's
            GPUs (default: only when the real /sys is read, so a fixture tree is
            never mixed with this machine).
    """
    values = pinxfer_settings()
    sysfs_root = resolve_sysfs_root(sysfs_root or None)
    if live is None:
        live = os.path.realpath(sysfs_root) == "/sys"
    if affinity is None:
        affinity = set(os.sched_getaffinity(0))
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    unl = resource.RLIM_INFINITY
    info = pinxfer.build_info()
    thp_dir = Path(sysfs_root) / "kernel" / "mm" / "transparent_hugepage"
    report: dict[str, Any] = {
        "pinxfer": pinxfer.__version__,
        "torch": torch.__version__,
        "sysfs_root": sysfs_root,
        "proc_root": proc_root,
        "gpus": gpu_records(sysfs_root, live=live),
        "process": {
            "affinity": sorted(affinity),
            "uid": os.geteuid(),
            "cap_ipc_lock": cap_ipc_lock(proc_root),
        },
        "memlock": {"soft": None if soft == unl else soft, "hard": None if hard == unl else hard},
        "thp": {
            "enabled": _bracketed(_read(thp_dir / "enabled")),
            "defrag": _bracketed(_read(thp_dir / "defrag")),
        },
        "hugepages": meminfo(proc_root),
        "settings": {
            "env": {name: os.environ.get(name) for name in values},
            "values": values,
            "max_pinned_bytes": pinxfer.get_max_pinned_bytes(),
            "build_info": {
                "with_cuda": info.with_cuda,
                "cuda_version": info.cuda_version,
                "cuda_usable": info.cuda_usable,
            },
            "installed": pinxfer.is_installed(),
        },
    }
    report["warnings"] = diagnose(report)
    return report


def diagnose(report: dict[str, Any]) -> list[dict[str, str]]:
    """Actionable warnings from a collected report."""
    warns: list[dict[str, str]] = []

    def warn(code: str, message: str) -> None:
        warns.append({"code": code, "message": message})

    cap = report["settings"]["max_pinned_bytes"]
    soft = report["memlock"]["soft"]
    exempt = report["process"]["cap_ipc_lock"]
    fix = (
        "raise it (`ulimit -l unlimited`, systemd LimitMEMLOCK=infinity, "
        "`docker run --ulimit memlock=-1`)"
    )
    if soft is not None and not exempt:
        if cap > 0 and soft < cap:
            warn(
                "memlock_below_cap",
                f"memlock limit {format_bytes(soft)} is below the pinned cap {format_bytes(cap)}: "
                "where pinxfer locks memory with mlock (no usable CUDA) it fails past the limit "
                f"and the memory stays pageable. {fix.capitalize()} or lower "
                "PINXFER_MAX_PINNED_BYTES.",
            )
        elif cap == 0 and soft < GIB:
            warn(
                "memlock_low",
                f"memlock limit {format_bytes(soft)} is below 1 GiB and the process lacks "
                f"CAP_IPC_LOCK: pinned staging buffers locked with mlock fail past it; {fix}.",
            )

    thp = report["thp"]["enabled"]
    if thp == "never":
        warn(
            "thp_never",
            "transparent huge pages are 'never': pinxfer's pool asks for huge pages "
            "(MADV_HUGEPAGE), which makes pinning about 3x faster. As root: "
            "`echo madvise > /sys/kernel/mm/transparent_hugepage/enabled`.",
        )

    affinity = set(report["process"]["affinity"])
    for g in report["gpus"]:
        if g["index"] is None:  # not visible to this process: not its concern
            continue
        node, cpus = g["numa_node"], set(g["cpus"])
        if node is not None and node >= 0 and cpus and not (affinity & cpus):
            warn(
                "affinity_far_from_gpu",
                f"GPU {g['index']} ({g['pci_bus_id']}) is on NUMA node {node} (CPUs "
                f"{_compact(sorted(cpus))}) but this process may run only on CPUs "
                f"{_compact(sorted(affinity))}: the threads that fill its pinned buffers work "
                "across the NUMA interconnect (H2D ~10% slower from a far node). Run under "
                f"`numactl --cpunodebind={node} --membind={node}` or "
                f"`taskset -c {_compact(sorted(cpus))}`, or set "
                "PINXFER_NUMA_NODE.",
            )
        link = g["pcie"] or {}
        cur_g, max_g = link.get("current_gen"), link.get("max_gen")
        cur_w, max_w = link.get("current_width"), link.get("max_width")
        slow_speed = cur_g is not None and max_g is not None and cur_g < max_g
        if cur_g is None and max_g is None:
            cs, ms = link.get("current_speed_gts"), link.get("max_speed_gts")
            slow_speed = cs is not None and ms is not None and cs < ms
        slow_width = cur_w is not None and max_w is not None and 0 < cur_w < max_w
        if slow_speed or slow_width:
            head = (
                f"GPU {g['index']} ({g['pci_bus_id']}) PCIe link runs at "
                f"{_link(cur_g, link.get('current_speed_gts'), cur_w)} but can do "
                f"{_link(max_g, link.get('max_speed_gts'), max_w)}"
            )
            if slow_width:
                tail = (
                    ": fewer lanes cut bandwidth in proportion. Check the slot (x16 electrical), "
                    "riser and BIOS bifurcation settings."
                )
            elif link.get("under_load"):
                tail = (
                    " while copying: check the slot, riser and BIOS PCIe settings (e.g. a slot "
                    "forced to a lower generation)."
                )
            else:
                tail = (
                    ". GPUs lower the link speed when idle: if it stays low while copying (run "
                    "`pinxfer bench` and look again), check the slot, riser and BIOS PCIe settings."
                )
            warn("pcie_below_max", head + tail)

    # Only where torch sees a GPU: on a machine without one there is nothing to miss.
    cuda_reason = pinxfer.cuda_unavailable_reason()
    if cuda_reason is not None and torch.cuda.is_available():
        warn(
            "cuda_unusable",
            f"torch sees a GPU, but {cuda_reason}. Meanwhile pinxfer's memory is mlocked, not "
            "registered with CUDA, and its transfers are unavailable.",
        )
    return warns


def _link(gen: int | None, gts: float | None, width: int | None) -> str:
    speed = f"Gen{gen}" if gen else (f"{gts:g} GT/s" if gts else "?")
    if gen and gts:
        speed += f" ({gts:g} GT/s)"
    return f"{speed} x{width if width else '?'}"


def _compact(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    parts, start, prev = [], None, None
    for c in cpus:
        if start is None:
            start = prev = c
        elif c == prev + 1:
            prev = c
        else:
            parts.append(f"{start}-{prev}" if prev != start else str(start))
            start = prev = c
    if start is not None:
        parts.append(f"{start}-{prev}" if prev != start else str(start))
    return ",".join(parts) or "-"


def render(report: dict[str, Any]) -> str:
    """The human-readable report."""
    lines = [f"pinxfer {report['pinxfer']} (torch {report['torch']})", ""]
    gpus = report["gpus"]
    if not gpus:
        lines.append(
            f"GPUs: none found (no NVIDIA device under {report['sysfs_root']}/bus/pci/devices)"
        )
    else:
        lines.append("GPUs:")
        header = ("idx", "name", "PCI bus id", "node", "node CPUs", "PCIe now", "PCIe max")
        rows = [header]
        for g in gpus:
            link = g["pcie"] or {}
            rows.append(
                (
                    "-" if g["index"] is None else str(g["index"]),
                    g["name"] or "?",
                    g["pci_bus_id"],
                    str(g["numa_node"]),
                    _compact(g["cpus"]),
                    _link(
                        link.get("current_gen"),
                        link.get("current_speed_gts"),
                        link.get("current_width"),
                    ),
                    _link(link.get("max_gen"), link.get("max_speed_gts"), link.get("max_width")),
                )
            )
        lines.extend("  " + line for line in format_table(rows))
        if any((g["pcie"] or {}).get("under_load") for g in gpus):
            lines.append(
                "  (PCIe links read while each GPU copied: idle GPUs lower their link speed)"
            )
        else:
            lines.append("  (PCIe links read idle: GPUs lower their link speed when idle)")
    lines.append("")
    proc = report["process"]
    mem = report["memlock"]

    def lim(v: int | None) -> str:
        return "unlimited" if v is None else format_bytes(v)

    hp = report["hugepages"]
    st = report["settings"]
    bi = st["build_info"]
    lines += [
        f"process CPU affinity: {_compact(proc['affinity'])}",
        f"memlock limit (ulimit -l): soft {lim(mem['soft'])}, hard {lim(mem['hard'])}"
        f"{'; CAP_IPC_LOCK held (no limit applies)' if proc['cap_ipc_lock'] else ''}",
        f"transparent huge pages: enabled={report['thp']['enabled'] or '?'}, "
        f"defrag={report['thp']['defrag'] or '?'}",
        f"huge pages (hugetlbfs): {hp['free'] if hp['free'] is not None else '?'} free of "
        f"{hp['total'] if hp['total'] is not None else '?'}, "
        f"{format_bytes(hp['size_bytes']) if hp['size_bytes'] else '?'} each",
        "",
        "pinxfer settings:",
        f"  build: with_cuda={bi['with_cuda']} cuda_version={bi['cuda_version'] or '-'} "
        f"cuda_usable={bi['cuda_usable']}",
        "  pinned cap: "
        f"{format_bytes(st['max_pinned_bytes']) if st['max_pinned_bytes'] else 'none'}",
        f"  torch host allocator installed: {st['installed']}",
    ]
    for name, setting in st["values"].items():
        lines.append(f"  {name} = {setting['value']} ({setting['source']}): {setting['doc']}")
    lines.append("")
    if report["warnings"]:
        lines.append(f"warnings ({len(report['warnings'])}):")
        for w in report["warnings"]:
            lines.append(f"  ! [{w['code']}] {w['message']}")
    else:
        lines.append("no warnings")
    return "\n".join(lines)


def main(args: Any) -> int:
    report = collect(sysfs_root=args.sysfs_root, proc_root=args.proc_root)
    text = json.dumps(report, indent=2)
    if args.json == "-":  # JSON alone on stdout, for pipes
        print(text)
        return 0
    print(render(report))
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0
