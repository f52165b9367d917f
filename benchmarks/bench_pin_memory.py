"""pinxfer.pin_memory against Tensor.pin_memory() (issue 3, "Benchmarks").

Sections, all in one process, pinxfer and torch side by side:
  1. warm: 1 GiB float32, both caches hold a fitting block (the result is freed each time).
  2. cold: 1 GiB, pinxfer.empty_cache() and torch._C._host_emptyCache() before every sample,
     so each sample maps, touches and page-locks fresh memory.
  3. background thread with torch.set_num_threads(1), as the DataLoader's pin thread:
     64 MiB batches, warm.
  4. a nested batch (dict of lists) of 64 tensors of mixed sizes (4 KiB .. 16 MiB, ~300 MiB):
     torch's DataLoader pinning (torch.utils.data._utils.pin_memory.pin_memory) vs
     pinxfer.pin_memory, from the main thread and from a set_num_threads(1) thread.

GB/s are 1e9 bytes/s of tensor data. Median of --repeats (>= 5) samples after two warm-up
calls. Results are freed before the next sample. Without a CUDA device torch cannot pin:
the torch rows are skipped (said so in the JSON) and pinxfer's rows are measured with
mlock'ed memory (pageable past `ulimit -l`).

Usage: python benchmarks/bench_pin_memory.py --out results/pin_memory.json [--size-mib 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

try:
    import pinxfer
except ImportError:  # run from a checkout with the extension built in place
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import pinxfer

MiB = 1 << 20
HAS_CUDA = pinxfer.cuda_unavailable_reason() is None


def median_seconds(
    fn: Callable[[], Any], repeats: int, warmup: int = 2, before: Callable[[], None] | None = None
) -> tuple[float, list[float]]:
    """Median wall seconds of fn(); `before` runs untimed ahead of each call."""
    for _ in range(warmup):
        if before:
            before()
        fn()
    times = []
    for _ in range(repeats):
        if before:
            before()
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
        del out  # the result goes back to its cache before the next sample
    return statistics.median(times), times


def in_thread_with_one_torch_thread(fn: Callable[[], Any]) -> Callable[[], Any]:
    """fn run on a fresh thread that first calls torch.set_num_threads(1)."""

    def run() -> Any:
        box: dict[str, Any] = {}

        def body() -> None:
            torch.set_num_threads(1)
            t0 = time.perf_counter()
            box["out"] = fn()
            box["seconds"] = time.perf_counter() - t0

        th = threading.Thread(target=body)
        th.start()
        th.join()
        return box

    return run


def in_thread_median(fn: Callable[[], Any], repeats: int) -> tuple[float, list[float]]:
    """Median of fn() timed inside a set_num_threads(1) thread (thread start not counted)."""
    run = in_thread_with_one_torch_thread(fn)
    for _ in range(2):
        run()
    times = [run()["seconds"] for _ in range(repeats)]
    return statistics.median(times), times


def row(section: str, way: str, nbytes: int, seconds: float, samples: list[float]) -> dict:
    return {
        "section": section,
        "way": way,
        "bytes": nbytes,
        "seconds": seconds,
        "ms": seconds * 1e3,
        "gbps": nbytes / seconds / 1e9 if seconds > 0 else 0.0,
        "samples_ms": [s * 1e3 for s in samples],
    }


def empty_caches() -> None:
    if HAS_CUDA:
        torch.cuda.synchronize()
        torch._C._host_emptyCache()
    pinxfer.empty_cache()


def mixed_batch(total_target: int) -> dict[str, list[torch.Tensor]]:
    """64 tensors, sizes spread log-uniformly from 4 KiB to 16 MiB, in a dict of lists."""
    g = torch.Generator().manual_seed(0)
    sizes = [int(4096 * (4096 ** (i / 63))) for i in range(64)]  # 4 KiB .. 16 MiB
    scale = total_target / sum(sizes)
    sizes = [max(4096, int(s * scale) // 4 * 4) for s in sizes]
    perm = torch.randperm(64, generator=g).tolist()
    tensors = [torch.randn(sizes[i] // 4, generator=g) for i in perm]
    return {f"field{k}": tensors[k * 8 : (k + 1) * 8] for k in range(8)}


def batch_bytes(batch: dict[str, list[torch.Tensor]]) -> int:
    return sum(t.nbytes for ts in batch.values() for t in ts)


def run(size_mib: int, repeats: int) -> dict:
    rows: list[dict] = []
    skipped: list[str] = []
    size = size_mib * MiB
    src = torch.randn(size // 4)
    torch_pin = (lambda: src.pin_memory()) if HAS_CUDA else None
    if not HAS_CUDA:
        skipped.append("torch rows: no usable CUDA device, Tensor.pin_memory() needs one")

    # 1. warm
    s, t = median_seconds(lambda: pinxfer.pin_memory(src), repeats)
    rows.append(row("warm", "pinxfer", size, s, t))
    if torch_pin:
        s, t = median_seconds(torch_pin, repeats)
        rows.append(row("warm", "torch", size, s, t))

    # 2. cold
    s, t = median_seconds(lambda: pinxfer.pin_memory(src), repeats, warmup=1, before=empty_caches)
    rows.append(row("cold", "pinxfer", size, s, t))
    if torch_pin:
        s, t = median_seconds(torch_pin, repeats, warmup=1, before=empty_caches)
        rows.append(row("cold", "torch", size, s, t))
    # Freed by rebinding, not del: the closures above read it (ruff's F821).
    src = None
    empty_caches()

    # 3. background thread, set_num_threads(1), 64 MiB batches
    batch64 = torch.randn(64 * MiB // 4)
    s, t = in_thread_median(lambda: pinxfer.pin_memory(batch64), repeats)
    rows.append(row("thread1_64MiB", "pinxfer", batch64.nbytes, s, t))
    if HAS_CUDA:
        s, t = in_thread_median(lambda: batch64.pin_memory(), repeats)
        rows.append(row("thread1_64MiB", "torch", batch64.nbytes, s, t))
    # Freed by rebinding, not del: the closures above read it (ruff's F821).
    batch64 = None
    empty_caches()

    # 4. nested batch of 64 mixed tensors
    from torch.utils.data._utils.pin_memory import pin_memory as torch_batch_pin

    batch = mixed_batch(min(size, 300 * MiB))
    nbytes = batch_bytes(batch)
    s, t = median_seconds(lambda: pinxfer.pin_memory(batch), repeats)
    rows.append(row("batch64", "pinxfer", nbytes, s, t))
    s, t = in_thread_median(lambda: pinxfer.pin_memory(batch), repeats)
    rows.append(row("batch64_thread1", "pinxfer", nbytes, s, t))
    if HAS_CUDA:
        s, t = median_seconds(lambda: torch_batch_pin(batch), repeats)
        rows.append(row("batch64", "torch", nbytes, s, t))
        s, t = in_thread_median(lambda: torch_batch_pin(batch), repeats)
        rows.append(row("batch64_thread1", "torch", nbytes, s, t))
    # Freed by rebinding, not del: the closures above read it (ruff's F821).
    batch = None
    empty_caches()

    ratios = {}
    by = {(r["section"], r["way"]): r for r in rows}
    for section in dict.fromkeys(r["section"] for r in rows):
        if (section, "pinxfer") in by and (section, "torch") in by:
            # > 1: pinxfer is faster (throughput ratio = inverse time ratio).
            ratios[section] = (
                by[(section, "torch")]["seconds"] / by[(section, "pinxfer")]["seconds"]
            )
    return {"rows": rows, "ratios_pinxfer_over_torch_speed": ratios, "skipped": skipped}


def print_table(report: dict) -> None:
    print(
        f"device: {report['device']}   pinxfer threads: {report['pinxfer_threads']}   "
        f"torch threads: {report['torch_threads']}"
    )
    print(f"{'section':<18}{'way':<10}{'MiB':>8}{'ms':>10}{'GB/s':>9}")
    for r in report["rows"]:
        print(
            f"{r['section']:<18}{r['way']:<10}{r['bytes'] / MiB:>8.0f}{r['ms']:>10.2f}"
            f"{r['gbps']:>9.1f}"
        )
    for section, ratio in report["ratios_pinxfer_over_torch_speed"].items():
        print(f"  {section}: pinxfer is {ratio:.2f}x torch's speed")
    for s in report["skipped"]:
        print(f"  skipped: {s}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="write the JSON report here")
    ap.add_argument("--size-mib", type=int, default=1024, help="warm/cold tensor size (1024)")
    ap.add_argument("--repeats", type=int, default=5, help="samples per row, >= 5 (5)")
    args = ap.parse_args(argv)
    if args.repeats < 5:
        ap.error("--repeats must be >= 5")
    settings = {name: value for name, value, _ in pinxfer._ops.settings()}
    report = {
        "benchmark": "pin_memory",
        "device": torch.cuda.get_device_name(0) if HAS_CUDA else "no CUDA device",
        "host": platform.node(),
        "torch": torch.__version__,
        "pinxfer": pinxfer.__version__,
        "build": pinxfer.build_info()._asdict(),
        "cpus": len(os.sched_getaffinity(0)),
        "pinxfer_threads": settings["PINXFER_NUM_THREADS"],  # value (and why, when derived)
        "torch_threads": torch.get_num_threads(),
        "numa_nodes": {str(k): len(v) for k, v in pinxfer.numa_nodes().items()},
        "topology": [g.__dict__ | {"cpus": len(g.cpus)} for g in pinxfer.topology()],
        "size_mib": args.size_mib,
        "repeats": args.repeats,
    }
    t0 = time.perf_counter()
    report.update(run(args.size_mib, args.repeats))
    report["wall_seconds"] = time.perf_counter() - t0
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print_table(report)
    print(f"wrote {args.out} ({report['wall_seconds']:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
