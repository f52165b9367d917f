"""Where pinxfer.pin_memory's time goes at 64 KiB - 32 MiB back to back (issue 22): its pool
allocation, its copy, and torch's, in one process.

Each way is timed as bench_loop times a back-to-back cell: every timed call right after an
untimed call of the same way. Besides pinxfer.pin_memory and t.pin_memory():

  px_empty / torch_empty            the allocation alone (pinxfer's pool, torch's cache)
  px_empty_copy / torch_empty_copy  the allocation, then torch's copy_ (on torch's team)
  copy_into_px_block / ..._torch_   torch's copy_ into a block kept from either
  small_torch_op_then_*             after a 256 KiB t.pin_memory() (torch's team wakes)
  probe_call / plain_call           _C._torch_team_state() (one /proc read) against a
                                    pybind call without it
  team_state                        _C._torch_team_state(): (threads learned, awake, copies
                                    on the team, threads each region asks for, /proc reads,
                                    probes the spin window answered)
  team_region                       pinxfer.pin_memory's region on the team, traced from
                                    inside (_C._last_team_region_trace): when its members
                                    arrived and finished; and its steps in C++
                                    (_C._last_pin_call_trace: pinned check, checks, setup,
                                    allocation, copy with probe and region)

    python benchmarks/diag_pin_copy.py OUT.json [--sync]   (PINXFER_TORCH_TEAM=off: the pool's
                                                           road; --sync: see SYNC)
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import pinxfer as px
from pinxfer import _C

#: With --sync: a torch.cuda.synchronize() after every call, inside the timed span, as
#: bench_loop times a back-to-back cell (its pin_memory rows miss there, 0.73-0.96x of
#: x.pin_memory() at 64 KiB-4 MiB, and pass in diag_small_calls, which does not sync).
SYNC: Callable[[], None] | None = None


def bench(fn: Callable[[], Any], n: int) -> tuple[float, float]:
    """(median, min) µs of n timed calls, each right after an untimed one (each followed by
    SYNC, timed, where it is set)."""
    sync = SYNC or (lambda: None)
    fn()
    fn()
    ts = []
    for _ in range(n):
        out = fn()
        sync()
        del out
        t = time.perf_counter()
        out = fn()
        sync()
        ts.append(time.perf_counter() - t)
        del out
    return round(statistics.median(ts) * 1e6, 1), round(min(ts) * 1e6, 1)


def region_trace(fn: Callable[[], Any], n: int = 100) -> dict[str, Any]:
    """Medians over n calls (each right after an untimed one) of the call and of its region on
    torch's team (_C._last_team_region_trace): its length, when the last member arrived,
    when the first and the last finished; and one call's chunks per member."""
    _C._trace_team_regions(True)
    calls, regions, last_in, first_out, last_out = [], [], [], [], []
    steps: dict[str, list[float]] = {}
    sample: dict[str, Any] = {}
    for _ in range(n):
        out = fn()
        del out
        t0 = time.perf_counter()
        out = fn()
        calls.append((time.perf_counter() - t0) * 1e6)
        del out
        for step, value in _C._last_pin_call_trace().items():
            steps.setdefault(step, []).append(float(value))
        tr = _C._last_team_region_trace()
        if not tr["arrive_us"]:
            continue
        regions.append(tr["total_us"])
        last_in.append(max(tr["arrive_us"]))
        first_out.append(min(tr["done_us"]))
        last_out.append(max(tr["done_us"]))
        sample = tr
    _C._trace_team_regions(False)

    def med(xs: list[float]) -> float | None:
        return round(statistics.median(xs), 1) if xs else None

    return {
        "call_us": med(calls),
        "region_us": med(regions),
        "last_member_arrived_us": med(last_in),
        "first_member_done_us": med(first_out),
        "last_member_done_us": med(last_out),
        "one_region": sample,
        # _C._last_pin_call_trace(): the call's steps in C++ (on_team: the share of calls)
        "pin_call_steps": {
            step: round(statistics.fmean(values), 2) if step == "on_team" else med(values)
            for step, values in steps.items()
        },
    }


def main() -> None:
    global SYNC
    if "--sync" in sys.argv[2:]:
        SYNC = torch.cuda.synchronize
    res: dict[str, Any] = {
        "team_setting": os.environ.get("PINXFER_TORCH_TEAM", "auto"),
        "torch_threads": torch.get_num_threads(),
        "synced": SYNC is not None,
        "rows": [],
    }
    if SYNC is not None:
        res["synchronize_alone"] = bench(lambda: None, 300)
    for nbytes in [64 << 10, 256 << 10, 1 << 20, 4 << 20, 8 << 20, 32 << 20]:
        numel = nbytes // 4
        t = torch.randn(numel)
        small = torch.randn(64 << 10)  # 256 KiB: a torch op that wakes the team
        pe = px.empty(numel)
        te = torch.empty(numel, pin_memory=True)
        ways = {
            "torch_pin": lambda: t.pin_memory(),
            "px_pin": lambda: px.pin_memory(t),
            "px_empty": lambda: px.empty(numel),
            "torch_empty": lambda: torch.empty(numel, pin_memory=True),
            "px_empty_copy": lambda: px.empty(numel).copy_(t),
            "torch_empty_copy": lambda: torch.empty(numel, pin_memory=True).copy_(t),
            "copy_into_px_block": lambda: pe.copy_(t),
            "copy_into_torch_block": lambda: te.copy_(t),
            "small_torch_op_then_torch_pin": lambda: (small.pin_memory(), t.pin_memory())[1],
            "small_torch_op_then_px_pin": lambda: (small.pin_memory(), px.pin_memory(t))[1],
            "small_torch_op_alone": lambda: small.pin_memory(),
        }
        row: dict[str, Any] = {"bytes": nbytes}
        for name, fn in ways.items():
            row[name] = bench(fn, 300 if nbytes <= (1 << 20) else 150)
        row["team_state"] = list(_C._torch_team_state())
        row["team_region"] = region_trace(lambda: px.pin_memory(t))
        t.pin_memory()  # the team awake for the probe
        row["probe_call"] = bench(_C._torch_team_state, 300)
        row["plain_call"] = bench(_C.stolen_pieces, 300)
        res["rows"].append(row)
        print(json.dumps(row), flush=True)
    with open(sys.argv[1], "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
