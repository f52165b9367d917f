"""The stress's own batch walker: reach a leaf of a nested batch by its path, and say how an
output's structure differs from its source's.

Independent of pinxfer's batch code (pinxfer/_batch.py), which it checks. The suite's other
batch comparisons (tests/test_fuzz.py ``assert_same_batch``, tests/test_slots.py
``assert_same``) assert equal values on one device, and the slots one walks with pinxfer's
own ``tensors_in``; here the structure is checked on the host and the bytes later, on the
device, by checker.Checker.
"""

from __future__ import annotations

import collections
from typing import Any

import torch

Pair = collections.namedtuple("Pair", ["a", "b"])


def get_path(obj: Any, path: tuple) -> Any:
    for key in path:
        obj = obj[key]
    return obj


def structure_diff(src: Any, out: Any, gpu_identity: bool, path: str = "batch") -> str | None:
    """None if ``out`` has the structure of ``src`` (types, keys, lengths, non-tensor leaves,
    and with ``gpu_identity`` device tensors returned as they are); else what differs."""
    if isinstance(src, torch.Tensor):
        if not isinstance(out, torch.Tensor):
            return f"{path}: got {type(out).__name__}, expected a tensor"
        if gpu_identity and src.device.type == "cuda" and out is not src:
            return f"{path}: a tensor already on the device was not returned as it is"
        return None
    if type(out) is not type(src):
        return f"{path}: got a {type(out).__name__}, expected a {type(src).__name__}"
    if isinstance(src, dict):
        if list(out.keys()) != list(src.keys()):
            return f"{path}: keys {list(out.keys())}, expected {list(src.keys())}"
        for k in src:
            d = structure_diff(src[k], out[k], gpu_identity, f"{path}[{k!r}]")
            if d:
                return d
        return None
    if isinstance(src, (list, tuple)):
        if len(out) != len(src):
            return f"{path}: length {len(out)}, expected {len(src)}"
        for i, (a, b) in enumerate(zip(src, out)):
            d = structure_diff(a, b, gpu_identity, f"{path}[{i}]")
            if d:
                return d
        return None
    if out is not src and out != src:
        return f"{path}: non-tensor leaf {src!r} came back as {out!r}"
    return None
