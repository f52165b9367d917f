"""Does a pinned pool miss wait for the GPU? (issue 22, session 20)

A large request the pool cannot serve maps a new segment; if the pool holds fully free large
segments too small for it, it first unmaps them (``cudaHostUnregister``) and maps one segment
of their total (csrc/README.md, "Reuse"). In session 20 a ``to_host`` whose block was such a
merging miss reported its copy finished although a 1 s GPU sleep was queued before it. This
times ``pinxfer.empty(size)`` with a GPU sleep queued on the current stream, in three pool
states, each prepared (and synchronized) before the sleep is queued:

  hit            a free block of the size is cached
  plain miss     the pool holds nothing (empty_cache): a new segment is mapped
  merging miss   ``--pieces`` free segments of size/pieces each: unmapped, one mapped

and reports each call's time and whether the sleep had already finished when it returned
(``torch.cuda.current_stream().query()``): True after a call that took far less than the sleep
means the call waited for the GPU.

    python benchmarks/diag_pool_miss.py [--size 16M] [--pieces 4] [--sleep-ms 300] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_loop import gpu_sleep_cycles, parse_sizes

import pinxfer


def prepare(state: str, nbytes: int, pieces: int) -> None:
    """Leaves the pool in ``state``, with nothing of it pending on the GPU."""
    pinxfer.empty_cache()
    if state == "hit":
        held = [pinxfer.empty(nbytes, dtype=torch.uint8)]
    elif state == "merging miss":
        # One at a time while the others are held: each a segment of its own.
        held = [pinxfer.empty(nbytes // pieces, dtype=torch.uint8) for _ in range(pieces)]
    else:
        held = []
    del held  # freed: their free fences are recorded on the current stream
    torch.cuda.synchronize()


def trial(state: str, nbytes: int, pieces: int, cycles: int) -> dict:
    prepare(state, nbytes, pieces)
    before = pinxfer.memory_stats()
    torch.cuda._sleep(cycles)
    t0 = time.perf_counter()
    block = pinxfer.empty(nbytes, dtype=torch.uint8)
    took_ms = (time.perf_counter() - t0) * 1e3
    sleep_done = torch.cuda.current_stream().query()
    after = pinxfer.memory_stats()
    torch.cuda.synchronize()
    del block
    return {
        "took_ms": took_ms,
        "sleep_done_at_return": sleep_done,
        "stats_delta": {
            k: after[k] - before[k]
            for k in after
            if k in before and isinstance(after[k], int) and after[k] != before[k]
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="16M")
    ap.add_argument("--pieces", type=int, default=4)
    ap.add_argument("--sleep-ms", type=float, default=300.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("diag_pool_miss: no CUDA device", file=sys.stderr)
        sys.exit(2)
    (nbytes,) = parse_sizes(args.size)
    cycles = gpu_sleep_cycles(args.sleep_ms / 1e3, torch.cuda.synchronize)
    result: dict = {"gpu": torch.cuda.get_device_name(), "bytes": nbytes, "trials": {}}
    for r in range(args.rounds):
        for state in ("hit", "plain miss", "merging miss"):
            t = trial(state, nbytes, args.pieces, cycles)
            result["trials"].setdefault(state, []).append(t)
            print(
                f"round {r} {state:13} empty({args.size}) {t['took_ms']:8.2f} ms  "
                f"GPU sleep ({args.sleep_ms:.0f} ms) done at return: {t['sleep_done_at_return']}",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
