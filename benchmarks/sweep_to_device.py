"""Tuning sweep for pinxfer.to_device and prefetch (not a torch comparison).

Runs one child process per setting of the knobs pinxfer reads once per process
from its environment (csrc/runtime/settings.h: staging copy kind and bytes staged
nontemporal at the tail as overrides of to_device's "auto", host thread count,
worker spin time) and, inside each child, a few chunk_bytes /
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
import sys
import time

from _child import run_child

MiB = 1 << 20

# name -> environment overrides
SETTINGS: dict[str, dict[str, str]] = {
    "default": {},
    "all nt": {"PINXFER_STAGE_COPY": "nt"},
    "all movsb": {"PINXFER_STAGE_COPY": "movsb"},
    "tail 32M": {"PINXFER_CACHED_TAIL": str(32 << 20)},
    "16 threads": {"PINXFER_NUM_THREADS": "16"},
    "no spin": {"PINXFER_SPIN_US": "0"},
}


def child() -> list[dict]:
    import torch

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from bench_transfer import timed as timed_once  # this script's directory is on sys.path

    import pinxfer

    def timed(fn, repeats: int) -> float:
        return timed_once(fn, repeats, warmup=3)

    rows = []

    def row(what: str, nbytes: int, seconds: float) -> None:
        rows.append({"what": what, "gbps": nbytes / seconds / 1e9, "us": seconds * 1e6})

    # Fixed costs: a tiny pageable tensor, and 8 MiB already pinned (one DMA).
    tiny = torch.rand(1024)
    row("to_device 4K (latency)", 4096, timed(lambda: pinxfer.to_device(tiny, "cuda"), 200))
    pinned8 = pinxfer.empty(2 * MiB)
    pinned8.uniform_()
    row("to_device 8M pinned", 8 * MiB, timed(lambda: pinxfer.to_device(pinned8, "cuda"), 50))
    # Freed by rebinding, not del: the closures above read it (ruff's F821).
    pinned8 = None

    # Hot sources: the same tensor again and again (as bench_transfer section 1).
    for nbytes, reps in ((8 * MiB, 50), (64 * MiB, 20), (256 * MiB, 10), (1024 * MiB, 7)):
        src = torch.rand(nbytes // 4)
        variants = [("", {})]
        if nbytes == 1024 * MiB:
            variants += [
                (" ring 8Mx4", {"chunk_bytes": 8 * MiB, "num_buffers": 4}),
                (" ring 16Mx8", {"num_buffers": 8}),
            ]
        for label, kw in variants:
            s = timed(lambda: pinxfer.to_device(src, "cuda", **kw), reps)
            row(f"to_device {nbytes // MiB}M{label}", nbytes, s)
        out = pinxfer.to_device(src, "cuda")
        assert torch.equal(out.cpu(), src), "to_device result differs from its source"
        del out
        # Freed by rebinding, not del: the closures above read it (ruff's F821).
        src = None

    # Cold sources: 16 distinct 64 MiB tensors in turn (1 GiB: not in any cache).
    batches = [torch.rand(4096, 4096) for _ in range(16)]
    turn = iter(range(1 << 30))
    for label, kw in (("", {}), (" ring 8Mx4", {"chunk_bytes": 8 * MiB, "num_buffers": 4})):
        s = timed(lambda: pinxfer.to_device(batches[next(turn) % 16], "cuda", **kw), 32)
        row(f"to_device 64M cold{label}", 64 * MiB, s)

    pinned = torch.empty(1024 * MiB // 4).pin_memory()
    dst = torch.empty_like(pinned, device="cuda")
    row(
        "pinned DMA 1G (ceiling)",
        1024 * MiB,
        timed(lambda: dst.copy_(pinned, non_blocking=True), 7),
    )
    # Freed by rebinding, not del: the closures above read them (ruff's F821).
    pinned = dst = None

    seq = [batches[i % 16] for i in range(48)]
    w = torch.randn(4096, 4096, device="cuda")
    small = [b.view(4, 1024, 4096)[i] for b in batches for i in range(4)]  # 16 MiB views
    for label, seq_, kw in (
        ("64M x48", seq, {}),
        ("64M x48 depth 3", seq, {"depth": 3}),
        ("16M x192", small * 3, {}),
    ):
        results = []
        for _ in range(4):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for x in pinxfer.prefetch(seq_, **kw):
                torch.matmul(x[:256], w)
            torch.cuda.synchronize()
            results.append(time.perf_counter() - t0)
        row(f"prefetch {label}", sum(t.nbytes for t in seq_), statistics.median(results[1:]))
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
        rows = run_child(__file__, ["--child"], SETTINGS[name], timeout=120)
        table[name] = {r["what"]: (r["us"] if "latency" in r["what"] else r["gbps"]) for r in rows}
        print(name, "done", flush=True)
    with open(args.out, "w") as f:
        json.dump(
            {
                "unit": "GB/s (latency rows: us)",
                "settings": {n: SETTINGS[n] for n in names},
                "results": table,
            },
            f,
            indent=1,
        )
    if table:
        settings = list(table)
        print("\nGB/s (latency: us)".ljust(30) + "".join(n[:12].rjust(13) for n in settings))
        for what in next(iter(table.values())):
            print(what[:29].ljust(30) + "".join(f"{table[n].get(what, 0):13.1f}" for n in settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
