"""Where a prefetch step's time goes on the caller's road with its C++ sender (issue 22):
each step split into next() and the synchronize after it, against the plain loop's
.to() and its synchronize, in one process, ways alternating pass by pass; and the
sender's own calls alone (take of a batch that has landed, submit), each timed right
after the gap. Patterns: back to back, after a 20 ms sleep, after a 20 ms GPU kernel the
host waits on. Median / minimum microseconds.

    python benchmarks/diag_sender.py [--sizes 4K,64K,1M] [--passes 6] [--json PATH] [--no-calls]
        [--trace]

Each row also has the whole step (next() and the synchronize: prefetch_step, loop_step) and
step_ratio_median (the plain loop's median step over prefetch's; > 1: prefetch faster), and
the pass's start: from making the iterator (prefetch(), or the plain loop's generator) to
the first batch usable on the consumer's stream (prefetch_first, loop_first,
first_ratio_median), each pass made after the pattern's gap.

The batch is bench_loop.py's ({"x", "y", "meta"} of the given total size).
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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import pinxfer
from pinxfer import _ops

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_loop import batch_layout, parse_sizes, size_label

GAP_S = 0.02


def make_batch(nbytes: int, i: int) -> dict:
    lay = batch_layout(nbytes)
    return {
        "x": torch.full((lay["x"] // 4,), float(i)),
        "y": torch.full((lay["y"] // 8,), i, dtype=torch.int64),
        "meta": [torch.tensor(i), torch.tensor(nbytes)],
    }


def stats(xs: list[float]) -> dict:
    """Median, minimum and mean in µs: bench_loop's prefetch rows are each pass's mean step,
    so the mean is what compares with them."""
    us = [x * 1e6 for x in xs]
    return {
        "median_us": statistics.median(us),
        "min_us": min(us),
        "mean_us": statistics.fmean(us),
        "n": len(us),
    }


def sender_calls(dev: torch.device, batch: dict, gap: Any, sync: Any, passes: int) -> dict:
    """The sender's calls alone, each right after the gap: take of a batch that has landed,
    submit, and a trivial Python call for scale."""
    sender = _ops.fast.batch_sender(dev)
    leaves = [batch["x"], batch["y"], *batch["meta"]]
    take_us, submit_us, noop_us = [], [], []
    ticket = sender.submit(leaves, 16 << 20, 4)
    for _ in range(passes * 4):
        time.sleep(0.05)  # the batch lands
        sync()
        if gap is not None:
            gap()
        t0 = time.perf_counter()
        got = sender.take(ticket)  # freed outside the timing, as a batch would be
        take_us.append(time.perf_counter() - t0)
        del got
        if gap is not None:
            gap()
        t0 = time.perf_counter()
        ticket = sender.submit(leaves, 16 << 20, 4)
        submit_us.append(time.perf_counter() - t0)
        if gap is not None:
            gap()
        t0 = time.perf_counter()
        _ops.eager()
        noop_us.append(time.perf_counter() - t0)
    sender.take(ticket)
    return {
        "sender_take_landed": stats(take_us),
        "sender_submit": stats(submit_us),
        "python_call_eager": stats(noop_us),
    }


def job_trace_stats(jobs: list[dict]) -> dict[str, Any]:
    """--trace: medians over the sender's jobs, microseconds: queued (submit to the worker's
    start), send (the worker's start to every copy queued), submit_to_take, and for jobs
    with a pipelined leaf its first_dma / last_dma queued (from the worker's start)."""
    if not jobs:
        return {}
    per: dict[str, list[float]] = {"queued": [], "send": [], "submit_to_take": []}
    for j in jobs:
        per["queued"].append((j["started_ns"] - j["submitted_ns"]) / 1e9)
        per["send"].append((j["sent_ns"] - j["started_ns"]) / 1e9)
        per["submit_to_take"].append((j["taken_ns"] - j["submitted_ns"]) / 1e9)
        b = j["block"]
        # The block is the job's last pipelined leaf: a batch whose second leaf is pipelined
        # too (diag's 64 MiB batch: its 1 MiB labels) would report that one's times.
        if b is not None and b["first_queued_us"] >= 0 and 2 * b["nbytes"] >= j["bytes"]:
            # The block's times are from its start, setup_us after its muster, which the
            # worker made after starting the job.
            start = (b["mustered_ns"] - j["started_ns"]) / 1e9 + b["setup_us"] / 1e6
            per.setdefault("first_dma", []).append(start + b["first_queued_us"] / 1e6)
            per.setdefault("last_dma", []).append(start + b["last_queued_us"] / 1e6)
    out: dict[str, Any] = {f"sender_{k}": stats(v) for k, v in per.items()}
    out["sender_jobs"] = len(jobs)
    out["sender_landed_share"] = sum(j["landed"] for j in jobs) / len(jobs)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="4K,64K,256K,1M")
    ap.add_argument("--passes", type=int, default=6)
    ap.add_argument("--batches", type=int, default=16)
    ap.add_argument("--json")
    ap.add_argument("--no-calls", action="store_true", help="skip the sender's calls alone")
    ap.add_argument(
        "--trace",
        action="store_true",
        help="trace the sender's jobs in the timed passes (BatchSender._job_traces): per job "
        "its wait in the queue, its send's host time, submit to take, and its pipelined "
        "leaf's first and last DMA queued",
    )
    args = ap.parse_args()
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.init()
    sync = lambda: torch.cuda.current_stream(dev).synchronize()  # noqa: E731
    torch.cuda._sleep(1000)
    sync()
    cycles = 1 << 20
    while True:  # a kernel of about GAP_S
        t0 = time.perf_counter()
        torch.cuda._sleep(cycles)
        sync()
        if time.perf_counter() - t0 >= GAP_S / 2:
            cycles = int(cycles * GAP_S / (time.perf_counter() - t0))
            break
        cycles *= 2
    gaps = {
        "b2b": None,
        "sleep": lambda: time.sleep(GAP_S),
        "gpu": lambda: (torch.cuda._sleep(cycles), sync()),
    }
    result: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    for nbytes in parse_sizes(args.sizes):
        batches = [make_batch(nbytes, i) for i in range(args.batches)]
        for pattern, gap in gaps.items():
            split: dict[str, list[float]] = {
                k: []
                for k in (
                    "prefetch_step",
                    "loop_step",
                    "prefetch_next",
                    "prefetch_sync",
                    "loop_to",
                    "loop_sync",
                    "prefetch_first",
                    "loop_first",
                )
            }

            def run_pass(way: str) -> None:
                if gap is not None:
                    gap()  # a pass starts after a step too (the first batch's row)
                t_start = time.perf_counter()
                it = (
                    iter(pinxfer.prefetch(batches, device=dev))
                    if way == "prefetch"
                    else (
                        {
                            k: [t.to(dev, non_blocking=True) for t in v]
                            if isinstance(v, list)
                            else v.to(dev, non_blocking=True)
                            for k, v in b.items()
                        }
                        for b in batches
                    )
                )
                first, second = (
                    ("prefetch_next", "prefetch_sync")
                    if way == "prefetch"
                    else ("loop_to", "loop_sync")
                )
                whole = f"{way}_step"
                for i in range(len(batches)):
                    if i and gap is not None:
                        gap()
                    t0 = time.perf_counter()
                    b = next(it)
                    t1 = time.perf_counter()
                    sync()
                    t2 = time.perf_counter()
                    if i:  # steady state: after the first batch
                        split[first].append(t1 - t0)
                        split[second].append(t2 - t1)
                        split[whole].append(t2 - t0)
                    else:  # the pass's start: from making the iterator to the first batch
                        split[f"{way}_first"].append(t2 - t_start)
                    assert float(b["x"][0]) == float(i)
                    del b
                for _ in it:
                    pass

            run_pass("prefetch")
            run_pass("loop")
            if args.trace:
                sender = _ops.fast.batch_sender(dev)
                _ops.fast._set_sender_tracing(True)
                taken_before = sender.taken
            for p in range(args.passes):
                for way in ("prefetch", "loop") if p % 2 == 0 else ("loop", "prefetch"):
                    run_pass(way)
            row = {k: stats(v) for k, v in split.items()}
            if args.trace:
                _ops.fast._set_sender_tracing(False)
                traced = sender._job_traces()  # the last ones (a ring): this row's jobs
                taken = min(sender.taken - taken_before, len(traced))
                row.update(job_trace_stats(traced[len(traced) - taken :]))
            row["step_ratio_median"] = (
                row["loop_step"]["median_us"] / row["prefetch_step"]["median_us"]
            )
            row["first_ratio_median"] = (
                row["loop_first"]["median_us"] / row["prefetch_first"]["median_us"]
            )
            result[f"{size_label(nbytes)} {pattern}"] = row
            if not args.no_calls:
                row.update(sender_calls(dev, batches[0], gap, sync, args.passes))
            print(
                f"{size_label(nbytes):>6} {pattern:<5} "
                f"step loop/prefetch x{row['step_ratio_median']:.2f}  "
                f"first x{row['first_ratio_median']:.2f}  "
                + "  ".join(
                    f"{k} {v['median_us']:.0f}/{v['min_us']:.0f}"
                    for k, v in row.items()
                    if isinstance(v, dict)
                ),
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
