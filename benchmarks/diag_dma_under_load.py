"""Does the copy engine read host memory slower while the CPU copies beside it, and do DMAs
split over two or four streams get that rate back? (issue 22: the mid-size engine phase.)

diag_chunk_timeline shows a staged 8-64 MiB to_device's DMAs running at 41-46 GB/s on the
H100, where torch's pinned copy of the same size runs at 53-55, while pinxfer's threads stage
beside them. This times, torch only (no pinxfer), a pinned source sent to the GPU:

  alone_1       one DMA, the host idle
  load_1        one DMA while the main thread runs a host copy of `--load-factor` times the
                size (torch's copy_ of a pageable tensor into a pinned one: its OpenMP team)
  alone_S / load_S   the same bytes in S equal parts, part i on stream i (S = 2, 4), all
                queued before the first starts (the streams wait on one start event)
  written_1     one DMA of a source the main thread has just rewritten (torch's copy_ from a
                pageable tensor: cached stores, so its lines are dirty in the writers' caches,
                as pinxfer's cached staging stores leave them), the host idle

Each timed by CUDA events (a start on the first stream, which the others wait on, and an end on
each stream: the latest end counts), behind a GPU sleep of about half a millisecond so that
every part is queued before the engine starts (`late_calls` counts calls where it was not); the
host load begins when the GPU reaches the start (the main thread waits for it after the
queueing), and lasts longer than the DMAs. Until a review of session 56 the sleep was about 30
µs and the load began right after the queueing on the main thread: the two- and four-stream
figures of session 56's files (`results/h100/dma_under_load*_2026-12-07_s56.json`) may hold some
of their queueing. Ways run in balanced orders, 20 rounds; median and minimum µs and GB/s.

    python benchmarks/diag_dma_under_load.py OUT.json [--sizes 8M,32M] [--rounds 20]
        [--load-factor 4]      (results/h100/dma_under_load*_2026-12-07_s56.json)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_loop import balanced_rounds, parse_sizes, size_label

STREAMS = (1, 2, 4)


def timed_send(
    src: torch.Tensor,
    dst: torch.Tensor,
    streams: list[torch.cuda.Stream],
    load: tuple[torch.Tensor, torch.Tensor] | None,
    rewrite: torch.Tensor | None = None,
) -> tuple[float, bool]:
    """(µs from the first DMA's start to the last one's end, by CUDA events; whether the GPU
    reached the start before every part was queued, which would put the queueing in the
    figure). The bytes go split evenly over `streams`; `load` (dst, src) is copied on the host
    from when the GPU reaches the start; `rewrite` is copied into `src` on the host just
    before."""
    if rewrite is not None:
        src.copy_(rewrite)
    first = streams[0]
    start = torch.cuda.Event(enable_timing=True)
    n = src.numel()
    bounds = [n * i // len(streams) for i in range(len(streams) + 1)]
    with torch.cuda.stream(first):
        torch.cuda._sleep(1_000_000)  # ~0.5 ms: every part queued before the engine starts
        start.record(first)
    ends = []
    for i, s in enumerate(streams):
        s.wait_event(start)
        with torch.cuda.stream(s):
            dst[bounds[i] : bounds[i + 1]].copy_(src[bounds[i] : bounds[i + 1]], non_blocking=True)
            e = torch.cuda.Event(enable_timing=True)
            e.record(s)
            ends.append(e)
    late = start.query()
    if load is not None:
        while not start.query():  # the load begins with the DMAs, not during the sleep
            pass
        load[0].copy_(load[1])
    for e in ends:
        e.synchronize()
    return max(start.elapsed_time(e) for e in ends) * 1e3, late


def measure(nbytes: int, rounds: int, load_factor: float) -> dict[str, Any]:
    dev = torch.device("cuda", torch.cuda.current_device())
    src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    src.random_(0, 255)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    load_n = int(nbytes * load_factor)
    load = (
        torch.empty(load_n, dtype=torch.uint8).pin_memory(),
        torch.randint(0, 255, (load_n,), dtype=torch.uint8),
    )
    streams = [torch.cuda.current_stream(dev)] + [torch.cuda.Stream(dev) for _ in range(3)]
    rewrite = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    ways = {f"{kind}_{s}": (s, kind) for kind in ("alone", "load") for s in STREAMS}
    ways["written_1"] = (1, "written")

    late: dict[str, int] = dict.fromkeys(ways, 0)

    def send(way: str) -> float:
        s, kind = ways[way]
        us, was_late = timed_send(
            src,
            dst,
            streams[:s],
            load if kind == "load" else None,
            rewrite if kind == "written" else None,
        )
        late[way] += was_late
        return us

    times: dict[str, list[float]] = {w: [] for w in ways}
    for w in ways:  # warm-up
        send(w)
    for order in balanced_rounds(list(ways), rounds):
        for w in order:
            times[w].append(send(w))
    out: dict[str, Any] = {}
    for w, ts in times.items():
        med, lo = statistics.median(ts), min(ts)
        out[w] = {
            "median_us": round(med, 1),
            "min_us": round(lo, 1),
            "gbps_median": round(nbytes / med / 1e3, 2),
            "late_calls": late[w],  # warm-up included: should be 0
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json_path")
    ap.add_argument("--sizes", default="8M,32M")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--load-factor", type=float, default=4.0)
    args = ap.parse_args()
    result: dict[str, Any] = {
        "benchmark": "diag_dma_under_load",
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(),
        "kind": os.environ.get("PINXFER_MACHINE_KIND", "unknown"),
        "rounds": args.rounds,
        "load_factor": args.load_factor,
        "sizes": {},
    }
    for nbytes in parse_sizes(args.sizes):
        cells = measure(nbytes, args.rounds, args.load_factor)
        result["sizes"][size_label(nbytes)] = cells
        for w, c in cells.items():
            print(
                f"{size_label(nbytes):>6} {w:8} {c['median_us']:9.1f} us (min {c['min_us']:9.1f})"
                f" {c['gbps_median']:6.2f} GB/s"
            )
    with open(args.json_path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
