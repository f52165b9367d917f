"""Two builds of pinxfer, same machine, same run: is the second one slower? (issue 10)

A redesign must show "no regression, same run, before vs after". Separate runs on the
same machine kind do not prove it: run-to-run variance on the GPU machines is larger
than any regression worth catching (1 GiB to_device has been seen at 26-52 GB/s). So
this driver alternates the two builds in fresh processes, round after round
(before, after; then after, before; ...), and compares them round by round.

Only the public API both builds share is used (to_device, pin_memory, empty, prefetch),
so an old checkout can be measured by this newer script.

  driver:  python benchmarks/bench_ab.py --before DIR --after DIR --out ab.json [--rounds 3]
           DIR: a checkout with pinxfer/_C*.so built in place.
  one run: python benchmarks/bench_ab.py --measure --root DIR --out run.json

Measures (each: median and minimum of --repeats samples after a warm-up):
  to_device_{8m,64m,1g}     pinxfer.to_device of a pageable uint8 tensor, GB/s; the
                            pinned ceiling (a pinned tensor's .to(non_blocking)) of the same
                            size in the same process is stored beside it
  prefetch_{16m,64m}        pinxfer.prefetch over an in-memory list of batches, GB/s
  pin_memory_64m            pinxfer.pin_memory of a 64 MiB pageable tensor, GB/s
  pin_memory_64k_us, empty_16k_us, to_device_4k_us, to_device_batch_64_us
                            small calls, µs per call (a batch = dict of 64 tensors, 4-256 KiB)

Result: per measure, each build's per-round medians, the median over rounds, and
after/before (for GB/s > 1 is faster, for µs < 1 is faster), also after/before of
"fraction of the ceiling" for the to_device rows (which removes the bus's drift
between processes). A measure is flagged "slower" when after is worse than before by
more than --tolerance (default 5%) in the median over rounds AND in most rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


# ---- one run: in the process of one build ----


def measure(root: str, repeats: int) -> dict:
    sys.path.insert(0, root)
    import torch

    import pinxfer

    where = os.path.realpath(pinxfer.__file__)
    if not where.startswith(os.path.realpath(root) + os.sep):
        raise SystemExit(
            f"imported pinxfer from {where}, expected a build under {root}: "
            "is another pinxfer installed ahead of it on sys.path?"
        )
    dev = torch.device("cuda")
    sync = torch.cuda.synchronize

    def seconds(fn: Callable[[], Any], reps: int = repeats, warmup: int = 2) -> dict:
        for _ in range(warmup):
            fn()
        sync()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
        return {"median_s": statistics.median(times), "min_s": min(times)}

    def gbps(nbytes: int, t: dict) -> dict:
        return {"median": nbytes / t["median_s"] / 1e9, "best": nbytes / t["min_s"] / 1e9}

    def per_call_us(fn: Callable[[], Any], calls: int, synced: bool = False) -> dict:
        def sample() -> float:
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            if synced:
                sync()
            return (time.perf_counter() - t0) / calls * 1e6

        sample()
        times = [sample() for _ in range(repeats)]
        return {"median": statistics.median(times), "best": min(times)}

    out: dict = {
        "root": root,
        "pinxfer_file": where,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(),
        "measures": {},
    }
    m = out["measures"]

    for name, nbytes in (
        ("to_device_8m", 8 * MiB),
        ("to_device_64m", 64 * MiB),
        ("to_device_1g", GiB),
    ):
        src = torch.empty(nbytes, dtype=torch.uint8).fill_(7)  # every page touched
        pinned = src.pin_memory()
        # Short transfers vary most between samples: take more of them (8 MiB: 64).
        reps = max(repeats, min(64, GiB // 2 // nbytes))
        row = gbps(nbytes, seconds(lambda: pinxfer.to_device(src, dev), reps))
        row["ceiling"] = gbps(nbytes, seconds(lambda: pinned.to(dev, non_blocking=True), reps))
        row["of_ceiling"] = row["median"] / row["ceiling"]["median"]
        row["unit"] = "GB/s"
        m[name] = row

    for name, nbytes, count in (("prefetch_16m", 16 * MiB, 32), ("prefetch_64m", 64 * MiB, 12)):
        batches = [torch.empty(nbytes, dtype=torch.uint8).fill_(i) for i in range(count)]

        def drain() -> None:
            for _b in pinxfer.prefetch(batches, dev):
                pass

        row = gbps(nbytes * count, seconds(drain))
        row["unit"] = "GB/s"
        m[name] = row

    src = torch.empty(64 * MiB, dtype=torch.uint8).fill_(3)
    m["pin_memory_64m"] = {
        **gbps(64 * MiB, seconds(lambda: pinxfer.pin_memory(src))),
        "unit": "GB/s",
    }

    x64 = torch.randn(16 * KiB)
    m["pin_memory_64k_us"] = {**per_call_us(lambda: pinxfer.pin_memory(x64), 2000), "unit": "us"}
    m["empty_16k_us"] = {**per_call_us(lambda: pinxfer.empty(16384), 2000), "unit": "us"}
    x4 = torch.randint(0, 255, (4 * KiB,), dtype=torch.uint8)
    m["to_device_4k_us"] = {
        **per_call_us(lambda: pinxfer.to_device(x4, dev), 2000, True),
        "unit": "us",
    }
    g = torch.Generator().manual_seed(0)
    batch = {
        f"t{i}": torch.randint(0, 255, ((4 * KiB) << (i % 7),), dtype=torch.uint8, generator=g)
        for i in range(64)
    }
    m["to_device_batch_64_us"] = {
        **per_call_us(lambda: pinxfer.to_device(batch, dev), 100, True),
        "unit": "us",
    }
    return out


# ---- driver: alternate the builds, compare round by round ----


def run_one(script: str, root: str, repeats: int, tmp: str) -> dict:
    cmd = [
        sys.executable,
        script,
        "--measure",
        "--root",
        root,
        "--repeats",
        str(repeats),
        "--out",
        tmp,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(
            f"measuring {root} failed (exit {proc.returncode}):\n"
            f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        )
    with open(tmp) as f:
        return json.load(f)


def better_is_higher(unit: str) -> bool:
    return unit == "GB/s"


def compare(runs: dict, tolerance: float) -> dict:
    """runs: {"before": [run, ...], "after": [run, ...]}, one run per round."""
    names = list(runs["before"][0]["measures"])
    table = {}
    for name in names:
        unit = runs["before"][0]["measures"][name]["unit"]
        per_round = {side: [r["measures"][name]["median"] for r in runs[side]] for side in runs}
        row: dict = {
            "unit": unit,
            "per_round_median": per_round,
            "best": {
                s: (max if better_is_higher(unit) else min)(
                    r["measures"][name]["best"] for r in runs[s]
                )
                for s in runs
            },
        }
        med = {s: statistics.median(v) for s, v in per_round.items()}
        row["median_over_rounds"] = med
        row["after_over_before"] = med["after"] / med["before"]
        if "of_ceiling" in runs["before"][0]["measures"][name]:
            of = {
                s: statistics.median(r["measures"][name]["of_ceiling"] for r in runs[s])
                for s in runs
            }
            row["of_ceiling_median"] = of
            row["of_ceiling_after_over_before"] = of["after"] / of["before"]
        # "slower" needs both: the median over rounds worse by more than the tolerance,
        # and after worse than before in most rounds (one noisy round cannot decide it).
        if better_is_higher(unit):
            worse_median = row["after_over_before"] < 1 - tolerance
            worse_rounds = sum(a < b for a, b in zip(per_round["after"], per_round["before"]))
        else:
            worse_median = row["after_over_before"] > 1 + tolerance
            worse_rounds = sum(a > b for a, b in zip(per_round["after"], per_round["before"]))
        row["rounds_after_worse"] = worse_rounds
        # The best sample of the whole run, per build: the code's own cost with the least
        # interference. On the shared GPU hosts small calls are bimodal per process (torch's
        # own calls too: scripts/small_call_probe.py), so medians over a few processes
        # can differ by 1.5x while the best agree; both are reported, the verdict is the
        # median's.
        best = row["best"]
        row["best_after_over_before"] = best["after"] / best["before"]
        row["verdict"] = (
            "slower"
            if worse_median and worse_rounds * 2 > len(per_round["after"])
            else "not slower"
        )
        table[name] = row
    return table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--measure", action="store_true", help="one run of one build (internal)")
    ap.add_argument("--root", help="with --measure: the checkout to import pinxfer from")
    ap.add_argument("--before", help="checkout of the old build")
    ap.add_argument("--after", help="checkout of the new build")
    ap.add_argument("--before-label", default="before")
    ap.add_argument("--after-label", default="after")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tolerance", type=float, default=0.05)
    ap.add_argument("--kind", default=os.environ.get("PINXFER_MACHINE_KIND", "unknown"))
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    if args.measure:
        result = measure(os.path.abspath(args.root), max(5, args.repeats))
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        return 0

    if not (args.before and args.after):
        ap.error("give --before DIR and --after DIR (or --measure --root DIR)")
    import torch

    if not torch.cuda.is_available():
        with open(args.out, "w") as f:
            json.dump({"benchmark": "ab", "skipped": "no CUDA device"}, f, indent=1)
        print("skipped: no CUDA device")
        return 0
    roots = {"before": os.path.abspath(args.before), "after": os.path.abspath(args.after)}
    runs: dict = {"before": [], "after": []}
    script = os.path.abspath(__file__)
    tmp = args.out + ".run.json"
    t0 = time.time()
    for rnd in range(args.rounds):
        order = ("before", "after") if rnd % 2 == 0 else ("after", "before")
        for side in order:
            runs[side].append(run_one(script, roots[side], args.repeats, tmp))
            print(
                f"round {rnd + 1}/{args.rounds} {side} done ({time.time() - t0:.0f} s)", flush=True
            )
    os.unlink(tmp)
    table = compare(runs, args.tolerance)
    result = {
        "benchmark": "ab",
        "kind": args.kind,
        "labels": {"before": args.before_label, "after": args.after_label},
        "machine": {
            "gpu": torch.cuda.get_device_name(),
            "host": platform.node(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
        },
        "rounds": args.rounds,
        "repeats": args.repeats,
        "tolerance": args.tolerance,
        "order": "rounds alternate: before,after then after,before ...",
        "table": table,
        "runs": runs,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(
        f"{'measure':24s} {'unit':5s} {args.before_label:>10s} {args.after_label:>10s} "
        f"{'after/before':>12s}  verdict"
    )
    for name, row in table.items():
        med = row["median_over_rounds"]
        extra = (
            f"  (of ceiling {row['of_ceiling_median']['before']:.2f} -> "
            f"{row['of_ceiling_median']['after']:.2f})"
            if "of_ceiling_median" in row
            else ""
        )
        print(
            f"{name:24s} {row['unit']:5s} {med['before']:10.2f} {med['after']:10.2f} "
            f"{row['after_over_before']:12.3f}  {row['verdict']} (best: "
            f"{row['best_after_over_before']:.3f}){extra}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
