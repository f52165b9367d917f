"""Small calls, pinxfer against torch, side by side in one process (issue 12).

Rows (µs per call; each sample is a loop of --calls calls, --repeats samples,
median and minimum reported, ratio = pinxfer / torch, <= 1.0 is the target):
  pin_memory_64k      pinxfer.pin_memory(x) vs x.pin_memory(), x 64 KiB float32, warm caches
  empty_16k           pinxfer.empty(16384) vs torch.empty(16384, pin_memory=True)
  installed_empty_16k torch.empty(16384, pin_memory=True) with pinxfer.install() vs without
  pin_batch_64        a dict of 64 tensors (4-256 KiB): pinxfer.pin_memory vs torch's
                      DataLoader pinning (torch.utils.data._utils.pin_memory.pin_memory)
  to_device_batch_64  the same batch -> GPU: pinxfer.to_device vs the best torch way
                      (DataLoader pin, then .to(cuda, non_blocking=True) per tensor), and
                      the bus floor (one pinned copy of the batch's bytes); synchronized
  to_device_4k        pinxfer.to_device(x) of 4 KiB pageable vs x_pinned.to(cuda,
                      non_blocking=True) (target: within +5 µs); synchronized
  walker_64           the batch walker (_batch.map_tensors, identity) vs torch.utils._pytree
                      (tree_flatten + tree_unflatten), 64 leaves, no copies
Without a CUDA device, torch cannot pin: rows that need it are listed as skipped.

Usage: python benchmarks/bench_small_calls.py --out results/small_calls.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

try:
    import pinxfer
except ImportError:  # run from a checkout with the extension built in place
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import pinxfer

from torch.utils._pytree import tree_flatten, tree_unflatten

from pinxfer import _batch

KiB = 1 << 10
HAS_CUDA = pinxfer.cuda_unavailable_reason() is None


def per_call_us(
    fn: Callable[[], Any], calls: int, repeats: int, sync: Callable[[], None] | None = None
) -> dict:
    """µs per call of fn(): `repeats` samples of `calls` calls each (after a warm-up
    sample); `sync` (if any) runs inside each sample after the calls."""

    def sample() -> float:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        if sync:
            sync()
        return (time.perf_counter() - t0) / calls * 1e6

    sample()
    times = [sample() for _ in range(repeats)]
    return {"median_us": statistics.median(times), "min_us": min(times), "samples_us": times}


def row(name: str, ours: dict, theirs: dict | None, what: str, floor: dict | None = None) -> dict:
    out = {"name": name, "what": what, "pinxfer": ours}
    if theirs is not None:
        out["torch"] = theirs
        out["ratio_median"] = ours["median_us"] / theirs["median_us"]
        out["ratio_min"] = ours["min_us"] / theirs["min_us"]
    if floor is not None:
        out["bus_floor"] = floor
    return out


def the_batch() -> dict:
    g = torch.Generator().manual_seed(0)
    sizes = [4 * KiB << (i % 7) for i in range(64)]  # 4 KiB .. 256 KiB
    return {
        f"t{i}": torch.randint(0, 255, (n,), dtype=torch.uint8, generator=g)
        for i, n in enumerate(sizes)
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    calls, reps = args.calls, max(5, args.repeats)
    rows, skipped = [], []

    x64 = torch.randn(16 * KiB)  # 64 KiB
    ours = per_call_us(lambda: pinxfer.pin_memory(x64), calls, reps)
    theirs = per_call_us(lambda: x64.pin_memory(), calls, reps) if HAS_CUDA else None
    rows.append(row("pin_memory_64k", ours, theirs, "pinxfer.pin_memory(x) vs x.pin_memory()"))

    ours = per_call_us(lambda: pinxfer.empty(16384), calls, reps)
    theirs = (
        per_call_us(lambda: torch.empty(16384, pin_memory=True), calls, reps) if HAS_CUDA else None
    )
    rows.append(
        row(
            "empty_16k", ours, theirs, "pinxfer.empty(16384) vs torch.empty(16384, pin_memory=True)"
        )
    )

    if HAS_CUDA:
        theirs = per_call_us(lambda: torch.empty(16384, pin_memory=True), calls, reps)
        pinxfer.install()
        try:
            ours = per_call_us(lambda: torch.empty(16384, pin_memory=True), calls, reps)
        finally:
            pinxfer.uninstall()
        rows.append(
            row(
                "installed_empty_16k",
                ours,
                theirs,
                "torch.empty(16384, pin_memory=True): pinxfer installed vs torch's allocator",
            )
        )
    else:
        skipped.append("installed_empty_16k: no CUDA device")

    batch = the_batch()
    batch_bytes = sum(t.numel() for t in batch.values())
    ours = per_call_us(lambda: pinxfer.pin_memory(batch), calls // 20, reps)
    if HAS_CUDA:
        from torch.utils.data._utils.pin_memory import pin_memory as dataloader_pin

        theirs = per_call_us(lambda: dataloader_pin(batch), calls // 20, reps)
    else:
        theirs = None
    rows.append(
        row(
            "pin_batch_64",
            ours,
            theirs,
            f"dict of 64 tensors ({batch_bytes} B): pinxfer.pin_memory vs DataLoader pinning",
        )
    )

    if HAS_CUDA:
        dev = torch.device("cuda")
        sync = torch.cuda.synchronize
        from torch.utils.data._utils.pin_memory import pin_memory as dataloader_pin

        ours = per_call_us(lambda: pinxfer.to_device(batch, dev), calls // 20, reps, sync)

        def torch_way() -> dict:
            return {k: v.to(dev, non_blocking=True) for k, v in dataloader_pin(batch).items()}

        theirs = per_call_us(torch_way, calls // 20, reps, sync)
        flat = torch.empty(batch_bytes, dtype=torch.uint8, pin_memory=True)
        floor = per_call_us(lambda: flat.to(dev, non_blocking=True), calls // 20, reps, sync)
        rows.append(
            row(
                "to_device_batch_64",
                ours,
                theirs,
                "64-tensor batch to GPU: pinxfer.to_device vs DataLoader pin + .to per "
                "tensor; bus_floor: one pinned copy of the same bytes",
                floor,
            )
        )

        x4 = torch.randint(0, 255, (4 * KiB,), dtype=torch.uint8)
        x4_pinned = x4.pin_memory()
        ours = per_call_us(lambda: pinxfer.to_device(x4, dev), calls, reps, sync)
        theirs = per_call_us(lambda: x4_pinned.to(dev, non_blocking=True), calls, reps, sync)
        r = row(
            "to_device_4k",
            ours,
            theirs,
            "pinxfer.to_device(4 KiB pageable) vs pinned.to(cuda, non_blocking=True)",
        )
        r["excess_median_us"] = ours["median_us"] - theirs["median_us"]
        rows.append(r)
    else:
        skipped += ["to_device_batch_64: no CUDA device", "to_device_4k: no CUDA device"]

    ours = per_call_us(lambda: _batch.map_tensors(batch, lambda t: t), calls // 10, reps)

    def pytree_roundtrip() -> Any:
        leaves, spec = tree_flatten(batch)
        return tree_unflatten(leaves, spec)

    theirs = per_call_us(pytree_roundtrip, calls // 10, reps)
    rows.append(
        row(
            "walker_64",
            ours,
            theirs,
            "pinxfer's batch walker vs torch.utils._pytree flatten+unflatten, 64 leaves",
        )
    )

    result = {
        "benchmark": "small_calls",
        "machine": {
            "gpu": torch.cuda.get_device_name() if HAS_CUDA else None,
            "host": platform.node(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "pinxfer": pinxfer.__version__,
        },
        "calls_per_sample": calls,
        "repeats": reps,
        "rows": rows,
        "skipped": skipped,
    }
    for r in rows:
        ratio = f"{r['ratio_median']:.2f}x" if "ratio_median" in r else "-"
        theirs = f"{r['torch']['median_us']:8.2f}" if "torch" in r else "       -"
        print(
            f"{r['name']:22s} pinxfer {r['pinxfer']['median_us']:8.2f} us  torch {theirs} us  "
            f"ratio {ratio}"
        )
    for s in skipped:
        print("skipped:", s)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
