"""How waking the copy threads scales after an idle gap (issue 22, item 3).

After a compute step every copy worker sleeps; a transfer that wants k helpers must wake
them. Two parts, both as a training loop sees them (back to back, and after 20 ms of sleep):

  wake      pinxfer._C._wake_probe on a fresh pool of the process's copy workers: the time
            the caller spends in the offer (the wake-up call) and when the 1st ... k-th
            helper starts, for k = 1, 2, 4, 8 and every worker. Serial wake-ups show as
            arrivals spaced evenly; a costly wake-up call as a long offer. After a gap also
            with the helpers woken ahead (ThreadPool::wake_ahead) AHEAD_US before the offer,
            as a transfer wakes them before its setup.
  calls     (GPU) pinxfer.pin_memory and pinxfer.to_device of 1, 4, 8 and 32 MiB pageable
            tensors, with torch's t.pin_memory() and t.to() beside them, each call timed to
            completion (a synchronize); both twice, their helpers woken ahead after a
            gap (the default) and woken at the offer (_C._set_wake_ahead(False)); to_device with
            the single-block trace of each call: setup_us (the op's start
            to the pipeline's) and first_helper_us (the pipeline's start to the first
            helper's claim).
            PINXFER_TORCH_TEAM=off unless set: the pool's threads do the copies, the road
            this script is about.

--root DIR imports pinxfer from another checkout (built in place), so two builds can be
run in turn by a driver and compared row by row.

    python benchmarks/diag_wake.py [--root DIR] [--json PATH] [--rounds 15] [--parts wake,calls]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

GAP_S = 0.020
AHEAD_US = 50  # a transfer's setup after a gap, between the wake-ahead and the offer
HELPERS = [1, 2, 4, 8]
CALL_SIZES = [1 << 20, 4 << 20, 8 << 20, 32 << 20]


def copy_workers(settings_rows: list) -> int:
    """Workers of the process's pool: its copy threads (PINXFER_NUM_THREADS as derived) less
    the caller."""
    for name, value, _source, _doc in settings_rows:
        if name == "PINXFER_NUM_THREADS":
            return max(1, int(str(value).split()[0]) - 1)
    raise SystemExit("no PINXFER_NUM_THREADS row in pinxfer._C.settings()")


def summarize(samples: list[float]) -> dict:
    return {"median": statistics.median(samples), "min": min(samples), "n": len(samples)}


def wake_part(C, rounds: int) -> dict:
    workers = copy_workers(C.settings())
    out: dict = {"workers": workers}
    for k in sorted({h for h in HELPERS if h <= workers} | {workers}):
        for gap_name, gap_us, ahead_us in (
            ("b2b", 0, -1),
            ("sleep", int(GAP_S * 1e6), -1),
            (f"sleep_ahead{AHEAD_US}", int(GAP_S * 1e6), AHEAD_US),
        ):
            # the first round builds up
            got = C._wake_probe(workers, k, gap_us, rounds + 1, ahead_us)[1:]
            arrivals = [s["arrivals_us"] for s in got]
            missing = sum(a < 0 for row in arrivals for a in row)
            row = {
                "offer_us": summarize([s["offer_us"] for s in got]),
                # median over rounds of the i-th arrival (sorted within each round)
                "arrival_us": [
                    statistics.median(r[i] for r in arrivals if r[i] >= 0)
                    if any(r[i] >= 0 for r in arrivals)
                    else -1
                    for i in range(k)
                ],
                "missing": missing,
            }
            out[f"{k}_helpers_{gap_name}"] = row
            firsts = row["arrival_us"]
            print(
                f"wake  {k:2d} helpers {gap_name:13s}  offer {row['offer_us']['median']:7.1f} us"
                f"  first {firsts[0]:7.1f}  last {firsts[-1]:7.1f} us"
                + (f"  ({missing} never came)" if missing else ""),
                flush=True,
            )
    return out


def calls_part(torch, pinxfer, rounds: int) -> dict:
    dev = torch.device("cuda", 0)
    torch.cuda.init()
    out: dict = {}
    for size in CALL_SIZES:
        src = torch.randn(size // 4)

        def woken_at_offer(call):
            def way():
                pinxfer._C._set_wake_ahead(False)
                try:
                    return call()
                finally:
                    pinxfer._C._set_wake_ahead(True)

            return way

        ways = {
            "pinxfer.pin_memory": lambda: pinxfer.pin_memory(src),
            "pinxfer.pin_memory@offer": woken_at_offer(lambda: pinxfer.pin_memory(src)),
            "t.pin_memory": lambda: src.pin_memory(),
            "pinxfer.to_device": lambda: pinxfer.to_device(src, dev),
            "pinxfer.to_device@offer": woken_at_offer(lambda: pinxfer.to_device(src, dev)),
            "t.to": lambda: src.to(dev),
        }
        traced = {"pinxfer.to_device", "pinxfer.to_device@offer"}
        for fn in ways.values():  # warm: pool blocks, CUDA allocations, threads
            for _ in range(3):
                fn()
        torch.cuda.synchronize()
        for gap_name, gap in (("b2b", 0.0), ("sleep", GAP_S)):
            times: dict[str, list[float]] = {name: [] for name in ways}
            traces: dict[str, list[dict]] = {name: [] for name in traced}
            order = random.Random(size)
            for _ in range(rounds):
                # each way after the same gap, in a new random order each round: back to
                # back, what a call follows matters (torch's copies leave its OpenMP team
                # spinning, pinxfer's its copy threads), so no way always follows another
                names = list(ways)
                order.shuffle(names)
                for name in names:
                    fn = ways[name]
                    if gap:
                        time.sleep(gap)
                    t0 = time.perf_counter()
                    fn()
                    torch.cuda.synchronize()
                    times[name].append((time.perf_counter() - t0) * 1e6)
                    if name in traced:
                        traces[name].append(dict(pinxfer._C._last_single_block_trace()))
            for name, got in times.items():
                row = summarize(got)
                extra = ""
                if name in traces:
                    for key in ("setup_us", "first_helper_us", "own_done_us", "total_us"):
                        row[key] = statistics.median(t[key] for t in traces[name])
                    extra = (
                        f"  setup {row['setup_us']:6.1f}  1st helper {row['first_helper_us']:6.1f}"
                        f"  own done {row['own_done_us']:6.1f}  pipeline {row['total_us']:7.1f}"
                    )
                out[f"{name}_{size >> 20}MiB_{gap_name}"] = row
                print(
                    f"call  {name:24s} {size >> 20:3d} MiB {gap_name:5s}"
                    f"  median {row['median']:8.1f}  min {row['min']:8.1f} us" + extra,
                    flush=True,
                )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=str(Path(__file__).resolve().parent.parent))
    ap.add_argument("--json", default=None)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--parts", default="wake,calls", help="wake, calls or both (comma-separated)")
    args = ap.parse_args()
    parts = set(args.parts.split(","))

    os.environ.setdefault("PINXFER_TORCH_TEAM", "off")
    sys.path.insert(0, str(Path(args.root).resolve()))
    import torch

    import pinxfer
    from pinxfer import _C

    result: dict = {
        "benchmark": "diag_wake",
        "root": str(Path(args.root).resolve()),
        "torch_team": os.environ["PINXFER_TORCH_TEAM"],
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    if "wake" in parts:
        result["wake"] = wake_part(_C, args.rounds)
    if "calls" in parts and torch.cuda.is_available():
        result["calls"] = calls_part(torch, pinxfer, args.rounds)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
