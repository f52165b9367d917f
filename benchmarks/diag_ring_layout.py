"""to_device past one staging block: which ring is fastest, at what CPU cost (issue 22)

A tensor larger than ``chunk_bytes x num_buffers`` is staged through a ring of ``num_buffers``
slots of ``chunk_bytes``; a smaller one in one block. This times ``pinxfer.to_device`` of one
pageable tensor under several (chunk, buffers) layouts, interleaved in one process with the
pinned copy of the same size (``pinned.to(non_blocking=True)``) and the pageable ``t.to()``,
each call followed by a synchronize, back to back (bench_loop's run_rounds and summarize). For
each layout: the median and minimum wall time, its ratio to the pinned copy's (by medians and
by minima), and the CPU seconds per GB the process spent in the calls (``time.process_time``:
every thread's), against ``t.to()``'s (bench_loop's "CPU s/GB" row).

    python benchmarks/diag_ring_layout.py [--sizes 64M,256M,1G] [--layouts 16x4,4x16,4x8]
                                          [--rounds 6] [--json PATH]

A layout is ``CHUNK_MiBxBUFFERS``; the defaults (``pinxfer.transfer.DEFAULT_*``) are always
included, as ``default``. Layouts differ by the process they run in as well: compare them
over several processes (the figures of csrc/README.md's "The ring's geometry" are three).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_loop import parse_sizes, run_rounds, size_label, speed_ratio, summarize

import pinxfer

MiB = 1 << 20


def parse_layouts(text: str) -> dict[str, tuple[int, int]]:
    """'16x4,4x16' -> {'16x4': (16 MiB, 4), '4x16': (4 MiB, 16)}; the defaults as 'default'."""
    layouts = {
        "default": (
            pinxfer.transfer.DEFAULT_CHUNK_BYTES,
            pinxfer.transfer.DEFAULT_NUM_BUFFERS,
        )
    }
    for item in filter(None, (s.strip() for s in text.split(","))):
        chunk, _, buffers = item.partition("x")
        if not (chunk.isdigit() and buffers.isdigit() and int(chunk) > 0 and int(buffers) > 0):
            raise SystemExit(f"diag_ring_layout: a layout is CHUNK_MiBxBUFFERS, got {item!r}")
        layouts[item] = (int(chunk) * MiB, int(buffers))
    return layouts


def measure(nbytes: int, layouts: dict[str, tuple[int, int]], rounds: int) -> dict:
    dev = torch.device("cuda", torch.cuda.current_device())
    src = torch.randn(nbytes // 4)
    pinned = src.pin_memory()
    ways: dict[str, Callable[[], object]] = {
        name: (lambda c=c, n=n: pinxfer.to_device(src, dev, chunk_bytes=c, num_buffers=n))
        for name, (c, n) in layouts.items()
    }
    ways["pinned"] = lambda: pinned.to(dev, non_blocking=True)
    ways["torch_to"] = lambda: src.to(dev)
    for fn in ways.values():  # warm-up: pools, torch's caches, the first ring's segments
        fn()
        torch.cuda.synchronize()
    times, cpu = run_rounds(ways, rounds, torch.cuda.synchronize)  # balanced orders, back to back
    stats = {name: summarize(times[name], nbytes, cpu[name]) for name in ways}
    to_cpu = stats["torch_to"]["cpu_s_per_gb"]
    out: dict = {"bytes": nbytes, "rounds": rounds, "ways": {}}
    for name, st in stats.items():
        x_pinned = speed_ratio(st, stats["pinned"])
        out["ways"][name] = {
            **st,
            "layout": list(layouts[name]) if name in layouts else None,
            "x_pinned": x_pinned["median"],  # type: ignore[index]
            "x_pinned_best": x_pinned["min"],  # type: ignore[index]
            "cpu_x_torch_to": st["cpu_s_per_gb"] / to_cpu if to_cpu > 0 else None,
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="64M,256M,1G")
    ap.add_argument("--layouts", default="16x4,4x16,4x8,8x8")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("diag_ring_layout: no CUDA device", file=sys.stderr)
        sys.exit(2)
    layouts = parse_layouts(args.layouts)
    result = {"gpu": torch.cuda.get_device_name(), "sizes": {}}
    for nbytes in parse_sizes(args.sizes):
        cell = measure(nbytes, layouts, args.rounds)
        result["sizes"][size_label(nbytes)] = cell
        for name, w in cell["ways"].items():
            cpu_x = w["cpu_x_torch_to"]
            print(
                f"{size_label(nbytes):>7} {name:>8}  {w['median_us']:9.0f} us  "
                f"x pinned {w['x_pinned']:.2f} (best {w['x_pinned_best']:.2f})  "
                f"CPU {w['cpu_s_per_gb']:.3f} s/GB"
                + (f" ({cpu_x:.2f}x t.to)" if cpu_x is not None else ""),
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
