"""The random sources of one stress thread: sizes, dtypes, layouts (views), host memory
kinds, nested batches, and for each host source its expected value on the device.

Expected values: each thread draws a random byte buffer R on the device (torch.randint with
a generator seeded from the thread's seed) and copies it to the host once with torch's
synchronous copy. A host source is a fresh allocation filled from a slice of R on the host
(torch's CPU copy); its expected value is the same slice of R on the device with the same
view applied there. On the CPU both are host tensors.
"""

from __future__ import annotations

import math
import mmap
import random
from typing import Any

import torch

import pinxfer
from tests.stress.batches import Pair
from tests.stress.env import Env
from tests.stress.tensors import (
    DTYPES,
    FLOAT_DTYPES,
    KiB,
    MiB,
    apply_view,
    as_bytes,
    elsize,
    flat_bytes,
    loguniform,
)

BOUNDARY_SIZES = [
    1,
    2,
    3,
    7,
    8,
    511,
    512,
    513,
    4095,
    4096,
    4097,
    65535,
    65536,
    65537,
    256 * KiB - 1,
    256 * KiB,
    256 * KiB + 1,
    MiB - 1,
    MiB,
    MiB + 1,
    4 * MiB + 3,
    16 * MiB - 1,
    16 * MiB,
    16 * MiB + 1,
    64 * MiB,
]
LAYOUTS = [
    "contig",
    "shaped",
    "scalar",
    "empty",
    "offset",
    "t",
    "step",
    "step2d",
    "expand",
    "permute",
]
LAYOUT_WEIGHTS = [34, 12, 2, 1, 9, 12, 9, 7, 6, 8]
DENSE_LAYOUTS = ["contig", "shaped", "scalar"]  # views whose base is the tensor itself


class Leaf:
    """One host source, its expected device value and how it was made."""

    __slots__ = ("base", "exp", "exp_b", "layout", "mem", "meta", "nbytes", "scribble_ok", "src")

    def __init__(self, src, base, exp, exp_b, mem, layout, nbytes, meta, scribble_ok=True):
        self.src, self.base, self.exp, self.exp_b = src, base, exp, exp_b
        self.mem, self.layout, self.nbytes, self.meta = mem, layout, nbytes, meta
        self.scribble_ok = scribble_ok

    def drop_source(self) -> None:
        self.src = None
        self.base = None


class Sources:
    def __init__(self, env: Env, rng: random.Random, large_frac: float, medium_frac: float):
        self.env = env
        self.rng = rng
        self.large_frac = large_frac
        self.medium_frac = medium_frac

    def fill_random(self, seed: int) -> None:
        """Draws R on the current stream (the caller synchronises it before use)."""
        env = self.env
        gen = torch.Generator(device=env.device)
        gen.manual_seed(seed)
        self.R_g = torch.randint(
            0, 256, (env.r_bytes,), dtype=torch.uint8, device=env.device, generator=gen
        )
        self.Rb_g = torch.bitwise_and(self.R_g, 1)  # bytes of valid bools
        # torch's synchronous device -> host copy: the trusted path.
        self.R_h = self.R_g.cpu() if env.cuda else self.R_g.clone()
        self.Rb_h = self.Rb_g.cpu() if env.cuda else self.Rb_g.clone()

    def sample_nbytes(self, cap: int) -> int:
        rng, cap = self.rng, min(cap, self.env.max_bytes)
        r = rng.random()
        if r < 0.03:
            n = rng.choice(BOUNDARY_SIZES)
        elif r < 0.03 + self.large_frac:
            n = loguniform(rng, 16 * MiB, 64 * MiB)
        elif r < 0.03 + self.large_frac + self.medium_frac:
            n = loguniform(rng, MiB, 16 * MiB)
        else:
            n = loguniform(rng, 1, 3 * MiB // 2)
        return max(1, min(n, cap))

    def layout(self, layout: str, n: int, es: int, cap: int) -> tuple[tuple, tuple | None]:
        """(base shape, view spec) for about n elements of es bytes; base <= cap bytes."""
        rng = self.rng
        maxel = max(1, min(cap, self.env.max_bytes) // es)
        n = max(1, min(n, maxel))
        if layout == "scalar":
            return (), None
        if layout == "empty":
            return rng.choice([(0,), (rng.randint(1, 5), 0), (0, 3)]), None
        if layout == "shaped":
            a = rng.randint(1, min(64, n))
            rest = max(1, n // a)
            if rng.random() < 0.5:
                return (a, rest), None
            b = rng.randint(1, min(64, rest))
            return (a, b, max(1, rest // b)), None
        if layout == "offset" and n + 128 <= maxel:
            k = rng.randint(1, 64)
            tail = rng.randint(0, 64)
            return (k + n + tail,), ("narrow", k, n)
        if layout == "t" and n >= 4:
            a = rng.randint(2, max(2, min(1024, n // 2)))
            return (a, max(2, n // a)), ("t",)
        if layout == "step":
            s = rng.randint(2, 4)
            m = max(1, min(n, maxel // s))
            return (m * s,), ("slice", 0, rng.randrange(s), s)
        if layout == "step2d":
            s = rng.randint(2, 3)
            m = max(1, min(n, maxel // s))
            a = rng.randint(1, min(256, m))
            return (a, max(1, m // a) * s), ("slice", 1, 0, s)
        if layout == "expand":
            m = rng.randint(1, min(n, 4096))
            r = max(1, n // m)
            return (1, m), ("expand", (r, m))
        if layout == "permute" and n >= 8:
            a = rng.randint(1, min(32, n))
            b = rng.randint(1, min(32, max(1, n // a)))
            return (a, b, max(1, n // (a * b))), ("permute", (2, 0, 1))
        return (n,), None

    def alloc(self, mem: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised host tensor in memory of kind ``mem``: ``pageable`` (torch's CPU
        allocator), ``pool`` (pinxfer.empty), ``torch_pinned`` (torch's pinned allocator,
        pinxfer's pool once installed) or ``mapped`` (an anonymous mapping of its own: pages
        that no other tensor shares, as user memory for pin_)."""
        if mem == "pageable":
            return torch.empty(shape, dtype=dtype)
        if mem == "pool":
            return pinxfer.empty(tuple(shape), dtype=dtype)
        if mem == "torch_pinned":
            return self.env.torch_pinned_empty(shape, dtype)
        if mem == "mapped":
            numel = math.prod(shape)
            if numel == 0:
                return torch.empty(shape, dtype=dtype)
            # frombuffer keeps the mapping alive as long as the tensor's storage.
            mapping = mmap.mmap(-1, numel * elsize(dtype))
            return torch.frombuffer(mapping, dtype=dtype, count=numel).view(shape)
        raise ValueError(mem)

    def r_slice(self, dtype: torch.dtype, nbytes: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        """A random 8-byte aligned offset into R and the (device, host) byte slices there."""
        R_g, R_h = (self.Rb_g, self.Rb_h) if dtype == torch.bool else (self.R_g, self.R_h)
        off = self.rng.randrange(0, (self.env.r_bytes - nbytes) // 8 + 1) * 8
        return off, R_g.narrow(0, off, nbytes), R_h.narrow(0, off, nbytes)

    def make_leaf(
        self,
        mems: tuple | None = None,
        layouts=None,
        cap: int = 64 * MiB,
        dtype: torch.dtype | None = None,
        shape: tuple | None = None,
    ) -> Leaf:
        """A host source filled from R (torch's CPU copy) and its expected device value (the
        same bytes of R on the device, same view applied there). ``mems``: the memory kinds
        to pick from (default: every kind this device has)."""
        rng = self.rng
        dtype = dtype or rng.choice(DTYPES)
        es = elsize(dtype)
        if shape is not None:
            layout, base_shape, spec = "contig", tuple(shape), None
        else:
            if layouts is None:
                layout = rng.choices(LAYOUTS, LAYOUT_WEIGHTS)[0]
            else:
                layout = rng.choice(layouts)
            base_shape, spec = self.layout(layout, self.sample_nbytes(cap) // es or 1, es, cap)
            if spec is None and layout not in [*DENSE_LAYOUTS, "empty"]:
                layout = "contig"  # too small for that view: layout() fell back
        base_numel = math.prod(base_shape)
        base_bytes = base_numel * es
        off, g_bytes, h_bytes = self.r_slice(dtype, base_bytes)
        exp_base = g_bytes.view(dtype).view(base_shape)
        mem = rng.choice(mems or self.env.host_memories)
        base = self.alloc(mem, base_shape, dtype)
        if base_bytes:
            flat_bytes(base).copy_(h_bytes)
        src = apply_view(base, spec)
        if spec is None:  # the expected bytes are exactly that slice of R
            exp, exp_b = exp_base, g_bytes
        else:
            exp = apply_view(exp_base, spec).contiguous()
            exp_b = as_bytes(exp)
        nbytes = src.numel() * es
        meta = (dtype, tuple(src.shape), src.stride(), layout, mem, nbytes, off)
        return Leaf(src, base, exp, exp_b, mem, layout, nbytes, meta)

    def device_tensor(self, cap: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """A GPU tensor (a view of R, maybe a fresh copy) and its expected contiguous value."""
        rng = self.rng
        dtype = rng.choice(DTYPES)
        es = elsize(dtype)
        layout = rng.choices(LAYOUTS, LAYOUT_WEIGHTS)[0]
        base_shape, spec = self.layout(layout, self.sample_nbytes(cap) // es or 1, es, cap)
        if spec is None and layout not in [*DENSE_LAYOUTS, "empty"]:
            layout = "contig"
        base_bytes = math.prod(base_shape) * es
        off, g_bytes, _ = self.r_slice(dtype, base_bytes)
        g_base = g_bytes.view(dtype).view(base_shape)
        g = apply_view(g_base, spec)
        exp = g.contiguous()
        if rng.random() < 0.3:
            g = g.clone()  # a temporary: freed right after to_host queues its copy
        meta = {
            "dtype": str(dtype).replace("torch.", ""),
            "shape": list(g.shape),
            "layout": layout,
            "mem": "device",
            "nbytes": g.numel() * es,
            "r_offset": off,
        }
        return g, exp, meta

    def make_batch(
        self,
        max_leaves: int,
        leaf_cap: int,
        allow_gpu: bool,
        mems: tuple | None = None,
        grad: bool = False,
    ):
        """A nested batch; returns (obj, [(path, Leaf)])."""
        rng = self.rng
        for _ in range(10):
            leaves: list[tuple[tuple, Leaf]] = []

            def build(depth: int, path: tuple) -> Any:
                ctype = rng.choice(["dict", "list", "tuple", "pair"])
                k = 2 if ctype == "pair" else rng.randint(1, 4)
                items = []
                for i in range(k):
                    key = f"k{i}" if ctype == "dict" else i
                    p = (*path, key)
                    r = rng.random()
                    if depth < 2 and r < 0.15:
                        v = build(depth + 1, p)
                    elif r < 0.25:
                        v = rng.choice([7, -1, "text", None, 2.5, b"raw"])
                    elif allow_gpu and r < 0.28:
                        nb = rng.randint(1, 4096) & ~7 or 8
                        v = self.R_g.narrow(0, rng.randrange(0, 1024) * 8, nb)
                    elif len(leaves) < max_leaves:
                        leaf = self.make_leaf(mems=mems, cap=leaf_cap)
                        if (
                            grad
                            and leaf.src.dtype in FLOAT_DTYPES
                            and leaf.mem == "pageable"
                            and leaf.layout == "contig"
                            and rng.random() < 0.05
                        ):
                            leaf.src = leaf.base = leaf.base.requires_grad_(True)
                            leaf.scribble_ok = False  # an in-place write on a grad leaf raises
                        leaves.append((p, leaf))
                        v = leaf.src
                    else:
                        v = 0
                    items.append((key, v))
                if ctype == "dict":
                    return dict(items)
                vals = [v for _, v in items]
                if ctype == "list":
                    return vals
                if ctype == "tuple":
                    return tuple(vals)
                return Pair(*vals)

            obj = build(0, ())
            if leaves:
                return obj, leaves
        leaf = self.make_leaf(mems=mems, cap=leaf_cap)
        return {"x": leaf.src}, [(("x",), leaf)]

    def chunk_kwargs(self, nbytes: int) -> dict:
        """Sometimes small staging chunks (ring mode) for to_device."""
        rng = self.rng
        if rng.random() < 0.75:
            return {}
        cb = rng.choice([4096, 70_001, 256 * KiB, MiB, 3 * MiB + 4096, 16 * MiB])
        while nbytes // cb > 512:  # bound the number of chunks (and of cudaMemcpyAsync calls)
            cb *= 4
        # 16: the defaults' ring depth (16 slots of 4 MiB), where a slot's refill has the most
        # pieces waiting on one watcher.
        return {"chunk_bytes": cb, "num_buffers": rng.choice([1, 2, 3, 4, 16])}

    def scribble(self, t: torch.Tensor | None) -> None:
        """Overwrites every byte of ``t`` (a source the caller may now modify)."""
        if t is None or t.numel() == 0:
            return
        with torch.no_grad():
            fb = flat_bytes(t)
            if t.dtype == torch.bool or fb is None:
                t.fill_(bool(self.rng.getrandbits(1)) if t.dtype == torch.bool else 0)
            else:
                fb.fill_(self.rng.randrange(256))

    def after_send(self, leaf: Leaf, non_blocking: bool) -> None:
        """What the to_device docstring allows once it has returned: pageable sources may be
        modified or freed at once; pinned ones once the copy is done (non_blocking=False)."""
        may_scribble = leaf.mem == "pageable" or not non_blocking
        if leaf.scribble_ok and self.rng.random() < 0.5 and may_scribble:
            self.scribble(leaf.base)
        leaf.drop_source()
