"""Does the copy engine read pinxfer's pinned memory as fast as torch's? (issue 22)

A staged to_device sends from pinxfer's pool blocks (mmap, MADV_HUGEPAGE, cudaHostRegister);
bench_loop's "pinned copy" sends from torch's pinned memory (cudaHostAlloc). If the engine read
one kind slower than the other, part of to_device's gap to the pinned copy would be the memory,
not the staging. This times the same host-to-device copy from each kind of page-locked source,
the copy alone (CUDA events around it, nothing else queued) and with its call and synchronize:

  torch_pinned   torch.empty(n, pin_memory=True)       (cudaHostAlloc, torch's cache)
  pool           pinxfer.empty(n)                      (pinxfer's pool block)
  registered     pinxfer.pin_(torch.empty(n))          (cudaHostRegister of malloc'd memory)

in bench_loop's balanced orders, and for each source the page sizes its mapping has
(/proc/self/smaps: KernelPageSize, AnonHugePages), with the machine's transparent huge page
setting.

    python benchmarks/diag_dma_source.py [--sizes 8M,64M,256M] [--reps 20] [--json PATH]
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


def mapping_of(address: int) -> dict[str, Any]:
    """The smaps fields of the mapping that holds `address`."""
    fields: dict[str, Any] = {}
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                inside = lo <= address < hi
                if inside:
                    fields["mapping_bytes"] = hi - lo
                continue
            if inside and head[0] in ("KernelPageSize:", "AnonHugePages:", "Rss:", "Locked:"):
                fields[head[0].rstrip(":")] = f"{head[1]} {head[2]}"
    return fields


def thp_setting() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().strip()
    except OSError as e:
        return f"unreadable: {e}"


def sources(nbytes: int) -> dict[str, torch.Tensor]:
    import pinxfer

    registered = torch.empty(nbytes, dtype=torch.uint8)
    pinxfer.pin_(registered)
    out = {
        "torch_pinned": torch.empty(nbytes, dtype=torch.uint8, pin_memory=True),
        "pool": pinxfer.empty(nbytes, dtype=torch.uint8),
        "registered": registered,
    }
    for t in out.values():
        t.fill_(1)
    return out


def measure(sizes: list[int], reps: int) -> dict[str, Any]:
    import pinxfer

    dev = torch.device("cuda", torch.cuda.current_device())
    stream = torch.cuda.current_stream(dev)
    result: dict[str, Any] = {"thp": thp_setting(), "sizes": {}}
    for nbytes in sizes:
        srcs = sources(nbytes)
        dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        gpu_us: dict[str, list[float]] = {k: [] for k in srcs}
        wall_us: dict[str, list[float]] = {k: [] for k in srcs}
        names = list(srcs)
        for name in names:  # warm-up
            dst.copy_(srcs[name], non_blocking=True)
        torch.cuda.synchronize()
        for order in balanced_rounds(names, reps):
            for name in order:
                t0 = time.perf_counter()
                begin.record(stream)
                dst.copy_(srcs[name], non_blocking=True)
                end.record(stream)
                end.synchronize()
                wall_us[name].append((time.perf_counter() - t0) * 1e6)
                gpu_us[name].append(begin.elapsed_time(end) * 1e3)
        cell: dict[str, Any] = {}
        for name, t in srcs.items():
            g = statistics.median(gpu_us[name])
            cell[name] = {
                "gpu_us_median": round(g, 1),
                "gpu_us_min": round(min(gpu_us[name]), 1),
                "gpu_gbps_median": round(nbytes / g / 1e3, 2),
                "wall_us_median": round(statistics.median(wall_us[name]), 1),
                "mapping": mapping_of(t.data_ptr()),
            }
        base = cell["torch_pinned"]["gpu_us_median"]
        for name in srcs:
            cell[name]["gpu_vs_torch_pinned"] = round(base / cell[name]["gpu_us_median"], 3)
        result["sizes"][size_label(nbytes)] = cell
        pinxfer.unpin_(srcs["registered"])
        del srcs, dst
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="8M,64M,256M")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("diag_dma_source: no CUDA device", file=sys.stderr)
        sys.exit(2)
    out = measure(parse_sizes(args.sizes), args.reps)
    out["gpu"] = torch.cuda.get_device_name()
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
