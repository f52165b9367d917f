"""Argument checks at the Python edge of the public API, each written once.

Every public function validates what a user passes here, before it reaches the
dispatcher, pybind11 or the OS, so a wrong type or an impossible value raises
TypeError or ValueError with a message that names the function, says what was
expected, what arrived and what to do -- never a dispatcher, pybind11 or
internal-assert message. The C++ operators check again for callers of
``torch.ops.pinxfer`` (csrc/); these checks only make the public edge clear.

Each check is cheap (a few isinstance tests) because ``empty`` and
``pin_memory`` are hot paths; the list of NUMA nodes is read once per process.
"""

from __future__ import annotations

import functools
import operator
import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from pinxfer import _ops

#: Largest int pinxfer's operators take, and so the largest byte count: an int64 (and off_t).
INT64_MAX = 2**63 - 1

#: What a ``device`` argument may be: a torch.device, a string such as ``"cuda:1"``, a GPU index.
DeviceLike = torch.device | str | int

_cuda_usable_in_pid: int | None = None  # the process that found CUDA usable


_F = TypeVar("_F", bound=Callable[..., Any])


def never_traced(op: str, why: str) -> Callable[[_F], _F]:
    """A public function that torch.compile must call, never trace (nor anything it calls):
    ``why`` it cannot be in a graph.

    The wrapper carries the marks ``torch._dynamo.disable`` gives its own wrappers
    (``_torchdynamo_disable``, and ``_torchdynamo_disable_msg``, the reason dynamo prints),
    so dynamo breaks the graph at the call: the code before and after it stays compiled (unless
    the call sits in a ``try`` block: dynamo then runs the whole function uncompiled), the call
    runs for real, and
    ``fullgraph=True`` fails naming ``pinxfer.<op>`` and the reason. Called, the wrapper runs
    the function with dynamo off for everything it calls (``torch._dynamo.disable``,
    recursive): dynamo would otherwise compile each function the call makes, each traced on
    its own (``require_cuda``, traced so, trusted a caller's op to check CUDA and skipped its
    check). The marks are private to dynamo, which reads them with ``getattr_static`` and a
    default, so a torch that does not know one ignores it; if dynamo traces into the wrapper
    anyway, it raises the same message. No compile can be running before something imported
    ``torch._dynamo``, and until then the function is called directly: importing dynamo costs
    about 1.6 s.

    Whether dynamo traces the wrapper is asked of ``_ops.compiling`` (dynamo's own test), not
    ``torch.compiler.is_compiling()``: torch 2.14 holds that one True in every thread for the
    whole of a compile, so a call in another thread (a monitoring thread's ``memory_stats``), or
    one run for real while something is traced (non-strict ``torch.export``, a function dynamo
    calls at trace time), raised this message (found by review, session 55).
    """
    message = (
        f"pinxfer.{op} cannot be traced by torch.compile: {why}. Call it outside the "
        "compiled function, or compile without fullgraph=True (the call then breaks the graph)"
    )

    def wrap(fn: _F) -> _F:
        disabled: Callable[..., Any] | None = None

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            nonlocal disabled
            if _ops.compiling():
                raise RuntimeError(message)
            if disabled is None:
                # Not before dynamo is imported, nor while another thread still imports it
                # (the module is in sys.modules before its disable is defined).
                disable = getattr(sys.modules.get("torch._dynamo"), "disable", None)
                if disable is None:
                    return fn(*args, **kwargs)
                disabled = disable(fn, recursive=True)  # two threads may both: either is right
            return disabled(*args, **kwargs)

        run._torchdynamo_disable = True  # type: ignore[attr-defined]
        run._torchdynamo_disable_msg = message  # type: ignore[attr-defined]
        return run  # type: ignore[return-value]

    return wrap


def require_cuda(op: str, hint: str = "") -> None:
    """Raises RuntimeError unless this process can use a CUDA device: the Python side's one
    "is CUDA usable" check, with the reason from :func:`pinxfer.cuda_unavailable_reason`.

    Once usable, CUDA stays usable in a process (a forked child is another pid), so after the
    first success this is one ``os.getpid()``."""
    if _ops.traced():
        # Traced (torch.compile, or an export's fake tensors): dynamo cannot trace os.getpid;
        # the op checks CUDA itself when the compiled code runs.
        return
    reason = _unusable_reason()
    if reason is not None:
        raise _cuda_unusable(op, reason, hint)


def _unusable_reason() -> str | None:
    """Why CUDA is unusable, None once it was found usable in this process (then one
    ``os.getpid()``). Not for traced code."""
    global _cuda_usable_in_pid
    if _cuda_usable_in_pid == os.getpid():
        return None
    reason = _ops.cuda_unavailable_reason()
    if reason is None:
        _cuda_usable_in_pid = os.getpid()
    return reason


def _cuda_unusable(op: str, reason: str, hint: str) -> RuntimeError:
    return RuntimeError(f"pinxfer.{op}: expected a usable CUDA device, but {reason}.{hint}")


def as_device(value: DeviceLike) -> torch.device:
    """A device argument as a torch.device (an int is that GPU), neither resolved nor checked.
    A bool is refused (``True`` read as GPU 1)."""
    if isinstance(value, bool):
        raise TypeError(
            f"pinxfer: expected a device (a torch.device, a string such as 'cuda:0', or a "
            f"GPU index), got bool {value!r}"
        )
    return torch.device("cuda", value) if isinstance(value, int) else torch.device(value)


def device(value: DeviceLike | None, op: str, hint: str = "") -> torch.device:
    """The device a call names, resolved once, at the edge: None is the current GPU, an int
    that GPU, a CUDA device without an index the current one. A CUDA device is checked to
    be usable (:func:`require_cuda`); the layers below take the result as it is."""
    if value is None:
        return torch.device("cuda", _current_cuda_index(op, hint))
    dev = as_device(value)
    if dev.type == "cuda":
        if dev.index is None:
            return torch.device("cuda", _current_cuda_index(op, hint))
        require_cuda(op, hint)
    return dev


def _current_cuda_index(op: str, hint: str) -> int:
    """The current GPU, once CUDA is known to be usable.

    torch.cuda.current_device() initialises CUDA, and on a machine without a GPU it raised
    inside dynamo (InternalTorchDynamoError, "Found no NVIDIA driver") where eager raises
    require_cuda's message (found in session 54: to_device of a batch, or to "cuda", compiled).
    Traced, require_cuda leaves its check to the op when the graph runs; and a frame dynamo
    gives up on runs eagerly while the functions it calls are compiled on their own, in
    which require_cuda checks nothing. So the check is made here, in this frame: traced, by
    ``cuda_unavailable_reason``, which dynamo answers at trace time (a constant result)."""
    reason = _ops.cuda_unavailable_reason() if _ops.traced() else _unusable_reason()
    if reason is not None:
        raise _cuda_unusable(op, reason, hint)
    return torch.cuda.current_device()


def integer(value: Any, op: str, name: str, *, lo: int, hi: int, hint: str = "") -> int:
    """``value`` as an int in ``[lo, hi]``.

    Accepts ints and objects with ``__index__`` (numpy integers, 0-d integer
    tensors); rejects bool (``True`` is not a count), float and everything else
    with TypeError, and a value out of range with ValueError."""
    if isinstance(value, (bool, float)):
        raise TypeError(
            f"pinxfer.{op}: {name} must be an int, got {type(value).__name__} {value!r}{hint}"
        )
    try:
        n = operator.index(value)
    except TypeError:
        raise TypeError(
            f"pinxfer.{op}: {name} must be an int, got {type(value).__name__} {value!r}{hint}"
        ) from None
    if not lo <= n <= hi:
        raise ValueError(f"pinxfer.{op}: {name} must be in [{lo}, {hi}], got {n}{hint}")
    return n


@functools.lru_cache(maxsize=1)
def existing_numa_nodes() -> tuple[int, ...]:
    """NUMA nodes of this machine, as placement sees them (sysfs under
    ``PINXFER_SYSFS_ROOT``, else ``/sys``); ``(0,)`` where sysfs has no NUMA
    information (one node). Read once: nodes do not come and go while a process runs."""
    return tuple(_ops.online_nodes(_ops.sysfs_root())) or (0,)


def numa_node(value: Any, op: str) -> int | None:
    """``numa_node`` argument: None (the current GPU's node) or an int (not a bool).
    Which ints are nodes (-1, or a node in sysfs) is the C++ side's one rule
    (``resolve_numa_node`` in csrc/memory/placement.h), which every way in shares."""
    if value is None:
        return None
    hint = " (-1: no binding; None: the current GPU's node)"
    return integer(value, op, "numa_node", lo=-(2**63), hi=INT64_MAX, hint=hint)


def byte_count(value: Any, op: str, name: str) -> int:
    """A number of bytes: an int in ``[0, 2**63 - 1]`` or a size string such as
    ``"8GiB"``, read by pinxfer's one size parser (csrc/runtime/parse.cpp: exact
    to 2**63 - 1, and a fraction of a byte is refused rather than read as 0)."""
    hint = " (a whole number of bytes, or a size string such as '8GiB'); for a float pass int(x)"
    if isinstance(value, str):
        return _ops.parse_byte_size(value)  # ValueError naming the text and the accepted forms
    return integer(value, op, name, lo=0, hi=INT64_MAX, hint=hint)


def dtype(value: Any, op: str) -> torch.dtype:
    """A ``torch.dtype`` that a plain tensor can hold (not quantized: a quantized
    tensor needs a quantizer, which a bare allocation does not have)."""
    if not isinstance(value, torch.dtype):
        raise TypeError(
            f"pinxfer.{op}: dtype must be a torch.dtype (e.g. torch.float32), got "
            f"{type(value).__name__} {value!r}"
        )
    return value


def tensor(value: Any, op: str) -> torch.Tensor:
    """A dense (strided) tensor that has memory: what pinxfer's queries about a
    tensor's memory (pool block, lock kind, stream marks, in-place pinning) take.
    None and non-tensors raise TypeError; sparse, nested and meta tensors, whose
    memory is not one storage of their own, raise ValueError."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"pinxfer.{op}: expected a torch.Tensor, got {type(value).__name__}")
    if value.is_nested:
        raise ValueError(
            f"pinxfer.{op}: expected a dense (strided) tensor, got a nested tensor; "
            "ask about its buffer (t.values() for a jagged one) or unbind() it"
        )
    if value.layout != torch.strided:
        raise ValueError(
            f"pinxfer.{op}: expected a dense (strided) tensor, got layout "
            f"{value.layout}; a sparse tensor's memory is its indices and values "
            "tensors: ask about those (e.g. t.values())"
        )
    if value.is_meta:
        raise ValueError(
            f"pinxfer.{op}: expected a tensor with memory, got a meta tensor "
            "(shape and dtype only); pass a CPU tensor"
        )
    return value


def pci_bus_ids(value: Any, op: str) -> list[str]:
    """A list of PCI bus ids. A single string is refused: iterating it would read
    each character as a bus id."""
    if isinstance(value, (str, bytes)):
        raise TypeError(
            f"pinxfer.{op}: pci_bus_ids must be a list of bus ids, got the single "
            f"string {value!r}; pass [{value!r}]"
        )
    try:
        ids = list(value)
    except TypeError:
        raise TypeError(
            f"pinxfer.{op}: pci_bus_ids must be a list of bus id strings such as "
            f"'0000:1b:00.0', got {type(value).__name__}"
        ) from None
    for i, bus_id in enumerate(ids):
        if not isinstance(bus_id, str):
            raise TypeError(
                f"pinxfer.{op}: pci_bus_ids[{i}] must be a bus id string such as "
                f"'0000:1b:00.0', got {type(bus_id).__name__} {bus_id!r}"
            )
    return ids
