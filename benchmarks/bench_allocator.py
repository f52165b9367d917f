"""Pinned allocator benchmarks: pinxfer's pool vs torch's CachingHostAllocator.

  1. cold allocation + fill of 64 MiB .. 4 GiB (caches emptied before each sample):
     pinxfer.empty vs torch.empty(pin_memory=True) with torch's default, and (in a
     child process, since torch reads it at CUDA init) with
     PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:True,pinned_num_register_threads:8
  2. cache-hit latency at 64 KiB (allocate + free, warm)
  3. reserved / peak requested after mixed-size workloads, from each allocator's stats

Usage: python benchmarks/bench_allocator.py --out results.json [--quick]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import _checkout  # noqa: F401  (pinxfer from this checkout if not installed)
import torch
from _child import run_child

import pinxfer

MiB = 1 << 20
TORCH_BEST_CONF = "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"


def _sizes(quick: bool):
    return [64 * MiB, 256 * MiB, 1024 * MiB] + ([] if quick else [4096 * MiB])


def _cold_torch(nbytes: int, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        torch._C._host_emptyCache()
        t0 = time.perf_counter()
        t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        t.fill_(1)
        out.append(time.perf_counter() - t0)
        del t
    torch._C._host_emptyCache()
    return out


def _cold_pinxfer(nbytes: int, reps: int) -> tuple[list[float], dict]:
    out, parts = [], {}
    for _ in range(reps):
        pinxfer.empty_cache()
        pinxfer.reset_accumulated_memory_stats()
        t0 = time.perf_counter()
        t = pinxfer.empty(nbytes, dtype=torch.uint8)
        t.fill_(1)
        out.append(time.perf_counter() - t0)
        s = pinxfer.memory_stats()
        parts = {k: s[k] / 1e6 for k in ("map_time_ns", "touch_time_ns", "lock_time_ns")}
        del t
    pinxfer.empty_cache()
    return out, {k.replace("_time_ns", "_ms"): v for k, v in parts.items()}


def _hit_latency(alloc, n: int = 20000) -> float:
    for _ in range(200):
        alloc()
    t0 = time.perf_counter()
    for _ in range(n):
        t = alloc()
        del t
    return (time.perf_counter() - t0) / n


def _workloads():
    def random64(step):
        rng = random.Random(step)
        return [int(2 ** rng.uniform(12, 24)) for _ in range(64)]

    def varlen(step):
        seq = random.Random(1000 + step).randint(128, 2048)
        return [32 * 3 * 224 * 224, 32 * seq * 8, 32 * seq, 32 * seq * 64 * 2, 32 * 8]

    fixed = [int(2 ** random.Random(3).uniform(12, 24)) for _ in range(64)]
    return {
        "64_random_sizes_per_step": random64,
        "5_tensors_varlen_seq": varlen,
        "64_fixed_mixed_sizes": lambda step: fixed,
    }


def _run_workload(alloc, sizes_for_step, steps=100, window=2) -> int:
    live, peak = [], 0
    for step in range(steps):
        live.append([alloc(n) for n in sizes_for_step(step)])
        peak = max(peak, sum(t.numel() for b in live for t in b))
        if len(live) > window:
            live.pop(0)
    return peak


def child_main(args) -> None:
    reps = args.reps
    res = {str(n): _cold_torch(n, reps if n < 4096 * MiB else 2) for n in _sizes(args.quick)}
    print(json.dumps(res))


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="skip the 4 GiB size")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--child-torch-cold", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_torch_cold:
        torch.cuda.init()
        return child_main(args)

    has_cuda = pinxfer.cuda_unavailable_reason() is None
    report = {
        "benchmark": "allocator",
        "device": torch.cuda.get_device_name() if has_cuda else None,
        "torch": torch.__version__,
        "pinxfer": pinxfer.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "results": {},
        "skipped": [],
    }
    if has_cuda:
        torch.cuda.init()
    # 1. cold allocation + fill
    cold = []
    best_conf = {}
    if has_cuda:
        best_conf = run_child(
            __file__,
            ["--child-torch-cold", "--reps", str(args.reps)] + (["--quick"] if args.quick else []),
            {"PYTORCH_CUDA_ALLOC_CONF": TORCH_BEST_CONF},
            timeout=600,
        )
    else:
        report["skipped"].append(
            {"section": "cold: torch", "reason": "no CUDA device: torch cannot pin"}
        )
    for n in _sizes(args.quick):
        reps = args.reps if n < 4096 * MiB else 2
        px, parts = _cold_pinxfer(n, reps)
        row = {"bytes": n, "pinxfer_ms": 1e3 * statistics.median(px), "pinxfer_parts_ms": parts}
        if has_cuda:
            row["torch_default_ms"] = 1e3 * statistics.median(_cold_torch(n, reps))
            if str(n) in best_conf:
                row["torch_register8_ms"] = 1e3 * statistics.median(best_conf[str(n)])
            row["speedup_vs_torch_default"] = row["torch_default_ms"] / row["pinxfer_ms"]
            if "torch_register8_ms" in row:
                row["speedup_vs_torch_register8"] = row["torch_register8_ms"] / row["pinxfer_ms"]
        cold.append(row)
    report["results"]["cold_alloc_fill"] = cold

    # 2. cache-hit latency at 64 KiB
    hit = {
        "bytes": 64 * 1024,
        "pinxfer_us": 1e6 * _hit_latency(lambda: pinxfer.empty(65536, dtype=torch.uint8)),
    }
    if has_cuda:
        hit["torch_us"] = 1e6 * _hit_latency(
            lambda: torch.empty(65536, dtype=torch.uint8, pin_memory=True)
        )
        hit["torch_over_pinxfer"] = hit["torch_us"] / hit["pinxfer_us"]
        # The allocator itself, without the torch.ops call overhead: torch's own
        # factory function served by pinxfer's pool (install()).
        pinxfer.install()
        try:
            hit["pinxfer_installed_us"] = 1e6 * _hit_latency(
                lambda: torch.empty(65536, dtype=torch.uint8, pin_memory=True)
            )
        finally:
            pinxfer.uninstall()
        hit["torch_over_pinxfer_installed"] = hit["torch_us"] / hit["pinxfer_installed_us"]
    report["results"]["cache_hit_64KiB"] = hit

    # 3. reserved / requested on mixed workloads
    waste = []
    for name, fn in _workloads().items():
        pinxfer.empty_cache()
        pinxfer.reset_peak_memory_stats()
        pinxfer.reset_accumulated_memory_stats()
        peak = _run_workload(lambda n: pinxfer.empty(n, dtype=torch.uint8), fn)
        s = pinxfer.memory_stats()
        row = {
            "workload": name,
            "peak_requested": peak,
            "pinxfer_reserved_peak": s["reserved_bytes.peak"],
            "pinxfer_ratio": s["reserved_bytes.peak"] / peak,
            "pinxfer_segment_maps": s["num_segment_maps"],
            "pinxfer_pin_ms": s["pin_time_ns"] / 1e6,
        }
        pinxfer.empty_cache()
        if has_cuda:
            torch._C._host_emptyCache()
            torch.cuda.reset_peak_host_memory_stats()
            peak_t = _run_workload(lambda n: torch.empty(n, dtype=torch.uint8, pin_memory=True), fn)
            ts = torch.cuda.host_memory_stats()
            reserved_t = ts.get("allocated_bytes.peak", ts.get("reserved_bytes.peak"))
            row.update(
                {
                    "torch_reserved_peak": reserved_t,
                    "torch_ratio": reserved_t / peak_t,
                    "torch_host_allocs": ts.get("num_host_alloc"),
                }
            )
            torch._C._host_emptyCache()
        waste.append(row)
    report["results"]["reserved_over_requested"] = waste

    # table
    print(f"\npinxfer allocator benchmark on {report['device'] or 'CPU only (mlock path)'}")
    print(
        f"{'cold alloc+fill':>18} {'pinxfer ms':>11} {'torch ms':>9} {'torch reg8 ms':>14} "
        f"{'x default':>9} {'x reg8':>7}"
    )
    nan = float("nan")
    for r in cold:
        print(
            f"{r['bytes'] // MiB:>14} MiB {r['pinxfer_ms']:>11.1f} "
            f"{r.get('torch_default_ms', nan):>9.1f} "
            f"{r.get('torch_register8_ms', nan):>14.1f} "
            f"{r.get('speedup_vs_torch_default', nan):>9.2f} "
            f"{r.get('speedup_vs_torch_register8', nan):>7.2f}"
        )
    print(
        f"cache hit 64 KiB: pinxfer.empty {hit['pinxfer_us']:.2f} us, torch.empty(pin_memory=True) "
        f"{hit.get('torch_us', float('nan')):.2f} us, same call with pinxfer installed "
        f"{hit.get('pinxfer_installed_us', float('nan')):.2f} us"
    )
    for r in waste:
        print(
            f"reserved/requested {r['workload']:>26}: pinxfer {r['pinxfer_ratio']:.3f}, "
            f"torch {r.get('torch_ratio', nan):.3f}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
