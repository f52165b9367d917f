"""The one walker of nested batches, used by pin_memory, to_device, to_host and prefetch.

Containers understood, in this order of precedence:
  * dataclass instances (frozen too; fields set with ``object.__setattr__`` on a
    shallow copy, so ``init=False`` fields and ``__post_init__`` are left alone);
  * Mappings: a MutableMapping is rebuilt as ``copy.copy(obj)`` with its values
    replaced (keeps OrderedDict, defaultdict's factory, subclasses), any other
    Mapping as ``type(obj)(dict)``, else a dict;
  * namedtuples (``type(obj)(*values)``, paths name fields), tuples (``type(obj)(values)``, else a tuple);
  * MutableSequences: a list as a list, others as a copy with items replaced,
    else a list;
  * other Sequences (range, a user's immutable Sequence): ``type(obj)(items)``, else a
    list, as torch's DataLoader pinning does (``range(3)`` becomes ``[0, 1, 2]``).
Strings and bytes are leaves. A caller may claim other objects first with
``other`` (pin_memory asks objects with their own ``pin_memory()`` to pin
themselves); every remaining object passes through untouched.

:func:`tensors_in` and :func:`map_tensors` visit tensors in the same order, so a
caller can send every tensor of a batch to C++ in one call and put the results
back: ``it = iter(results); map_tensors(obj, lambda t: next(it))``.

A batch that contains itself (a list appended to itself, say) raises ValueError
naming the cycle, e.g. ``batch['x'][1] is batch['x']``, where recursion would
otherwise end in a bare RecursionError. The walk does not track what it has
seen (that would cost every call); the cycle is looked for only once the
recursion limit is hit.

Errors carry the place they happened: an exception raised by ``fn`` or
``other`` is re-raised by :func:`map_tensors` through ``describe(err, path)``
with a path such as ``batch['x'][2].field``. The path is assembled only when
an exception passes (zero cost otherwise).

Measured against ``torch.utils._pytree`` (which needs dataclasses registered and
treats Mapping subclasses other than dict/OrderedDict/defaultdict as leaves):
see ``benchmarks/bench_small_calls.py``.
"""
from __future__ import annotations

import copy
import dataclasses
import sys
from collections.abc import Mapping, MutableMapping, MutableSequence, Sequence
from typing import Any, Callable, Optional

import torch

# other(obj) returns this to decline an object (it is walked or passed through).
PASS = object()

_LEAF_TYPES = (str, bytes, bytearray, int, float, bool, type(None))


class _WhereError(Exception):
    """Carries an exception out of the walk with the path parts, innermost first."""

    def __init__(self, err: BaseException, part: str):
        super().__init__()
        self.err = err
        self.parts = [part]


def _is_dataclass_instance(obj: Any) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def _walk(obj: Any, fn: Callable, other: Optional[Callable]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, _LEAF_TYPES):
        return obj
    if other is not None:
        claimed = other(obj)
        if claimed is not PASS:
            return claimed
    if _is_dataclass_instance(obj):
        clone = copy.copy(obj)
        for f in dataclasses.fields(obj):
            if hasattr(obj, f.name):  # an init=False field may be unset
                object.__setattr__(clone, f.name, _step(getattr(obj, f.name), fn, other,
                                                        f.name, "."))
        return clone
    if isinstance(obj, Mapping):
        values = {k: _step(v, fn, other, k, "[]") for k, v in obj.items()}
        if isinstance(obj, MutableMapping):
            try:
                clone = copy.copy(obj)  # keeps the type and e.g. a defaultdict's factory
                clone.update(values)
                return clone
            except Exception:  # noqa: BLE001 - an uncopyable mapping becomes a dict
                return values
        try:
            return type(obj)(values)  # type: ignore[call-arg]
        except Exception:  # noqa: BLE001
            return values
    if isinstance(obj, tuple):
        fields = getattr(type(obj), "_fields", None)
        if fields is not None:  # namedtuple: paths name the fields
            return type(obj)(*(_step(v, fn, other, f, ".") for f, v in zip(fields, obj)))
        items = [_step(v, fn, other, i, "[]") for i, v in enumerate(obj)]
        if type(obj) is tuple:
            return tuple(items)
        try:
            return type(obj)(items)
        except Exception:  # noqa: BLE001
            return tuple(items)
    if isinstance(obj, MutableSequence):
        items = [_step(v, fn, other, i, "[]") for i, v in enumerate(obj)]
        if type(obj) is list:
            return items
        try:
            clone = copy.copy(obj)
            for i, v in enumerate(items):
                clone[i] = v
            return clone
        except Exception:  # noqa: BLE001
            return items
    if isinstance(obj, Sequence) and not isinstance(obj, (str, bytes, bytearray, memoryview)):
        # An immutable sequence that is not a tuple (range, a user's Sequence): rebuilt as
        # type(obj)(items), else a list -- what torch's DataLoader pinning does
        # (torch/utils/data/_utils/pin_memory.py), so range(3) comes back as [0, 1, 2].
        items = [_step(v, fn, other, i, "[]") for i, v in enumerate(obj)]
        try:
            return type(obj)(items)  # type: ignore[call-arg]
        except TypeError:
            return items
    return obj


def _step(value: Any, fn: Callable, other: Optional[Callable], key: Any, style: str) -> Any:
    try:
        return _walk(value, fn, other)
    except _WhereError as where:
        where.parts.append(_part(key, style))
        raise
    except Exception as err:  # noqa: BLE001 - carried out with its path, re-raised as is
        raise _WhereError(err, _part(key, style)) from None


def _part(key: Any, style: str) -> str:
    return f".{key}" if style == "." else f"[{key!r}]"


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any], *,
                other: Optional[Callable[[Any], Any]] = None,
                describe: Callable[[BaseException, str], BaseException] = lambda e, _p: e,
                root: str = "batch") -> Any:
    """Returns ``obj`` with every tensor ``t`` inside it replaced by ``fn(t)``.

    Args:
        obj: a tensor or a nested batch.
        fn: applied to each tensor, in traversal order.
        other: called with each non-container, non-tensor object before it is
            walked; its result replaces the object unless it returns ``PASS``.
        describe: turns an exception raised inside the batch and its path
            (e.g. ``batch['x'][2]``) into the exception to raise (default: the
            original exception, unchanged).
        root: the name of the outermost object in paths.

    Returns:
        The new structure; ``obj`` itself is not modified.
    """
    try:
        return _walk(obj, fn, other)
    except RecursionError:
        raise _too_deep(obj, root) from None
    except _WhereError as where:
        err = where.err
        if isinstance(err, RecursionError):
            raise _too_deep(obj, root) from None
        described = describe(err, root + "".join(reversed(where.parts)))
        if described is err:
            raise err from None  # the original, as fn or other raised it
        raise described from err


def tensors_in(obj: Any, *, other: Optional[Callable[[Any], bool]] = None) -> list[torch.Tensor]:
    """Every tensor in a nested batch, in the order :func:`map_tensors` visits them.

    ``other(obj)`` True marks an object that :func:`map_tensors`'s ``other``
    claims: it is not looked into."""
    found: list[torch.Tensor] = []
    try:
        _collect(obj, found, other)
    except RecursionError:
        raise _too_deep(obj, "batch") from None
    return found


def _collect(obj: Any, found: list, other: Optional[Callable[[Any], bool]]) -> None:
    if isinstance(obj, torch.Tensor):
        found.append(obj)
    elif isinstance(obj, _LEAF_TYPES) or (other is not None and other(obj)):
        return
    elif _is_dataclass_instance(obj):
        for f in dataclasses.fields(obj):
            if hasattr(obj, f.name):
                _collect(getattr(obj, f.name), found, other)
    elif isinstance(obj, Mapping):
        for v in obj.values():
            _collect(v, found, other)
    elif isinstance(obj, (tuple, MutableSequence)) or (
            isinstance(obj, Sequence) and not isinstance(obj, (str, bytes, bytearray, memoryview))):
        for v in obj:
            _collect(v, found, other)


def _children(obj: Any) -> list[tuple[str, Any]]:
    """(path part, child) of a container, as :func:`_walk` visits them; [] for leaves."""
    if isinstance(obj, (torch.Tensor,) + _LEAF_TYPES):
        return []
    if _is_dataclass_instance(obj):
        return [(_part(f.name, "."), getattr(obj, f.name)) for f in dataclasses.fields(obj)
                if hasattr(obj, f.name)]
    if isinstance(obj, Mapping):
        return [(_part(k, "[]"), v) for k, v in obj.items()]
    if isinstance(obj, tuple) and getattr(type(obj), "_fields", None) is not None:
        return [(_part(f, "."), v) for f, v in zip(type(obj)._fields, obj)]
    if isinstance(obj, (tuple, MutableSequence)):
        return [(_part(i, "[]"), v) for i, v in enumerate(obj)]
    return []


def _too_deep(obj: Any, root: str) -> ValueError:
    """The error for a batch whose walk hit the recursion limit: the cycle it
    contains, found by an iterative depth-first search, or its depth."""
    path_ids: dict[int, str] = {id(obj): root}  # containers on the current path -> their path
    stack = [(obj, root, iter(_children(obj)))]
    while stack:
        container, where, children = stack[-1]
        for part, child in children:
            child_path = where + part
            if id(child) in path_ids:
                return ValueError(
                    f"pinxfer: the batch contains itself: {child_path} is {path_ids[id(child)]} "
                    "(a cycle), so it cannot be walked; pass a batch whose containers do not "
                    "refer back to an enclosing one")
            grandchildren = _children(child)
            if grandchildren:
                path_ids[id(child)] = child_path
                stack.append((child, child_path, iter(grandchildren)))
                break
        else:
            stack.pop()
            path_ids.pop(id(container), None)
    return ValueError(f"pinxfer: the batch nests deeper than Python's recursion limit "
                      f"({sys.getrecursionlimit()}) allows walking; flatten it")
