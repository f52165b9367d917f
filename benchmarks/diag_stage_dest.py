"""The staging copy alone, by where its source and its destination are (issue 22, session 51).

Session 50 measured, inside the small road (the caller's copy into one pool block) on one H100
host, `rep movsb` copying a cold source about twice as fast as the nontemporal loop. On session
51's host the CPU alone (benchmarks/diag_stage_reads.cpp: plain memory, the destination flushed
before each copy) read a cold source faster with the nontemporal loop, wherever the source was.
What that probe leaves out is pinxfer's destination: a registered pool block, written by the
same kind of stores call after call and read by the GPU's DMA in between. This times
`transfer::stage_copy` itself (`pinxfer._C._stage_copy_ns`, one thread, the GIL released;
`_C._place_cache_lines` puts each side where the cell says first) for every combination of

  kind        nt (nontemporal stores), movsb (cached stores)
  source      warm (just read by this thread: by the rewrite where there is one), dram
              (flushed), after_sleep (warm, then 20 ms of sleep: the core's deep idle state may
              have emptied its caches)
  dest        pool (pinxfer.empty: registered where CUDA is usable, else mlocked), pageable
              (torch.empty)
  dest state  flushed (the block flushed from the caches), rewritten (the same kind copied
              into it just before, untimed, as back to back calls do), dma_read (rewritten, then
              sent to the GPU and synchronized, as the small road's block is between two calls;
              CUDA only)

the kinds in alternating order each round. Medians and minima in microseconds, per cell.

    python benchmarks/diag_stage_dest.py [--sizes 256K,1M,4M] [--rounds 21] [--json PATH]
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
from bench_loop import parse_sizes, size_label

KINDS = ("nt", "movsb")
SOURCES = ("warm", "dram", "after_sleep")
SLEEP_S = 0.020


def dest_states(cuda: bool) -> tuple[str, ...]:
    return ("flushed", "rewritten", "dma_read") if cuda else ("flushed", "rewritten")


def one_copy(
    dst: torch.Tensor,
    src: torch.Tensor,
    gpu: torch.Tensor | None,
    kind: str,
    source: str,
    dest_state: str,
) -> float:
    """Microseconds of one staging copy of src into dst, both first put where the cell says."""
    from pinxfer import _C

    if dest_state in ("rewritten", "dma_read"):
        _C._stage_copy_ns(dst, src, kind)  # reads the source too: it is warm after this
    if dest_state == "dma_read":
        assert gpu is not None
        gpu.copy_(dst, non_blocking=True)
        torch.cuda.synchronize()
    if dest_state == "flushed":
        _C._place_cache_lines(dst, "dram")
        if source in ("warm", "after_sleep"):
            _C._place_cache_lines(src, "cache")  # reads only: the destination stays flushed
    if source == "dram":
        _C._place_cache_lines(src, "dram")
    if source == "after_sleep":
        time.sleep(SLEEP_S)
    return _C._stage_copy_ns(dst, src, kind) / 1000.0


def measure(sizes: list[int], rounds: int) -> list[dict[str, Any]]:
    import pinxfer

    cuda = pinxfer.cuda_unavailable_reason() is None
    cells: list[dict[str, Any]] = []
    for nbytes in sizes:
        src = torch.ones(nbytes, dtype=torch.uint8)
        dests = {
            "pool": pinxfer.empty(nbytes, dtype=torch.uint8),
            "pageable": torch.zeros(nbytes, dtype=torch.uint8),
        }
        gpu = torch.empty(nbytes, dtype=torch.uint8, device="cuda") if cuda else None
        for dest, dst in dests.items():
            for dest_state in dest_states(cuda):
                if dest_state == "dma_read" and dest == "pageable":
                    continue  # a pageable block is not what the GPU reads
                for source in SOURCES:
                    times: dict[str, list[float]] = {k: [] for k in KINDS}
                    for r in range(rounds):
                        order = KINDS if r % 2 == 0 else KINDS[::-1]
                        for kind in order:
                            times[kind].append(one_copy(dst, src, gpu, kind, source, dest_state))
                    for kind in KINDS:
                        cells.append(
                            {
                                "size": size_label(nbytes),
                                "bytes": nbytes,
                                "dest": dest,
                                "dest_state": dest_state,
                                "source": source,
                                "kind": kind,
                                "n": rounds,
                                "median_us": statistics.median(times[kind]),
                                "min_us": min(times[kind]),
                            }
                        )
    return cells


def render(cells: list[dict[str, Any]]) -> str:
    lines = [
        "| size | dest | dest state | source | nt median / min | movsb median / min |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    by_cell: dict[tuple[str, str, str, str], dict[str, dict[str, Any]]] = {}
    for c in cells:
        key = (c["size"], c["dest"], c["dest_state"], c["source"])
        by_cell.setdefault(key, {})[c["kind"]] = c
    for (size, dest, state, source), kinds in by_cell.items():
        text = [f"{kinds[k]['median_us']:.1f} / {kinds[k]['min_us']:.1f}" for k in KINDS]
        lines.append(f"| {size} | {dest} | {state} | {source} | {text[0]} | {text[1]} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="256K,1M,4M")
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--json", default=None, help="where to write the cells")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds: expected at least 1")
    cells = measure(parse_sizes(args.sizes), args.rounds)
    print(render(cells))
    if args.json:
        meta = {
            "benchmark": "diag_stage_dest",
            "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "affinity_cpus": len(os.sched_getaffinity(0)),
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "rounds": args.rounds,
        }
        with open(args.json, "w") as f:
            json.dump({**meta, "cells": cells}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
