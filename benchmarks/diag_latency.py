"""Where the time of one to_device goes after an idle gap (issue 22, item 3).

For a 4 KiB, a 1 MiB and an 8 MiB pageable tensor, each call timed to completion
(host clock around the call and a synchronize), back to back and after 20 ms of
sleep, through each layer in turn, so the differences are the per-layer costs:

  pinned      `pinned.to(dev, non_blocking=True)`: the DMA alone, torch's overhead
  torch.to    pageable `t.to(dev)`
  op          `torch.ops.pinxfer.to_device`: dispatcher + kernel
  fast        `pinxfer._C.to_device`: the kernel alone (no dispatcher)
  public      `pinxfer.to_device`: the whole Python API

and the whole run again in child processes with the copy threads changed:
PINXFER_NUM_THREADS=1 (no helper to wake) and PINXFER_SPIN_US=50000 (helpers
never sleep through the gap). Cost of waking the helpers = default - spinning.

    python benchmarks/diag_latency.py [--json out.json] [--rounds 15]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import _checkout  # noqa: F401  (pinxfer from this checkout if not installed)
import torch
from _child import run_child

SIZES = [4 << 10, 1 << 20, 8 << 20]
GAP_S = 0.020
VARIANTS = {
    "default": {},
    "threads=1": {"PINXFER_NUM_THREADS": "1"},
    "spinning": {"PINXFER_SPIN_US": "50000"},
}


def measure(rounds: int) -> dict:
    import pinxfer
    from pinxfer import _C

    dev = torch.device("cuda", 0)
    torch.cuda.init()
    out: dict = {}
    for size in SIZES:
        src = torch.randn(size // 4)
        pinned = src.pin_memory()

        ways = {
            "pinned": lambda: pinned.to(dev, non_blocking=True),
            "torch.to": lambda: src.to(dev),
            "op": lambda: torch.ops.pinxfer.to_device(src, dev, 16 << 20, 4, "auto", -1),
            "fast": lambda: _C.to_device(src, dev, 16 << 20, 4, "auto"),
            "public": lambda: pinxfer.to_device(src, dev),
        }
        for pattern in ("back_to_back", "after_idle"):
            samples: dict[str, list[float]] = {k: [] for k in ways}
            for _ in range(rounds):
                for name, call in ways.items():  # interleaved: drift hits all alike
                    call()  # untimed call of the same way first (caches, pool)
                    torch.cuda.synchronize()
                    if pattern == "after_idle":
                        time.sleep(GAP_S)
                    t0 = time.perf_counter()
                    call()
                    torch.cuda.synchronize()
                    samples[name].append((time.perf_counter() - t0) * 1e6)
            out[f"{size}:{pattern}"] = {
                k: {"median_us": statistics.median(v), "min_us": min(v)} for k, v in samples.items()
            }
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.rounds)))
        return
    if not torch.cuda.is_available():
        print("diag_latency: no CUDA device; nothing to measure")
        return
    results = {}
    for variant, env in VARIANTS.items():
        results[variant] = run_child(__file__, ["--child", "--rounds", str(args.rounds)], env)
    print(
        f"{'size:pattern':<22} {'variant':<10} "
        + " ".join(f"{w:>14}" for w in ("pinned", "torch.to", "op", "fast", "public"))
        + "   (median / min µs)"
    )
    for key in results["default"]:
        for variant in VARIANTS:
            row = results[variant][key]
            print(
                f"{key:<22} {variant:<10} "
                + " ".join(
                    f"{row[w]['median_us']:7.1f}/{row[w]['min_us']:<6.1f}"
                    for w in ("pinned", "torch.to", "op", "fast", "public")
                )
            )
    doc = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "gap_s": GAP_S,
        "rounds": args.rounds,
        "results": results,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
