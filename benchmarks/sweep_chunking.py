"""Staging layout sweep for mid-size to_device (8-64 MiB): one block vs small rings.

sweep_to_device.py chose the defaults with one staging block for tensors up to
num_buffers x chunk_bytes. This grid asks whether a small ring of cache-sized
slots (the DMA reads the slot while it is still in the last-level cache) moves
8-64 MiB tensors faster, per staging kind, and per copy-thread count (one child
process per count, since the pool is sized once per process). Sources are cold:
each call sends the next of distinct tensors holding 512 MiB in all.

Usage: python3 benchmarks/sweep_chunking.py --out chunking.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import _checkout  # noqa: F401  (pinxfer from this checkout if not installed)
from _child import run_child

MiB = 1 << 20
THREADS = ["", "8", "15"]  # "": pinxfer's own choice
LAYOUTS = [  # (label, chunk_bytes, num_buffers); one block when nbytes <= chunk x buffers
    ("block", 16 * MiB, 4),
    ("ring 1Mx4", 1 * MiB, 4),
    ("ring 1Mx8", 1 * MiB, 8),
    ("ring 2Mx4", 2 * MiB, 4),
    ("ring 2Mx8", 2 * MiB, 8),
    ("ring 4Mx4", 4 * MiB, 4),
]
STAGING = ["auto", "nt", "movsb"]
SIZES = [8 * MiB, 16 * MiB, 64 * MiB]


def child(runs: int) -> dict:
    import torch

    from pinxfer import _ops

    dev = torch.device("cuda", 0)
    out: dict = {}
    for nbytes in SIZES:
        srcs = [torch.rand(nbytes // 4) for _ in range(max(2, 512 * MiB // nbytes))]
        pinned = srcs[0].pin_memory()
        turn = [0]

        def nxt():
            turn[0] += 1
            return srcs[turn[0] % len(srcs)]

        def timed(fn) -> float:
            for _ in range(3):
                fn()
            torch.cuda.synchronize(dev)
            ts = []
            for _ in range(runs):
                t0 = time.perf_counter()
                for _ in range(8):
                    fn()
                torch.cuda.synchronize(dev)
                ts.append((time.perf_counter() - t0) / 8)
            return nbytes / statistics.median(ts) / 1e9

        row = {"ceiling": timed(lambda: pinned.to(dev, non_blocking=True))}
        for label, chunk, bufs in LAYOUTS:
            for kind in STAGING:
                row[f"{label} {kind}"] = timed(
                    lambda: _ops.to_device(nxt(), dev, chunk, bufs, kind)
                )
        check = _ops.to_device(srcs[1], dev, 1 * MiB, 4, "movsb")
        assert torch.equal(check.cpu(), srcs[1])
        out[f"{nbytes // MiB}MiB"] = row

    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="chunking.json")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.runs)))
        return 0
    table = {}
    for threads in THREADS:
        env = {"PINXFER_NUM_THREADS": threads} if threads else {}
        name = f"threads {threads or 'default'}"
        table[name] = run_child(__file__, ["--child", "--runs", str(args.runs)], env)
        for size, row in table[name].items():
            ceiling = row["ceiling"]
            best = sorted(((v, k) for k, v in row.items() if k != "ceiling"), reverse=True)[:4]
            print(
                f"{name:16s} {size:6s} ceiling {ceiling:5.1f}  "
                + "  ".join(f"{k} {v:5.1f} ({v / ceiling:.2f})" for v, k in best),
                flush=True,
            )
    with open(args.out, "w") as f:
        json.dump(
            {"unit": "GB/s, median of runs of 8 calls, cold sources", "results": table}, f, indent=1
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
