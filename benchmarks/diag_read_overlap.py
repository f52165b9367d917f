"""What a transfer costs a compute step that runs beside it (issue 22: the staged-read kernel).

A copy engine reads host memory without the SMs; a kernel that reads it (PINXFER_H2D_READ,
csrc/transfer/cuda/staged_read.h) occupies SMs while the bytes cross the bus. This times a
compute step (bf16 matmuls on the current stream) alone and with a pageable `to_device` of
`--size` queued just after it (the copy runs on pinxfer's copy stream, beside the step), in
balanced orders; per round the step's GPU time by CUDA events, and the whole (step and copy,
to the synchronize) by the host clock. Run once per PINXFER_H2D_READ value (a fresh process
each) and compare the "with_copy" step time over "alone" between them.

    PINXFER_H2D_READ=kernel python benchmarks/diag_read_overlap.py OUT.json [--size 32M]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import _checkout  # noqa: F401  (pinxfer from this checkout if not installed)
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_loop import balanced_rounds, parse_sizes

import pinxfer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json_path")
    ap.add_argument("--size", default="32M")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--matmuls", type=int, default=2, help="8192^2 bf16 matmuls per step")
    args = ap.parse_args()
    dev = torch.device("cuda", torch.cuda.current_device())
    nbytes = parse_sizes(args.size)[0]
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    src = torch.randn(nbytes // 4)

    def step() -> None:
        for _ in range(args.matmuls):
            torch.mm(a, a)

    def run(way: str) -> tuple[float, float]:
        torch.cuda.synchronize()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        begin.record()
        step()
        end.record()
        # Queued after the step: the copy stream does not wait for it, so the copy runs beside
        # the step (the current stream then waits for the copy, after `end`).
        out = pinxfer.to_device(src, dev) if way == "with_copy" else None
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e6
        del out
        return begin.elapsed_time(end) * 1e3, wall

    ways = ["alone", "with_copy", "copy_only"]
    step_us: dict[str, list[float]] = {w: [] for w in ways}
    wall_us: dict[str, list[float]] = {w: [] for w in ways}
    for w in ways:  # warm-up
        run(w) if w != "copy_only" else pinxfer.to_device(src, dev)
    for order in balanced_rounds(ways, args.rounds):
        for w in order:
            if w == "copy_only":
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                pinxfer.to_device(src, dev)
                torch.cuda.synchronize()
                wall_us[w].append((time.perf_counter() - t0) * 1e6)
                continue
            s, wl = run(w)
            step_us[w].append(s)
            wall_us[w].append(wl)
    result: dict[str, Any] = {
        "benchmark": "diag_read_overlap",
        "h2d_read": os.environ.get("PINXFER_H2D_READ", "auto"),
        "gpu": torch.cuda.get_device_name(),
        "size": nbytes,
        "matmuls": args.matmuls,
        "rounds": args.rounds,
        "step_us_median": {w: round(statistics.median(v), 1) for w, v in step_us.items() if v},
        "wall_us_median": {w: round(statistics.median(v), 1) for w, v in wall_us.items()},
    }
    result["step_slowdown"] = round(
        result["step_us_median"]["with_copy"] / result["step_us_median"]["alone"], 3
    )
    print(json.dumps(result))
    with open(args.json_path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
