"""What the torch-team probe costs a whole call after an idle gap (issue 22), timed in one
process: the same call with the probe and without it, in turn, round by round.

A host copy that could use two threads first asks whether torch's intra-op team is awake
(csrc/runtime/torch_team.h: a /proc read of one member's state once the team is learned). In
session 48 `diag_midsize.py` put that question at 23-41 us of a 1-8 MiB `to_device`'s muster
after a 20 ms gap on an H100, against 6-11 us with `PINXFER_TORCH_TEAM=off`, but whole calls
compared across processes (default against team_off) differed by less than the processes
did. Here one process learns the team, then each round times every way twice, probe on and
probe off (`pinxfer._C._set_team_probe`, a diagnostic switch: off answers "asleep" without
asking, as the setting does), in an order that alternates round by round, each timed call
right after an untimed call of the same way and the gap (diag_midsize.timed_after_twin), so
both sides share the process, the host and the time. After a 20 ms gap torch's team sleeps
(its spin lasts milliseconds: `team_spin` in the JSON), so both sides take the same road and
differ by the question alone: its cost is what moving the probe off the caller's path (a
woken helper reading the team's state) could save at most.

Ways: `to_device` of one pageable tensor and `pin_memory` of it (both ask), and torch's
pinned copy of the same size as the reference (asks nothing), each probe on and off.

    python benchmarks/diag_team_probe.py [--json PATH] [--sizes 1M,8M] [--gaps gpu,sleep]
        [--rounds 31]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_loop import parse_sizes, size_label
from diag_midsize import gap_before_timed_call, team_spin_ms, timed_after_twin

SIDES = ("probe", "no_probe")


def learn_team(pinxfer, t: torch.Tensor, dev: torch.device, tries: int = 20) -> int:
    """Has pinxfer learn torch's team, as bench_loop's rotation does: a copy asked for while
    the team spins after one of torch's parallel ops. Returns the threads learned (0: none,
    as with one intra-op thread or without libgomp)."""
    state = pinxfer._C._torch_team_state
    wake = torch.ones(1 << 22)
    for _ in range(tries):
        if state()[0] > 0:
            break
        wake.add_(1)
        pinxfer.to_device(t, dev)
        torch.cuda.synchronize()
    return int(state()[0])


def summary(samples: list[float]) -> dict[str, float]:
    return {
        "n": len(samples),
        "median_us": statistics.median(samples),
        "min_us": min(samples),
    }


def measure(sizes: list[int], gaps: list[str], rounds: int) -> dict[str, Any]:
    import pinxfer

    dev = torch.device("cuda", torch.cuda.current_device())
    sync = torch.cuda.synchronize
    set_probe = pinxfer._C._set_team_probe
    state = pinxfer._C._torch_team_state
    out: dict[str, Any] = {"cells": {}}
    learn_from = torch.randn((1 << 20) // 4)
    out["team_threads_learned"] = learn_team(pinxfer, learn_from, dev)
    for nbytes in sizes:
        t = torch.randn(nbytes // 4)
        pinned = t.pin_memory()
        ways = {
            "to_device": lambda t=t: pinxfer.to_device(t, dev),
            "pin_memory": lambda t=t: pinxfer.pin_memory(t),
            "torch_pinned_to": lambda p=pinned: p.to(dev, non_blocking=True),
        }
        for gap in gaps:
            before_timed = gap_before_timed_call(gap, sync)
            walls: dict[str, dict[str, list[float]]] = {w: {s: [] for s in SIDES} for w in ways}
            reads: dict[str, int] = dict.fromkeys(SIDES, 0)
            try:
                for r in range(rounds):
                    order = SIDES if r % 2 == 0 else SIDES[::-1]
                    for way, fn in ways.items():
                        for side in order:
                            set_probe(False)  # state() asks the probe itself: not counted
                            reads_before = state()[4]
                            set_probe(side == "probe")
                            t0, _t1, t2 = timed_after_twin(fn, sync, before_timed)
                            set_probe(False)
                            reads[side] += state()[4] - reads_before
                            walls[way][side].append((t2 - t0) / 1e3)
            finally:
                set_probe(True)
            cell: dict[str, Any] = {"state_reads": reads, "ways": {}}
            for way, sides in walls.items():
                paired = [a - b for a, b in zip(sides["probe"], sides["no_probe"], strict=True)]
                cell["ways"][way] = {
                    "probe": summary(sides["probe"]),
                    "no_probe": summary(sides["no_probe"]),
                    # per round: probe's wall minus no_probe's (> 0: the probe cost that much)
                    "paired_diff_median_us": statistics.median(paired),
                    "rounds_probe_slower": sum(d > 0 for d in paired),
                }
            out["cells"][f"{size_label(nbytes)} {gap}"] = cell
    return out


def report(result: dict[str, Any]) -> str:
    lines = [
        f"team threads learned: {result['team_threads_learned']}; team spin after one op: "
        f"{result.get('team_spin')}",
        "cell            way              probe med/min     no_probe med/min   diff med  "
        "probe slower  reads probe/no",
    ]
    for name, cell in result["cells"].items():
        for way, w in cell["ways"].items():
            p, q = w["probe"], w["no_probe"]
            lines.append(
                f"{name:<15} {way:<16} {p['median_us']:8.1f}/{p['min_us']:7.1f} "
                f"{q['median_us']:9.1f}/{q['min_us']:7.1f} {w['paired_diff_median_us']:9.1f} "
                f"{w['rounds_probe_slower']:>5}/{p['n']:<6} "
                f"{cell['state_reads']['probe']}/{cell['state_reads']['no_probe']}"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--sizes", default="1M,8M")
    ap.add_argument("--gaps", default="gpu,sleep")
    ap.add_argument("--rounds", type=int, default=31)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("diag_team_probe: needs a CUDA device")
    gaps = args.gaps.split(",")
    for gap in gaps:
        if gap not in ("b2b", "sleep", "gpu"):
            sys.exit(f"diag_team_probe: --gaps takes b2b, sleep and gpu, got {gap!r}")
    started = time.perf_counter()
    result = measure(parse_sizes(args.sizes), gaps, args.rounds)
    result["team_spin"] = team_spin_ms()
    result |= {
        "benchmark": "diag_team_probe",
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "rounds": args.rounds,
        "elapsed_s": round(time.perf_counter() - started, 1),
    }
    print(report(result), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
