"""Where a pageable to_device spends its time after an idle gap, step by step (issue 22).

bench_loop's H100 table (session 46) has pinxfer's small road (pipeline.h,
caller_staged_copy: a pool block, the caller's copy into it, one DMA on the current stream)
25-30 µs longer than the driver's pageable road (`t.to(dev, non_blocking=True)`) at 256 KiB
after a 20 ms gap, while back to back the two tie. This times each host step of that road
(pinxfer._C._set_step_stamps: csrc/runtime/step_stamps.h) in calls that follow the gap,
beside torch's two roads in the same rounds. Each step's figure is the median of its own
duration (from the step before it): python_in from the Python call to the op's entry, then
the op's steps as to_device_cuda.cpp and pipeline.cpp name them (usable, device, source,
pinned_check, capture_check, sources_released, stream, output, block, staged, queued,
returned), python_out from the op's end to the Python call's return, and sync from the
return to the end of the synchronize that follows.

Above the small road's bound (pinxfer._C.small_leaf_bytes) a size takes the pipelined road,
stamped since session 49 with its own steps: usable, device, source, pinned_check, mustered
(the copy crew: the torch-team probe and the helpers woken ahead), capture_check,
sources_released, stream, output (on the copy stream), pipelined (the staging and every DMA
queued, pipeline.cpp's trace splits it), handed_over (the current stream made to wait for
the copy stream, the output recorded on the current stream: copy_streams.h, hand_over).
Session 48 measured its steps outside the pipeline only as one sum (77-111 us after a gap at
1-8 MiB on an H100, diag_midsize): python_in, python_out and handed_over split it.

--loop-ways times it among all of bench_loop's ways of a cell (pinxfer's batch and
pin_memory, torch's seven), as bench_loop's rows are, and splits pinxfer's rows by the way
timed before each (px_to_device_after).

Run it once per PINXFER_STAGE_COPY value to compare the staging stores (auto: nontemporal
at these sizes; movsb: cached).

    python benchmarks/diag_small_steps.py [--sizes 4K,64K,256K] [--rounds 25]
        [--gaps b2b,sleep,gpu] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_loop import balanced_rounds, call_ways, parse_sizes, size_label
from diag_batch import make_batch
from diag_midsize import gap_before_timed_call, timed_after_twin


def median_of(rows: list[dict[str, float]]) -> dict[str, float]:
    return {k: round(statistics.median(r[k] for r in rows), 1) for k in rows[0]}


def step_durations(pinxfer, t0: int, t1: int) -> dict[str, float]:
    """The last stamped call's steps as durations (µs), with the Python call's ends."""
    record = pinxfer._C._last_step_stamps()
    steps = record["steps"]
    # A call that published nothing (another road, an error) leaves the last record as it was.
    assert steps and record["entered_ns"] >= t0, (
        "this call left no stamps: not to_device of one tensor?"
    )
    out = {"python_in": (record["entered_ns"] - t0) / 1e3}
    previous_end = 0.0
    for name, end_us in steps:
        out[name] = end_us - previous_end
        previous_end = end_us
    out["python_out"] = (t1 - record["entered_ns"]) / 1e3 - previous_end
    return out


def measure(
    pinxfer, nbytes: int, rounds: int, gap: str, loop_ways: bool, twin: bool = True
) -> dict[str, Any]:
    dev = torch.device("cuda", torch.cuda.current_device())
    sync = torch.cuda.synchronize
    gap_before = gap_before_timed_call(gap, sync)
    t = torch.randn(nbytes // 4)
    pinned = t.pin_memory()
    if loop_ways:
        batch = make_batch(nbytes)
        pinned_batch = torch.utils._pytree.tree_map(torch.Tensor.pin_memory, batch)
        ways = call_ways(pinxfer, t, pinned, batch, dev, pinned_batch)
        ways = {"px_to_device" if k == "to_device" else k: v for k, v in ways.items()}
    else:
        ways = {
            "px_to_device": lambda: pinxfer.to_device(t, dev),
            "torch_to_nb": lambda: t.to(dev, non_blocking=True),
            "torch_pinned_to": lambda: pinned.to(dev, non_blocking=True),
        }
    for fn in ways.values():
        fn()
    sync()
    rows: dict[str, list[dict[str, float]]] = {w: [] for w in ways}
    # px_to_device's rows by the way timed before it (its own untimed twin runs between)
    after: dict[str, list[dict[str, float]]] = {}
    previous = "none"
    for order in balanced_rounds(list(ways), rounds):
        for name in order:
            t0, t1, t2 = timed_after_twin(ways[name], sync, gap_before, twin or gap == "b2b")
            row = {"wall": (t2 - t0) / 1e3, "call": (t1 - t0) / 1e3, "sync": (t2 - t1) / 1e3}
            if name == "px_to_device":
                row |= step_durations(pinxfer, t0, t1)
                after.setdefault(previous, []).append(row)
            rows[name].append(row)
            previous = name
    out: dict[str, Any] = {w: median_of(r) for w, r in rows.items()}
    if loop_ways:
        out["px_to_device_after"] = {
            w: {"n": len(r), "wall": median_of(r)["wall"]} for w, r in sorted(after.items())
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="4K,64K,256K")
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--gaps", default="b2b,sleep,gpu")
    ap.add_argument(
        "--loop-ways",
        action="store_true",
        help="time among all of bench_loop's ways of a cell (call_ways), not torch's two alone",
    )
    ap.add_argument(
        "--no-twin",
        action="store_true",
        help="after a gap, no untimed call of the same way before it: the timed call follows "
        "the gap, and before the gap the timed call of another way, as in bench_loop's gap "
        "cells (back to back a twin always runs, as there)",
    )
    ap.add_argument("--json")
    args = ap.parse_args()
    import pinxfer

    sizes = parse_sizes(args.sizes)
    result: dict[str, Any] = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(),
        "stage_copy": os.environ.get("PINXFER_STAGE_COPY", "auto"),
        "rounds": args.rounds,
        "loop_ways": args.loop_ways,
        "twin": not args.no_twin,
        "gaps": {},
    }
    pinxfer._C._set_step_stamps(True)
    try:
        for gap in args.gaps.split(","):
            result["gaps"][gap] = {
                size_label(n): measure(
                    pinxfer, n, args.rounds, gap, args.loop_ways, not args.no_twin
                )
                for n in sizes
            }
    finally:
        pinxfer._C._set_step_stamps(False)
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
