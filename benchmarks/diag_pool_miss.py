"""Does a pinned pool miss wait for the GPU? (issue 22, sessions 20-21)

A large request the pool cannot serve maps a new segment (at least 32 MiB). Only when the
pool would then reserve more than twice the most it ever had allocated does it first unmap
its fully free large segments (``cudaHostUnregister``) and map one segment of their total
(csrc/README.md, "Reuse"). This times ``pinxfer.empty`` with a GPU sleep queued on the
current stream, in four pool states, each prepared (and synchronized) before the sleep:

  hit                 a free block of the size is cached
  plain miss          the pool holds nothing (empty_cache): a new segment is mapped
  miss beside free    three free 32 MiB segments (24 MiB blocks, held at once) and a
                      40 MiB request: too big for each, so a 40 MiB segment is mapped
  merging miss        24 MiB then 40 MiB allocated and freed one at a time (reserved
                      72 MiB, high-water mark 40 MiB), then 48 MiB: reserved would pass
                      twice the high-water mark, so the two are unmapped and one mapped

and reports each call's time and whether the sleep had already finished when it returned
(``torch.cuda.current_stream().query()``): True after a call that took far less than the sleep
means the call waited for the GPU. Session 21 (H200) found the merge's wait, 300 ms behind a
300 ms sleep, with the old pool that merged on every such miss.

    python benchmarks/diag_pool_miss.py [--sleep-ms 300] [--rounds 3] [--json PATH]
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
from bench_loop import gpu_sleep_cycles

import pinxfer

MiB = 1 << 20
# state: (blocks allocated and freed before the sleep, each group held at once; request)
STATES = {
    "hit": ([[16 * MiB]], 16 * MiB),
    "plain miss": ([], 16 * MiB),
    "miss beside free": ([[24 * MiB] * 3], 40 * MiB),
    "merging miss": ([[24 * MiB], [40 * MiB]], 48 * MiB),
}


def prepare(groups: list[list[int]]) -> None:
    """Leaves the pool in a state, with nothing of it pending on the GPU."""
    pinxfer.empty_cache()
    for group in groups:
        held = [pinxfer.empty(n, dtype=torch.uint8) for n in group]
        del held  # freed: their free fences are recorded on the current stream
    torch.cuda.synchronize()


def trial(state: str, cycles: int) -> dict:
    groups, nbytes = STATES[state]
    prepare(groups)
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
        "bytes": nbytes,
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
    ap.add_argument("--sleep-ms", type=float, default=300.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("diag_pool_miss: no CUDA device", file=sys.stderr)
        sys.exit(2)
    cycles = gpu_sleep_cycles(args.sleep_ms / 1e3, torch.cuda.synchronize)
    result: dict = {"gpu": torch.cuda.get_device_name(), "sleep_ms": args.sleep_ms, "trials": {}}
    for r in range(args.rounds):
        for state in STATES:
            t = trial(state, cycles)
            result["trials"].setdefault(state, []).append(t)
            unmaps = t["stats_delta"].get("num_segment_unmaps", 0)
            print(
                f"round {r} {state:16} empty({t['bytes'] >> 20} MiB) {t['took_ms']:8.2f} ms  "
                f"unmaps {unmaps}  GPU sleep ({args.sleep_ms:.0f} ms) done at return: "
                f"{t['sleep_done_at_return']}",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
