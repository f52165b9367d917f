"""Why a mid-size to_device is slow back to back in bench_loop (issue 22): each timed call
traced from inside.

bench_loop's back-to-back cells call every way (the same ones here) in its balanced orders
(bench_loop.balanced_rounds), each timed call right after an untimed call of the same way.
Some ways are torch CPU ops (t.pin_memory() copies with torch's OpenMP team, which then spins
on every core for milliseconds). This script runs those same orders for a few sizes and, for
every timed pinxfer.to_device call, keeps:

  wall_us        the call and a synchronize
  preempted      involuntary context switches of the calling thread during the call
  pool_misses    pool cache misses during the call (a cold block pinned)
  trace          pinxfer._C._last_single_block_trace(): pieces the caller staged, pieces
                 helpers staged, pieces stolen, when the first helper claimed a piece, when
                 the caller ran out of pieces to claim, whether it ran on torch's awake
                 intra-op team (csrc/runtime/torch_team.h)
  after          the way timed just before this call's untimed twin (what it left behind:
                 torch's team spinning, the caches)

and the same for every timed pinxfer.to_device of the cell's batch (to_device_batch_calls: the
trace is its large leaf's, sent by the same pipeline; the small leaves go packed beside it),

and for every timed pinxfer.pin_memory call (pin_memory_calls) its wall time and its steps in
C++ (pinxfer._C._last_pin_call_trace(): pinned check, checks, setup with the team probe,
allocation, copy, whether it ran on torch's team), beside t.pin_memory()'s time in the same
rounds (its rows miss torch back to back in bench_loop at 1-32 MiB).

Each variant runs in a child process with the environment it names:

  default        as bench_loop runs
  omp=1          OMP_NUM_THREADS=1 (torch's CPU ops on one thread: no OpenMP team)
  omp_passive    OMP_WAIT_POLICY=PASSIVE (the team sleeps at once after each op)
  pinxfer_only   default environment, but only pinxfer.to_device is called (no torch way)
  threads=N      PINXFER_NUM_THREADS=N (1: the caller alone, no helper)
  team_off       PINXFER_TORCH_TEAM=off (pinxfer's copies never on torch's team)

    python benchmarks/diag_midsize.py [--json PATH] [--sizes 1M,8M,32M] [--rounds 15]
        [--variants default,team_off] [--copy-probes] [--batch-parts] [--gap b2b|sleep|gpu]

--gap puts bench_loop's idle gap (a 20 ms sleep, or a 20 ms GPU kernel the host waits on)
between each untimed call and its timed one, so the traces show the steps of a call that
follows a training step.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from _child import run_child

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_loop import GAP_S, balanced_rounds, call_ways, gpu_sleep_cycles, parse_sizes, size_label
from diag_batch import make_batch

VARIANTS: dict[str, dict[str, str]] = {
    "default": {},
    "omp=1": {"OMP_NUM_THREADS": "1"},
    "omp_passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "pinxfer_only": {},
    "threads=1": {"PINXFER_NUM_THREADS": "1"},
    "threads=4": {"PINXFER_NUM_THREADS": "4"},
    "team_off": {"PINXFER_TORCH_TEAM": "off"},
}


def involuntary_switches() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_nivcsw


def copy_probe_ways(pinxfer, t: torch.Tensor) -> dict:
    """--copy-probes: torch's copy_ of the same tensor into a pool block and into a torch
    pinned block, each kept for the whole cell, and into a new pool block each call. In the
    rounds pinxfer.pin_memory's copy (torch's copy_ on torch's team) takes longer than
    t.pin_memory()'s whole call: these tell the block's memory from pinxfer's call path.
    torch_empty_copy is t.pin_memory() written out (at::_pin_memory: a block from torch's
    pinned allocator, then copy_): session 28's rounds had t.pin_memory() 150-200 µs faster
    at 32 MiB than a copy_ into a kept torch block."""
    pool_block = pinxfer.empty(t.numel(), dtype=t.dtype)
    torch_block = torch.empty(t.numel(), dtype=t.dtype, pin_memory=True)
    return {
        "copy_into_pool_block": lambda: pool_block.copy_(t),
        "copy_into_torch_block": lambda: torch_block.copy_(t),
        "pool_empty_copy": lambda: pinxfer.empty(t.numel(), dtype=t.dtype).copy_(t),
        "torch_empty_copy": lambda: torch.empty(t.numel(), dtype=t.dtype, pin_memory=True).copy_(t),
    }


def batch_part_ways(pinxfer, batch: dict, dev: torch.device) -> dict:
    """--batch-parts: the batch's two sends alone, in the same rounds: its large leaf ("x",
    sent by the pipeline) and its small leaves ("y" and the two scalars, packed into one
    copy). Their sum against the batch tells the sends from what lies around them. And the
    batch sent by to_device's Python batch path (batch_python)."""
    from pinxfer import _ops
    from pinxfer._plain import plain_batch, rebuilt_batch
    from pinxfer.transfer import DEFAULT_CHUNK_BYTES, DEFAULT_NUM_BUFFERS

    def batch_in_python() -> dict:
        # to_device's batch path before session 34 (its Python walk, binding and rebuild),
        # beside the one C call that now takes this batch (to_device_batch_if_plain).
        leaves, layout = plain_batch(batch)
        sent = _ops.fast.send_batch_leaves(
            leaves, dev, DEFAULT_CHUNK_BYTES, DEFAULT_NUM_BUFFERS, "auto"
        )
        return rebuilt_batch(batch, layout, sent)

    small = {"y": batch["y"], "meta": batch["meta"]}
    return {
        "batch_leaf": lambda: pinxfer.to_device(batch["x"], dev),
        "batch_pack": lambda: pinxfer.to_device(small, dev),
        "batch_python": batch_in_python,
    }


def call_split(way: str, t0_ns: int, end_ns: int, leaf: dict, pack: dict) -> dict:
    """Where one traced batch call went, in µs, from the traces' stamps on
    time.perf_counter_ns's clock: Python before the first C++ step, the large leaf's send (from
    its crew's muster to the end of its pipeline), the steps between the leaf and the pack, the
    pack (its op's entry to its end), and Python after it. batch_pack has no leaf."""
    pack_begin = pack["entered_ns"]
    pack_end = pack_begin + pack["total_us"] * 1e3
    split: dict[str, float] = {}
    # A batch of small leaves alone is one pack: the single-block trace is an earlier call's.
    if way == "batch_pack" or leaf["mustered_ns"] < t0_ns:
        split["py_before_us"] = (pack_begin - t0_ns) / 1e3
    else:
        leaf_end = leaf["mustered_ns"] + (leaf["setup_us"] + leaf["total_us"]) * 1e3
        split["py_before_us"] = (leaf["mustered_ns"] - t0_ns) / 1e3
        split["leaf_us"] = (leaf_end - leaf["mustered_ns"]) / 1e3
        split["between_us"] = (pack_begin - leaf_end) / 1e3
    split["pack_us"] = pack["total_us"]
    split["py_after_us"] = (end_ns - pack_end) / 1e3
    return {k: round(v, 1) for k, v in split.items()}


def gap_before_timed_call(gap: str, sync) -> Callable[[], None]:
    """What comes between a way's untimed call and its timed one: nothing (``b2b``, as
    bench_loop's back-to-back cells), a 20 ms sleep (``sleep``) or a 20 ms GPU kernel the host
    waits on (``gpu``): bench_loop's three patterns (GAP_S, gpu_sleep_cycles)."""
    if gap == "b2b":
        return lambda: None
    if gap == "sleep":
        return lambda: time.sleep(GAP_S)
    cycles = gpu_sleep_cycles(GAP_S, sync)

    def gpu_gap() -> None:
        torch.cuda._sleep(cycles)
        sync()

    return gpu_gap


def timed_after_twin(
    fn: Callable[[], Any],
    sync: Callable[[], None],
    gap_before: Callable[[], None],
    twin: bool = True,
) -> tuple[int, int, int]:
    """One timed call of a way: an untimed call of the same way (synchronized), the gap
    (gap_before_timed_call), then the timed call and a synchronize. Returns
    time.perf_counter_ns() at the call, at its return and at the synchronize's end.

    bench_loop's back-to-back cells make each call so. Its gap cells (run_rounds, warm_each
    off) have no twin: the timed call follows the gap, and before the gap came the timed call
    of another way of the round. twin=False times a call that way."""
    if twin:
        fn()
        sync()
    gap_before()
    t0 = time.perf_counter_ns()
    res = fn()
    t1 = time.perf_counter_ns()
    sync()
    t2 = time.perf_counter_ns()
    del res
    return t0, t1, t2


def measure(
    sizes: list[int],
    rounds: int,
    pinxfer_only: bool,
    copy_probes: bool,
    batch_parts: bool = False,
    gap: str = "b2b",
) -> dict:
    import pinxfer

    dev = torch.device("cuda", torch.cuda.current_device())
    sync = torch.cuda.synchronize
    before_timed = gap_before_timed_call(gap, sync)
    out: dict[str, Any] = {}
    pinxfer._C._trace_team_regions(True)  # _last_pin_call_trace() is recorded only then
    for nbytes in sizes:
        t = torch.randn(nbytes // 4)
        pinned = t.pin_memory()
        batch = make_batch(nbytes)
        ways = call_ways(pinxfer, t, pinned, batch, dev)
        if copy_probes:
            ways |= copy_probe_ways(pinxfer, t)
        if batch_parts:
            ways |= batch_part_ways(pinxfer, batch, dev)
        if pinxfer_only:
            ways = {"to_device": ways["to_device"]}
        for fn in ways.values():  # warm-up
            fn()
            sync()
        times: dict[str, list[float]] = {w: [] for w in ways}
        call_us: dict[str, list[float]] = {w: [] for w in ways}  # the call, without its sync
        traces: dict[str, list[dict]] = {"to_device": [], "to_device_batch": []}
        if batch_parts:
            traces["batch_leaf"] = []
            traces["batch_pack"] = []
            traces["batch_python"] = []
        pin_traces: list[dict] = []
        previous = None  # the way timed last, in this cell
        same_block: dict[str, list[bool]] = {
            w: []
            for w in ("pin_memory", "torch_pin", "pool_empty_copy", "torch_empty_copy")
            if w in ways
        }
        for order in balanced_rounds(list(ways), rounds):
            for name in order:
                fn = ways[name]
                untimed = fn()  # the untimed call of the same way, as bench_loop's b2b
                untimed_at = untimed.data_ptr() if name in same_block else 0
                del untimed
                sync()
                before_timed()
                stats0 = pinxfer.memory_stats()
                sw0 = involuntary_switches()
                t0_ns = time.perf_counter_ns()
                t0 = time.perf_counter()
                res = fn()
                t_call = time.perf_counter()
                t_call_ns = time.perf_counter_ns()
                sync()
                wall = (time.perf_counter() - t0) * 1e6
                call_us[name].append((t_call - t0) * 1e6)
                sw1 = involuntary_switches()
                if name in same_block:
                    # Whether the timed call got the block the untimed one wrote just before
                    # (still in the caches) or another one.
                    same_block[name].append(res.data_ptr() == untimed_at)
                del res
                times[name].append(wall)
                if name == "pin_memory":
                    steps = pinxfer._C._last_pin_call_trace()
                    stats1 = pinxfer.memory_stats()
                    pin_traces.append(
                        {"wall_us": round(wall, 1), "preempted": sw1 - sw0}
                        # Fence markers the pool recorded and its misses from the timed call
                        # to after the free of its output (`del res`, past the timed window):
                        # a marker the synchronize may wait for, or the output's own free.
                        | {
                            k: stats1[f"num_{k}"] - stats0[f"num_{k}"]
                            for k in ("fence_markers", "cache_misses")
                        }
                        | {k2: round(float(v), 1) for k2, v in steps.items()}
                    )
                if name in traces:
                    trace = dict(pinxfer._C._last_single_block_trace())
                    pack = dict(pinxfer._C._last_pack_trace())
                    traces[name].append(
                        (
                            {
                                "pack": {k2: round(v, 1) for k2, v in pack.items()},
                                "split": call_split(name, t0_ns, t_call_ns, trace, pack),
                            }
                            if name in ("to_device_batch", "batch_pack", "batch_python")
                            else {}
                        )
                        | {
                            "wall_us": round(wall, 1),
                            "call_us": round(call_us[name][-1], 1),
                            "after": previous,
                            "preempted": sw1 - sw0,
                            "pool_misses": pinxfer.memory_stats()["num_cache_misses"]
                            - stats0["num_cache_misses"],
                            "trace": {
                                k2: round(v, 1) if isinstance(v, float) else v
                                for k2, v in trace.items()
                            },
                        }
                    )
                previous = name
        cell = {
            w: {
                "median_us": round(statistics.median(v), 1),
                "min_us": round(min(v), 1),
                "call_median_us": round(statistics.median(call_us[w]), 1),
            }
            for w, v in times.items()
        }
        slow = [tr for tr in traces["to_device"] if tr["wall_us"] > 2 * cell["to_device"]["min_us"]]
        cell["to_device_calls"] = traces["to_device"]
        cell["to_device_batch_calls"] = traces["to_device_batch"]
        if batch_parts:
            cell["batch_leaf_calls"] = traces["batch_leaf"]
            cell["batch_pack_calls"] = traces["batch_pack"]
            cell["batch_python_calls"] = traces["batch_python"]
        cell["pin_memory_calls"] = pin_traces
        cell["same_block_share"] = {
            w: round(sum(v) / len(v), 2) if v else None for w, v in same_block.items()
        }
        cell["slow_calls"] = len(slow)
        cell["slow_preempted"] = sum(1 for tr in slow if tr["preempted"])
        cell["slow_stolen"] = sum(1 for tr in slow if tr["trace"]["stolen"])
        cell["slow_missed"] = sum(1 for tr in slow if tr["pool_misses"])
        out[size_label(nbytes)] = cell
    return out


def team_spin_ms(trials: int = 7) -> dict:
    """How long torch's intra-op team stays awake (spinning) after one parallel op, as
    pinxfer's probe sees it (csrc/runtime/torch_team.h): the window in which pinxfer's
    copies run on the team, and the CPU each such copy re-arms on every team thread."""
    import pinxfer

    state = pinxfer._C._torch_team_state
    wake = torch.ones(1 << 22)
    spins = []
    for _ in range(trials):
        time.sleep(0.3)
        wake.add_(1)
        t0 = time.perf_counter()
        while state()[1] and time.perf_counter() - t0 < 2.0:
            time.sleep(0.0002)
        spins.append((time.perf_counter() - t0) * 1e3)
    return {
        "team_threads": state()[0],
        "median_ms": round(statistics.median(spins), 2),
        "min_ms": round(min(spins), 2),
        "max_ms": round(max(spins), 2),
    }


def report(variant: str, cells: dict[str, Any]) -> str:
    """One variant's cells as text: each way's median / minimum µs (and the call without its
    synchronize), the traced to_device calls, the traced pin_memory calls, the slow calls."""
    lines = []
    for size, cell in cells.items():
        ways = "  ".join(
            f"{w} {c['median_us']:.0f}/{c['min_us']:.0f} (call {c['call_median_us']:.0f})"
            for w, c in cell.items()
            if isinstance(c, dict) and "median_us" in c
        )
        lines.append(f"{variant:13} {size:>6}  {ways}")
        calls = cell["to_device_calls"]
        if calls:
            med = lambda key: statistics.median(c["trace"][key] for c in calls)  # noqa: E731
            lines.append(
                f"{'':21}slow {cell['slow_calls']}/{len(calls)} "
                f"(preempted {cell['slow_preempted']}, stolen {cell['slow_stolen']}, pool miss "
                f"{cell['slow_missed']}); median own_done {med('own_done_us'):.0f} us, "
                f"first helper {med('first_helper_us'):.0f} us, "
                f"helper pieces {med('helper_pieces'):.0f} of {med('pieces'):.0f}, "
                f"stolen {med('stolen'):.0f}, on torch's team "
                f"{sum(c['trace']['on_torch_team'] for c in calls)}"
            )
        batch_calls = cell.get("to_device_batch_calls", [])
        if batch_calls:
            lines.append(f"{'':21}to_device_batch by the way timed before it (median wall us, n):")
            by_after: dict[str, list[dict]] = {}
            for c in batch_calls:
                by_after.setdefault(str(c["after"]), []).append(c)
            for after, group in sorted(by_after.items()):
                med = lambda key, g=group: statistics.median(c["trace"][key] for c in g)  # noqa: E731
                lines.append(
                    f"{'':23}after {after:20} {statistics.median(c['wall_us'] for c in group):6.0f}"
                    f" (n {len(group)}; call {statistics.median(c['call_us'] for c in group):.0f},"
                    f" leaf total {med('total_us'):.0f}, first DMA {med('first_queued_us'):.0f},"
                    f" setup {med('setup_us'):.0f}, on team "
                    f"{sum(c['trace']['on_torch_team'] for c in group)}, preempted "
                    f"{sum(1 for c in group if c['preempted'])})"
                )
        for way in ("to_device_batch", "batch_python", "batch_pack"):
            calls_of_way = cell.get(f"{way}_calls", [])
            if not calls_of_way or "split" not in calls_of_way[0]:
                continue
            parts = ", ".join(
                f"{k} {statistics.median(c['split'][k] for c in calls_of_way):.1f}"
                for k in calls_of_way[0]["split"]
            )
            steps = ", ".join(
                f"{k} {statistics.median(c['pack'][k] for c in calls_of_way):.1f}"
                for k in (
                    "checked_us",
                    "output_us",
                    "block_us",
                    "staged_us",
                    "queued_us",
                    "returned_us",
                    "total_us",
                )
            )
            lines.append(f"{'':21}{way} split (median us): {parts}; pack steps: {steps}")
        pins = cell["pin_memory_calls"]
        if pins:
            steps = [k for k in pins[0] if k != "preempted"]
            lines.append(
                f"{'':21}pin_memory (t.pin_memory {cell['torch_pin']['median_us']:.0f} us), "
                f"timed call on the untimed call's block {cell['same_block_share']}, median "
                + ", ".join(f"{k} {statistics.median(c[k] for c in pins):.1f}" for k in steps)
            )
        slow = [c for c in calls if c["wall_us"] > 2 * cell["to_device"]["min_us"]]
        lines += [f"{'':21}slow call: {c}" for c in slow[:4]]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--sizes", default="1M,8M,32M")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument(
        "--copy-probes",
        action="store_true",
        help="add torch's copy_ into a kept pool block, a kept torch block and a new pool block "
        "to the rounds",
    )
    ap.add_argument(
        "--batch-parts",
        action="store_true",
        help="add the batch's large leaf alone and its packed small leaves alone to the rounds",
    )
    ap.add_argument(
        "--gap",
        default="b2b",
        choices=("b2b", "sleep", "gpu"),
        help="before each timed call (after its untimed twin): nothing, a 20 ms sleep, or a "
        "20 ms GPU kernel the host waits on (bench_loop's patterns; default b2b)",
    )
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    sizes = parse_sizes(args.sizes)
    if args.child == "team_spin":
        print(json.dumps(team_spin_ms()))
        return
    if args.child:
        print(
            json.dumps(
                measure(
                    sizes,
                    args.rounds,
                    args.child == "pinxfer_only",
                    args.copy_probes,
                    args.batch_parts,
                    args.gap,
                )
            )
        )
        return
    result: dict[str, Any] = {
        "gap": args.gap,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(),
        "variants": {},
    }
    result["team_spin"] = run_child(__file__, ["--child", "team_spin"])
    print(f"torch's team stays awake after one op: {result['team_spin']}", flush=True)
    for variant in args.variants.split(","):
        cells = run_child(
            __file__,
            ["--child", variant, "--sizes", args.sizes, "--rounds", str(args.rounds)]
            + ["--gap", args.gap]
            + (["--copy-probes"] if args.copy_probes else [])
            + (["--batch-parts"] if args.batch_parts else []),
            VARIANTS[variant],
        )
        result["variants"][variant] = cells
        if args.json:  # after each variant: a later one that fails keeps the earlier ones
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        print(report(variant, cells), flush=True)


if __name__ == "__main__":
    main()
