"""Batches of plain dense CPU tensors: their tensors found, and results put back in their
places, without the batch walker where the batch's shape allows.

``to_device`` of a batch, ``prefetch``'s sender road and ``pin_memory`` of a batch send a
batch's tensors to C++ in one call and rebuild the batch around the results. The walker
(:mod:`pinxfer._batch`) does that for any batch, at a cost that matters on a small call
(a two-tensor dict about 5 us on this project's 2-core machine), so the two shapes most
batches have are taken directly: a flat batch (exactly a dict, list or tuple of tensors)
and a batch one level deep (exactly a dict, list or tuple whose values are tensors and
exact lists / tuples of tensors: a collated batch with a list field). Whatever way is
taken, the tensors are ``tensors_in(obj)`` and the rebuilt batch is what ``map_tensors``
builds (tests/test_batch_layout.py, and a fuzz test against the walker).
"""

from __future__ import annotations

from typing import Any

import torch

from pinxfer import _ops
from pinxfer._batch import map_tensors, tensors_in

_FLAT_BATCH_TYPES = (dict, list, tuple)  # exactly these: subclasses take the batch walker


def _flat_values(batch: dict | list | tuple) -> list:
    """A flat batch's values in the order map_tensors visits them (a dict's in key order)."""
    return list(batch.values()) if type(batch) is dict else list(batch)


def _rebuilt_flat(batch: dict | list | tuple, values: list) -> dict | list | tuple:
    """``batch`` (exactly a dict, list or tuple) with its values replaced, in order: what
    map_tensors builds for a flat batch of tensors."""
    if type(batch) is dict:
        return dict(zip(batch, values))
    return values if type(batch) is list else tuple(values)


#: How :func:`rebuilt_batch` puts a plain batch's results back (:func:`plain_batch`): True, a
#: flat batch; a tuple of counts, a batch one level deep; False, the batch walker (the only
#: layout under which an object inside the batch may be something other than a tensor or
#: an exact container of them).
Layout = bool | tuple[int, ...]


def _one_level_leaves(values: list) -> tuple[list, tuple[int, ...]] | None:
    """The tensors of a flat batch's values when each is a tensor or exactly a list or
    tuple of tensors (a collated batch with a list field): (leaves, per value -1 for a
    tensor or the length of its list / tuple); None for any other values."""
    leaves: list = []
    counts: list[int] = []
    for v in values:
        kind = type(v)
        if kind is torch.Tensor:
            leaves.append(v)
            counts.append(-1)
        elif (kind is list or kind is tuple) and all(type(t) is torch.Tensor for t in v):
            leaves.extend(v)
            counts.append(len(v))
        else:
            return None
    return leaves, tuple(counts)


def plain_batch(obj: Any, min_leaves: int = 2, walk: bool = True) -> tuple[list, Layout] | None:
    """A batch whose tensors are all plain dense CPU tensors (plain_dense_cpu of every leaf,
    in one C++ call), at least ``min_leaves`` of them: (leaves, layout); None for any other
    batch, and (``walk`` False) for one only the walker can take. The leaves are
    ``tensors_in(obj)``, found without the batch walker when ``obj`` is exactly a dict, list
    or tuple whose values are tensors (layout True) or tensors and exact lists / tuples of
    tensors (layout: their counts); the walker costs a two-tensor dict about 5 us on this
    project's 2-core machine, and a collated batch with a list of two tensors 4 us to walk
    and 5 to rebuild, against 1 and 1 this way. :func:`rebuilt_batch` puts results back in
    their places."""

    def all_plain(leaves: list) -> bool:
        return len(leaves) >= min_leaves and _ops.fast.plain_leaves_max_bytes(leaves) >= 0

    if type(obj) in _FLAT_BATCH_TYPES:
        values = _flat_values(obj)
        if all_plain(values):
            return values, True
        one_level = _one_level_leaves(values)
        if one_level is not None:
            return one_level if all_plain(one_level[0]) else None
    # Deeper, or a value that is not a tensor or a list of them: the walker finds them.
    if not walk:
        return None
    leaves = tensors_in(obj)
    return (leaves, False) if all_plain(leaves) else None


def rebuilt_batch(obj: Any, layout: Layout, results: list) -> Any:
    """``obj`` with the leaves :func:`plain_batch` found replaced by ``results``, in order:
    what ``map_tensors`` builds."""
    if layout is True:
        return _rebuilt_flat(obj, results)
    if layout is False:
        sent = iter(results)
        return map_tensors(obj, lambda _t: next(sent))
    values: list = []
    at = 0
    for v, n in zip(_flat_values(obj), layout):  # type: ignore[arg-type]
        if n < 0:
            values.append(results[at])
            at += 1
        else:
            part = results[at : at + n]
            values.append(part if type(v) is list else tuple(part))
            at += n
    return _rebuilt_flat(obj, values)
