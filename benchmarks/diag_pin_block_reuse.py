"""Does a back-to-back pin_memory write the block its warm call wrote (issue 22)?

bench_loop times a back-to-back cell right after an untimed call of the same way, the ways in
turn. Session 56 found pinxfer.pin_memory even with t.pin_memory() alone and 0.75-0.90 of it
at 1-64 MiB in that rotation; one reading was that the pool's best fit handed the timed call
another block of that size than the warm call's (a hole a staging block left), out of the
cache. This runs a rotation like it (t.pin_memory(), pinxfer.pin_memory, pinxfer.to_device,
pageable .to, the pinned copy, always in that order, where bench_loop balances the order over
rounds), each way warm + synchronize, then timed + synchronize, and counts, per way, the timed
calls whose output had the warm call's data_ptr.

    python benchmarks/diag_pin_block_reuse.py OUT.json [--rounds N] [--sizes 1,8,32,64]

Each timed pinxfer.pin_memory's steps in C++ (_C._last_pin_call_trace: pinned check, checks,
setup with the team probe and the helpers' wake-up, allocation, copy; whether the copy ran on
torch's team) are kept per round, and pinxfer's and torch's pin are then timed alone (warm +
synchronize, then timed, over and over, no other way between), pinxfer's with its steps: where
the rotation's time goes that the call alone does not spend (session 59).

Session 58 (H100): pinxfer's pin wrote the warm call's block in 10 of 10 rounds at every size
with best fit, so block choice is not what the rotation costs it (csrc/README.md, "Pin blocks
in bench_loop's rotation").
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import pinxfer
from pinxfer import _C

MiB = 1 << 20
TRACE_KEYS = ("pinned_check_us", "checks_us", "setup_us", "alloc_us", "copy_us", "total_us")


def trace_medians(traces: list[dict[str, Any]]) -> dict[str, Any]:
    """Median of each step over the calls, and how many copies ran on torch's team."""
    out: dict[str, Any] = {k: statistics.median(t[k] for t in traces) for k in TRACE_KEYS}
    out["on_team"] = sum(bool(t["on_team"]) for t in traces)
    out["calls"] = len(traces)
    return out


def warm_then_timed(fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, int, float]:
    """One untimed call of fn, then a timed one, each followed by a synchronize (the timed
    one's inside its span): (the timed call's output, the warm call's data_ptr, µs)."""
    warm = fn()
    torch.cuda.synchronize()
    warm_ptr = warm.data_ptr()
    del warm
    t0 = time.perf_counter()
    timed = fn()
    torch.cuda.synchronize()
    return timed, warm_ptr, (time.perf_counter() - t0) * 1e6


def alone(x: torch.Tensor, rounds: int) -> dict[str, Any]:
    """pinxfer.pin_memory(x), then t.pin_memory(), each timed with no other way between
    (warm + synchronize, then timed, `rounds` times); pinxfer's steps beside."""
    out: dict[str, Any] = {}
    for name, fn in (("px_pin", lambda: pinxfer.pin_memory(x)), ("torch_pin", x.pin_memory)):
        times, traces = [], []
        for _ in range(rounds):
            timed, _, us = warm_then_timed(fn)
            times.append(us)
            if name == "px_pin":  # torch's pin leaves pinxfer's last trace as it was
                traces.append(_C._last_pin_call_trace())
            del timed
        out[name] = {"median_us": statistics.median(times), "times_us": times}
        if name == "px_pin":
            out[name]["steps"] = trace_medians(traces)
    return out


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
    rec: dict[str, dict[str, Any]] = {k: {"same_block": 0, "times_us": []} for k in ways}
    pin_traces = []
    for _ in range(rounds):
        for name, fn in ways.items():
            timed, warm_ptr, us = warm_then_timed(fn)
            rec[name]["same_block"] += timed.data_ptr() == warm_ptr
            rec[name]["times_us"].append(us)
            if name == "px_pin":
                pin_traces.append(_C._last_pin_call_trace())
            del timed
    for r in rec.values():
        r["median_us"] = statistics.median(r["times_us"])
    rec["px_pin"]["steps"] = trace_medians(pin_traces)
    rec["px_pin"]["step_rounds"] = pin_traces
    return {
        "rounds": rounds,
        "ways": rec,
        "alone": alone(x, rounds),
        # speed ratios (>1: pinxfer faster)
        "pin_x_torch": rec["torch_pin"]["median_us"] / rec["px_pin"]["median_us"],
        "to_device_x_pinned": rec["pinned_copy"]["median_us"] / rec["px_to_device"]["median_us"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="JSON path")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--sizes", default="1,8,32,64", help="MiB, comma-separated")
    args = ap.parse_args()
    sizes = [int(v) * MiB for v in args.sizes.split(",")]
    if not torch.cuda.is_available():
        raise SystemExit("diag_pin_block_reuse: needs a CUDA device")
    dev = torch.device("cuda", torch.cuda.current_device())
    _C._trace_team_regions(True)  # _last_pin_call_trace records only while this is on
    result = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "sizes": {}}
    for nbytes in sizes:
        r = rotate(nbytes, args.rounds, dev)
        result["sizes"][str(nbytes)] = r
        same = {k: v["same_block"] for k, v in r["ways"].items()}
        print(
            f"{nbytes // MiB} MiB same block {same} pin x torch {r['pin_x_torch']:.3f} "
            f"to_device x pinned {r['to_device_x_pinned']:.3f}",
            flush=True,
        )
        for where, steps in (
            ("rotation", r["ways"]["px_pin"]["steps"]),
            ("alone", r["alone"]["px_pin"]["steps"]),
        ):
            print(
                f"  px_pin steps, {where}: "
                + " ".join(
                    f"{k[:-3]} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                    for k, v in steps.items()
                ),
                flush=True,
            )
        medians = (
            r["alone"]["px_pin"]["median_us"],
            r["alone"]["torch_pin"]["median_us"],
            r["ways"]["px_pin"]["median_us"],
            r["ways"]["torch_pin"]["median_us"],
        )
        print(
            "  alone: px_pin {:.1f} us, torch_pin {:.1f}; rotation: {:.1f}, {:.1f}".format(
                *medians
            ),
            flush=True,
        )
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
