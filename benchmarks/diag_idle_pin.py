"""pin_memory after an idle gap, step by step (issue 22, item 3): where pinxfer's time goes
against t.pin_memory()'s when the call follows 20 ms of sleep, as between training steps.

Every way is timed alone, right after its own 20 ms sleep, in a new random order each round,
so each pays the gap's cost once (csrc/README.md, "What an idle gap costs by itself"):

  torch_pin                     t.pin_memory()
  px_pin                        pinxfer.pin_memory(t), and its steps in C++
                                (_C._last_pin_call_trace: pinned check, checks, setup with the
                                helpers' wake-up, pool allocation, copy; "total" is all but
                                the pinned check; what the call took beyond pinned check +
                                total is Python, the binding and the result's wrapper)
  px_pin_1thread                pinxfer.pin_memory(t, num_threads=1): the caller alone
  torch_copy_into_kept_pinned   kept.copy_(t) into a pinned tensor kept across rounds:
                                torch's copy alone, on its OpenMP team
  np_copy_into_kept_pinned      numpy's copyto into the same kept block: one thread's copy
  np_copy_into_kept_pageable    the same into pageable memory (is pinned memory slower?)
  px_empty                      pinxfer.empty(n): the pool allocation with Python around it

    python benchmarks/diag_idle_pin.py OUT.json [--rounds 24] [--sizes 1,4,8]  (MiB)

Without CUDA, torch_pin is left out and the pool's memory is locked by mlock (a smoke test).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import pinxfer as px
from pinxfer import _C

GAP_S = 0.020


def ways_for(mib: int) -> dict[str, Callable[[], Any]]:
    src = torch.randn(mib << 18)
    kept_pinned = px.pin_memory(torch.empty_like(src))
    kept_pageable = torch.zeros_like(src)
    src_np, pinned_np, pageable_np = src.numpy(), kept_pinned.numpy(), kept_pageable.numpy()
    ways: dict[str, Callable[[], Any]] = {
        "torch_pin": lambda: src.pin_memory(),
        "px_pin": lambda: px.pin_memory(src),
        "px_pin_1thread": lambda: px.pin_memory(src, num_threads=1),
        "torch_copy_into_kept_pinned": lambda: kept_pinned.copy_(src),
        "np_copy_into_kept_pinned": lambda: np.copyto(pinned_np, src_np),
        "np_copy_into_kept_pageable": lambda: np.copyto(pageable_np, src_np),
        "px_empty": lambda: px.empty([src.numel()], dtype=torch.float32),
    }
    if not torch.cuda.is_available():
        del ways["torch_pin"]  # torch pins only where CUDA is usable
    return ways


def after_gaps(ways: dict[str, Callable[[], Any]], rounds: int) -> dict[str, Any]:
    """Median and minimum µs of each way after a gap; px_pin's traced steps, medians."""
    times: dict[str, list[float]] = {name: [] for name in ways}
    steps: dict[str, list[float]] = {}
    for fn in ways.values():  # warm: pool blocks, torch's cache, the threads started
        fn()
        fn()
    for _ in range(rounds):
        order = list(ways)
        random.shuffle(order)
        for name in order:
            time.sleep(GAP_S)
            t0 = time.perf_counter()
            out = ways[name]()
            times[name].append((time.perf_counter() - t0) * 1e6)
            del out
            if name == "px_pin":
                for step, value in _C._last_pin_call_trace().items():
                    steps.setdefault(step, []).append(float(value))
    res: dict[str, Any] = {
        name: {"median_us": round(statistics.median(v), 1), "min_us": round(min(v), 1)}
        for name, v in times.items()
    }
    res["px_pin_steps_median"] = {s: round(statistics.median(v), 1) for s, v in steps.items()}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--rounds", type=int, default=24)
    ap.add_argument("--sizes", default="1,4,8", help="MiB of float32, comma separated")
    args = ap.parse_args()
    if torch.cuda.is_available():
        torch.zeros(1, device="cuda")
        torch.cuda.synchronize()
    _C._trace_team_regions(True)  # also turns on _last_pin_call_trace
    report: dict[str, Any] = {
        "benchmark": "diag_idle_pin",
        "issue": 22,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "gap_s": GAP_S,
        "rounds": args.rounds,
        "torch_team": os.environ.get("PINXFER_TORCH_TEAM", "auto"),
        "sizes": {},
    }
    for mib in (int(s) for s in args.sizes.split(",")):
        report["sizes"][f"{mib}MiB"] = row = after_gaps(ways_for(mib), args.rounds)
        print(f"{mib} MiB", json.dumps(row))
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
