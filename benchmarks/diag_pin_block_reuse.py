"""Does a back-to-back pin_memory write the block its warm call wrote (issue 22)?

bench_loop times a back-to-back cell right after an untimed call of the same way, the ways in
turn. Session 56 found pinxfer.pin_memory even with t.pin_memory() alone and 0.75-0.90 of it
at 1-64 MiB in that rotation; one reading was that the pool's best fit handed the timed call
another block of that size than the warm call's (a hole a staging block left), out of the
cache. This runs a rotation like it (t.pin_memory(), pinxfer.pin_memory, pinxfer.to_device,
pageable .to, the pinned copy, always in that order, where bench_loop balances the order over
rounds), each way warm + synchronize, then timed + synchronize, and counts, per way, the timed
calls whose output had the warm call's data_ptr.

    python benchmarks/diag_pin_block_reuse.py OUT.json [--rounds N]

Session 58 (H100): pinxfer's pin wrote the warm call's block in 10 of 10 rounds at every size
with best fit, so block choice is not what the rotation costs it (csrc/README.md, "Pin blocks
in bench_loop's rotation").
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import pinxfer

MiB = 1 << 20
SIZES = (MiB, 8 * MiB, 32 * MiB, 64 * MiB)


def rotate(nbytes: int, rounds: int, dev: torch.device) -> dict:
    x = torch.randn(nbytes // 4)
    pinned = x.pin_memory()
    ways = {
        "torch_pin": lambda: x.pin_memory(),
        "px_pin": lambda: pinxfer.pin_memory(x),
        "px_to_device": lambda: pinxfer.to_device(x, dev),
        "torch_to": lambda: x.to(dev),
        "pinned_copy": lambda: pinned.to(dev, non_blocking=True),
    }
    rec = {k: {"same_block": 0, "times_us": []} for k in ways}
    for _ in range(rounds):
        for name, fn in ways.items():
            warm = fn()
            torch.cuda.synchronize()
            warm_ptr = warm.data_ptr()
            del warm
            t0 = time.perf_counter()
            timed = fn()
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            rec[name]["same_block"] += timed.data_ptr() == warm_ptr
            rec[name]["times_us"].append((t1 - t0) * 1e6)
            del timed
    for r in rec.values():
        r["median_us"] = statistics.median(r["times_us"])
    return {
        "rounds": rounds,
        "ways": rec,
        # speed ratios (>1: pinxfer faster)
        "pin_x_torch": rec["torch_pin"]["median_us"] / rec["px_pin"]["median_us"],
        "to_device_x_pinned": rec["pinned_copy"]["median_us"] / rec["px_to_device"]["median_us"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="JSON path")
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("diag_pin_block_reuse: needs a CUDA device")
    dev = torch.device("cuda", torch.cuda.current_device())
    result = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "sizes": {}}
    for nbytes in SIZES:
        r = rotate(nbytes, args.rounds, dev)
        result["sizes"][str(nbytes)] = r
        same = {k: v["same_block"] for k, v in r["ways"].items()}
        print(
            f"{nbytes // MiB} MiB same block {same} pin x torch {r['pin_x_torch']:.3f} "
            f"to_device x pinned {r['to_device_x_pinned']:.3f}",
            flush=True,
        )
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
