"""Which road a small pageable send should take (issue 22): pinxfer's pool block or the CUDA
driver's own pageable staging.

Up to 256 KiB pinxfer copies a pageable source into a pool block on the calling thread and sends
that block on the current stream (pipeline.h, caller_staged_copy): a pool hit, the copy, the DMA
call, and the block's return with its stream mark. A pageable `cudaMemcpyAsync` does the copy
inside the driver (into its own pinned staging) and returns once the source is read. After an
idle gap every CUDA call of the caller is slower (csrc/README.md, "Host steps"), so the road
with fewer calls may be the faster one there; and a collated batch packed into one pageable
buffer would then need one device allocation and one driver call for all its leaves.

Ways, each timed call followed by a synchronize, in bench_loop's balanced orders, after the
chosen gap (b2b, a 20 ms sleep, a 20 ms GPU kernel the host waits on):

  px_to_device      pinxfer.to_device(t)                      (the pool block)
  torch_to          t.to(dev)
  torch_to_nb       t.to(dev, non_blocking=True)              (the driver's pageable staging)
  torch_pinned_to   pinned.to(dev, non_blocking=True)         (the pinned copy)
  px_batch          pinxfer.to_device(batch)                  (bench_loop's 4-leaf batch)
  torch_batch_to    each leaf .to(dev, non_blocking=True)
  packed_pageable   the batch's bytes already packed in one pageable buffer, .to(nb):
                    what one driver call for the whole batch costs (no packing, no views)
  packed_pinned     the same bytes in one pinned buffer, .to(nb)

and, separately, how long each road's call takes to return while a 20 ms GPU kernel is still
queued ahead of it on the stream (queued_return_us): a road that waits for the stream there
would stall a training loop, whose next batch is sent while the GPU computes; and whether each
pageable road had read its source by the time it returned (source_read_on_return: the source
flipped at once, behind such a kernel), which to_device promises and CUDA's documentation does
not promise of the driver's road.

    python benchmarks/diag_small_route.py [--sizes 4K,64K,256K,1M] [--rounds 15]
        [--gaps b2b,sleep,gpu] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_loop import GAP_S, balanced_rounds, gpu_sleep_cycles, parse_sizes, size_label
from diag_batch import make_batch
from diag_midsize import gap_before_timed_call, timed_after_twin


def packed_bytes(batch: dict) -> torch.Tensor:
    """The batch's leaves' bytes back to back in one pageable uint8 tensor."""
    leaves = [batch["x"], batch["y"], *batch["meta"]]
    return torch.cat([leaf.reshape(-1).view(torch.uint8) for leaf in leaves])


def route_ways(pinxfer, nbytes: int, dev: torch.device) -> dict[str, Callable[[], Any]]:
    t = torch.randn(nbytes // 4)
    pinned = t.pin_memory()
    batch = make_batch(nbytes)
    packed = packed_bytes(batch)
    packed_pin = packed.pin_memory()
    leaves = [batch["x"], batch["y"], *batch["meta"]]
    return {
        "px_to_device": lambda: pinxfer.to_device(t, dev),
        "torch_to": lambda: t.to(dev),
        "torch_to_nb": lambda: t.to(dev, non_blocking=True),
        "torch_pinned_to": lambda: pinned.to(dev, non_blocking=True),
        "px_batch": lambda: pinxfer.to_device(batch, dev),
        "torch_batch_to": lambda: [leaf.to(dev, non_blocking=True) for leaf in leaves],
        "packed_pageable": lambda: packed.to(dev, non_blocking=True),
        "packed_pinned": lambda: packed_pin.to(dev, non_blocking=True),
    }


def measure_gap(pinxfer, sizes: list[int], rounds: int, gap: str) -> dict:
    dev = torch.device("cuda", torch.cuda.current_device())
    sync = torch.cuda.synchronize
    before = gap_before_timed_call(gap, sync)
    out: dict[str, Any] = {}
    for nbytes in sizes:
        ways = route_ways(pinxfer, nbytes, dev)
        for fn in ways.values():
            fn()
            sync()
        wall: dict[str, list[float]] = {w: [] for w in ways}
        call: dict[str, list[float]] = {w: [] for w in ways}
        for order in balanced_rounds(list(ways), rounds):
            for name in order:
                t0, t1, t2 = timed_after_twin(ways[name], sync, before)
                call[name].append((t1 - t0) / 1e3)
                wall[name].append((t2 - t0) / 1e3)
        out[size_label(nbytes)] = {
            w: {
                "median_us": round(statistics.median(wall[w]), 1),
                "min_us": round(min(wall[w]), 1),
                "call_median_us": round(statistics.median(call[w]), 1),
            }
            for w in ways
        }
    return out


def queued_return(pinxfer, sizes: list[int], trials: int, cycles: int) -> dict:
    """Each road's call time with a 20 ms kernel queued ahead of it on the current stream."""
    dev = torch.device("cuda", torch.cuda.current_device())
    sync = torch.cuda.synchronize
    out: dict[str, Any] = {}
    for nbytes in sizes:
        ways = route_ways(pinxfer, nbytes, dev)
        cell: dict[str, list[float]] = {w: [] for w in ways}
        for _ in range(trials):
            for name, fn in ways.items():
                torch.cuda._sleep(cycles)
                t0 = time.perf_counter()
                res = fn()
                cell[name].append((time.perf_counter() - t0) * 1e6)
                sync()
                del res
        out[size_label(nbytes)] = {w: round(statistics.median(v), 1) for w, v in cell.items()}
    return out


def source_read_on_return(pinxfer, sizes: list[int], trials: int, cycles: int) -> dict:
    """Whether each pageable road had read its source when the call returned (session 52).

    to_device promises that a pageable source may change or go once the call returns; CUDA's
    documentation does not promise it of an async copy from pageable memory (csrc/README.md,
    "Session 52"). So: a kernel queued ahead on the current stream, the call, every byte of
    the source flipped at once, then the result compared with the bytes at the call. A road
    that read its source later, when the stream reached the copy, delivers flipped bytes.
    Per road and size: how many of `trials` calls delivered the bytes as they were at the call
    (and, to show the test could see a late read, whether the kernel still ran at the flip)."""
    dev = torch.device("cuda", torch.cuda.current_device())
    roads: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "px_to_device": lambda t: pinxfer.to_device(t, dev),
        "torch_to_nb": lambda t: t.to(dev, non_blocking=True),
    }
    out: dict[str, Any] = {}
    for nbytes in sizes:
        cell: dict[str, dict[str, int]] = {}
        for name, road in roads.items():
            exact = queued = 0
            for _ in range(trials):
                src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
                want = src.clone()
                torch.cuda.synchronize()
                torch.cuda._sleep(cycles)
                got = road(src)
                src.bitwise_not_()
                queued += int(not torch.cuda.current_stream().query())
                exact += int(torch.equal(got.cpu(), want))
                del got, src
            cell[name] = {"exact": exact, "kernel_still_running": queued, "trials": trials}
        out[size_label(nbytes)] = cell
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="4K,64K,256K,1M")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--gaps", default="b2b,sleep,gpu")
    ap.add_argument("--json")
    args = ap.parse_args()
    import pinxfer

    sizes = parse_sizes(args.sizes)
    sync = torch.cuda.synchronize
    cycles = gpu_sleep_cycles(GAP_S, sync)
    result: dict[str, Any] = {
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(),
        "rounds": args.rounds,
        "queued_return_us": queued_return(pinxfer, sizes, 5, cycles),
        "source_read_on_return": source_read_on_return(pinxfer, sizes, 5, cycles),
    }
    for gap in args.gaps.split(","):
        result[gap] = measure_gap(pinxfer, sizes, args.rounds, gap)
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
