"""Tuning sweep for pinxfer.to_device and prefetch (not a torch comparison).

Runs one child process per setting of the knobs that are read once per process
or per call from the environment (staging copy kind, host thread count, worker
spin time, first chunk of the ramp) and, inside each child, a few chunk_bytes /
num_buffers choices. Each child measures to_device on pageable 8 MiB, 64 MiB and
1 GiB tensors and prefetch over an in-memory list of 64 MiB batches, plus the
pinned-memory DMA ceiling. The figures chose the defaults; bench_transfer.py
holds the comparisons with torch.

Usage: python benchmarks/sweep_to_device.py --out sweep.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

MiB = 1 << 20

# name -> environment overrides
SETTINGS: dict[str, dict[str, str]] = {
    "default": {},
    "copy=nt4": {"PINXFER_STAGE_COPY": "nt4"},
    "copy=memcpy": {"PINXFER_STAGE_COPY": "memcpy"},
    "copy=movsb": {"PINXFER_STAGE_COPY": "movsb"},
    "threads=8": {"PINXFER_NUM_THREADS": "8"},
    "threads=12": {"PINXFER_NUM_THREADS": "12"},
    "spin=0": {"PINXFER_SPIN_US": "0"},
    "first=64K": {"PINXFER_FIRST_CHUNK": str(64 << 10)},
    "first=4M (no ramp)": {"PINXFER_FIRST_CHUNK": str(64 << 20)},
}


def child() -> list[dict]:
    import torch

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import pinxfer

    def timed(fn, repeats: int) -> float:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    rows = []
    for nbytes, reps in ((8 * MiB, 50), (64 * MiB, 20), (1024 * MiB, 7)):
        src = torch.rand(nbytes // 4)
        variants = [("", {})]
        if nbytes >= 64 * MiB:
            variants += [(" chunk=8M", {"chunk_bytes": 8 * MiB}),
                         (" chunk=32M", {"chunk_bytes": 32 * MiB}),
                         (" buffers=8", {"num_buffers": 8})]
        for label, kw in variants:
            s = timed(lambda: pinxfer.to_device(src, "cuda", **kw), reps)
            rows.append({"what": f"to_device {nbytes // MiB}M{label}", "gbps": nbytes / s / 1e9})
        out = pinxfer.to_device(src, "cuda")
        assert torch.equal(out.cpu(), src), "to_device result differs from its source"
        del out
    pinned = torch.empty(1024 * MiB // 4).pin_memory()
    dst = torch.empty_like(pinned, device="cuda")
    s = timed(lambda: dst.copy_(pinned, non_blocking=True), 7)
    rows.append({"what": "pinned DMA 1024M (ceiling)", "gbps": 1024 * MiB / s / 1e9})
    del pinned, dst

    batches = [torch.rand(4096, 4096) for _ in range(16)]
    seq = [batches[i % 16] for i in range(48)]
    w = torch.randn(4096, 4096, device="cuda")
    results = []
    for _ in range(4):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for x in pinxfer.prefetch(seq, depth=2):
            torch.matmul(x[:256], w)
        torch.cuda.synchronize()
        results.append(len(seq) * 64 * MiB / (time.perf_counter() - t0) / 1e9)
    rows.append({"what": "prefetch list 64M x48", "gbps": statistics.median(results[1:])})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="sweep.json")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--only", default="", help="comma-separated setting names")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child()))
        return 0
    names = [n for n in SETTINGS if not args.only or n in args.only.split(",")]
    table: dict[str, dict[str, float]] = {}
    for name in names:
        env = {**os.environ, **SETTINGS[name]}
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child"], env=env,
                              capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            print(f"{name}: FAILED\n{proc.stderr[-2000:]}")
            continue
        rows = json.loads(proc.stdout.strip().splitlines()[-1])
        table[name] = {r["what"]: r["gbps"] for r in rows}
        print(name, {k: round(v, 1) for k, v in table[name].items()}, flush=True)
    with open(args.out, "w") as f:
        json.dump({"unit": "GB/s", "settings": SETTINGS, "results": table}, f, indent=1)
    if table:
        cols = list(next(iter(table.values())))
        print("\nGB/s".ljust(22) + "".join(c.replace("to_device ", "")[:13].rjust(14) for c in cols))
        for name, vals in table.items():
            print(name[:20].ljust(21) + "".join(f"{vals.get(c, 0):14.1f}" for c in cols))
    return 0


if __name__ == "__main__":
    sys.exit(main())
