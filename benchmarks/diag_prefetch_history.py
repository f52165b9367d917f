"""Does a process's history slow prefetch's 8 MiB batches? (issue 22, session 41)

bench_loop's whole table (sizes from 1 GiB down, in one process) measured prefetch of
8 MiB batches back to back at 473 us a batch (0.36 of the pinned copy) on an H200, where a
process running only 8 and 32 MiB took 200-210 us with every PINXFER_SENDER_OUTPUTS
setting. This script times the same step (next() and a synchronize of the consumer's
stream, 16 batches a pass, the first left out) fresh, after 256 MiB and 1 GiB rows
(to_device and prefetch), after pin_memory of those sizes (pinxfer's and torch's), after
plain-loop passes, after torch.cuda.empty_cache() and after pinxfer.empty_cache(),
with to_device and the pinned copy of the 8 MiB leaf beside it and the sender's job traces
(diag_sender.job_trace_stats) of each phase. One JSON line a phase.

    python benchmarks/diag_prefetch_history.py [--passes 8] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from diag_sender import job_trace_stats, make_batch

import pinxfer
from pinxfer import _ops

MiB = 1 << 20


def median_us(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e6, 1)


def timed_calls(fn: Any, n: int = 20) -> list[float]:
    out = []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    return out


def phase(tag: str, batches: list[dict], dev: torch.device, passes: int) -> dict:
    sender = _ops.fast.batch_sender(dev)
    steps: list[float] = []
    _ops.fast._set_sender_tracing(True)
    taken_before = sender.taken
    for _ in range(passes):
        it = iter(pinxfer.prefetch(batches, device=dev))
        for i in range(len(batches)):
            t = time.perf_counter()
            b = next(it)
            torch.cuda.current_stream(dev).synchronize()
            if i:
                steps.append(time.perf_counter() - t)
            del b
        for _ in it:  # ends the pass
            pass
    _ops.fast._set_sender_tracing(False)
    traced = sender._job_traces()
    jobs = traced[len(traced) - min(sender.taken - taken_before, len(traced)) :]
    leaf = batches[0]["x"]
    pinned = leaf.pin_memory()
    stats = pinxfer.memory_stats()
    return {
        "phase": tag,
        "step_median_us": median_us(steps),
        "step_min_us": round(min(steps) * 1e6, 1),
        "to_device_us": median_us(timed_calls(lambda: pinxfer.to_device(leaf, dev))),
        "pinned_copy_us": median_us(timed_calls(lambda: pinned.to(dev, non_blocking=True))),
        "jobs": len(jobs),
        "jobs_with_consumer_outputs": sum(1 for j in jobs if j.get("outputs_ns")),
        "trace": job_trace_stats(jobs),
        "pool_reserved_bytes": stats["reserved_bytes.current"],
        "pool_segments": stats["segments.current"],
        "torch_cuda_reserved_mib": torch.cuda.memory_reserved(dev) >> 20,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--passes", type=int, default=8)
    ap.add_argument("--json", help="also write the phases here, one JSON object")
    args = ap.parse_args()
    dev = torch.device("cuda", torch.cuda.current_device())
    batches = [make_batch(8 * MiB, i) for i in range(16)]
    for _ in pinxfer.prefetch(batches[:2], device=dev):  # the sender and its workers made
        pass
    rows = [phase("fresh", batches, dev, args.passes)]
    big = [make_batch(256 * MiB, i) for i in range(4)]
    for _ in range(3):
        pinxfer.to_device(big[0]["x"], dev)
    for _ in range(2):
        for _ in pinxfer.prefetch(big, device=dev):
            pass
    torch.cuda.synchronize()
    rows.append(phase("after 256 MiB rows", batches, dev, args.passes))
    gib = torch.ones(1 << 28)
    for _ in range(2):
        pinxfer.to_device(gib, dev)
    torch.cuda.synchronize()
    rows.append(phase("after 1 GiB rows", batches, dev, args.passes))
    # bench_loop's rows also pin each size with both pinxfer and torch (pool blocks of 256 MiB
    # and 1 GiB, free afterwards) and run plain-loop passes between prefetch passes.
    for t in (big[0]["x"], gib):
        for _ in range(2):
            pinxfer.pin_memory(t)
            t.pin_memory()
    rows.append(phase("after pin_memory of 256 MiB and 1 GiB", batches, dev, args.passes))
    for _ in range(2):
        sent = [[b[k].to(dev, non_blocking=True) for k in ("x", "y")] for b in batches]
        torch.cuda.synchronize()
        del sent
    rows.append(phase("after plain-loop passes", batches, dev, args.passes))
    torch.cuda.empty_cache()
    rows.append(phase("torch's CUDA cache emptied", batches, dev, args.passes))
    pinxfer.empty_cache()
    rows.append(phase("pinxfer's pool emptied", batches, dev, args.passes))
    for row in rows:
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "diag_prefetch_history", "phases": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
