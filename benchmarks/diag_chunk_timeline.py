"""Where a mid-size to_device loses to the pinned copy (issue 22): the DMA engine's timeline,
chunk by chunk.

A single-block to_device of 8-64 MiB runs at 0.6-0.76x the pinned copy of the same size, yet
pinxfer's threads stage 8 MiB at 80-100 GB/s (pin_memory, bench_loop) and the bus carries
50-55. Either the DMA engine waits for staged bytes (the staging is late: wake-ups, the ramp,
the caller noticing a finished chunk) or it reads staged bytes slower than a pinned source's
(the staging's stores, the CPU's DRAM traffic beside the DMA). This script tells them apart.

For each timed call, pinxfer._C._set_chunk_timeline(True) has the transfer record a timing
event before its first DMA and after each chunk's, with the host time each chunk was queued:

  wall_us        the call and a synchronize
  first_dma_us   when the first chunk was queued (the call's setup and first staging)
  dma_wait_us    the time the DMA engine had nothing queued: per chunk, how long after the
                 previous chunk's DMA finished this one was queued (host and GPU clocks share
                 the start event's origin, off by its launch latency, a few µs)
  busy_gbps      the DMA's rate over the chunks queued before the previous one finished
                 (the engine had work waiting): bytes over the spacing of their finishes
  tail_us        from the last chunk's queueing to its DMA's end
  head_gbps      busy_gbps over the spans that begin in the first half of the bytes, and
  rest_gbps      over the others. Under 'auto' all but a transfer's last 16 MiB is staged with
                 cached stores (all of it from 32 MiB up while the copy stream is busy), so the
                 halves are the two store kinds only at 32 MiB; there the engine read the
                 cached half at 38-47 GB/s and the other at 53-54 (session 56, H100)
  spans          the DMAs the chunks went in (consecutive staged chunks go together while
                 the engine has work queued: pipeline.cpp's SpanGate)
  at_*_us        pinxfer's host steps, from the Python call (host_steps): where the time
                 before the first DMA and after the last one goes

wall_us is the call and its synchronize alone: the timeline is read after it.

and the same for the pinned source: the same chunks, each queued with torch's copy_ (so
its busy_gbps is the bus's rate chunk by chunk), and the whole pinned copy in one DMA.
And the copy engine's own cost of a DMA: the pinned source sent whole and in the plan's
chunks behind a GPU sleep, so the host never holds the engine up (engine_cost).
Staging modes ("auto", "nt", "movsb") interleave call by call in one process, the ways of
each round in bench_loop's balanced orders (the same order for both patterns). Patterns: back
to back (an untimed call first, as bench_loop) and after a 20 ms sleep.

    python benchmarks/diag_chunk_timeline.py OUT.json [--sizes 8M,32M,64M] [--rounds 12]
        [--modes auto,nt,movsb]
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
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import itertools

from bench_loop import balanced_rounds, parse_sizes, size_label

MODES = ("auto", "nt", "movsb")
STEP_FIELDS = (
    "at_muster_us",
    "at_probed_us",
    "at_checked_us",
    "at_streams_us",
    "at_output_us",
    "at_entry_us",
    "at_start_us",
    "at_alloc_us",
    "at_offered_us",
    "at_first_dma_us",
    "at_last_dma_us",
    "at_copy_done_us",
    "at_return_us",
    "at_dma_end_us",
    "at_synced_us",
    "at_first_own_us",
    "own_stage_us",
    "gate_us",
    "gate_queries",
    "queue_us",
)
PATTERNS = ("b2b", "sleep")


def summarize(chunks: list[dict]) -> dict[str, float]:
    """The DMA engine's figures of one call from its chunk timeline (see the docstring)."""
    waited = 0.0
    busy_bytes = 0
    busy_us = 0.0
    for c in range(1, len(chunks)):
        prev, cur = chunks[c - 1], chunks[c]
        waited += max(0.0, cur["queued_us"] - prev["dma_done_us"])
        if cur["queued_us"] <= prev["dma_done_us"]:
            busy_bytes += cur["end"] - cur["begin"]
            busy_us += cur["dma_done_us"] - prev["dma_done_us"]
    last = chunks[-1]
    half = last["end"] / 2
    # busy_gbps split by where a span begins: only spans queued while the engine still ran the
    # previous one, timed on the GPU's clock alone (end to end); a span queued to an idle engine
    # would be timed from its host queue time, off by the start event's launch latency.
    span_bytes = {True: 0, False: 0}
    span_us = {True: 0.0, False: 0.0}
    for prev, cur in itertools.pairwise(chunks):
        if cur["queued_us"] <= prev["dma_done_us"]:
            head = cur["begin"] < half
            span_bytes[head] += cur["end"] - cur["begin"]
            span_us[head] += cur["dma_done_us"] - prev["dma_done_us"]

    def rate(head: bool) -> float:
        return span_bytes[head] / span_us[head] / 1e3 if span_us[head] > 0 else float("nan")

    return {
        "spans": len(chunks),
        "first_dma_us": chunks[0]["queued_us"],
        "dma_wait_us": waited,
        "busy_gbps": busy_bytes / busy_us / 1e3 if busy_us > 0 else float("nan"),
        "busy_share": busy_bytes / last["end"],
        "tail_us": last["dma_done_us"] - last["queued_us"],
        "head_gbps": rate(True),
        "rest_gbps": rate(False),
        "dma_span_us": last["dma_done_us"],
    }


def host_steps(
    t0_ns: int, returned_ns: int, synced_ns: int, trace: dict, rows: list[dict]
) -> dict[str, float]:
    """One pinxfer call's host steps, µs from the Python call (time.perf_counter_ns and the
    trace's steady clock are both CLOCK_MONOTONIC): the op's muster of its copy threads, the
    single-block copy's start, its staging block allocated, its helpers' job posted, its first
    and last DMA span queued, the copy's end, the call's return, the DMA's end (the timeline's
    start event placed at its host time, off by that event's launch latency) and the
    synchronize's return."""
    muster = (trace["mustered_ns"] - t0_ns) / 1e3
    start = muster + trace["setup_us"]
    # The timeline's origin on the host: its first span's queue time, in both clocks.
    timeline_origin = start + trace["first_queued_us"] - rows[0]["queued_us"]
    return {
        "at_muster_us": muster,
        "at_start_us": start,
        "at_alloc_us": start + trace["alloc_us"],
        "at_offered_us": start + trace["offered_us"],
        "at_first_dma_us": start + trace["first_queued_us"],
        "at_last_dma_us": start + trace["last_queued_us"],
        "at_copy_done_us": start + trace["total_us"],
        "at_return_us": (returned_ns - t0_ns) / 1e3,
        "at_dma_end_us": timeline_origin + rows[-1]["dma_done_us"],
        "at_synced_us": (synced_ns - t0_ns) / 1e3,
        # The op's steps between the muster and the copy's start: the muster's own end (the
        # team probe, the wake-ahead), the capture check and finished-sources sweep, the
        # streams, the output's allocation, the pipeline's entry (then the plan).
        "at_probed_us": muster + trace["probed_us"],
        "at_checked_us": muster + trace["checked_us"],
        "at_streams_us": muster + trace["streams_us"],
        "at_output_us": muster + trace["output_us"],
        "at_entry_us": muster + trace["entry_us"],
        # The caller's own account: its first piece, and its time staging, asking the span
        # gate (event queries) and queueing spans (the DMA calls and each span's event).
        "at_first_own_us": start + trace["first_own_done_us"],
        "own_stage_us": trace["own_stage_us"],
        "gate_us": trace["gate_us"],
        "gate_queries": float(trace["gate_queries"]),
        "queue_us": trace["queue_us"],
    }


def pinned_timeline(pinned: torch.Tensor, dst: torch.Tensor, bounds: list[int]) -> list[dict]:
    """The pinned source sent in the same chunks, one torch copy_ each, timed like
    pinxfer's (events on the current stream, host queue times from the start event's)."""
    stream = torch.cuda.current_stream()
    src8, dst8 = pinned.view(torch.uint8), dst.view(torch.uint8)
    start = torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record(stream)
    rows = []
    events = []
    for b, e in itertools.pairwise(bounds):
        dst8[b:e].copy_(src8[b:e], non_blocking=True)
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream)
        events.append(ev)
        rows.append({"begin": b, "end": e, "queued_us": (time.perf_counter() - t0) * 1e6})
    for row, ev in zip(rows, events):
        ev.synchronize()
        row["dma_done_us"] = start.elapsed_time(ev) * 1e3
    return rows


def engine_cost(pinned: torch.Tensor, dst: torch.Tensor, bounds: list[int]) -> dict[str, float]:
    """The copy engine's own time for the pinned source sent whole and in the plan's chunks,
    with no event between the chunks: every copy is queued behind a GPU sleep, so the engine
    never waits for the host. Medians of 5; per_dma_us is what each extra DMA cost."""
    stream = torch.cuda.current_stream()
    src8, dst8 = pinned.view(torch.uint8), dst.view(torch.uint8)
    times: dict[str, list[float]] = {"whole_us": [], "chunks_us": []}
    for _ in range(5):
        for way in times:
            torch.cuda._sleep(20_000_000)  # ~10 ms: longer than queueing the chunks
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            if way == "whole_us":
                dst8.copy_(src8, non_blocking=True)
            else:
                for b, e in itertools.pairwise(bounds):
                    dst8[b:e].copy_(src8[b:e], non_blocking=True)
            end.record(stream)
            end.synchronize()
            times[way].append(start.elapsed_time(end) * 1e3)
    out = {k: statistics.median(v) for k, v in times.items()}
    out["chunks"] = len(bounds) - 1
    out["per_dma_us"] = (out["chunks_us"] - out["whole_us"]) / max(1, len(bounds) - 2)
    out["whole_gbps"] = bounds[-1] / out["whole_us"] / 1e3
    return out


def measure(sizes: list[int], rounds: int, modes: tuple[str, ...] = MODES) -> dict[str, Any]:
    import pinxfer

    dev = torch.device("cuda", torch.cuda.current_device())
    sync = torch.cuda.synchronize
    out: dict[str, Any] = {}
    pinxfer._C._set_chunk_timeline(True)
    try:
        for nbytes in sizes:
            t = torch.randn(nbytes // 4)
            pinned = t.pin_memory()
            dst = torch.empty_like(t, device=dev)
            for mode in modes:  # warm-up: pool blocks, code
                pinxfer.to_device(t, dev, staging=mode)
            sync()
            pinxfer._C._last_chunk_timeline()
            bounds = pinxfer._C._chunk_plan(
                nbytes,
                pinxfer.transfer.DEFAULT_CHUNK_BYTES,
                pinxfer.transfer.DEFAULT_NUM_BUFFERS,
                1,
            )[0]
            ways = [*(f"px_{m}" for m in modes), "pinned_chunks", "pinned_whole"]
            cells: dict[str, dict[str, list]] = {
                f"{p}/{w}": {"wall_us": [], "calls": []} for p in PATTERNS for w in ways
            }

            def call(way: str) -> tuple[float, list[dict] | None, dict | None]:
                """Runs one call of `way` and its synchronize: (wall µs, its chunk timeline,
                pinxfer's host steps) - the timeline is read after the wall time is taken."""
                t0 = time.perf_counter_ns()
                if way.startswith("px_"):
                    pinxfer.to_device(t, dev, staging=way[3:])
                    returned = time.perf_counter_ns()
                    sync()
                    synced = time.perf_counter_ns()
                    rows = pinxfer._C._last_chunk_timeline()
                    trace = pinxfer._C._last_single_block_trace()
                    return (synced - t0) / 1e3, rows, host_steps(t0, returned, synced, trace, rows)
                if way == "pinned_chunks":
                    rows = pinned_timeline(pinned, dst, bounds)
                    sync()
                    return (time.perf_counter_ns() - t0) / 1e3, rows, None
                dst.copy_(pinned, non_blocking=True)
                sync()
                return (time.perf_counter_ns() - t0) / 1e3, None, None

            for r, order in enumerate(balanced_rounds(ways, rounds)):
                for pattern in PATTERNS:
                    for way in order:
                        if pattern == "b2b":
                            call(way)
                        else:
                            time.sleep(0.02)
                        wall, rows, steps = call(way)
                        cell = cells[f"{pattern}/{way}"]
                        cell["wall_us"].append(round(wall, 1))
                        if rows:
                            cell["calls"].append({**summarize(rows), **(steps or {})})
                        if r == rounds - 1 and rows:
                            cell["last_timeline"] = rows
            summary = {}
            for key, cell in cells.items():
                s: dict[str, Any] = {"wall_us": statistics.median(cell["wall_us"])}
                if cell["calls"]:
                    for field in cell["calls"][0]:
                        vals = [c[field] for c in cell["calls"] if c[field] == c[field]]
                        s[field] = round(statistics.median(vals), 2) if vals else None
                summary[key] = s
            out[size_label(nbytes)] = {
                "bounds": bounds,
                "engine": engine_cost(pinned, dst, bounds),
                "summary": summary,
                "cells": cells,
            }
    finally:
        pinxfer._C._set_chunk_timeline(False)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json_path")
    ap.add_argument("--sizes", default="8M,32M,64M")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--modes", default=",".join(MODES), help="staging modes, comma list")
    args = ap.parse_args()
    result: dict[str, Any] = {
        "benchmark": "diag_chunk_timeline",
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(),
        "kind": os.environ.get("PINXFER_MACHINE_KIND", "unknown"),
        "rounds": args.rounds,
        "sizes": measure(parse_sizes(args.sizes), args.rounds, tuple(args.modes.split(","))),
    }
    cols = (
        "wall_us",
        "spans",
        "first_dma_us",
        "dma_wait_us",
        "busy_gbps",
        "busy_share",
        "tail_us",
        "head_gbps",
        "rest_gbps",
        *STEP_FIELDS,
    )
    print(f"{'size':>6} {'cell':22} " + " ".join(f"{c:>12}" for c in cols))
    for size, block in result["sizes"].items():
        eng = block["engine"]
        print(
            f"{size:>6} chunks {eng['chunks']}: engine whole {eng['whole_us']:.1f} us "
            f"({eng['whole_gbps']:.1f} GB/s), in chunks {eng['chunks_us']:.1f} us, "
            f"{eng['per_dma_us']:.2f} us per extra DMA"
        )
        for key, s in block["summary"].items():
            vals = " ".join(
                f"{s[c]:12.2f}" if isinstance(s.get(c), float) else f"{'-':>12}" for c in cols
            )
            print(f"{'':6} {key:22} {vals}")
    with open(args.json_path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
