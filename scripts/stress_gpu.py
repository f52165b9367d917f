#!/usr/bin/env python3
"""Randomized multi-threaded stress of pinxfer on a GPU; every byte is checked on the GPU.

For each mode (``plain``: pinxfer as a library; ``install``: after ``pinxfer.install()``,
with ``uninstall()`` at the end) ``--threads`` Python threads (>= 3), each with its own
CUDA stream current and a side stream, run a random mix of:

* ``to_device`` of one tensor: pageable, pool-pinned (``pinxfer.empty``) or torch-pinned;
  contiguous, shaped, 0-d, empty, offset, transposed, stepped, expanded or permuted views;
  sizes log-uniform from 1 B to 64 MiB (mostly small, a fraction of 1-16 MiB and 16-64 MiB,
  and the staging boundaries), 9 dtypes, sometimes with small ``chunk_bytes`` (ring mode)
  and ``non_blocking=False``;
* ``to_device`` of nested batches (dict / list / tuple / namedtuple, non-tensor leaves, a
  tensor already on the GPU that must come back as is);
* ``prefetch`` over lists of batches, depth 1-4, the consumer writes into every yielded
  batch after checking it, passes left early (``break``) then closed, deleted or collected;
* ``to_host(...).wait()`` of GPU tensors and batches (sometimes dropped unwaited);
* pool tensors copied with ``.to(device, non_blocking=True)`` on the side stream,
  ``pinxfer.record_stream`` and freed at once, a new block scribbled right away;
* D2H ``copy_(non_blocking=True)`` into a pool tensor freed at once: the next block of the
  same size, filled on the host, must not be overwritten by the late copy;
* ``pinxfer.pin_memory`` of tensors and batches, then a copy to the GPU;
* install mode also: ``torch.empty(pin_memory=True)``, ``Tensor.pin_memory()``, ``.item()``
  on GPU scalars, H2D ``copy_(non_blocking=True)`` then ``del``, torch-pinned D2H then ``del``.

Expected values: each thread draws a random byte buffer R on the GPU (torch.randint with a
CUDA generator seeded from --seed) and copies it to the host once with torch's synchronous
copy. A host source is a fresh allocation filled from a slice of R on the host (torch's CPU
copy); its expected device value is the same slice of R on the GPU with the same view
applied there. Outputs are compared as raw bytes (uint8 views: bool, NaN payloads and -0.0
compare exactly) on the thread's stream; each check leaves a 4-number summary on the GPU
(bad bytes, first bad index, got, expected) and the summaries are fetched every 32 checks,
so the checks do not serialise the threads. Sources are modified or freed after a call
returns only where the docstrings allow it (pageable sources of to_device, pinned sources
after ``non_blocking=False``, sources of ``pin_memory``).

Counts per mode: transfers (tensors checked), calls, bytes checked and moved, bad bytes (not
a flag), the first mismatches with details, errors (exceptions with tracebacks) and contract
violations (wrong device/dtype/shape/contiguity/structure, unpinned results, leftover
prefetch threads, pool event errors). Exit status: 0 if every mode has no bad byte, no error,
no contract violation and at least --min-transfers transfers; 1 otherwise; 2 if no GPU.
A crash kills the process (run with ``python3 -X faulthandler``); a hang past --watchdog
seconds dumps every thread's stack and exits 1.

    python3 -X faulthandler scripts/stress_gpu.py --mode both --seconds 90 --json stress.json
    python3 scripts/stress_gpu.py --self-test          # on the CPU: generators and checker
    python3 scripts/stress_gpu.py --seconds 20 --inject-faults 0.01   # the checker must count them
"""
from __future__ import annotations

import argparse
import bisect
import collections
import contextlib
import faulthandler
import gc
import itertools
import json
import math
import os
import platform
import random
import socket
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)  # the checkout's pinxfer (with _C built in place)

import torch  # noqa: E402

import pinxfer  # noqa: E402

KiB = 1 << 10
MiB = 1 << 20
DTYPES = [torch.uint8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
          torch.float32, torch.float64, torch.bool]
ITEM_DTYPES = [torch.int64, torch.int32, torch.int16, torch.uint8, torch.bool]
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
BOUNDARY_SIZES = [1, 2, 3, 7, 8, 511, 512, 513, 4095, 4096, 4097, 65535, 65536, 65537,
                  256 * KiB - 1, 256 * KiB, 256 * KiB + 1, MiB - 1, MiB, MiB + 1,
                  4 * MiB + 3, 16 * MiB - 1, 16 * MiB, 16 * MiB + 1, 64 * MiB]
LAYOUTS = ["contig", "shaped", "scalar", "empty", "offset", "t", "step", "step2d", "expand",
           "permute"]
LAYOUT_WEIGHTS = [34, 12, 2, 1, 9, 12, 9, 7, 6, 8]
DENSE_LAYOUTS = ["contig", "shaped", "scalar"]  # views whose base is the tensor itself
RESOLVE_EVERY = 32  # checks between two fetches of their summaries (one host sync)
MAX_MISMATCHES = 20  # mismatch details kept per mode
MAX_SAMPLES = 10  # error / contract samples kept per mode
MAX_ERRORS_PER_THREAD = 200  # a thread stops after this many exceptions (e.g. a sticky CUDA error)
PRINT_LOCK = threading.Lock()


def log(msg: str) -> None:
    with PRINT_LOCK:
        print(msg, file=sys.stderr, flush=True)


Pair = collections.namedtuple("Pair", ["a", "b"])


# ---------------------------------------------------------------- helpers on tensors


_ELSIZE: dict = {}


def elsize(dtype: torch.dtype) -> int:
    n = _ELSIZE.get(dtype)
    if n is None:
        n = _ELSIZE[dtype] = torch.empty((), dtype=dtype).element_size()
    return n


def flat_bytes(t: torch.Tensor) -> Optional[torch.Tensor]:
    """A dense tensor's bytes as a 1-D uint8 view (no copy); None if it has no such view
    (not contiguous, or a one-element view whose stride is not 1)."""
    if not t.is_contiguous():
        return None
    f = t.view(-1)
    if f.numel() and f.stride(0) != 1:
        return None
    return f.view(torch.uint8)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The values of ``t`` in logical order, as raw bytes (a copy only if needed)."""
    if t.requires_grad:
        t = t.detach()
    f = flat_bytes(t)
    if f is None:
        f = flat_bytes(t.clone(memory_format=torch.contiguous_format))
    return f


def apply_view(t: torch.Tensor, spec: Optional[tuple]) -> torch.Tensor:
    """Applies a view spec (see Worker.layout) identically to a host or a device tensor."""
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


def smap(obj: Any, fn) -> Any:
    """Our own rebuild of a batch (dict, list, tuple, namedtuple) with fn applied to tensors."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: smap(v, fn) for k, v in obj.items()}
    if isinstance(obj, Pair):
        return Pair(*(smap(v, fn) for v in obj))
    if isinstance(obj, tuple):
        return tuple(smap(v, fn) for v in obj)
    if isinstance(obj, list):
        return [smap(v, fn) for v in obj]
    return obj


def get_path(obj: Any, path: tuple) -> Any:
    for key in path:
        obj = obj[key]
    return obj


def structure_diff(src: Any, out: Any, gpu_identity: bool, path: str = "batch") -> Optional[str]:
    """None if ``out`` has the structure of ``src`` (types, keys, lengths, non-tensor leaves,
    device tensors returned as they are); else what differs."""
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


def loguniform(rng: random.Random, lo: int, hi: int) -> int:
    return max(lo, min(hi, int(math.exp(rng.uniform(math.log(lo), math.log(hi + 1))))))


# ---------------------------------------------------------------- the device under test


class _FakeHostTransfer:
    """CPU self-test stand-in for pinxfer.HostTransfer."""

    def __init__(self, result: Any):
        self._result = result

    def wait(self) -> Any:
        return self._result

    @property
    def tensor(self) -> Any:
        return self._result

    def ready(self) -> bool:
        return True


class Env:
    """Where the stress runs. On a GPU every call is the real pinxfer / torch call. On the CPU
    (--self-test) the transfers become host copies, so that the generators, the views, the
    batches, the bookkeeping and the checker run end to end without a GPU."""

    def __init__(self, device: torch.device, inject: float = 0.0, max_bytes: int = 64 * MiB):
        self.device = device
        self.cuda = device.type == "cuda"
        self.strict = self.cuda  # device/contiguity/pinning contracts only hold on a GPU
        self.inject = inject
        self.max_bytes = max_bytes
        self.r_bytes = max_bytes + MiB  # size of each thread's random buffer
        self.argmax_u8 = True  # argmax over uint8 works (else int32, more memory)

    def probe(self) -> str:
        """Checks the reductions the checker uses on this device; returns a note."""
        flags = torch.tensor([0, 0, 1, 0, 1], dtype=torch.uint8, device=self.device)
        try:
            first = int(flags.argmax().item())
        except RuntimeError as err:
            self.argmax_u8 = False
            first = int(flags.to(torch.int32).argmax().item())
            note = f"argmax on uint8 failed ({str(err).splitlines()[0]}): using int32. "
        else:
            note = ""
        if first != 2:
            note += f"argmax returned {first}, not the first maximum: first_bad_byte is some bad byte"
        return note

    def first_true(self, ne: torch.Tensor) -> torch.Tensor:
        """Index of the first True of a 1-D bool tensor (0 if none), on the device."""
        if self.argmax_u8:
            return ne.view(torch.uint8).argmax()
        return ne.to(torch.int32).argmax()

    # streams
    def new_stream(self):
        return torch.cuda.Stream(self.device) if self.cuda else None

    def stream_ctx(self, s):
        return torch.cuda.stream(s) if self.cuda else contextlib.nullcontext()

    def current_stream(self):
        return torch.cuda.current_stream(self.device) if self.cuda else None

    def wait_stream(self, waiter, signaller) -> None:
        if self.cuda:
            waiter.wait_stream(signaller)

    def sync(self, s) -> None:
        if self.cuda:
            s.synchronize()

    def sleep(self, cycles: int) -> None:
        if self.cuda and hasattr(torch.cuda, "_sleep"):
            torch.cuda._sleep(cycles)

    def record_pool(self, t: torch.Tensor, s) -> None:
        if self.cuda:
            pinxfer.record_stream(t, s)

    def record_dev(self, d: torch.Tensor, s) -> None:
        if self.cuda:
            d.record_stream(s)

    # allocation
    def torch_pinned_empty(self, shape, dtype) -> torch.Tensor:
        if self.cuda:
            return torch.empty(shape, dtype=dtype, pin_memory=True)
        return torch.empty(shape, dtype=dtype)

    def torch_pin(self, t: torch.Tensor) -> torch.Tensor:
        return t.pin_memory() if self.cuda else t.clone()

    def is_pinned(self, t: torch.Tensor) -> bool:
        return t.is_pinned() if self.cuda else True

    def is_pool(self, t: torch.Tensor) -> bool:
        return pinxfer.is_pool_tensor(t) if self.cuda else True

    # transfers under test
    def to_device(self, obj: Any, non_blocking: bool = True, **kw) -> Any:
        if self.cuda:
            return pinxfer.to_device(obj, self.device, non_blocking=non_blocking, **kw)
        out = pinxfer.to_device(obj, "cpu", non_blocking=non_blocking, **kw)
        return smap(out, lambda t: t.detach().contiguous().clone().requires_grad_(t.requires_grad))

    def to_host(self, obj: Any):
        if self.cuda:
            return pinxfer.to_host(obj)
        return _FakeHostTransfer(smap(obj, lambda t: t.contiguous().clone()))

    def prefetch(self, batches: list, depth: int, **kw):
        return pinxfer.prefetch(batches, device=self.device if self.cuda else "cpu", depth=depth,
                                **kw)

    def h2d_trusted(self, t: torch.Tensor) -> torch.Tensor:
        """torch's synchronous host -> device copy (the reference path)."""
        return t.to(self.device) if self.cuda else t.clone()


# ---------------------------------------------------------------- bookkeeping


def new_op_stats() -> dict:
    return {"calls": 0, "transfers": 0, "bytes": 0, "bad_bytes": 0, "errors": 0}


class Stats:
    def __init__(self) -> None:
        self.transfers = 0
        self.calls = 0
        self.bytes_checked = 0
        self.bytes_moved = 0
        self.bad_bytes = 0
        self.bad_checks = 0
        self.errors = 0
        self.contract_errors = 0
        self.injected = 0
        self.ops: dict[str, dict] = collections.defaultdict(new_op_stats)
        self.mismatches: list[dict] = []
        self.error_samples: list[dict] = []
        self.contract_samples: list[dict] = []

    def merge(self, other: "Stats") -> None:
        for name in ("transfers", "calls", "bytes_checked", "bytes_moved", "bad_bytes",
                     "bad_checks", "errors", "contract_errors", "injected"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for op, d in other.ops.items():
            for k, v in d.items():
                self.ops[op][k] += v
        self.mismatches = sorted(self.mismatches + other.mismatches,
                                 key=lambda m: m["t"])[:MAX_MISMATCHES]
        self.error_samples = (self.error_samples + other.error_samples)[:MAX_SAMPLES]
        self.contract_samples = (self.contract_samples + other.contract_samples)[:MAX_SAMPLES]


class Leaf:
    """One host source, its expected device value and how it was made."""

    __slots__ = ("src", "base", "exp", "exp_b", "mem", "layout", "nbytes", "meta", "scribble_ok")

    def __init__(self, src, base, exp, exp_b, mem, layout, nbytes, meta, scribble_ok=True):
        self.src, self.base, self.exp, self.exp_b = src, base, exp, exp_b
        self.mem, self.layout, self.nbytes, self.meta = mem, layout, nbytes, meta
        self.scribble_ok = scribble_ok

    def drop_source(self) -> None:
        self.src = None
        self.base = None


META_KEYS = ("dtype", "shape", "stride", "layout", "mem", "nbytes", "r_offset")


def meta_dict(m: Any) -> Any:
    """Leaf metadata is kept as a cheap tuple; a dict only where it is reported."""
    if isinstance(m, tuple):
        d = dict(zip(META_KEYS, m))
        d["dtype"] = str(d["dtype"]).replace("torch.", "")
        d["shape"], d["stride"] = list(d["shape"]), list(d["stride"])
        return d
    return m


class Shared:
    def __init__(self, n: int, seconds: float):
        self.seconds = seconds
        self.deadline = 0.0
        self.t0 = 0.0
        self.barrier = threading.Barrier(n, action=self._start)

    def _start(self) -> None:
        self.t0 = time.monotonic()
        self.deadline = self.t0 + self.seconds


# ---------------------------------------------------------------- one stress thread


class Worker:
    def __init__(self, idx: int, env: Env, mode: str, seed: int, shared: Shared,
                 large_frac: float, medium_frac: float):
        self.idx = idx
        self.env = env
        self.mode = mode
        self.installed = mode == "install"
        self.seed = seed
        self.shared = shared
        self.large_frac = large_frac
        self.medium_frac = medium_frac
        self.rng = random.Random(seed)
        self.st = Stats()
        self.pending: list[tuple] = []
        self.printed_errors = 0
        self.thread = threading.Thread(target=self.run, name=f"stress-{mode}-{idx}", daemon=True)
        table = [
            ("to_device", self.op_to_device, 30),
            ("to_device_batch", self.op_to_device_batch, 20),
            ("prefetch", self.op_prefetch, 6),
            ("to_host", self.op_to_host, 12),
            ("pool_side_h2d", self.op_pool_side_h2d, 8),
            ("pool_d2h_free", self.op_pool_d2h_free, 8),
            ("pin_memory", self.op_pin_memory, 10),
            ("maintenance", self.op_maintenance, 0.3),
            ("graph", self.op_graph, 1.5),
        ]
        if self.installed:
            table += [
                ("torch_pinned_side_h2d", self.op_torch_pinned_side_h2d, 5),
                ("torch_pin_memory", self.op_torch_pin_memory, 5),
                ("item", self.op_item, 4),
                ("copy_nb_del", self.op_copy_nb_del, 5),
                ("torch_pinned_d2h_free", self.op_torch_pinned_d2h_free, 5),
            ]
        self.op_names = [t[0] for t in table]
        self.op_fns = [t[1] for t in table]
        self.op_cum = list(itertools.accumulate(t[2] for t in table))
        self.op_weights = {t[0]: t[2] for t in table}

    # ---- setup and loop

    def setup(self) -> None:
        env = self.env
        if env.cuda:
            torch.cuda.set_device(env.device)
        self.stream = env.new_stream()
        self.side = env.new_stream()
        with env.stream_ctx(self.stream):
            gen = torch.Generator(device=env.device)
            gen.manual_seed(self.seed)
            self.R_g = torch.randint(0, 256, (env.r_bytes,), dtype=torch.uint8,
                                     device=env.device, generator=gen)
            self.Rb_g = torch.bitwise_and(self.R_g, 1)  # bytes of valid bools
            # torch's synchronous device -> host copy: the trusted path.
            self.R_h = self.R_g.cpu() if env.cuda else self.R_g.clone()
            self.Rb_h = self.Rb_g.cpu() if env.cuda else self.Rb_g.clone()
        env.sync(self.stream)

    def run(self) -> None:
        ok = False
        try:
            self.setup()
            ok = True
        except Exception:  # noqa: BLE001
            self.error("setup")
        try:
            self.shared.barrier.wait()
        except threading.BrokenBarrierError:
            return
        if not ok:
            return
        with self.env.stream_ctx(self.stream):
            while time.monotonic() < self.shared.deadline:
                i = bisect.bisect_right(self.op_cum, self.rng.random() * self.op_cum[-1])
                i = min(i, len(self.op_fns) - 1)
                name = self.op_names[i]
                self.st.calls += 1
                self.st.ops[name]["calls"] += 1
                try:
                    # torch.cuda.Stream() hands out streams from a shared pool of 32, so a
                    # capture on one would capture another thread's work on the same stream:
                    # a graph op runs alone (exclusive), every other op shares the gate.
                    with _GATE.hold(exclusive=name == "graph"):
                        self.op_fns[i]()
                except Exception:  # noqa: BLE001 - counted, reported, and we go on
                    self.error(name)
                if self.st.errors >= MAX_ERRORS_PER_THREAD:
                    log(f"[{self.thread.name}] {self.st.errors} errors: this thread stops")
                    break
            try:
                self.resolve()
                self.env.sync(self.stream)
                self.env.sync(self.side)
            except Exception:  # noqa: BLE001
                self.error("final_resolve")

    # ---- recording

    def now(self) -> float:
        return round(time.monotonic() - self.shared.t0, 3)

    def error(self, op: str) -> None:
        tb = traceback.format_exc()
        self.st.errors += 1
        self.st.ops[op]["errors"] += 1
        if len(self.st.error_samples) < MAX_SAMPLES:
            self.st.error_samples.append({"op": op, "thread": self.idx, "mode": self.mode,
                                          "t": self.now(), "traceback": tb[-6000:]})
        if self.printed_errors < 3:
            self.printed_errors += 1
            log(f"[{self.mode} thread {self.idx}] ERROR in {op}:\n{tb}")

    def contract(self, op: str, msg: str, meta: Optional[dict] = None) -> None:
        self.st.contract_errors += 1
        self.st.ops[op]["errors"] += 1
        meta = meta_dict(meta)
        if len(self.st.contract_samples) < MAX_SAMPLES:
            self.st.contract_samples.append({"op": op, "thread": self.idx, "mode": self.mode,
                                             "t": self.now(), "what": msg, "leaf": meta})
        if self.printed_errors < 3:
            self.printed_errors += 1
            log(f"[{self.mode} thread {self.idx}] CONTRACT {op}: {msg} {meta or ''}")

    def moved(self, op: str, nbytes: int) -> None:
        self.st.bytes_moved += nbytes
        self.st.ops[op]["bytes"] += nbytes

    # ---- generators

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

    def layout(self, layout: str, n: int, es: int, cap: int) -> tuple[tuple, Optional[tuple]]:
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
        if mem == "pageable":
            return torch.empty(shape, dtype=dtype)
        if mem == "pool":
            return pinxfer.empty(tuple(shape), dtype=dtype)
        if mem == "torch_pinned":
            return self.env.torch_pinned_empty(shape, dtype)
        raise ValueError(mem)

    def r_slice(self, dtype: torch.dtype, nbytes: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        """A random 8-byte aligned offset into R and the (device, host) byte slices there."""
        R_g, R_h = (self.Rb_g, self.Rb_h) if dtype == torch.bool else (self.R_g, self.R_h)
        off = self.rng.randrange(0, (self.env.r_bytes - nbytes) // 8 + 1) * 8
        return off, R_g.narrow(0, off, nbytes), R_h.narrow(0, off, nbytes)

    def make_leaf(self, mems=("pageable", "pool", "torch_pinned"), layouts=None,
                  cap: int = 64 * MiB, dtype: Optional[torch.dtype] = None,
                  shape: Optional[tuple] = None) -> Leaf:
        """A host source filled from R (torch's CPU copy) and its expected device value (the
        same bytes of R on the device, same view applied there)."""
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
            if spec is None and layout not in DENSE_LAYOUTS + ["empty"]:
                layout = "contig"  # too small for that view: layout() fell back
        base_numel = math.prod(base_shape)
        base_bytes = base_numel * es
        off, g_bytes, h_bytes = self.r_slice(dtype, base_bytes)
        exp_base = g_bytes.view(dtype).view(base_shape)
        mem = rng.choice(mems)
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
        if spec is None and layout not in DENSE_LAYOUTS + ["empty"]:
            layout = "contig"
        base_bytes = math.prod(base_shape) * es
        off, g_bytes, _ = self.r_slice(dtype, base_bytes)
        g_base = g_bytes.view(dtype).view(base_shape)
        g = apply_view(g_base, spec)
        exp = g.contiguous()
        if rng.random() < 0.3:
            g = g.clone()  # a temporary: freed right after to_host queues its copy
        meta = {"dtype": str(dtype).replace("torch.", ""), "shape": list(g.shape),
                "layout": layout, "mem": "device", "nbytes": g.numel() * es, "r_offset": off}
        return g, exp, meta

    def make_batch(self, max_leaves: int, leaf_cap: int, allow_gpu: bool,
                   mems=("pageable", "pool", "torch_pinned"), grad: bool = False):
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
                    p = path + (key,)
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
                        if (grad and leaf.src.dtype in FLOAT_DTYPES and leaf.mem == "pageable"
                                and leaf.layout == "contig" and rng.random() < 0.05):
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
        rng = self.rng
        if rng.random() < 0.75:
            return {}
        cb = rng.choice([4096, 70_001, 256 * KiB, MiB, 3 * MiB + 4096, 16 * MiB])
        while nbytes // cb > 512:  # bound the number of chunks (and of cudaMemcpyAsync calls)
            cb *= 4
        return {"chunk_bytes": cb, "num_buffers": rng.randint(1, 4)}

    def scribble(self, t: Optional[torch.Tensor]) -> None:
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
        if leaf.scribble_ok and self.rng.random() < 0.5:
            if leaf.mem == "pageable" or not non_blocking:
                self.scribble(leaf.base)
        leaf.drop_source()

    # ---- checking

    def check_leaves(self, op: str, gots: list, leaves: list, extra: Optional[dict] = None,
                     contiguous: bool = True) -> None:
        self.check(op, gots, [lf.exp for lf in leaves], [lf.meta for lf in leaves], extra,
                   contiguous, exp_bytes=[lf.exp_b for lf in leaves])

    def check(self, op: str, gots: list, exps: list, metas: list,
              extra: Optional[dict] = None, contiguous: bool = True,
              transfers: Optional[int] = None, exp_bytes: Optional[list] = None) -> None:
        """Queues a bytewise comparison of outputs against expected values on the current
        stream; a 4-number summary stays on the device until resolve()."""
        env = self.env
        g_parts, e_parts, part_meta, bounds = [], [], [], [0]
        for i, (g, e, m) in enumerate(zip(gots, exps, metas)):
            if not isinstance(g, torch.Tensor):
                self.contract(op, f"got a {type(g).__name__}, expected a tensor", m)
                continue
            if g.device != e.device or g.dtype != e.dtype or tuple(g.shape) != tuple(e.shape):
                self.contract(op, f"got {g.device} {g.dtype} {tuple(g.shape)}, expected "
                                  f"{e.device} {e.dtype} {tuple(e.shape)}", m)
                continue
            if env.strict and contiguous and not g.is_contiguous():
                self.contract(op, f"result not contiguous: stride {g.stride()}", m)
            if e.numel() == 0:
                continue
            gb = as_bytes(g)
            eb = exp_bytes[i] if exp_bytes is not None else as_bytes(e)
            g_parts.append(gb)
            e_parts.append(eb)
            part_meta.append(m)
            bounds.append(bounds[-1] + gb.numel())
        n = len(gots) if transfers is None else transfers
        self.st.transfers += n
        self.st.ops[op]["transfers"] += n
        total = bounds[-1]
        self.st.bytes_checked += total
        if total == 0:
            return
        G = g_parts[0] if len(g_parts) == 1 else torch.cat(g_parts)
        E = e_parts[0] if len(e_parts) == 1 else torch.cat(e_parts)
        if env.inject > 0 and self.rng.random() < env.inject:
            G = G.clone()  # a simulated corruption: exactly one byte differs
            G.narrow(0, self.rng.randrange(total), 1).bitwise_xor_(0x5A)
            self.st.injected += 1
        ne = G != E
        idx = env.first_true(ne).view(1)
        summary = torch.cat([ne.sum().view(1), idx, G.gather(0, idx).long(),
                             E.gather(0, idx).long()])
        self.pending.append((summary, op, part_meta, bounds, extra or {}))
        if len(self.pending) >= RESOLVE_EVERY:
            self.resolve()

    def resolve(self) -> None:
        """Fetches the pending summaries (one sync of the current stream) and counts."""
        if not self.pending:
            return
        pend, self.pending = self.pending, []
        values = torch.stack([p[0] for p in pend]).cpu().tolist()
        for (_, op, metas, bounds, extra), (bad, idx, got, exp) in zip(pend, values):
            if bad == 0:
                continue
            self.st.bad_bytes += bad
            self.st.bad_checks += 1
            self.st.ops[op]["bad_bytes"] += bad
            leaf = bisect.bisect_right(bounds, idx) - 1
            detail = {"op": op, "mode": self.mode, "thread": self.idx, "t": self.now(),
                      "bad_bytes": bad, "tensors_in_check": len(metas), "tensor": leaf,
                      "first_bad_byte": idx - bounds[leaf], "got": got, "expected": exp,
                      "leaf": meta_dict(metas[leaf]), **extra}
            if len(self.st.mismatches) < MAX_MISMATCHES:
                self.st.mismatches.append(detail)
            if self.st.bad_checks <= 5:
                log(f"[{self.mode} thread {self.idx}] MISMATCH {json.dumps(detail)}")

    # ---- operations

    def op_to_device(self) -> None:
        leaf = self.make_leaf()
        nb = self.rng.random() < 0.8
        kw = self.chunk_kwargs(leaf.nbytes)
        out = self.env.to_device(leaf.src, non_blocking=nb, **kw)
        self.after_send(leaf, nb)
        self.moved("to_device", leaf.nbytes)
        self.check_leaves("to_device", [out], [leaf], {"non_blocking": nb, **kw})

    def op_to_device_batch(self) -> None:
        obj, leaves = self.make_batch(max_leaves=self.rng.randint(2, 12), leaf_cap=16 * MiB,
                                      allow_gpu=self.env.cuda, grad=True)
        nb = self.rng.random() < 0.85
        kw = self.chunk_kwargs(max(leaf.nbytes for _, leaf in leaves))
        out = self.env.to_device(obj, non_blocking=nb, **kw)
        diff = structure_diff(obj, out, gpu_identity=self.env.cuda)
        del obj
        for _, leaf in leaves:
            self.after_send(leaf, nb)
            self.moved("to_device_batch", leaf.nbytes)
        if diff:
            self.contract("to_device_batch", diff)
            return
        gots = [get_path(out, p) for p, _ in leaves]
        self.check_leaves("to_device_batch", gots, [lf for _, lf in leaves],
                          {"non_blocking": nb, **kw})

    def op_prefetch(self) -> None:
        rng = self.rng
        n = rng.randint(1, 8)
        depth = rng.randint(1, 4)
        batches = []
        for _ in range(n):
            if rng.random() < 0.5:
                leaf = self.make_leaf(cap=32 * MiB)
                batches.append((leaf.src, [((), leaf)]))
            else:
                batches.append(self.make_batch(max_leaves=4, leaf_cap=16 * MiB, allow_gpu=False))
        break_at = rng.randrange(n) if rng.random() < 0.3 else None
        how = rng.choice(["for", "with", "next"])
        # gc.collect() costs ~0.2 s with torch loaded: rarely
        finish = rng.choices(["close", "del", "gc"], [0.495, 0.495, 0.01])[0]
        kw = self.chunk_kwargs(32 * MiB) if rng.random() < 0.3 else {}
        extra = {"depth": depth, "batches": n, "break_at": break_at, "how": how, **kw}
        pf = self.env.prefetch([b[0] for b in batches], depth=depth, **kw)
        if how == "with":
            with pf:
                got = self._consume(iter(pf), batches, break_at, extra)
        elif how == "for":
            got = self._consume(pf, batches, break_at, extra)
        else:
            got = self._consume(_next_iter(pf), batches, break_at, extra)
        if break_at is None and got != n:
            self.contract("prefetch", f"the pass yielded {got} batches, the source has {n}")
        for _, leaves in batches:
            for _, leaf in leaves:
                self.moved("prefetch", leaf.nbytes)
        if finish == "close":
            pf.close()
            del pf
        elif finish == "del":
            del pf
        else:
            del pf
            gc.collect()

    def _consume(self, iterable, batches: list, break_at: Optional[int], extra: dict) -> int:
        i = 0
        for out in iterable:
            if i >= len(batches):
                self.contract("prefetch", "the pass yielded more batches than the source has")
                break
            obj, leaves = batches[i]
            diff = structure_diff(obj, out, gpu_identity=False)
            if diff:
                self.contract("prefetch", f"batch {i}: {diff}")
            else:
                gots = [get_path(out, p) for p, _ in leaves]
                self.check_leaves("prefetch", gots, [lf for _, lf in leaves],
                                  {**extra, "index": i}, contiguous=self.env.strict)
                # The consumer owns the batch: write into it (after the check, same stream).
                for g in gots:
                    if isinstance(g, torch.Tensor) and g.numel() and g.is_contiguous():
                        fb = flat_bytes(g)
                        if fb is None or g.dtype == torch.bool or self.rng.random() < 0.5:
                            g.zero_()
                        else:
                            fb.add_(1)
            del out
            i += 1
            if break_at is not None and i > break_at:
                break
        return i

    def op_to_host(self) -> None:
        rng = self.rng
        k = 1 if rng.random() < 0.7 else rng.randint(2, 4)
        gs, exps, metas = [], [], []
        for _ in range(k):
            g, exp, meta = self.device_tensor(cap=32 * MiB if k == 1 else 8 * MiB)
            gs.append(g)
            exps.append(exp)
            metas.append(meta)
        if k == 1:
            obj = gs[0]
        else:
            obj = rng.choice([list, tuple, lambda v: {f"k{i}": x for i, x in enumerate(v)}])(gs)
        h = self.env.to_host(obj)
        del obj, gs  # temporaries are freed while their copies are queued (stream-ordered)
        nbytes = sum(m["nbytes"] for m in metas)
        self.moved("to_host", nbytes)
        if rng.random() < 0.08:
            del h  # dropped unwaited: its pinned block must not be reused before the copy
            self.st.ops["to_host_dropped"]["calls"] += 1
            return
        res = h.wait() if rng.random() < 0.5 else h.tensor
        if not h.ready():
            self.contract("to_host", "ready() is False after wait()")
        outs = [res] if k == 1 else (list(res.values()) if isinstance(res, dict) else list(res))
        backs, kept_exps, kept_metas = [], [], []
        for t, e, m in zip(outs, exps, metas):
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                self.contract("to_host", f"result is not a CPU tensor: {type(t).__name__}", m)
                continue
            if self.env.strict:
                if not t.is_contiguous():
                    self.contract("to_host", f"host result not contiguous: {t.stride()}", m)
                if t.numel() and not (t.is_pinned() and pinxfer.is_pool_tensor(t)):
                    self.contract("to_host", "host result is not a pinned pool tensor", m)
            backs.append(self.env.h2d_trusted(t))
            kept_exps.append(e)
            kept_metas.append(m)
        del res, outs, h
        self.check("to_host", backs, kept_exps, kept_metas)

    def _side_h2d(self, op: str, mem: str, record: bool) -> None:
        """A pinned host tensor copied on the side stream and freed at once; a new block of
        the same size is scribbled at once; the copy must still deliver the old bytes."""
        env = self.env
        leaf = self.make_leaf(mems=(mem,), layouts=DENSE_LAYOUTS)
        t = leaf.base
        if (env.strict and mem == "torch_pinned" and self.installed and t.numel()
                and not env.is_pool(t)):
            self.contract(op, "torch.empty(pin_memory=True) did not come from the pool", leaf.meta)
        leaf.drop_source()
        shape, dtype = tuple(t.shape), t.dtype
        cur = env.current_stream()
        with env.stream_ctx(self.side):
            if self.rng.random() < 0.3:
                env.sleep(self.rng.randint(10_000, 1_000_000))  # the copy starts late
            d = t.to(env.device, non_blocking=True)
            if record:
                env.record_pool(t, self.side)
        del t
        junk = self.alloc(mem, shape, dtype)
        self.scribble(junk)
        env.wait_stream(cur, self.side)
        env.record_dev(d, cur)
        self.moved(op, leaf.nbytes)
        self.check_leaves(op, [d], [leaf], {"recorded": record})
        del junk

    def op_pool_side_h2d(self) -> None:
        # Without install, torch tells only its own allocator about the copy: record_stream
        # is required (README, Limitations). Installed, torch reports it to the pool.
        record = (not self.installed) or self.rng.random() < 0.5
        self._side_h2d("pool_side_h2d", "pool", record)

    def op_torch_pinned_side_h2d(self) -> None:
        self._side_h2d("torch_pinned_side_h2d", "torch_pinned", record=False)

    def _d2h_free(self, op: str, mem: str, policy: str) -> None:
        """D2H copy_(non_blocking=True) into a pinned tensor freed at once. A new tensor of
        the same size, filled on the host, is read back twice (before and after the first
        copy is certainly done): a block handed out too early would be overwritten."""
        env, rng = self.env, self.rng
        dtype = rng.choice(DTYPES)
        es = elsize(dtype)
        numel = max(1, self.sample_nbytes(16 * MiB) // es)
        g_off, g_bytes, _ = self.r_slice(dtype, numel * es)
        g = g_bytes.view(dtype)
        h = self.alloc(mem, (numel,), dtype)
        use_side = rng.random() < 0.5
        # policy "needed": record_stream where the docs require it (a side stream without
        # install; on the current stream the pool's fence at free covers the copy);
        # "optional": installed, torch reports copy_ to the pool; "never": torch's tensors.
        if policy == "needed":
            record = use_side or rng.random() < 0.5
        elif policy == "optional":
            record = rng.random() < 0.5
        else:
            record = False
        stream = self.side if use_side else env.current_stream()
        with env.stream_ctx(stream):
            if rng.random() < 0.5:
                env.sleep(rng.randint(10_000, 1_000_000))  # the copy lands late
            h.copy_(g, non_blocking=True)
            if record:
                env.record_pool(h, stream)
        del h
        leaf = self.make_leaf(mems=(mem,), dtype=dtype, shape=(numel,))
        d1 = env.h2d_trusted(leaf.base)
        env.sync(stream)
        d2 = env.h2d_trusted(leaf.base)
        self.moved(op, numel * es)
        self.check_leaves(op, [d1, d2], [leaf, leaf],
                          {"side_stream": use_side, "recorded": record, "d2h_r_offset": g_off})

    def op_pool_d2h_free(self) -> None:
        self._d2h_free("pool_d2h_free", "pool", "optional" if self.installed else "needed")

    def op_torch_pinned_d2h_free(self) -> None:
        self._d2h_free("torch_pinned_d2h_free", "torch_pinned", "never")

    def op_pin_memory(self) -> None:
        env, rng = self.env, self.rng
        if rng.random() < 0.25:
            obj, leaves = self.make_batch(max_leaves=4, leaf_cap=16 * MiB, allow_gpu=False,
                                          mems=("pageable", "pageable", "pool"))
            p = pinxfer.pin_memory(obj)
            diff = structure_diff(obj, p, gpu_identity=False)
            if diff:
                self.contract("pin_memory", diff)
                return
            for path, leaf in leaves:
                pt = get_path(p, path)
                if not leaf.nbytes:
                    continue  # an empty tensor has no memory to pin
                if env.strict and not pt.is_pinned():
                    self.contract("pin_memory", "batch leaf not pinned", leaf.meta)
                if leaf.mem == "pool" and pt is not leaf.src:
                    self.contract("pin_memory", "a pinned leaf was copied", leaf.meta)
            for _, leaf in leaves:
                if leaf.mem == "pageable":
                    self.scribble(leaf.base)  # the pinned copy is independent of the source
                leaf.drop_source()
            out = env.to_device(p, non_blocking=True)
            del p, obj
            gots = [get_path(out, path) for path, _ in leaves]
            for _, leaf in leaves:
                self.moved("pin_memory", leaf.nbytes)
            self.check_leaves("pin_memory", gots, [lf for _, lf in leaves], {"batch": True})
            return
        leaf = self.make_leaf(mems=("pageable",))
        p = pinxfer.pin_memory(leaf.src)
        if p.dtype != leaf.src.dtype or p.shape != leaf.src.shape:
            self.contract("pin_memory", f"got {p.dtype} {tuple(p.shape)}", leaf.meta)
            return
        if env.strict and leaf.nbytes and not p.is_pinned():
            self.contract("pin_memory", "result not pinned", leaf.meta)
        if leaf.layout != "expand" and p.stride() != leaf.src.stride():
            self.contract("pin_memory", f"strides {p.stride()}, source {leaf.src.stride()}",
                          leaf.meta)
        if rng.random() < 0.5:
            self.scribble(leaf.base)
        leaf.drop_source()
        how = rng.choice(["to_device", "torch_to"])
        if how == "to_device":
            out = env.to_device(p, non_blocking=True)
        else:
            # On the current stream: without install the pool fences the free on it.
            out = p.to(env.device, non_blocking=True)
        del p
        self.moved("pin_memory", leaf.nbytes)
        self.check_leaves("pin_memory", [out], [leaf], {"copy": how},
                          contiguous=how == "to_device")

    def op_torch_pin_memory(self) -> None:
        env = self.env
        leaf = self.make_leaf(mems=("pageable",),
                              layouts=["contig", "shaped", "offset", "t", "step", "step2d"])
        p = env.torch_pin(leaf.src)
        if env.strict and leaf.nbytes and not (p.is_pinned() and env.is_pool(p)):
            self.contract("torch_pin_memory", "Tensor.pin_memory() did not use the pool",
                          leaf.meta)
        if self.rng.random() < 0.5:
            self.scribble(leaf.base)
        leaf.drop_source()
        shape, dtype = tuple(p.shape), p.dtype
        cur = env.current_stream()
        with env.stream_ctx(self.side):
            if self.rng.random() < 0.3:
                env.sleep(self.rng.randint(10_000, 1_000_000))
            d = p.to(env.device, non_blocking=True)  # torch reports the copy to the pool
        del p
        junk = env.torch_pinned_empty(shape, dtype)
        self.scribble(junk)
        env.wait_stream(cur, self.side)
        env.record_dev(d, cur)
        self.moved("torch_pin_memory", leaf.nbytes)
        self.check_leaves("torch_pin_memory", [d], [leaf], contiguous=False)
        del junk

    def op_item(self) -> None:
        rng = self.rng
        k = rng.randint(1, 8)
        vals, exps = [], []
        for _ in range(k):
            dtype = rng.choice(ITEM_DTYPES)
            _, g_bytes, _ = self.r_slice(dtype, elsize(dtype))
            g = g_bytes.view(dtype)[0]
            vals.append(int(g.item()))  # torch's D2H scalar read through its pinned allocator
            exps.append(g.to(torch.int64))
        got = torch.tensor(vals, dtype=torch.int64, device=self.env.device)
        exp = torch.stack(exps)
        self.moved("item", k * 8)
        self.check("item", [got], [exp], [{"scalars": k}], transfers=k)

    def op_copy_nb_del(self) -> None:
        env = self.env
        leaf = self.make_leaf(mems=("torch_pinned",), layouts=DENSE_LAYOUTS)
        t = leaf.base
        leaf.drop_source()
        if self.rng.random() < 0.3:
            env.sleep(self.rng.randint(10_000, 1_000_000))
        d = torch.empty(tuple(t.shape), dtype=t.dtype, device=env.device)
        d.copy_(t, non_blocking=True)
        shape, dtype = tuple(t.shape), t.dtype
        del t
        junk = env.torch_pinned_empty(shape, dtype)
        self.scribble(junk)
        self.moved("copy_nb_del", leaf.nbytes)
        self.check_leaves("copy_nb_del", [d], [leaf])
        del junk

    def op_graph(self) -> None:
        """CUDA graph capture and replay: H2D copy_(non_blocking=True) from a pool-pinned
        buffer allocated before the capture (a static input) and, installed, D2H into a
        pinned buffer allocated inside it (the graph's private pool) plus one allocated and
        freed there; replayed with new host bytes from R, each replay checked. One capture
        at a time in the process, in relaxed mode (the other threads keep calling CUDA)."""
        env, rng = self.env, self.rng
        if not env.cuda:
            return
        nbytes = rng.choice([1, 4096, 65536 + 3, 1 * MiB, 3 * MiB + 5])
        host_in = pinxfer.empty(nbytes, dtype=torch.uint8)
        dev = torch.empty(nbytes, dtype=torch.uint8, device=env.device)
        cur = torch.cuda.current_stream()
        if True:  # alone: see _GATE in run()
            g = torch.cuda.CUDAGraph()
            self.side.wait_stream(cur)
            with torch.cuda.graph(g, stream=self.side, capture_error_mode="relaxed"):
                dev.copy_(host_in, non_blocking=True)
                dev2 = dev.add(1)
                host_out = None
                if self.installed:
                    host_out = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
                    host_out.copy_(dev2, non_blocking=True)
                    scratch = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
                    del scratch  # unused: free again for this graph pool only
            cur.wait_stream(self.side)
        for _ in range(rng.randint(1, 3)):
            off, g_bytes, h_bytes = self.r_slice(torch.uint8, nbytes)
            host_in.copy_(h_bytes)
            g.replay()  # on the current stream
            env.sync(cur)
            self.check("graph", [dev2.clone()], [g_bytes.add(1)], [{"nbytes": nbytes}])
            if host_out is not None:
                self.check("graph", [host_out.to(env.device)], [g_bytes.add(1)],
                           [{"nbytes": nbytes, "d2h": True}])
            self.moved("graph", nbytes)
        env.sync(cur)
        del g, host_out, dev2  # releases the graph pool (installed: after a device sync)

    def op_maintenance(self) -> None:
        r = self.rng.random()
        stats = pinxfer.memory_stats()
        if "num_allocs" not in stats:
            self.contract("maintenance", "memory_stats() has no num_allocs")
        if r < 0.3:
            pinxfer.empty_cache()
        elif r < 0.4:
            pinxfer.reset_peak_memory_stats()


class _Gate:
    """A readers-writer gate: many ops at once, or one graph capture alone."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._readers = 0
        self._writer = False

    @contextlib.contextmanager
    def hold(self, exclusive: bool):
        with self._cv:
            if exclusive:
                self._cv.wait_for(lambda: not self._writer and self._readers == 0)
                self._writer = True
            else:
                self._cv.wait_for(lambda: not self._writer)
                self._readers += 1
        try:
            yield
        finally:
            with self._cv:
                if exclusive:
                    self._writer = False
                else:
                    self._readers -= 1
                self._cv.notify_all()


_GATE = _Gate()


def _next_iter(pf):
    """Drives a Prefetcher with next() (its __next__ starts a pass) instead of for."""
    while True:
        try:
            yield next(pf)
        except StopIteration:
            return


# ---------------------------------------------------------------- one mode


POOL_KEYS = ["num_allocs", "num_frees", "num_cache_hits", "num_cache_misses", "num_segment_maps",
             "num_segment_unmaps", "num_ooms", "num_event_waits", "num_fenced_frees",
             "num_event_errors"]
POOL_CURRENT = ["reserved_bytes.current", "reserved_bytes.peak", "active_blocks.current",
                "pending_blocks.current", "segments.current"]


def prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("pinxfer-prefetch-")]


def run_mode(env: Env, mode: str, args: argparse.Namespace, mode_index: int) -> dict:
    installed = False
    before = pinxfer.memory_stats()
    if mode == "install" and env.cuda:
        pinxfer.install()
        installed = True
    workers = []
    total = Stats()
    wall = 0.0
    fatal = None
    try:
        if installed and not pinxfer.is_installed():
            raise RuntimeError("pinxfer.install() returned but is_installed() is False")
        shared = Shared(args.threads, args.seconds)
        for i in range(args.threads):
            seed = (args.seed * 1_000_003 + mode_index * 10_007 + i) & 0x7FFFFFFF
            workers.append(Worker(i, env, mode, seed, shared, args.large_frac, args.medium_frac))
        for w in workers:
            w.thread.start()
        for w in workers:
            w.thread.join()
        wall = time.monotonic() - shared.t0 if shared.t0 else 0.0
        if env.cuda:
            torch.cuda.synchronize(env.device)
    except Exception:  # noqa: BLE001
        fatal = traceback.format_exc()
        log(f"[{mode}] FATAL:\n{fatal}")
    finally:
        for w in workers:
            total.merge(w.st)
        del workers
        gc.collect()
        if installed:
            pinxfer.uninstall()
    if installed and pinxfer.is_installed():
        total.contract_errors += 1
        total.contract_samples.append({"op": "uninstall", "what": "still installed"})
    deadline = time.monotonic() + 10
    while prefetch_threads() and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    leftover = [t.name for t in prefetch_threads()]
    if leftover:
        total.contract_errors += 1
        total.contract_samples.append({"op": "prefetch", "what": f"threads left: {leftover}"})
    after = pinxfer.memory_stats()
    pool = {k: after.get(k, 0) - before.get(k, 0) for k in POOL_KEYS}
    pool.update({k: after.get(k, 0) for k in POOL_CURRENT})
    if env.cuda and pool["num_event_errors"] > 0:
        total.contract_errors += 1
        total.contract_samples.append({"op": "pool", "what":
                                       f"{pool['num_event_errors']} CUDA event errors in the pool"})
    if env.cuda:
        torch.cuda.synchronize(env.device)
    released = pinxfer.empty_cache()
    failures = []
    if fatal:
        failures.append("fatal error")
    if total.bad_bytes:
        failures.append(f"{total.bad_bytes} bad bytes in {total.bad_checks} checks")
    if total.errors:
        failures.append(f"{total.errors} errors")
    if total.contract_errors:
        failures.append(f"{total.contract_errors} contract violations")
    if total.transfers < args.min_transfers:
        failures.append(f"{total.transfers} transfers < --min-transfers {args.min_transfers}")
    secs = max(wall, 1e-9)
    return {
        "ok": not failures,
        "failures": failures,
        "seconds": round(wall, 2),
        "threads": args.threads,
        "transfers": total.transfers,
        "calls": total.calls,
        "transfers_per_s": round(total.transfers / secs, 1),
        "bytes_checked": total.bytes_checked,
        "gb_checked": round(total.bytes_checked / 1e9, 3),
        "gb_moved": round(total.bytes_moved / 1e9, 3),
        "gb_moved_per_s": round(total.bytes_moved / 1e9 / secs, 3),
        "bad_bytes": total.bad_bytes,
        "bad_checks": total.bad_checks,
        "injected_bytes": total.injected,
        "errors": total.errors,
        "contract_errors": total.contract_errors,
        "ops": {k: dict(v) for k, v in sorted(total.ops.items())},
        "mismatches": total.mismatches,
        "error_samples": total.error_samples,
        "contract_samples": total.contract_samples,
        "leftover_prefetch_threads": leftover,
        "pool": pool,
        "empty_cache_released_bytes": released,
        "fatal": fatal,
    }


def summary_line(mode: str, r: dict, min_transfers: int) -> str:
    status = "OK" if r["ok"] else "FAIL (" + "; ".join(r["failures"]) + ")"
    return (f"stress {mode}: {status} | transfers {r['transfers']} (min {min_transfers}), "
            f"calls {r['calls']}, {r['seconds']} s, {r['transfers_per_s']} transfers/s, "
            f"{r['gb_checked']} GB checked, {r['gb_moved']} GB moved, "
            f"bad_bytes {r['bad_bytes']}, errors {r['errors']}, "
            f"contract {r['contract_errors']}")


def machine_info(env: Env) -> dict:
    info = {"hostname": socket.gethostname(), "python": platform.python_version(),
            "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "pinxfer": getattr(pinxfer, "__version__", "?"),
            "pinxfer_build": list(pinxfer.build_info()), "cpus": os.cpu_count(),
            "device": str(env.device)}
    if env.cuda:
        props = torch.cuda.get_device_properties(env.device)
        info["device_name"] = torch.cuda.get_device_name(env.device)
        info["device_memory_gib"] = round(props.total_memory / 2**30, 1)
    return info


def write_json(path: Optional[str], report: dict) -> None:
    if not path:
        return
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1, default=str)
    os.replace(tmp, path)


# ---------------------------------------------------------------- CPU self-test


def self_test(args: argparse.Namespace) -> int:
    """Runs every generator, operation and the checker on the CPU (transfers become host
    copies): no errors, no contract violations, no bad byte; then with injected one-byte
    corruptions, which must all be counted, and a few direct checker cases."""
    problems = []
    env = Env(torch.device("cpu"), max_bytes=args.self_test_max_bytes)
    note = env.probe()
    if note:
        problems.append(f"probe: {note}")
    st_args = argparse.Namespace(threads=3, seconds=args.self_test_seconds, seed=args.seed,
                                 large_frac=args.large_frac, medium_frac=args.medium_frac,
                                 min_transfers=1)
    results = {}
    for i, mode in enumerate(("plain", "install")):
        r = run_mode(env, mode, st_args, i)
        results[mode] = r
        print("self-test " + summary_line(mode, r, 1))
        if not r["ok"]:
            problems.append(f"{mode}: {r['failures']}")
        weights = Worker(0, env, mode, 0, Shared(1, 0), 0, 0).op_weights
        missing = sorted(op for op, wt in weights.items()
                         if wt >= 4 and r["ops"].get(op, {}).get("calls", 0) == 0)
        if missing and args.self_test_seconds >= 3:
            problems.append(f"{mode}: operations never ran: {missing}")
    inj = Env(torch.device("cpu"), inject=0.05, max_bytes=args.self_test_max_bytes)
    r = run_mode(inj, "plain", st_args, 7)
    results["injected"] = r
    print(f"self-test injected: {r['injected_bytes']} corruptions injected, "
          f"{r['bad_bytes']} bad bytes counted in {r['bad_checks']} checks")
    if r["injected_bytes"] == 0 or r["bad_bytes"] != r["injected_bytes"]:
        problems.append(f"injection: {r['injected_bytes']} injected, {r['bad_bytes']} counted")
    if r["errors"] or r["contract_errors"]:
        problems.append(f"injection run: {r['errors']} errors, {r['contract_errors']} contract")
    if not r["mismatches"] or any(m["got"] == m["expected"] for m in r["mismatches"]):
        problems.append(f"injection: mismatch details wrong: {r['mismatches'][:2]}")
    # Direct checker cases: the leaf and byte of a known corruption are found.
    shared = Shared(1, 0)
    w = Worker(0, env, "plain", 1, shared, 0, 0)
    w.setup()
    shared.t0 = time.monotonic()
    a = torch.arange(10, dtype=torch.int32)
    b = torch.tensor([True, False, True])
    c = torch.tensor([float("nan"), -0.0, 1.0], dtype=torch.float32)
    a2, b2, c2 = a.clone(), b.clone(), c.clone()
    w.check("direct", [a2, b2, c2], [a, b, c], [{"n": "a"}, {"n": "b"}, {"n": "c"}])
    w.resolve()
    if w.st.bad_bytes:
        problems.append(f"direct: equal tensors (NaN, -0.0, bool) reported {w.st.bad_bytes} bad")
    flat_bytes(b2)[1] = 7  # a bool byte that is not 0/1: still one bad byte
    flat_bytes(c2)[7] ^= 0x80  # -0.0 -> +0.0 (its sign byte): == would miss it
    w.check("direct", [a2, b2, c2], [a, b, c], [{"n": "a"}, {"n": "b"}, {"n": "c"}])
    w.resolve()
    m = w.st.mismatches[0] if w.st.mismatches else {}
    if w.st.bad_bytes != 2 or m.get("tensor") != 1 or m.get("first_bad_byte") != 1 \
            or m.get("got") != 7 or m.get("expected") != 0:
        problems.append(f"direct: expected 2 bad bytes, first in tensor 1 byte 1 (7 vs 0); "
                        f"got {w.st.bad_bytes}, {m}")
    env.argmax_u8 = False  # the fallback gives the same answer
    w.check("direct", [a2, b2, c2], [a, b, c], [{"n": "a"}, {"n": "b"}, {"n": "c"}])
    w.resolve()
    env.argmax_u8 = True
    m2 = w.st.mismatches[1] if len(w.st.mismatches) > 1 else {}
    if w.st.bad_bytes != 4 or m2.get("tensor") != 1 or m2.get("first_bad_byte") != 1:
        problems.append(f"direct (int32 argmax): got {w.st.bad_bytes} bad, {m2}")
    w.check("direct", [a.view(2, 5)], [a], [{"n": "shape"}])
    if w.st.contract_errors != 1:
        problems.append("direct: a shape mismatch was not reported as a contract violation")
    # Views are applied identically on both sides.
    for layout in LAYOUTS:
        for _ in range(20):
            leaf = w.make_leaf(layouts=[layout], cap=64 * KiB)
            if not torch.equal(as_bytes(leaf.src), as_bytes(leaf.exp)):
                problems.append(f"layout {layout}: source and expected differ "
                                f"({meta_dict(leaf.meta)})")
                break
            if not torch.equal(as_bytes(leaf.exp), leaf.exp_b):
                problems.append(f"layout {layout}: expected bytes differ "
                                f"({meta_dict(leaf.meta)})")
                break
    report = {"self_test": True, "ok": not problems, "problems": problems,
              "machine": machine_info(env), "modes": results}
    path = args.json or os.path.join(tempfile.gettempdir(), "pinxfer_stress_selftest.json")
    write_json(path, report)
    with open(path) as f:
        json.load(f)
    for p in problems:
        print("SELF-TEST PROBLEM:", p)
    print(("SELF-TEST OK" if not problems else "SELF-TEST FAILED") + f" (json: {path})")
    return 0 if not problems else 1


# ---------------------------------------------------------------- main


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["plain", "install", "both"], default="both")
    p.add_argument("--seconds", type=float, default=60.0, help="run time per mode (default 60)")
    p.add_argument("--threads", type=int, default=3, help="stress threads per mode (>= 3)")
    p.add_argument("--min-transfers", type=int, default=1000,
                   help="fail a mode that checked fewer tensors (default 1000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="OUT", help="write the report here")
    p.add_argument("--large-frac", type=float, default=0.02,
                   help="fraction of tensors of 16-64 MiB (default 0.02)")
    p.add_argument("--medium-frac", type=float, default=0.08,
                   help="fraction of tensors of 1-16 MiB (default 0.08)")
    p.add_argument("--inject-faults", type=float, default=0.0, metavar="P",
                   help="corrupt one byte in a fraction P of checks (checker sanity: the run "
                        "must then fail with bad_bytes == injected_bytes)")
    p.add_argument("--watchdog", type=float, default=0.0,
                   help="seconds before a hung run dumps all stacks and exits 1 "
                        "(default: modes x (seconds + 90) + 120)")
    p.add_argument("--self-test", action="store_true",
                   help="run the generators and the checker on the CPU, then exit")
    p.add_argument("--cpu", action="store_true",
                   help="run the stress itself on the CPU, transfers replaced by host copies "
                        "(to test this script without a GPU; sizes capped by "
                        "--self-test-max-bytes)")
    p.add_argument("--self-test-seconds", type=float, default=4.0)
    p.add_argument("--self-test-max-bytes", type=int, default=8 * MiB)
    args = p.parse_args(argv)
    if args.threads < 3:
        p.error("--threads must be >= 3")
    return args


def main(argv=None) -> int:
    faulthandler.enable()
    args = parse_args(argv)
    if args.self_test:
        return self_test(args)
    from pinxfer import cuda_unavailable_reason

    if args.cpu:
        env = Env(torch.device("cpu"), inject=args.inject_faults,
                  max_bytes=args.self_test_max_bytes)
    else:
        reason = cuda_unavailable_reason()
        if reason is not None:
            print(f"stress_gpu: no usable GPU: {reason}. (--self-test runs on the CPU.)")
            return 2
        env = Env(torch.device("cuda", torch.cuda.current_device()), inject=args.inject_faults)
    modes = ["plain", "install"] if args.mode == "both" else [args.mode]
    watchdog = args.watchdog or len(modes) * (args.seconds + 90) + 120
    faulthandler.dump_traceback_later(watchdog, exit=True)
    note = env.probe()
    report = {"ok": False, "complete": False, "machine": machine_info(env), "args": vars(args),
              "modes": {}}
    print(f"stress_gpu: {report['machine'].get('device_name', env.device)} "
          f"torch {torch.__version__}, "
          f"modes {modes}, {args.seconds} s each, {args.threads} threads, seed {args.seed}"
          + (f" ({note})" if note else ""), flush=True)
    report["probe_note"] = note
    for i, mode in enumerate(modes):
        r = run_mode(env, mode, args, i)
        report["modes"][mode] = r
        print(summary_line(mode, r, args.min_transfers), flush=True)
        write_json(args.json, report)  # partial results survive a crash in a later mode
    faulthandler.cancel_dump_traceback_later()
    report["ok"] = all(r["ok"] for r in report["modes"].values())
    report["complete"] = True
    if args.inject_faults > 0:
        injected = sum(r["injected_bytes"] for r in report["modes"].values())
        counted = sum(r["bad_bytes"] for r in report["modes"].values())
        print(f"stress_gpu: injected {injected} one-byte faults, counted {counted} bad bytes "
              f"({'checker OK' if injected == counted and injected else 'CHECKER PROBLEM'})")
        report["checker_ok"] = bool(injected == counted and injected)
    write_json(args.json, report)
    print("STRESS " + ("PASSED" if report["ok"] else "FAILED"), flush=True)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
