"""Byte-level helpers on tensors: element sizes, raw byte views, the view specs the sources
apply identically on the host and on the device. torch only: nothing here asks pinxfer."""

from __future__ import annotations

import math
import random

import torch

KiB = 1 << 10
MiB = 1 << 20

DTYPES = [
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.bool,
]
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

_ELSIZE: dict = {}


def elsize(dtype: torch.dtype) -> int:
    n = _ELSIZE.get(dtype)
    if n is None:
        n = _ELSIZE[dtype] = torch.empty((), dtype=dtype).element_size()
    return n


def flat_bytes(t: torch.Tensor) -> torch.Tensor | None:
    """A dense tensor's bytes as a 1-D uint8 view (no copy); None if it has no such view
    (not contiguous, or a one-element view whose stride is not 1)."""
    if not t.is_contiguous():
        return None
    f = t.view(-1)
    if f.numel() and f.stride(0) != 1:
        return None
    return f.view(torch.uint8)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The values of ``t`` in logical order, as raw bytes (a copy only if needed): bool,
    NaN payloads and -0.0 then compare exactly."""
    if t.requires_grad:
        t = t.detach()
    f = flat_bytes(t)
    if f is None:
        f = flat_bytes(t.clone(memory_format=torch.contiguous_format))
    return f


def apply_view(t: torch.Tensor, spec: tuple | None) -> torch.Tensor:
    """Applies a view spec (see sources.Sources.layout) identically to a host or a device
    tensor."""
    if spec is None:
        return t
    kind = spec[0]
    if kind == "narrow":
        return t.narrow(0, spec[1], spec[2])
    if kind == "t":
        return t.t()
    if kind == "slice":
        _, dim, start, step = spec
        return t[start::step] if dim == 0 else t[:, start::step]
    if kind == "expand":
        return t.expand(*spec[1])
    if kind == "permute":
        return t.permute(*spec[1])
    raise ValueError(f"unknown view spec {spec!r}")


def loguniform(rng: random.Random, lo: int, hi: int) -> int:
    return max(lo, min(hi, int(math.exp(rng.uniform(math.log(lo), math.log(hi + 1))))))
