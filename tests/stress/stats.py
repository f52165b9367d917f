"""What a stress thread counts and keeps: calls, transfers, bytes moved and checked, bad
bytes, errors and contract violations, per operation and in all, with the first samples of
each for the report; a mode's total is the merge of its threads'."""

from __future__ import annotations

import collections
import json
import sys
import threading
import time
import traceback
from typing import Any

import torch

MAX_MISMATCHES = 20  # mismatch details kept per mode
MAX_SAMPLES = 10  # error / contract samples kept per mode
MAX_PRINTED = 3  # messages a thread prints to stderr (the rest only in the report)
_PRINT_LOCK = threading.Lock()

META_KEYS = ("dtype", "shape", "stride", "layout", "mem", "nbytes", "r_offset")


def log(msg: str) -> None:
    with _PRINT_LOCK:
        print(msg, file=sys.stderr, flush=True)


def meta_dict(m: Any) -> Any:
    """Leaf metadata is kept as a cheap tuple (sources.Leaf.meta); a dict only where it is
    reported."""
    if isinstance(m, tuple):
        d = dict(zip(META_KEYS, m))
        d["dtype"] = str(d["dtype"]).replace("torch.", "")
        d["shape"], d["stride"] = list(d["shape"]), list(d["stride"])
        return d
    if isinstance(m, dict) and isinstance(m.get("dtype"), torch.dtype):
        return {**m, "dtype": str(m["dtype"]).replace("torch.", "")}
    return m


def new_op_stats() -> dict:
    # bytes: bytes the operation moved (sent, pinned, copied); bytes_checked: bytes of its
    # results compared with their expected values.
    return {"calls": 0, "transfers": 0, "bytes": 0, "bytes_checked": 0, "bad_bytes": 0, "errors": 0}


class Stats:
    _SUMS = (
        "transfers",
        "calls",
        "bytes_checked",
        "bytes_moved",
        "bad_bytes",
        "bad_checks",
        "errors",
        "contract_errors",
        "injected",
    )

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

    def merge(self, other: Stats) -> None:
        for name in self._SUMS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for op, d in other.ops.items():
            for k, v in d.items():
                self.ops[op][k] += v
        self.mismatches = sorted(self.mismatches + other.mismatches, key=lambda m: m["t"])[
            :MAX_MISMATCHES
        ]
        self.error_samples = (self.error_samples + other.error_samples)[:MAX_SAMPLES]
        self.contract_samples = (self.contract_samples + other.contract_samples)[:MAX_SAMPLES]


class Recorder:
    """One thread's Stats and how its events are recorded (with the thread, the mode and the
    time since the start) and printed (the first few)."""

    def __init__(self, mode: str, thread: int) -> None:
        self.mode = mode
        self.thread = thread
        self.t0 = time.monotonic()  # the worker sets the common start once all are ready
        self.stats = Stats()
        self._printed = 0

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 3)

    def _print(self, msg: str) -> None:
        if self._printed < MAX_PRINTED:
            self._printed += 1
            log(f"[{self.mode} thread {self.thread}] {msg}")

    def call(self, op: str) -> None:
        self.stats.calls += 1
        self.stats.ops[op]["calls"] += 1

    def moved(self, op: str, nbytes: int) -> None:
        self.stats.bytes_moved += nbytes
        self.stats.ops[op]["bytes"] += nbytes

    def error(self, op: str) -> None:
        """An exception escaped an operation (call from its except block)."""
        tb = traceback.format_exc()
        self.stats.errors += 1
        self.stats.ops[op]["errors"] += 1
        if len(self.stats.error_samples) < MAX_SAMPLES:
            self.stats.error_samples.append(
                {
                    "op": op,
                    "thread": self.thread,
                    "mode": self.mode,
                    "t": self.now(),
                    "traceback": tb[-6000:],
                }
            )
        self._print(f"ERROR in {op}:\n{tb}")

    def contract(self, op: str, msg: str, meta: Any | None = None) -> None:
        """A documented promise broken (device, dtype, shape, structure, pinning, ...)."""
        self.stats.contract_errors += 1
        self.stats.ops[op]["errors"] += 1
        meta = meta_dict(meta)
        if len(self.stats.contract_samples) < MAX_SAMPLES:
            self.stats.contract_samples.append(
                {
                    "op": op,
                    "thread": self.thread,
                    "mode": self.mode,
                    "t": self.now(),
                    "what": msg,
                    "leaf": meta,
                }
            )
        self._print(f"CONTRACT {op}: {msg} {meta or ''}")

    def mismatch(self, op: str, detail: dict) -> None:
        """A check found bad bytes (detail: where, what)."""
        bad = detail["bad_bytes"]
        self.stats.bad_bytes += bad
        self.stats.bad_checks += 1
        self.stats.ops[op]["bad_bytes"] += bad
        detail = {"op": op, "mode": self.mode, "thread": self.thread, "t": self.now(), **detail}
        if len(self.stats.mismatches) < MAX_MISMATCHES:
            self.stats.mismatches.append(detail)
        if self.stats.bad_checks <= 5:
            log(f"[{self.mode} thread {self.thread}] MISMATCH {json.dumps(detail, default=str)}")
