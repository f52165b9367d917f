"""The one walker of nested batches, used by pin_memory, to_device, to_host and prefetch.

Containers understood, in this order of precedence:
  * dataclass instances (frozen too; fields set with ``object.__setattr__`` on a
    shallow copy, so ``init=False`` fields and ``__post_init__`` are left alone);
  * Mappings: a MutableMapping is rebuilt as ``copy.copy(obj)`` with its values
    replaced (keeps OrderedDict, defaultdict's factory, subclasses), any other
    Mapping as ``type(obj)(dict)``, else a dict;
  * namedtuples (``type(obj)(*values)``, paths name fields), tuples (``type(obj)(values)``,
    else a tuple);
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
from collections.abc import Callable, Mapping, MutableMapping, MutableSequence, Sequence
from typing import Any

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


# The containers a walk looks into, in order of precedence: _kind is the one
# classification, and _set_fields / _values give each kind's children in the one order
# that map_tensors, tensors_in and the cycle search all follow.
_DATACLASS, _MAPPING, _NAMEDTUPLE, _TUPLE, _MUTABLE_SEQUENCE, _SEQUENCE = range(6)
_NOT_SEQUENCES = (str, bytes, bytearray, memoryview)


def _kind(obj: Any) -> int | None:
    """The container kind of a non-tensor, non-leaf object; None: not a container."""
    if _is_dataclass_instance(obj):
        return _DATACLASS
    if isinstance(obj, Mapping):
        return _MAPPING
    if isinstance(obj, tuple):
        return _NAMEDTUPLE if getattr(type(obj), "_fields", None) is not None else _TUPLE
    if isinstance(obj, MutableSequence):
        return _MUTABLE_SEQUENCE
    if isinstance(obj, Sequence) and not isinstance(obj, _NOT_SEQUENCES):
        return _SEQUENCE
    return None


# Exactly a tuple, list or dict (most batches): _kind's answer without its isinstance chain.
_PLAIN_KINDS = {tuple: _TUPLE, list: _MUTABLE_SEQUENCE, dict: _MAPPING}


def _set_fields(obj: Any) -> list[str]:
    """A dataclass instance's fields that are set (an init=False field may be unset)."""
    return [f.name for f in dataclasses.fields(obj) if hasattr(obj, f.name)]


def _values(obj: Any, kind: int) -> Any:
    """A container's children, in walk order."""
    if kind == _DATACLASS:
        return [getattr(obj, name) for name in _set_fields(obj)]
    if kind == _MAPPING:
        return obj.values()
    return obj  # tuples, namedtuples, sequences: their own order


def _walk(obj: Any, fn: Callable, other: Callable | None) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, _LEAF_TYPES):
        return obj
    if other is not None:
        claimed = other(obj)
        if claimed is not PASS:
            return claimed
    kind = _PLAIN_KINDS.get(type(obj))
    if kind is None:
        kind = _kind(obj)
        if kind is None:
            return obj
    if kind == _DATACLASS:
        clone = copy.copy(obj)
        for name in _set_fields(obj):
            object.__setattr__(clone, name, _step(getattr(obj, name), fn, other, name, "."))
        return clone
    if kind == _MAPPING:
        values = {k: _step(v, fn, other, k, "[]") for k, v in obj.items()}
        if type(obj) is dict:
            return values  # what the copy below would give, without its cost
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
    if kind == _NAMEDTUPLE:  # paths name the fields
        return type(obj)(*(_step(v, fn, other, f, ".") for f, v in zip(type(obj)._fields, obj)))
    items = [_step(v, fn, other, i, "[]") for i, v in enumerate(obj)]
    if kind == _TUPLE:
        if type(obj) is tuple:
            return tuple(items)
        try:
            return type(obj)(items)
        except Exception:  # noqa: BLE001
            return tuple(items)
    if kind == _MUTABLE_SEQUENCE:
        if type(obj) is list:
            return items
        try:
            clone = copy.copy(obj)
            for i, v in enumerate(items):
                clone[i] = v
            return clone
        except Exception:  # noqa: BLE001
            return items
    # An immutable sequence that is not a tuple (range, a user's Sequence): rebuilt as
    # type(obj)(items), else a list -- what torch's DataLoader pinning does
    # (torch/utils/data/_utils/pin_memory.py), so range(3) comes back as [0, 1, 2].
    try:
        return type(obj)(items)  # type: ignore[call-arg]
    except TypeError:
        return items


def _step(value: Any, fn: Callable, other: Callable | None, key: Any, style: str) -> Any:
    try:
        return _walk(value, fn, other)
    except _WhereError as where:
        where.parts.append(_part(key, style))
        raise
    except Exception as err:  # noqa: BLE001 - carried out with its path, re-raised as is
        raise _WhereError(err, _part(key, style)) from None


def _part(key: Any, style: str) -> str:
    return f".{key}" if style == "." else f"[{key!r}]"


def map_tensors(
    obj: Any,
    fn: Callable[[torch.Tensor], Any],
    *,
    other: Callable[[Any], Any] | None = None,
    describe: Callable[[BaseException, str], BaseException] = lambda e, _p: e,
    root: str = "batch",
) -> Any:
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


def tensors_in(obj: Any, *, other: Callable[[Any], bool] | None = None) -> list[torch.Tensor]:
    """Every tensor in a nested batch, in the order :func:`map_tensors` visits them.

    ``other(obj)`` True marks an object that :func:`map_tensors`'s ``other``
    claims: it is not looked into."""
    found: list[torch.Tensor] = []
    try:
        _collect(obj, found, other)
    except RecursionError:
        raise _too_deep(obj, "batch") from None
    return found


def _collect(obj: Any, found: list, other: Callable[[Any], bool] | None) -> None:
    if isinstance(obj, torch.Tensor):
        found.append(obj)
    elif not (isinstance(obj, _LEAF_TYPES) or (other is not None and other(obj))):
        kind = _PLAIN_KINDS.get(type(obj))
        if kind is None:
            kind = _kind(obj)
            if kind is None:
                return
        for v in _values(obj, kind):
            _collect(v, found, other)


def _children(obj: Any) -> list[tuple[str, Any]]:
    """(path part, child) of a container, as :func:`_walk` visits them; [] for leaves."""
    if isinstance(obj, (torch.Tensor, *_LEAF_TYPES)):
        return []
    kind = _kind(obj)
    if kind is None:
        return []
    if kind == _DATACLASS:
        keys, style = _set_fields(obj), "."
    elif kind == _MAPPING:
        keys, style = list(obj.keys()), "[]"
    elif kind == _NAMEDTUPLE:
        keys, style = list(type(obj)._fields), "."
    else:
        keys, style = range(len(obj)), "[]"
    return [(_part(k, style), v) for k, v in zip(keys, _values(obj, kind))]


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
                    "refer back to an enclosing one"
                )
            grandchildren = _children(child)
            if grandchildren:
                path_ids[id(child)] = child_path
                stack.append((child, child_path, iter(grandchildren)))
                break
        else:
            stack.pop()
            path_ids.pop(id(container), None)
    return ValueError(
        f"pinxfer: the batch nests deeper than Python's recursion limit "
        f"({sys.getrecursionlimit()}) allows walking; flatten it"
    )
