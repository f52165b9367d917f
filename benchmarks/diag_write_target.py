"""Does a CPU copy write pinxfer's pinned memory as fast as torch's? (issue 22)

bench_loop's `pin_memory` rows miss `t.pin_memory()` back to back at 1-32 MiB, and
diag_midsize traced the gap to the copy itself: torch's `copy_`, on torch's awake team,
into a pool block took longer than `t.pin_memory()`'s whole call (32 MiB: 402-470 µs
against 377-477 for torch's call with its synchronize). diag_dma_source showed that the copy
engine reads every kind of page-locked memory at one rate; this is the write side: torch's
`copy_` of one pageable source into targets of the same size, each kept for the run:

  torch_pinned   torch.empty(n, pin_memory=True)     (cudaHostAlloc, 4 KiB pages)
  pool           pinxfer.empty(n)                    (pool block: mmap, MADV_HUGEPAGE, registered)
  pool_off64     a pool block of n + 4 KiB, written from byte 64 on
  pool_off2k     the same, from byte 2048 on
  pageable       torch.empty(n)                      (malloc, not page-locked)

Back to back as bench_loop's b2b cells run (an untimed copy into the same target just
before each timed one), in bench_loop's balanced orders; no GPU work in between. For each
target: median and minimum µs, GB/s, the ratio of torch_pinned's median to its own (above 1:
faster than torch's block), the address modulo 4 KiB and 2 MiB (the source's too: a store
stream 4 KiB apart from its load stream can stall on address aliasing) and the page sizes of
its mapping. A second pass does the same with the source read from byte 64 of a larger
tensor (`--source-offsets`).

    python benchmarks/diag_write_target.py [--sizes 8M,32M,64M] [--rounds 40] [--json PATH]
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
from bench_loop import balanced_rounds, parse_sizes, size_label
from diag_dma_source import mapping_of, thp_setting

PAGE = 4096


def offset_view(base: torch.Tensor, offset_bytes: int, numel: int) -> torch.Tensor:
    """`numel` float32 elements of `base` from byte `offset_bytes` on."""
    first = offset_bytes // base.element_size()
    return base[first : first + numel]


def targets(pinxfer: Any, numel: int) -> dict[str, torch.Tensor]:
    spare = PAGE // 4  # float32 elements in 4 KiB
    made = {
        "torch_pinned": torch.empty(numel, pin_memory=True),
        "pool": pinxfer.empty(numel),
        "pool_off64": offset_view(pinxfer.empty(numel + spare), 64, numel),
        "pool_off2k": offset_view(pinxfer.empty(numel + spare), 2048, numel),
        "pageable": torch.empty(numel),
    }
    for t in made.values():
        t.fill_(0)  # every page present before the first timed copy
    return made


def place(t: torch.Tensor) -> dict[str, Any]:
    ptr = t.data_ptr()
    return {"mod_4k": ptr % PAGE, "mod_2m": ptr % (2 << 20)} | mapping_of(ptr)


def time_copies(src: torch.Tensor, dsts: dict[str, torch.Tensor], rounds: int) -> dict:
    times: dict[str, list[float]] = {k: [] for k in dsts}
    for order in balanced_rounds(list(dsts), rounds):
        for name in order:
            dst = dsts[name]
            dst.copy_(src)  # untimed, as bench_loop's b2b cells
            t0 = time.perf_counter()
            dst.copy_(src)
            times[name].append((time.perf_counter() - t0) * 1e6)
    return times


def summarize(times: dict[str, list[float]], nbytes: int) -> dict[str, dict]:
    ref = statistics.median(times["torch_pinned"])
    out = {}
    for name, v in times.items():
        med = statistics.median(v)
        out[name] = {
            "median_us": round(med, 1),
            "min_us": round(min(v), 1),
            "gbps_median": round(nbytes / med / 1e3, 1),
            "torch_pinned_over_this": round(ref / med, 3),
        }
    return out


def measure(sizes: list[int], rounds: int, source_offsets: list[int]) -> dict:
    import pinxfer

    cells: dict[str, Any] = {}
    for nbytes in sizes:
        numel = nbytes // 4
        base = torch.randn(numel + PAGE // 4)
        dsts = targets(pinxfer, numel)
        for src_off in source_offsets:
            src = offset_view(base, src_off, numel)
            times = time_copies(src, dsts, rounds)
            cells[f"{size_label(nbytes)} src+{src_off}"] = {
                "ways": summarize(times, nbytes),
                "source": place(src),
                "targets": {k: place(v) for k, v in dsts.items()},
            }
        del dsts, base
    return cells


def report(cells: dict) -> str:
    lines = []
    for cell, c in cells.items():
        src = c["source"]
        lines.append(f"{cell}  (source mod 4K {src['mod_4k']}, mod 2M {src['mod_2m']})")
        for name, w in c["ways"].items():
            at = c["targets"][name]
            lines.append(
                f"  {name:13} {w['median_us']:9.1f} / {w['min_us']:9.1f} us  "
                f"{w['gbps_median']:6.1f} GB/s  x{w['torch_pinned_over_this']:.2f}  "
                f"mod 4K {at['mod_4k']:5}  mod 2M {at['mod_2m']:8}  "
                f"pages {at.get('KernelPageSize', '?')}, THP {at.get('AnonHugePages', '?')}"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="8M,32M,64M")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--source-offsets", default="0,64", help="bytes, comma-separated")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    offsets = [int(x) for x in args.source_offsets.split(",")]
    cells = measure(parse_sizes(args.sizes), args.rounds, offsets)
    print(report(cells))
    result = {
        "benchmark": "diag_write_target",
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "host_cpus": os.cpu_count(),
        "thp": thp_setting(),
        "rounds": args.rounds,
        "cells": cells,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
