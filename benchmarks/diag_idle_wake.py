"""What an idle gap costs by itself (issue 22, item 3): primitive steps timed after each gap.

bench_loop finds that after 20 ms of sleep every way of moving 4 KiB, torch's pinned copy
included, takes about 300 us instead of 15-20. This script times steps far smaller than a
transfer, each alone, right after each kind of gap, to tell where that cost lives:

  gaps      none (back to back), sleep (time.sleep: the calling core may idle), spin (a
            busy wait on the calling thread: its core stays awake, the GPU idles), gpu (a
            20 ms kernel the host waits on with a synchronize)
  steps     noop; py_work (a few us of Python); stream_sync (nothing queued); event_query
            (of a completed event); kernel_sync (a tiny kernel + stream sync);
            pinned_4k / pageable_4k / pinned_1m (torch .to(cuda) + sync); host_copy_1m (a
            CPU copy, no CUDA); px_4k / px_1m (pinxfer.to_device + sync);
            side_ready (a 1 MiB copy queued on a side stream with an event *before* the gap;
            after it the current stream waits on the event and is synchronized: what a
            prefetcher that sends one batch ahead on its own stream pays at the next step)

If spin removes the cost the calling core's idle state is the cause (its caches, its clock);
if only the steps that touch the GPU pay it, the GPU or its link is.

    python benchmarks/diag_idle_wake.py [--json PATH] [--rounds 15]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

GAP_S = 0.020


def calibrate_gpu_sleep() -> int:
    torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    cycles = 1_000_000
    t = time.perf_counter()
    torch.cuda._sleep(cycles)
    torch.cuda.synchronize()
    per_cycle = (time.perf_counter() - t) / cycles
    return max(1000, int(GAP_S / per_cycle))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # pinxfer from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_loop import balanced_rounds

    import pinxfer

    dev = torch.device("cuda", 0)
    torch.cuda.init()
    cycles = calibrate_gpu_sleep()
    side = torch.cuda.Stream(dev)
    cur = torch.cuda.current_stream(dev)
    p4k, s4k = torch.randn(1024).pin_memory(), torch.randn(1024)
    p1m, s1m = torch.randn(1 << 18).pin_memory(), torch.randn(1 << 18)
    h1m = torch.empty(1 << 18).pin_memory()
    done = torch.cuda.Event()
    done.record(cur)
    torch.cuda.synchronize()
    side_state: dict = {}

    def side_prepare() -> None:
        with torch.cuda.stream(side):
            side_state["out"] = p1m.to(dev, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(side)
        side_state["ev"] = ev

    def side_ready() -> None:
        cur.wait_event(side_state["ev"])
        cur.synchronize()

    steps: dict[str, tuple[Callable[[], object], Callable[[], None] | None]] = {
        "noop": (lambda: None, None),
        "py_work": (lambda: sum(range(300)), None),
        "stream_sync": (cur.synchronize, None),
        "event_query": (done.query, None),
        "kernel_sync": (lambda: (torch.cuda._sleep(1), cur.synchronize()), None),
        "pinned_4k": (lambda: (p4k.to(dev, non_blocking=True), cur.synchronize()), None),
        "pageable_4k": (lambda: (s4k.to(dev), cur.synchronize()), None),
        "pinned_1m": (lambda: (p1m.to(dev, non_blocking=True), cur.synchronize()), None),
        "host_copy_1m": (lambda: h1m.copy_(s1m), None),
        "px_4k": (lambda: (pinxfer.to_device(s4k, dev), cur.synchronize()), None),
        "px_1m": (lambda: (pinxfer.to_device(s1m, dev), cur.synchronize()), None),
        "side_ready": (side_ready, side_prepare),
    }

    def spin() -> None:
        end = time.perf_counter() + GAP_S
        while time.perf_counter() < end:
            pass

    def gpu() -> None:
        torch.cuda._sleep(cycles)
        torch.cuda.synchronize()

    gaps: dict[str, Callable[[], None] | None] = {
        "none": None,
        "sleep": lambda: time.sleep(GAP_S),
        "spin": spin,
        "gpu": gpu,
    }
    result: dict = {"gpu": torch.cuda.get_device_name(dev), "rounds": args.rounds, "us": {}}
    for gap_name, gap in gaps.items():
        samples: dict[str, list[float]] = {k: [] for k in steps}
        # balanced: no step always follows the same one
        for r, order in enumerate(balanced_rounds(list(steps), args.rounds + 1)):
            for name in order:
                fn, prepare = steps[name]
                if gap is None:  # back to back: each timed call right after an untimed one
                    if prepare is not None:
                        prepare()
                    fn()
                if prepare is not None:
                    prepare()
                if gap is not None:
                    gap()
                t = time.perf_counter()
                fn()
                dt = time.perf_counter() - t
                torch.cuda.synchronize()
                if r:  # round 0 warms up
                    samples[name].append(dt * 1e6)
        result["us"][gap_name] = {
            k: {"median": statistics.median(v), "min": min(v)} for k, v in samples.items()
        }
    names = list(steps)
    print(f"{'step':14}" + "".join(f"{g:>18}" for g in gaps))
    for n in names:
        cells = "".join(
            f"{result['us'][g][n]['median']:9.1f}/{result['us'][g][n]['min']:<8.1f}" for g in gaps
        )
        print(f"{n:14}{cells}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
