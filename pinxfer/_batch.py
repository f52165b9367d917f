"""Walking nested batches: find the tensors, rebuild the same structure around new ones.

Containers understood: Mapping (dict, OrderedDict, defaultdict, ...), namedtuple,
tuple, list (and subclasses), dataclass instances. Every other object is a leaf
that passes through untouched (strings, numbers, None, arbitrary objects).
Traversal order is deterministic, so ``tensors_in(obj)`` and the ``fn`` calls of
``map_tensors(obj, fn)`` visit the same tensors in the same order.
"""
from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping, MutableMapping
from typing import Any, Callable

import torch


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """Returns ``obj`` with every tensor ``t`` inside it replaced by ``fn(t)``.

    Containers are rebuilt as their own type where that is possible (a copy of a
    Mapping or dataclass with its fields replaced; ``type(obj)(...)`` for
    sequences), else as the plain builtin (dict, list, tuple).

    Args:
        obj: a tensor or a nested batch.
        fn: applied to each tensor, in traversal order.

    Returns:
        The new structure; ``obj`` itself is not modified.
    """
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (str, bytes, bytearray)):
        return obj
    if isinstance(obj, Mapping):
        items = [(k, map_tensors(v, fn)) for k, v in obj.items()]
        if isinstance(obj, MutableMapping):
            try:
                clone = copy.copy(obj)  # keeps the type and e.g. a defaultdict's factory
                for k, v in items:
                    clone[k] = v
                return clone
            except Exception:  # noqa: BLE001 - an uncopyable mapping becomes a dict
                return dict(items)
        try:
            return type(obj)(items)
        except Exception:  # noqa: BLE001
            return dict(items)
    if isinstance(obj, tuple):
        values = [map_tensors(v, fn) for v in obj]
        if hasattr(obj, "_fields"):  # namedtuple
            return type(obj)(*values)
        if type(obj) is tuple:
            return tuple(values)
        try:
            return type(obj)(values)
        except Exception:  # noqa: BLE001
            return tuple(values)
    if isinstance(obj, list):
        values = [map_tensors(v, fn) for v in obj]
        if type(obj) is list:
            return values
        try:
            return type(obj)(values)
        except Exception:  # noqa: BLE001
            return values
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        clone = copy.copy(obj)
        for f in dataclasses.fields(obj):
            # object.__setattr__ also works for frozen dataclasses.
            object.__setattr__(clone, f.name, map_tensors(getattr(obj, f.name), fn))
        return clone
    return obj


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """Every tensor in a nested batch, in the order :func:`map_tensors` visits them."""
    found: list[torch.Tensor] = []
    _collect(obj, found)
    return found


def _collect(obj: Any, found: list[torch.Tensor]) -> None:
    if isinstance(obj, torch.Tensor):
        found.append(obj)
    elif isinstance(obj, (str, bytes, bytearray)):
        return
    elif isinstance(obj, Mapping):
        for v in obj.values():
            _collect(v, found)
    elif isinstance(obj, (tuple, list)):
        for v in obj:
            _collect(v, found)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            _collect(getattr(obj, f.name), found)
