"""The boundary between pinxfer's Python and its C++: one typed wrapper per native function.

Two kinds of native functions, each wrapped here under its own name:

* the **operators** (``torch.ops.pinxfer``, schemas in csrc/module.cpp, one
  ``TORCH_LIBRARY`` block): the functions that take or return tensors (empty,
  pin_memory, pin_, unpin_, to_device, ...), so that the dispatcher, autograd,
  FakeTensor, ``torch.compile`` and ``torch.library.opcheck`` see them. Each one
  that returns tensors has its fake right beneath it; so do the two queries
  ``pinxfer.pin_memory`` asks about a tensor it may be tracing (is_pool_tensor,
  inplace_lock_kind). The ops that act on memory and return nothing (record_stream,
  pin_, unpin_) have none on purpose: a fake is also an op's Meta kernel, and
  pinning a meta tensor must raise.
* the plain functions of the extension module ``pinxfer._C`` (``fast`` here;
  csrc/python/): everything that takes no tensor (stats, the cap, install,
  settings, topology, the copy stream, test hooks), and the eager **fast calls**
  into the operators' own kernels for the small-call hot paths (``pin_memory`` of
  a tensor or a batch, ``empty``, ``to_device``).

The rest of the package calls these wrappers and never ``torch.ops.pinxfer`` or
``pinxfer._C`` itself; the public modules (memory, pin, topology, transfer)
re-export a wrapper where the public function is the native one, and add argument
handling where it is not.

A ``torch.ops`` call costs about 3 µs of Python-side dispatch, more than pinning a
64 KiB tensor; a fast call costs a fraction of a microsecond. Fast calls bypass the
dispatcher, so callers use them only where the dispatcher would add nothing:
:func:`eager` must be true (no tracing, no ``__torch_function__`` or
``__torch_dispatch__`` mode) and the tensors are plain (``type(t) is
torch.Tensor``), dense, on the CPU and need no autograd (:func:`plain_dense_cpu`).
Everything else takes the operators. Each kernel's choice is made at one call site:
``memory.empty``, ``pin.pin_memory`` (one tensor), ``pin._pin_batch``
(``pin_memory_many``), ``pin.is_pinned`` (a query: autograd does not matter, so any
plain dense tensor), and :func:`to_device` and :func:`to_device_many` here. (They
are not all wrappers here: on the ``pin_memory``/``empty`` hot paths one more
Python call would cost about 5% of a small call.)
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import NamedTuple

import torch

from pinxfer import _C as fast

# The only place the package names the operator namespace (``fast`` is the only
# name of the module pinxfer._C).
_lib = torch.ops.pinxfer

_len_dispatch_modes = torch._C._len_torch_dispatch_stack
_function_mode_on = torch._C._is_torch_function_mode_enabled
#: True in code torch.compile's dynamo traces (a constant there), False whenever Python runs
#: for real: the one check a fast call leaves to Python (``traced()`` below adds a tracing
#: mode's real Python). The ``*_if_plain``/``*_if_eager`` fast calls make the others in C++
#: and answer None where the operator must run. Not ``torch.compiler.is_compiling()``: torch
#: 2.14 holds that True in every thread for the whole of a compile, so a data thread's calls
#: took the traced road while the main thread compiled (``pin_memory`` of a pinned tensor
#: returned a copy), and ``never_traced`` raised there (session 55).
compiling = torch.compiler.is_dynamo_compiling
_is_compiling = torch.compiler.is_compiling

# True in a forked child of a process that initialised CUDA: torch can no longer
# query CUDA there (Tensor.is_pinned() may raise), and nothing is pinned for this
# process's CUDA context (it has none).
in_bad_fork = getattr(torch._C, "_cuda_isInBadFork", lambda: False)


def traced() -> bool:
    """True where pinxfer's Python runs as part of a trace: dynamo tracing it (``compiling``),
    or real Python under a tracing mode while a compile or an export is under way (non-strict
    ``torch.export``, ``make_fx`` inside a backend). Not in another thread while one compiles:
    modes are per thread, while ``is_compiling()`` is True in every thread then. Where a
    call's road differs traced (pin_memory's pinned check, the CUDA checks), this decides; the
    fast calls need only ``compiling`` (their C++ declines under a mode)."""
    return compiling() or (_is_compiling() and bool(_len_dispatch_modes() or _function_mode_on()))


def eager() -> bool:
    """True where a fast call is equivalent to its operator: not tracing, no mode active."""
    # compiling() first: under dynamo it is a constant, and the two mode queries
    # return ints dynamo cannot put in a graph (a graph break under fullgraph).
    return not (compiling() or _len_dispatch_modes() or _function_mode_on())


_STRIDED = torch.strided
_TENSOR = torch.Tensor


def dense_layout(t: torch.Tensor) -> bool:
    """Memory pinxfer's kernels read as one strided storage: not sparse, nested or
    quantized (those go to torch's own functions: ``Tensor.pin_memory()``, ``Tensor.to()``)."""
    return t.layout is _STRIDED and not t.is_nested and not t.is_quantized


def plain_dense_cpu(t: torch.Tensor) -> bool:
    """The one plain-dense predicate: a plain (not a subclass) dense CPU tensor that needs
    no autograd. What the fast calls take, what ``to_device`` stages and packs itself, what
    a batch slot holds. (Faster than one long expression: module-level names, the cheap
    tests first; this is on every small call's path.)"""
    return type(t) is _TENSOR and t.is_cpu and not t.requires_grad and dense_layout(t)


# ---- the pinned pool (ops: csrc/ops/memory_ops.cpp; the rest: python/memory_bindings.cpp) ----


def empty(size: Sequence[int], dtype: torch.dtype, numa_node: int | None = None) -> torch.Tensor:
    """A CPU tensor of ``size`` and ``dtype`` from the pinned pool of ``numa_node``
    (None: the current GPU's node; -1: unbound). Sizes must be non-negative."""
    return _lib.empty(size, dtype, numa_node)


@torch.library.register_fake("pinxfer::empty")
def _empty_fake(size: list[int], dtype: torch.dtype, numa_node: int | None = None) -> torch.Tensor:
    return torch.empty(size, dtype=dtype, device="cpu")


def record_stream(
    tensor: torch.Tensor, stream_id: int, device_index: int, device_type: int
) -> None:
    """Marks that the CUDA stream packed as (stream_id, device_index, device_type)
    uses pool tensor ``tensor``: its block is not reused before that stream's work so far."""
    _lib.record_stream(tensor, stream_id, device_index, device_type)


def is_pool_tensor(tensor: torch.Tensor) -> bool:
    """True if ``tensor``'s storage is a live block of pinxfer's pool."""
    return bool(_lib.is_pool_tensor(tensor))


# Queries about a tensor's memory: a fake tensor has none, so it is neither a pool
# block nor pinned in place (pinxfer.pin_memory of a fake tensor then traces the copy).
@torch.library.register_fake("pinxfer::is_pool_tensor")
def _is_pool_tensor_fake(tensor: torch.Tensor) -> bool:
    return False


def lock_kind(tensor: torch.Tensor) -> str:
    """How a pool tensor's memory is locked: ``cuda_registered``, ``mlocked`` or ``pageable``."""
    return str(_lib.lock_kind(tensor))


def memory_stats(numa_node: int | None = None) -> collections.OrderedDict[str, int]:
    """Counters of the pinned pool, shaped like ``torch.cuda.memory_stats()``.

    Keys (bytes are exact): ``requested_bytes`` (what live tensors asked for),
    ``allocated_bytes`` (their rounded blocks), ``reserved_bytes`` (pinned from
    the OS), ``cached_bytes`` (reserved but not allocated), ``active_blocks``,
    ``pending_blocks`` (freed, waiting on CUDA events), ``segments``,
    ``graph_segments`` (owned by a CUDA graph's private pool), ``held_blocks``
    (freed, held for CUDA graphs until their pools are released), each with
    ``.current`` and ``.peak``; ``reserved_bytes.{cuda_registered,mlocked,pageable}``;
    counts ``num_allocs``, ``num_frees``, ``num_cache_hits``, ``num_cache_misses``,
    ``num_segment_maps``, ``num_segment_unmaps``, ``num_ooms``, ``num_event_waits``,
    ``num_fenced_frees``, ``num_fence_markers``, ``num_idle_reclaims``, ``num_event_errors``,
    ``num_graph_allocs``;
    times in ns ``pin_time_ns`` (= ``map_time_ns`` + ``touch_time_ns`` + ``lock_time_ns``) and
    ``unpin_time_ns``.

    Args:
        numa_node: one node's pool; None sums all pools (peaks then add up per
            pool, an upper bound of the process peak).
    """
    names, values = fast.memory_stats(numa_node)
    return collections.OrderedDict(zip(names, values))


def reset_peak_memory_stats() -> None:
    """Sets every ``.peak`` counter to its ``.current`` value."""
    fast.reset_peak_memory_stats()


def reset_accumulated_memory_stats() -> None:
    """Zeroes the ``num_*`` counters and the timers."""
    fast.reset_accumulated_memory_stats()


def empty_cache() -> int:
    """The native call behind :func:`pinxfer.empty_cache`: the bytes released."""
    return int(fast.empty_cache())


def set_max_pinned_bytes(limit: int) -> None:
    """Hard cap on pinned bytes reserved by all pools, in bytes (0: no cap)."""
    fast.set_max_pinned_bytes(limit)


def get_max_pinned_bytes() -> int:
    """The cap in bytes (0: no cap)."""
    return int(fast.get_max_pinned_bytes())


def install() -> None:
    """The native call behind :func:`pinxfer.install` (memory.py says what it does)."""
    fast.install(torch.cuda.is_initialized())


def uninstall() -> None:
    """Gives torch its own CUDA host allocator back."""
    fast.uninstall()


def is_installed() -> bool:
    """True while pinxfer's pool is torch's CUDA host allocator."""
    return bool(fast.is_installed())


class BuildInfo(NamedTuple):
    with_cuda: bool  # compiled with the CUDA paths
    cuda_version: str  # toolkit the extension was compiled with, "" if none
    cuda_usable: bool  # a CUDA device can be used by this process (it does not change in it)


def build_info() -> BuildInfo:
    """What the extension was built with and whether CUDA is usable in this process."""
    return _pinxfer_build_info()


def _pinxfer_build_info() -> BuildInfo:
    return BuildInfo(*fast.build_info())


# build_info and cuda_unavailable_reason answer the same for the whole process (the build, and
# whether CUDA is usable, do not change in it), so torch.compile may call them while it traces
# and put the answer in the graph, as it does torch.cuda.is_available(): their bodies carry the
# private mark torch.compiler.assume_constant_result sets (calling that would import dynamo,
# about 1.6 s, at import pinxfer; a torch that does not know the mark traces into the C call
# and breaks the graph there). The bodies are private functions with long names because dynamo
# keeps each answer in the compiled function's module globals under the marked function's
# name, where a user's global of the same name would then be read instead (found by review,
# session 55). A function compiled before a fork keeps its answer in the child, where pinxfer
# no longer uses CUDA; the ops check CUDA again when they run.
_pinxfer_build_info._dynamo_marked_constant = True  # type: ignore[attr-defined]


def page_nodes(tensor: torch.Tensor) -> list[int]:
    """NUMA node of each page of CPU tensor ``tensor`` (negative errno where a page is absent)."""
    return list(_lib.page_nodes(tensor))


def _set_debug_pause_us(us: int) -> None:
    """Test only: allocate and free sleep ``us`` microseconds between their critical sections,
    and so does releasing CUDA graph memory between taking released pools and returning it."""
    fast._set_debug_pause_us(us)


def _inject_host_register_failures(n: int) -> int:
    """Test only: the next ``n`` cudaHostRegister calls of segment mapping fail.
    Returns the injected failures still pending before the call."""
    return int(fast._inject_host_register_failures(n))


def _inject_host_unregister_failures(n: int) -> int:
    """Test only: the next ``n`` cudaHostUnregister calls (a segment's unmapping, ``unpin_``)
    fail, the memory staying registered. Returns the injected failures still pending before."""
    return int(fast._inject_host_unregister_failures(n))


# True once torch's CUDA state is initialised, or once pinxfer knows it cannot use
# CUDA in this process (then nothing is registered with CUDA and there is nothing to
# initialise). Callers on hot paths test it before calling ensure_torch_cuda(), which
# does the work once.
torch_cuda_ready = False


def ensure_torch_cuda() -> None:
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
    global torch_cuda_ready
    if build_info().cuda_usable and not torch.cuda.is_initialized():
        torch.cuda.init()
    torch_cuda_ready = True
    fast.mark_torch_cuda_ready()  # opens the hot calls of pin_memory and empty


def cuda_unavailable_reason() -> str | None:
    """Why pinxfer cannot use a CUDA device in this process, or None if it can.

    The one answer the library's errors, ``pinxfer bench``, ``pinxfer doctor``,
    the examples and the tests give.
    """
    return _pinxfer_cuda_unavailable_reason()


def _pinxfer_cuda_unavailable_reason() -> str | None:
    reason = cuda_unusable_reason()  # C++'s answer: build, fork, setting, driver
    if reason is None and not torch.cuda.is_available():
        reason = (
            f"torch sees no CUDA device (torch {torch.__version__}, CUDA "
            f"{torch.version.cuda or 'none'}): none is present, or CUDA_VISIBLE_DEVICES "
            "hides them"
        )
    return reason


_pinxfer_cuda_unavailable_reason._dynamo_marked_constant = True  # type: ignore[attr-defined]


# ---- settings (pinxfer._C: csrc/python/settings_bindings.cpp) ----


class Setting(NamedTuple):
    name: str  # the environment variable
    value: str  # the value in force, as doctor shows it
    source: str  # "env", "derived" or "default"
    doc: str  # one line: what it sets (csrc/runtime/settings.cpp's table)


def settings() -> list[Setting]:
    """Every row of the settings table as read once from the environment or derived, in
    the table's order. Raises ValueError if a variable is malformed."""
    return [Setting(*row) for row in fast.settings()]


def copy_threads_for(
    affinity_cpus: int, online_cpus: int, quota_cpus: float, local_world_size: int
) -> tuple[int, str]:
    """Copy threads for a process with these CPUs, and the reasoning in one line."""
    threads, why = fast.copy_threads_for(
        affinity_cpus, online_cpus, float(quota_cpus), local_world_size
    )
    return int(threads), str(why)


def _node_pool_plan(
    budget: int, node_cpus: list[int], affinity_cpus: list[int], budget_from_env: bool
) -> tuple[int, list[int]]:
    """TEST-ONLY: the thread pool of a NUMA node whose CPUs are ``node_cpus`` in a process
    allowed on ``affinity_cpus`` with a copy-thread budget of ``budget``: threads (counting
    the caller) and the CPUs its workers are bound to ([]: unbound)."""
    threads, cpus = fast._node_pool_plan(budget, node_cpus, affinity_cpus, budget_from_env)
    return int(threads), list(cpus)


def cgroup_quota_cpus(cgroup_root: str, proc_self_cgroup: str) -> float:
    """CPU quota in CPUs (0: none) of the cgroup named by /proc/self/cgroup's text."""
    return float(fast.cgroup_quota_cpus(cgroup_root, proc_self_cgroup))


def cuda_unusable_reason() -> str | None:
    """C++'s reason CUDA is not usable in this process (None when it is)."""
    return fast.cuda_unusable_reason()


# ---- pin_memory and in-place pinning (kernels: csrc/ops/cpu/) ----


def pin_memory(
    tensor: torch.Tensor, numa_node: int | None = None, num_threads: int = 0
) -> torch.Tensor:
    """``tensor.pin_memory()`` into the pool of ``numa_node`` (None: the current GPU's):
    same sizes and strides, copied by the node's threads, at most ``num_threads`` (0: all)."""
    return _lib.pin_memory(tensor, numa_node, num_threads)


@torch.library.register_fake("pinxfer::pin_memory")
def _pin_memory_fake(
    tensor: torch.Tensor, numa_node: int | None = None, num_threads: int = 0
) -> torch.Tensor:
    # An internally overlapping view (expand) is pinned as a contiguous copy.
    if torch._debug_has_internal_overlap(tensor) == 1:
        return torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
    return torch.empty_strided(
        tensor.shape, tensor.stride(), dtype=tensor.dtype, device=tensor.device
    )


def pin_(tensor: torch.Tensor) -> None:
    """Page-locks ``tensor``'s whole storage in place (cudaHostRegister, else mlock)."""
    _lib.pin_(tensor)


def unpin_(tensor: torch.Tensor) -> None:
    """Undoes exactly what :func:`pin_` did to ``tensor``'s storage."""
    _lib.unpin_(tensor)


def inplace_lock_kind(tensor: torch.Tensor) -> str | None:
    """How :func:`pin_` locked ``tensor``'s storage: ``'cuda_registered'`` or
    ``'mlocked'``; None if ``pin_`` did not pin it."""
    kind = _lib.inplace_lock_kind(tensor)
    return None if kind is None else str(kind)


@torch.library.register_fake("pinxfer::inplace_lock_kind")
def _inplace_lock_kind_fake(tensor: torch.Tensor) -> str | None:
    return None


# ---- topology (pinxfer._C: csrc/python/topology_bindings.cpp) ----


def sysfs_root() -> str:
    """The sysfs root C++ reads by default: ``PINXFER_SYSFS_ROOT``, else ``/sys``."""
    return str(fast.sysfs_root())


def parse_byte_size(text: str) -> int:
    """'512MiB' -> 536870912: the one byte-size parser, C++'s (csrc/runtime/parse.h), so
    Python and PINXFER_MAX_PINNED_BYTES accept the same text. Units are binary; K/M/G/T and
    KB/MB/GB/TB mean the same. Raises ValueError naming the text and the accepted forms."""
    return int(fast.parse_byte_size(text))


def parse_cpulist(text: str) -> list[int]:
    """CPU ids of a kernel CPU list such as ``"0-3,8,10-11"`` (sorted, unique).

    Raises:
        ValueError: the text is not such a list.
    """
    return list(fast.parse_cpulist(text))


def node_cpus(node: int, sysfs_root: str) -> list[int]:
    """CPUs of NUMA node ``node`` under ``sysfs_root``; [] if the node or its cpulist is missing.

    Raises:
        ValueError: the node's cpulist is malformed (the message names the file).
    """
    return list(fast.node_cpus(node, sysfs_root))


def online_nodes(sysfs_root: str) -> list[int]:
    """NUMA nodes present under ``sysfs_root``; [] if none."""
    return list(fast.online_nodes(sysfs_root))


def pci_numa_node(pci_bus_id: str, sysfs_root: str) -> int:
    """NUMA node of a PCI device (``"0000:1b:00.0"``) under ``sysfs_root``; -1 if unknown."""
    return int(fast.pci_numa_node(pci_bus_id, sysfs_root))


def cuda_pci_bus_id(device: int) -> str:
    """PCI bus id CUDA reports for ``device``, without creating a context."""
    return str(fast.cuda_pci_bus_id(device))


def cuda_device_count() -> int:
    """CUDA devices this process can use (0 without CUDA, in a forked child, or when disabled)."""
    return int(fast.cuda_device_count())


def numa_node_for_device(device: int) -> int:
    """NUMA node pinxfer places memory on for CUDA ``device`` (PINXFER_NUMA_NODE, sysfs, or -1)."""
    return int(fast.numa_node_for_device(device))


# ---- transfers (ops: csrc/ops/cuda/to_device_cuda.cpp, CUDA builds only;
#      copy_stream, release_finished_sources, _chunk_plan: csrc/python/transfer_bindings.cpp) ----


def to_device(
    tensor: torch.Tensor,
    device: torch.device,
    chunk_bytes: int,
    num_buffers: int,
    staging: str = "auto",
    cached_tail: int = -1,
) -> torch.Tensor:
    """One CPU tensor to ``device`` (a CUDA device), through pinxfer's staging pipeline.

    Args:
        tensor: a dense CPU tensor, pageable or pinned, any dtype and strides.
        device: the CUDA device.
        chunk_bytes: largest staging chunk (>= 4096); smaller tensors use smaller chunks.
        num_buffers: staging chunks in the ring (>= 1).
        staging: how chunks are staged: "auto", "nt" (nontemporal stores) or "movsb"
            (cached stores); see csrc/transfer/stage_copy.h. ``PINXFER_STAGE_COPY``
            overrides "auto".
        cached_tail: under "auto", bytes at the end of the transfer staged nontemporal
            (-1: pinxfer's choice).

    Returns:
        A contiguous tensor on ``device`` with the same values, dtype and shape.
    """
    if cached_tail == -1 and plain_dense_cpu(tensor) and eager():
        return fast.to_device(tensor, device, chunk_bytes, num_buffers, staging)
    return _lib.to_device(
        tensor, device, int(chunk_bytes), int(num_buffers), staging, int(cached_tail)
    )


@torch.library.register_fake("pinxfer::to_device")
def _to_device_fake(
    tensor: torch.Tensor,
    device: torch.device,
    chunk_bytes: int,
    num_buffers: int,
    staging: str = "auto",
    cached_tail: int = -1,
) -> torch.Tensor:
    return torch.empty(tensor.shape, dtype=tensor.dtype, device=device)


def _cuda_build_function(name: str):
    """The function ``name`` of pinxfer._C that CUDA builds alone have (transfers), or a
    RuntimeError saying that this build has no CUDA."""
    function = getattr(fast, name, None)
    if function is None:
        raise RuntimeError(
            f"pinxfer.{name}: this pinxfer was built without CUDA, so it has no transfers. "
            "Rebuild against a CUDA build of torch with a CUDA toolkit (README, Install)."
        )
    return function


# Offsets of to_device_packed's buffer are rounded to this: C++'s kPackAlign
# (csrc/ops/kernels.h), the one place it is written.
_PACK_ALIGN = int(fast.pack_align)


# The eager call (CUDA builds only).
_fast_to_device_many = getattr(fast, "to_device_many", None)


def pack_offsets(tensors: list[torch.Tensor]) -> tuple[list[int], int]:
    """Where to_device_packed puts each tensor: byte offsets, and the buffer's length."""
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total = (
            (total + t.numel() * t.element_size() + _PACK_ALIGN - 1) // _PACK_ALIGN * _PACK_ALIGN
        )
    return offsets, total


def to_device_packed(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Several CPU tensors to ``device`` packed in one pinned buffer and sent with one copy.

    Args:
        tensors: dense CPU tensors, pageable or pinned, any dtypes and strides.
        device: the CUDA device.

    Returns:
        The packed bytes on ``device`` (uint8): tensor i's values at ``pack_offsets(tensors)
        [0][i]``, contiguous, the padding between tensors zeroed.
    """
    return _lib.to_device_packed(tensors, device)


@torch.library.register_fake("pinxfer::to_device_packed")
def _to_device_packed_fake(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    return torch.empty(pack_offsets(tensors)[1], dtype=torch.uint8, device=device)


def to_device_many(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Several CPU tensors to ``device`` packed in one pinned buffer and one copy.

    Eager: one fast call that also cuts the views in C++. Traced (torch.compile, a
    dispatch mode, autograd): the operator ``to_device_packed`` and the views cut here,
    so tracing sees an operator whose one output aliases nothing.

    Args:
        tensors: dense CPU tensors (at least one), pageable or pinned.
        device: the CUDA device.

    Returns:
        Contiguous tensors on ``device``, same order, sharing one device allocation:
        slices of it (eager), views of it (traced).
    """
    if _fast_to_device_many is not None and eager() and all(plain_dense_cpu(t) for t in tensors):
        return _fast_to_device_many(tensors, device)
    packed = to_device_packed(tensors, device)
    offsets, _ = pack_offsets(tensors)
    return [
        packed.narrow(0, off, t.numel() * t.element_size()).view(t.dtype).view(t.shape)
        for off, t in zip(offsets, tensors)
    ]


def copy_stream(device: torch.device) -> tuple[int, int, int]:
    """The stream pinxfer's H2D copies to ``device`` run on, packed as
    (stream_id, device_index, device_type)."""
    stream_id, device_index, device_type = _cuda_build_function("copy_stream")(device)
    return int(stream_id), int(device_index), int(device_type)


def release_finished_sources(device: torch.device) -> None:
    """Drops pinxfer's references to pinned source tensors whose copies to ``device`` have
    finished (a pinned source is kept alive until its copy ran; the next transfer to the
    device drops it, or this call). Call it after waiting for the copies, before freeing
    pinned memory that must not outlive its owner (the slot ring does)."""
    _cuda_build_function("release_finished_sources")(device)


def _chunk_plan(
    nbytes: int, chunk_bytes: int, num_buffers: int, num_threads: int
) -> tuple[list[int], list[int], int, int, int]:
    """TEST-ONLY: how to_device would cut a transfer: chunk bounds, pieces as flattened
    (chunk, begin, end) triples, ring slots (0: one block), slot bytes, threads."""
    return fast._chunk_plan(nbytes, chunk_bytes, num_buffers, num_threads)
