"""A loop-shaped benchmark: pinxfer against torch at every size, back to back and after idle.

Issue 22, item 1. In a training loop a transfer follows a compute step; the copy threads
have gone to sleep and most tensors are small or mid-size. This script measures every way
of moving the same bytes, in one process, at every size

    4 KiB, 64 KiB, 256 KiB, 1 MiB, 4 MiB, 8 MiB, 32 MiB, 64 MiB, 256 MiB, 1 GiB

in three patterns:

    b2b     back to back: an untimed call of the same way right before the timed one
    sleep   after an idle gap of 20 ms made by time.sleep
    gpu     after a 20 ms gap made by a GPU kernel the host waits on (torch.cuda._sleep,
            cycles calibrated once from measurement, then the stream is synchronized)

Ways (per size and pattern; each call timed to completion: host clock around the call
and torch.cuda.synchronize()):

    to_device        pinxfer.to_device(t), t one pageable float32 tensor
    to_device_batch  pinxfer.to_device(batch), batch = {"x": float32 (~size*63/64),
                     "y": int64 (size/64), "meta": [two int64 scalars]} (same total bytes)
    pin_memory       pinxfer.pin_memory(t)
    torch_to         t.to("cuda")                               (pageable)
    torch_to_nb      t.to("cuda", non_blocking=True)            (pageable; no stream sync)
    torch_pinned_to  pinned.to("cuda", non_blocking=True)      (already pinned: the ceiling)
    torch_pin_to     t.pin_memory().to("cuda", non_blocking=True)
    torch_pin        t.pin_memory()
    torch_batch_to, torch_batch_pin_to, torch_batch_pinned_to   the batch's four tensors,
                     each .to("cuda", non_blocking=True): pageable, through .pin_memory(),
                     already pinned (the batch's ceiling)
  and, per pass over an in-memory list of such batches (the consumer waits its gap between
  batches, as a training step would; each batch "waits" from next() to its data being usable
  on the consumer's stream):
    prefetch         pinxfer.prefetch(batches): per batch in steady state (after the first)
                     and per batch including the pass start (thread start, first batch)
    loop             the plain loop: .to("cuda", non_blocking=True) of each tensor

Ratios are speed ratios, > 1 means pinxfer is faster: ref time / pinxfer time, by medians
(and by minima). "x torch" is against torch's best way of the same size and pattern (the
way with the lowest median, with its own minimum: of torch_to, torch_to_nb and torch_pin_to
for to_device rows, of the batch ways for to_device_batch, torch_pin for pin_memory, the
plain loop for prefetch); "x pinned" is against torch_pinned_to of the same size and pattern,
for the rows that move the batch against torch_batch_pinned_to (four DMAs, as they send).
Until 2026-12-06 (session 45) torch_to_nb was not among torch's ways, the batch rows were
judged against one pinned tensor, and torch's best took the lowest minimum of either way.
Small-call rows (issue 22's table) follow, then CPU seconds per GB of a 1 GiB transfer and
the process's idle CPU over 1 s after the transfers; the pinxfer.install() rows run last.

Ways run interleaved, every way once a round, so that the host's drift falls on all of them
alike, in orders that vary which way runs before which (balanced_orders: every way follows
every other equally often), so that what one way leaves behind does too. Until 2026-12-02 the
order was a rotation of one list, in which each way always followed the same one (pin_memory
always came after to_device_batch, t.pin_memory() after t.pin_memory().to()): a change to
to_device's staging stores alone moved pin_memory's row from 0.79 to 0.95 of torch's
(csrc/README.md, "The sender road", session 28). Rows of earlier runs that such leftovers move
are not comparable one to one with later ones.

Samples per cell are adaptive: a time budget (--budget) is shared over the cells (largest
sizes first, so that they get their minimum), capped per size.

One process runs every size by default, largest first, so each size follows the larger ones'
history (pools and caches holding their blocks, threads woken by them). That history can move
a row: prefetch of 8 MiB batches back to back took 473 us a batch in a whole table (H200,
session 41) and 200-210 in processes of 8 and 32 MiB only. --process-per-size runs each size
in a fresh process of its own (a child bench_loop, an equal share of the budget), as a
training loop of one batch size runs; the small rows then run in the parent.

Usage:
  python3 benchmarks/bench_loop.py                  # results/<kind>/loop.json (~5 min, H100)
  python3 benchmarks/bench_loop.py --quick          # 4 sizes, a small budget (a smoke run)
  python3 benchmarks/bench_loop.py --sizes 4K,1M,8M --json /tmp/loop.json
  python3 benchmarks/bench_loop.py --process-per-size   # each size in a fresh process
  python3 benchmarks/bench_loop.py --self-test      # statistics and table code, CPU only
Kind: --kind, else PINXFER_MACHINE_KIND, else torch.cuda.get_device_name() as a slug.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

torch: Any = None  # imported by main(): the self-test needs neither torch nor pinxfer

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
SIZES = [4 * KiB, 64 * KiB, 256 * KiB, MiB, 4 * MiB, 8 * MiB, 32 * MiB, 64 * MiB, 256 * MiB, GiB]
QUICK_SIZES = [4 * KiB, MiB, 8 * MiB, 64 * MiB]
PATTERNS = ["b2b", "sleep", "gpu"]
GAP_S = 0.020
CALL_WAYS = [
    "to_device",
    "to_device_batch",
    "pin_memory",
    "torch_to",
    "torch_to_nb",
    "torch_pinned_to",
    "torch_pin_to",
    "torch_pin",
]
PINXFER_WAYS = {"to_device", "to_device_batch", "pin_memory", "prefetch_steady", "prefetch_pass"}
# torch's ways over one tensor (call_ways): the reference of to_device.
TORCH_WAYS = ("torch_to", "torch_to_nb", "torch_pin_to")
# torch's ways over a cell's batch (call_ways): the reference of to_device_batch.
BATCH_TORCH_WAYS = ("torch_batch_to", "torch_batch_pin_to")
#: Idle CPU allowed over 1 s ("idle copy threads use no CPU"): timer and allocator noise only.
IDLE_CPU_LIMIT_S = 0.005


# ---------------------------------------------------------------- pure helpers (self-tested)


def call_ways(
    px: Any, t: Any, pinned: Any, batch: dict, dev: Any, pinned_batch: dict | None = None
) -> dict[str, Callable[[], Any]]:
    """The per-call ways of a cell, in bench_loop's order (balanced_orders permutes it):
    pinxfer's three and torch's, over the same tensor `t` (pageable), its pinned copy, a
    batch and (given) that batch already pinned: the batch's ceiling, four DMAs as
    to_device_batch sends. benchmarks/diag_midsize.py runs the same ones."""
    ways = {
        "to_device": lambda: px.to_device(t, dev),
        "to_device_batch": lambda: px.to_device(batch, dev),
        "pin_memory": lambda: px.pin_memory(t),
        "torch_to": lambda: t.to(dev),
        # Pageable non_blocking: the driver stages it, and torch skips the stream sync.
        "torch_to_nb": lambda: t.to(dev, non_blocking=True),
        "torch_pinned_to": lambda: pinned.to(dev, non_blocking=True),
        "torch_pin_to": lambda: t.pin_memory().to(dev, non_blocking=True),
        "torch_pin": lambda: t.pin_memory(),
        "torch_batch_to": lambda: torch_batch_to(batch, dev, pin=False),
        "torch_batch_pin_to": lambda: torch_batch_to(batch, dev, pin=True),
    }
    if pinned_batch is not None:
        ways["torch_batch_pinned_to"] = lambda: torch_batch_to(pinned_batch, dev, pin=False)
    return ways


def torch_batch_to(batch: dict, dev: Any, pin: bool) -> dict:
    """torch's way with the cell's batch ({"x", "y", "meta": [two scalars]}), written out as a
    training loop writes it: each leaf .to(dev, non_blocking=True), from pageable memory or
    (pin) through .pin_memory() first. The torch reference of to_device_batch: a batch of
    four tensors against one tensor would charge pinxfer for three calls torch is not
    timed for."""
    if pin:
        return {
            "x": batch["x"].pin_memory().to(dev, non_blocking=True),
            "y": batch["y"].pin_memory().to(dev, non_blocking=True),
            "meta": [m.pin_memory().to(dev, non_blocking=True) for m in batch["meta"]],
        }
    return {
        "x": batch["x"].to(dev, non_blocking=True),
        "y": batch["y"].to(dev, non_blocking=True),
        "meta": [m.to(dev, non_blocking=True) for m in batch["meta"]],
    }


def size_label(n: int) -> str:
    for unit, name in ((GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB")):
        if n >= unit and n % unit == 0:
            return f"{n // unit}{name}"
    return f"{n}B"


def parse_sizes(text: str) -> list[int]:
    """'4K,1M,1G' (or 4KiB, 1MiB, plain bytes) -> byte counts."""
    out = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:i?B)?\s*", part, re.IGNORECASE)
        if not m:
            raise ValueError(f"bad size {part!r} (e.g. 4K, 64KiB, 1M, 1G)")
        n = int(m.group(1)) * {"": 1, "K": KiB, "M": MiB, "G": GiB}[m.group(2).upper()]
        if n < 4096 or n % 4096:
            raise ValueError(f"size {part!r}: a multiple of 4 KiB, at least 4 KiB")
        out.append(n)
    return out


def per_size_commands(
    script: str, sizes: list[int], args: argparse.Namespace, json_dir: str
) -> list[tuple[int, list[str], str]]:
    """--process-per-size: one bench_loop child per size (largest first, as matrix() runs
    them), each a fresh process with an equal share of the budget and no small rows (the
    parent runs those). Returns (bytes, argv, the child's JSON path) per size."""
    share = args.budget / len(sizes)
    out = []
    for nbytes in sorted(sizes, reverse=True):
        path = os.path.join(json_dir, f"loop_{size_label(nbytes)}.json")
        argv = [sys.executable, script, "--sizes", size_label(nbytes), "--no-small"]
        argv += ["--budget", f"{share:.3f}", "--json", path, "--producer", args.producer]
        if args.kind:
            argv += ["--kind", args.kind]
        if args.quick:
            argv.append("--quick")
        out.append((nbytes, argv, path))
    return out


def merge_size_runs(runs: list[tuple[int, dict]]) -> tuple[list[dict], dict]:
    """The cells of per-size child reports, in the children's order, and each child's
    measured gaps by size label. A child whose cells are not all of its own size is an
    error: its rows would be filed under the wrong size."""
    cells: list[dict] = []
    gaps: dict[str, Any] = {}
    for nbytes, report in runs:
        got = {c["bytes"] for c in report["cells"]}
        if got != {nbytes}:
            raise ValueError(
                f"bench_loop child for {size_label(nbytes)} reported sizes "
                f"{sorted(size_label(b) for b in got)}"
            )
        cells.extend(report["cells"])
        gaps[size_label(nbytes)] = report.get("gaps")
    return cells, gaps


def cells_in_fresh_processes(
    script: str, sizes: list[int], args: argparse.Namespace, json_dir: str
) -> tuple[list[dict], dict]:
    """Runs per_size_commands' children one after another, each printing to this process's
    output as it goes (its cells, its table), and merges their cells. A child that fails or
    crashes fails the run (its own output above says why)."""
    runs = []
    for nbytes, argv, path in per_size_commands(script, sizes, args, json_dir):
        print(f"== {size_label(nbytes)} in a fresh process", flush=True)
        code = subprocess.run(argv).returncode
        if code != 0:
            raise RuntimeError(
                f"bench_loop child for {size_label(nbytes)} exited with {code} "
                "(its output is above)"
            )
        runs.append((nbytes, json.loads(Path(path).read_text())))
    return merge_size_runs(runs)


def kind_slug(env_kind: str | None, device_name: str) -> str:
    """The machine kind: PINXFER_MACHINE_KIND if set, else the device name as a slug."""
    if env_kind:
        return env_kind
    return re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-") or "unknown"


def batch_layout(nbytes: int) -> dict[str, int]:
    """Bytes of the nested batch's parts: x float32, y int64 (1/64), meta two int64 scalars."""
    meta = 16
    y = max(64, nbytes // 64) // 8 * 8
    x = nbytes - y - meta
    assert x > 0 and x % 4 == 0, nbytes
    return {"x": x, "y": y, "meta": meta}


def summarize(times_s: list[float], nbytes: int, cpu_s: list[float] | None = None) -> dict:
    """Median and minimum µs of the samples, GB/s of both, and CPU s per GB if given."""
    med, best = statistics.median(times_s), min(times_s)
    out = {
        "n": len(times_s),
        "median_us": med * 1e6,
        "min_us": best * 1e6,
        "gbps_median": nbytes / med / 1e9,
        "gbps_best": nbytes / best / 1e9,
    }
    if cpu_s is not None:
        out["cpu_s_per_gb"] = sum(cpu_s) / (len(cpu_s) * nbytes / 1e9)
    return out


def last_level_cache_bytes(cpu_root: str = "/sys/devices/system/cpu/cpu0/cache") -> int | None:
    """The largest cache CPU 0 sees (sysfs `index*/size`, e.g. "32768K"), None if unreadable."""
    sizes = []
    for index in sorted(os.listdir(cpu_root)) if os.path.isdir(cpu_root) else []:
        try:
            with open(os.path.join(cpu_root, index, "size")) as f:
                text = f.read().strip()
        except OSError:
            continue
        scale = {"K": KiB, "M": MiB, "G": GiB}.get(text[-1:].upper(), 1)
        digits = text[:-1] if scale != 1 else text
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes) if sizes else None


def speed_ratio(ours: dict | None, ref: dict | None) -> dict | None:
    """ref time / our time (> 1: ours faster), by medians and by minima."""
    if ours is None or ref is None:
        return None
    return {"median": ref["median_us"] / ours["median_us"], "min": ref["min_us"] / ours["min_us"]}


def plan_samples(round_s: float, cell_budget_s: float, nbytes: int, quick: bool = False) -> int:
    """Samples for a cell: as many rounds as its share of the budget allows, at least 3,
    at most a cap that falls with the size (many for 4 KiB, 5 for 1 GiB)."""
    cap = (
        31
        if nbytes <= 256 * KiB
        else 21
        if nbytes <= 8 * MiB
        else 11
        if nbytes <= 64 * MiB
        else 7
        if nbytes <= 256 * MiB
        else 5
    )
    if quick:
        cap = min(cap, 7)
    fit = int(cell_budget_s / max(round_s, 1e-6))
    return max(3, min(cap, fit))


def gpu_sleep_cycles(seconds: float, sync: Callable[[], None]) -> int:
    """Cycles of torch.cuda._sleep that take about ``seconds`` here, from measurement: a sleep
    grown until it takes 4 ms, then the median rate of five (``sync`` waits for the stream
    the sleeps run on)."""
    import torch  # this module's global is set by main(); other scripts call this without it

    torch.cuda._sleep(1000)
    sync()
    cycles = 1 << 20
    while True:
        t0 = time.perf_counter()
        torch.cuda._sleep(cycles)
        sync()
        if time.perf_counter() - t0 >= 0.004 or cycles > 1 << 36:
            break
        cycles *= 4
    rates = []
    for _ in range(5):
        t0 = time.perf_counter()
        torch.cuda._sleep(cycles)
        sync()
        rates.append(cycles / (time.perf_counter() - t0))
    return int(seconds * statistics.median(rates))


def balanced_orders(names: list[str]) -> list[list[str]]:
    """Orders of `names` for successive rounds, in which every way runs right after every
    other way equally often (within the rounds) and first equally often: a Williams design
    (a balanced Latin square; for an odd count, each order and its reverse). So what a way
    leaves behind (cached lines, awake copy threads, torch's spinning team) falls on every
    other way alike, as the host's drift does when each round runs every way once."""
    n = len(names)
    first, low, high = [0], 1, n - 1
    while len(first) < n:  # 0, 1, n-1, 2, n-2, ...
        if len(first) % 2:
            first.append(low)
            low += 1
        else:
            first.append(high)
            high -= 1
    rows = [[(i + r) % n for i in first] for r in range(n)]
    if n % 2:
        rows += [row[::-1] for row in rows]
    return [[names[i] for i in row] for row in rows]


def balanced_rounds(names: list[str], rounds: int) -> list[list[str]]:
    """The order of each of `rounds` rounds: balanced_orders' orders, cycled."""
    orders = balanced_orders(names)
    return [orders[r % len(orders)] for r in range(rounds)]


def run_rounds(
    ways: dict[str, Callable[[], Any]],
    n: int,
    sync: Callable[[], None],
    gap: Callable[[], None] | None = None,
    warm_each: bool = False,
    cpu_clock: Callable[[], float] = time.process_time,
    clock: Callable[[], float] = time.perf_counter,
    order_log: list | None = None,
) -> tuple[dict, dict]:
    """n rounds; each round calls every way once, timed to completion (call + sync), in the
    round's order from balanced_rounds. warm_each: an untimed call of the same way (synced)
    just before the timed one (back to back); gap: called just before the timed call (idle).
    Returns ({way: [seconds]}, {way: [cpu seconds]})."""
    times: dict[str, list[float]] = {k: [] for k in ways}
    cpu: dict[str, list[float]] = {k: [] for k in ways}
    for order in balanced_rounds(list(ways), n):
        for name in order:
            fn = ways[name]
            if warm_each:
                fn()
                sync()
            if gap is not None:
                gap()
            c0 = cpu_clock()
            t0 = clock()
            out = fn()
            sync()
            t1 = clock()
            c1 = cpu_clock()
            del out
            times[name].append(t1 - t0)
            cpu[name].append(c1 - c0)
            if order_log is not None:
                order_log.append(name)
    return times, cpu


def pass_samples(passes: list[tuple[float, list[float]]]) -> dict[str, list[float]]:
    """Per pass (start seconds, per batch waits): the steady per batch time (mean wait after
    the first batch) and the per batch time including the pass start."""
    steady, whole = [], []
    for start, waits in passes:
        steady.append(sum(waits[1:]) / max(1, len(waits) - 1))
        whole.append((start + sum(waits)) / len(waits))
    return {"steady": steady, "pass": whole}


def pinned_target(nbytes: int) -> float | None:
    """Issue 22: to_device >= 0.5x the pinned copy at 1 MiB, 0.8x at 8 MiB, 0.9x from 32 MiB."""
    if nbytes >= 32 * MiB:
        return 0.9
    return {MiB: 0.5, 8 * MiB: 0.8}.get(nbytes)


def targets_for(way: str, nbytes: int) -> list[tuple[str, str, float]]:
    """(label, ratio key, lowest median speed ratio) for a row of the matrix."""
    if way not in PINXFER_WAYS:
        return []
    out = [("x torch >= 1", "ratio_torch", 1.0)]
    if way in ("to_device", "to_device_batch") and pinned_target(nbytes) is not None:
        p = pinned_target(nbytes)
        out.append((f"x pinned >= {p}", "ratio_pinned", p))
    if way == "prefetch_steady" and nbytes >= 8 * MiB:
        out.append(("x pinned >= 0.85", "ratio_pinned", 0.85))
    return out


def judge(row: dict) -> None:
    """Adds 'targets' (labels) and 'verdict' (PASS, MISS, or None without targets)."""
    targets = targets_for(row["way"], row["bytes"])
    row["targets"] = [t[0] for t in targets]
    if not targets:
        row["verdict"], row["missed"] = None, []
        return
    missed = [
        label for label, key, low in targets if row.get(key) is None or row[key]["median"] < low
    ]
    row["missed"] = missed
    row["verdict"] = "MISS" if missed else "PASS"


# Rows that move the cell's batch (x, y and two scalars), judged against the batch pinned.
BATCH_SHAPED_WAYS = {
    "to_device_batch",
    "prefetch_steady",
    "prefetch_pass",
    "loop_steady",
    "loop_pass",
    *BATCH_TORCH_WAYS,
}


def best_way(calls: dict, names: tuple[str, ...]) -> dict | None:
    """torch's best of `names`: the way with the lowest median, with that way's own minimum
    (not the lowest minimum of any way, which would mix two ways' noise)."""
    measured = [w for w in names if w in calls]
    if not measured:
        return None
    way = min(measured, key=lambda w: calls[w]["median_us"])
    return {"median_us": calls[way]["median_us"], "min_us": calls[way]["min_us"], "way": way}


def build_rows(cells: list[dict]) -> list[dict]:
    """Flat rows per (size, pattern, way) with ratios and verdicts, from the measured cells:
    {"bytes", "pattern", "calls": {way: stats}, "prefetch": {"prefetch_steady", ...}}."""
    rows = []
    for cell in cells:
        nbytes, pattern = cell["bytes"], cell["pattern"]
        calls = cell.get("calls", {})
        pre = cell.get("prefetch", {})
        pinned = calls.get("torch_pinned_to")
        # The batch's ceiling: its four tensors pinned beforehand (runs without it: one).
        pinned_batch = calls.get("torch_batch_pinned_to", pinned)
        best = best_way(calls, TORCH_WAYS)
        # The same for the batch: torch's ways over the same four tensors.
        best_batch = best_way(calls, BATCH_TORCH_WAYS) or best
        refs = {
            "to_device": best,
            "to_device_batch": best_batch,
            "pin_memory": calls.get("torch_pin"),
            "prefetch_steady": pre.get("loop_steady"),
            "prefetch_pass": pre.get("loop_pass"),
        }
        stats_by_way = dict(calls)
        stats_by_way.update(pre)
        for way, st in stats_by_way.items():
            row = {
                "bytes": nbytes,
                "size": size_label(nbytes),
                "pattern": pattern,
                "way": way,
                **st,
                "ratio_torch": speed_ratio(st, refs.get(way)),
                "ratio_pinned": None
                if way in ("pin_memory", "torch_pin")
                else speed_ratio(st, pinned_batch if way in BATCH_SHAPED_WAYS else pinned),
            }
            if way in BATCH_SHAPED_WAYS and pinned_batch is not pinned:
                # Kept for comparison with runs that judged the batch against one tensor.
                row["ratio_pinned_one_tensor"] = speed_ratio(st, pinned)
            if way in ("to_device", "to_device_batch") and refs[way] is not None:
                row["torch_ref"] = refs[way]["way"]
            if way == "to_device_batch" and best_batch is not best and best is not None:
                # Kept for comparison with results from before the batch ways were timed.
                row["ratio_torch_one_tensor"] = speed_ratio(st, best)
            judge(row)
            rows.append(row)
    return rows


def judge_small(rows: list[dict]) -> None:
    """Verdicts of the small-call rows: each has 'value', 'limit' and 'cmp' ('<=' or '>=':
    the value must be at most, or at least, the limit)."""
    for r in rows:
        if r.get("value") is None or r.get("limit") is None:
            r["verdict"] = None
        elif r.get("cmp", "<=") == ">=":
            r["verdict"] = "PASS" if r["value"] >= r["limit"] else "MISS"
        else:
            r["verdict"] = "PASS" if r["value"] <= r["limit"] else "MISS"


def _f(x: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def _us(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.1f}" if x < 100 else f"{x:.0f}"


def detail_table(rows: list[dict]) -> str:
    """Every (size, pattern, way): median/min µs, GB/s, x torch and x pinned (median/min)."""
    out = [
        f"{'size':>7} {'pattern':7} {'way':16} {'med us':>9} {'min us':>9} {'GB/s':>6} "
        f"{'x torch med/min':>15} {'x pinned med/min':>16} {'verdict':7}"
    ]
    for r in sorted(rows, key=lambda r: (r["bytes"], PATTERNS.index(r["pattern"]), r["way"])):
        rt, rp = r.get("ratio_torch"), r.get("ratio_pinned")
        out.append(
            f"{r['size']:>7} {r['pattern']:7} {r['way']:16} {_us(r['median_us']):>9} "
            f"{_us(r['min_us']):>9} {r['gbps_median']:6.2f} "
            f"{(_f(rt['median']) + '/' + _f(rt['min'])) if rt else '-':>15} "
            f"{(_f(rp['median']) + '/' + _f(rp['min'])) if rp else '-':>16} "
            f"{r['verdict'] or '':7}"
        )
    return "\n".join(out)


def compact_table(rows: list[dict], small: list[dict]) -> str:
    """One line per (size, pattern): the pinned copy and torch's best in µs, then each
    pinxfer way as µs and speed ratios (xt: to torch's best, xp: to the pinned copy),
    the issue's targets for that line and PASS/MISS; then the small-call rows."""
    by = {}
    for r in rows:
        by.setdefault((r["bytes"], r["pattern"]), {})[r["way"]] = r
    head = (
        f"{'size':>7} {'pat':5} {'pinned':>7} {'torch':>7} {'t.batch':>7} | "
        f"{'to_device us xt xp':>20} | "
        f"{'batch us xt xp':>20} | {'prefetch steady us xt xp':>24} | "
        f"{'pass us xt':>13} | {'pin us xt':>13} | {'targets':40} | result"
    )
    out = [
        "== loop table (us: median per call or per batch; xt/xp: speed vs torch's best / "
        "the pinned copy, >1 = pinxfer faster; t.batch: torch's best way over the batch, "
        "the batch's xt reference)",
        head,
    ]

    def cellfmt(r: dict | None, width: int, pinned: bool = True) -> str:
        if r is None:
            return f"{'-':>{width}}"
        rt, rp = r.get("ratio_torch"), r.get("ratio_pinned")
        s = f"{_us(r['median_us'])} {_f(rt['median'] if rt else None)}"
        if pinned:
            s += f" {_f(rp['median'] if rp else None)}"
        return f"{s:>{width}}"

    for nbytes, pattern in sorted(by, key=lambda k: (k[0], PATTERNS.index(k[1]))):
        w = by[(nbytes, pattern)]
        pinned = w.get("torch_pinned_to")
        torch_best = min((w[k]["median_us"] for k in TORCH_WAYS if k in w), default=None)
        torch_batch = min((w[k]["median_us"] for k in BATCH_TORCH_WAYS if k in w), default=None)
        ours = [
            w.get(k)
            for k in (
                "to_device",
                "to_device_batch",
                "prefetch_steady",
                "prefetch_pass",
                "pin_memory",
            )
        ]
        shorts = ("td", "batch", "pf", "pass", "pin")
        parts = ["all xt>=1"] if any(r and r["targets"] for r in ours) else []
        groups: dict[str, list[str]] = {}
        for short, r in zip(shorts, ours):
            for t in r["targets"] if r else []:
                if t.startswith("x pinned"):
                    groups.setdefault(t.replace("x pinned >= ", "xp>="), []).append(short)
        parts += [f"{','.join(ws)} {t}" for t, ws in groups.items()]
        target_text = "; ".join(parts) or "-"
        misses = [
            f"{short} {m.replace('x pinned >= ', 'xp<').replace('x torch >= ', 'xt<')}"
            for short, r in zip(shorts, ours)
            if r
            for m in r["missed"]
        ]
        judged = [r for r in ours if r and r["verdict"]]
        result = "-" if not judged else ("MISS " + ",".join(misses)) if misses else "PASS"
        out.append(
            f"{size_label(nbytes):>7} {pattern:5} {_us(pinned['median_us']) if pinned else '-':>7} "
            f"{_us(torch_best):>7} {_us(torch_batch):>7} | {cellfmt(ours[0], 20)} | "
            f"{cellfmt(ours[1], 20)} | "
            f"{cellfmt(ours[2], 24)} | {cellfmt(ours[3], 13, False)} | "
            f"{cellfmt(ours[4], 13, False)} | {target_text:40} | {result}"
        )
    if small:
        out.append("== small calls and CPU (issue 22's rows)")
        out.append(f"{'row':24} {'pinxfer':>12} {'torch':>12} {'target':34} result")
        for r in small:
            out.append(
                f"{r['name']:24} {r['ours_text']:>12} {r['ref_text']:>12} "
                f"{r['target']:34} {r['verdict'] or '-'}"
            )
    verdicts = [r["verdict"] for r in rows if r.get("verdict")] + [
        r["verdict"] for r in small if r.get("verdict")
    ]
    out.append(f"targets: {verdicts.count('PASS')} PASS, {verdicts.count('MISS')} MISS")
    return "\n".join(out)


# ---------------------------------------------------------------- self-test (CPU only)


def self_test() -> int:
    import random

    assert parse_sizes("4K,64KiB,1M,8MiB,1G") == [4 * KiB, 64 * KiB, MiB, 8 * MiB, GiB]
    assert parse_sizes("4096") == [4096]
    for bad in ("3K", "1.5M", "x"):
        try:
            parse_sizes(bad)
        except ValueError:
            pass
        else:
            raise AssertionError(f"parse_sizes accepted {bad!r}")
    assert [size_label(s) for s in SIZES] == [
        "4KiB",
        "64KiB",
        "256KiB",
        "1MiB",
        "4MiB",
        "8MiB",
        "32MiB",
        "64MiB",
        "256MiB",
        "1GiB",
    ]
    assert kind_slug("nvidia-h100-x1", "whatever") == "nvidia-h100-x1"
    assert kind_slug(None, "NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    for s in SIZES:
        lay = batch_layout(s)
        assert sum(lay.values()) == s and lay["x"] % 4 == 0 and lay["y"] % 8 == 0, (s, lay)

    st = summarize([3e-6, 1e-6, 2e-6], 4000, [1e-6, 1e-6, 1e-6])
    assert st["n"] == 3 and abs(st["median_us"] - 2.0) < 1e-9 and abs(st["min_us"] - 1.0) < 1e-9
    assert abs(st["gbps_median"] - 2.0) < 1e-9 and abs(st["gbps_best"] - 4.0) < 1e-9
    assert abs(st["cpu_s_per_gb"] - 1e-6 / 4e-6) < 1e-9
    r = speed_ratio({"median_us": 2.0, "min_us": 1.0}, {"median_us": 4.0, "min_us": 3.0})
    assert r == {"median": 2.0, "min": 3.0}, r
    assert speed_ratio(None, {"median_us": 1, "min_us": 1}) is None

    assert plan_samples(0.001, 10.0, 4 * KiB) == 31  # capped
    assert plan_samples(10.0, 1.0, GiB) == 3  # at least 3
    assert plan_samples(1.0, 4.5, 8 * MiB) == 4
    assert plan_samples(0.001, 10.0, 4 * KiB, quick=True) == 7

    # balanced_orders: each way first equally often, and right after each other way equally
    # often within the rounds, for an even and an odd count (bench_loop's cells have 9 ways)
    for count in (2, 3, 4, 7, 9):
        names = [chr(ord("a") + i) for i in range(count)]
        orders = balanced_orders(names)
        assert all(sorted(o) == names for o in orders), orders
        assert len(orders) == count * (1 + count % 2)
        firsts = [o[0] for o in orders]
        assert all(firsts.count(w) == firsts.count("a") for w in names), firsts
        follows = [(o[i], o[i + 1]) for o in orders for i in range(count - 1)]
        each = len(follows) // (count * (count - 1))
        assert all(follows.count((x, y)) == each for x in names for y in names if x != y)

    # run_rounds on fake ways: balanced orders, warm-ups and gaps where asked, one sample each
    calls: list[str] = []
    fake_now = [0.0]

    def way(name: str, cost: float) -> Callable[[], str]:
        def fn() -> str:
            calls.append(name)
            fake_now[0] += cost
            return name

        return fn

    gaps = []
    order: list[str] = []
    times, cpu = run_rounds(
        {"a": way("a", 1.0), "b": way("b", 2.0), "c": way("c", 3.0)},
        4,
        sync=lambda: None,
        gap=lambda: gaps.append(1),
        warm_each=False,
        clock=lambda: fake_now[0],
        order_log=order,
    )
    assert order == list("abcbcacabcba"), order  # balanced_orders(3 ways)'s first four
    assert len(gaps) == 12 and calls == order
    assert times == {"a": [1.0] * 4, "b": [2.0] * 4, "c": [3.0] * 4}, times
    assert all(len(v) == 4 for v in cpu.values())
    calls.clear()
    times, _ = run_rounds(
        {"a": way("a", 1.0), "b": way("b", 2.0)},
        2,
        sync=lambda: None,
        warm_each=True,
        clock=lambda: fake_now[0],
    )
    assert calls == list("aabbbbaa"), calls  # warm-up call right before each timed one
    assert times == {"a": [1.0, 1.0], "b": [2.0, 2.0]}

    ps = pass_samples([(0.5, [2.0, 1.0, 1.0, 1.0]), (0.0, [1.0, 3.0, 3.0])])
    assert ps["steady"] == [1.0, 3.0] and ps["pass"] == [5.5 / 4, 7.0 / 3], ps

    with tempfile.TemporaryDirectory() as root:  # a sysfs cache tree, as CPU 0's
        for index, size in (("index0", "48K"), ("index2", "2048K"), ("index3", "32768K")):
            os.makedirs(os.path.join(root, index))
            with open(os.path.join(root, index, "size"), "w") as f:
                f.write(size + "\n")
        assert last_level_cache_bytes(root) == 32 * MiB
        assert last_level_cache_bytes(os.path.join(root, "absent")) is None

    assert pinned_target(MiB) == 0.5 and pinned_target(8 * MiB) == 0.8
    assert pinned_target(4 * MiB) is None and pinned_target(GiB) == 0.9

    # a synthetic matrix: every size and pattern, pinxfer slower than torch at 1 MiB
    rng = random.Random(0)
    cells = []
    for s in SIZES:
        for p in PATTERNS:
            pinned_us = 10 + s / 50e3  # ~50 GB/s
            base = {
                "torch_pinned_to": pinned_us,
                "torch_to": pinned_us * 7,
                "torch_to_nb": pinned_us * (4 if s == 4 * KiB else 6.5),
                "torch_pin_to": pinned_us * 5,
                "torch_pin": pinned_us * 4,
                "to_device": pinned_us * (2.2 if s == MiB else 1.05),
                "to_device_batch": pinned_us * 1.1,
                "pin_memory": pinned_us * 2,
                "torch_batch_to": pinned_us * 8,
                "torch_batch_pin_to": pinned_us * 6,
                "torch_batch_pinned_to": pinned_us * 1.2,
            }
            calls_st = {}
            for w, us in base.items():
                samples = [us * 1e-6 * (1 + 0.1 * rng.random()) for _ in range(5)]
                calls_st[w] = summarize(samples, s, [1e-6] * 5)
            pre = {}
            for w, us in (
                ("prefetch_steady", pinned_us * 1.1),
                ("prefetch_pass", pinned_us * 2),
                ("loop_steady", pinned_us * 6),
                ("loop_pass", pinned_us * 6),
            ):
                pre[w] = summarize([us * 1e-6 * (1 + 0.1 * rng.random()) for _ in range(3)], s)
            cells.append({"bytes": s, "pattern": p, "calls": calls_st, "prefetch": pre})
    rows = build_rows(cells)
    assert len(rows) == len(SIZES) * len(PATTERNS) * 15, len(rows)
    by = {(r["bytes"], r["pattern"], r["way"]): r for r in rows}
    rb = by[(MiB, "b2b", "to_device_batch")]  # judged against torch's ways over the batch
    assert rb["torch_ref"] == "torch_batch_pin_to", rb
    assert 5 < rb["ratio_torch"]["median"] < 6.2 and 4 < rb["ratio_torch_one_tensor"]["median"] < 5
    # ... and against the batch pinned (1.2 / 1.1), not one pinned tensor (1 / 1.1)
    assert 1.0 < rb["ratio_pinned"]["median"] < 1.2, rb["ratio_pinned"]
    assert rb["ratio_pinned_one_tensor"]["median"] < 0.98, rb["ratio_pinned_one_tensor"]
    # torch's best is one way: the lowest median (torch_to_nb at 4 KiB), with its own minimum
    r4 = by[(4 * KiB, "b2b", "to_device")]
    nb = by[(4 * KiB, "b2b", "torch_to_nb")]
    assert r4["torch_ref"] == "torch_to_nb", r4
    assert r4["ratio_torch"]["min"] == nb["min_us"] / r4["min_us"], (r4, nb)
    r1 = by[(MiB, "sleep", "to_device")]
    assert r1["torch_ref"] == "torch_pin_to"
    # 1 MiB: 2.2x the pinned time -> x pinned ~0.45 < 0.5 (MISS), x torch ~5/2.2 > 1
    assert r1["verdict"] == "MISS" and r1["missed"] == ["x pinned >= 0.5"], r1
    assert 0.35 < r1["ratio_pinned"]["median"] < 0.55 and r1["ratio_torch"]["median"] > 1.5
    r8 = by[(8 * MiB, "gpu", "to_device")]
    assert r8["verdict"] == "PASS" and r8["targets"] == ["x torch >= 1", "x pinned >= 0.8"]
    assert by[(4 * KiB, "b2b", "torch_to")]["verdict"] is None
    assert by[(4 * KiB, "b2b", "pin_memory")]["ratio_pinned"] is None
    assert by[(GiB, "b2b", "prefetch_steady")]["targets"] == ["x torch >= 1", "x pinned >= 0.85"]
    pf = by[(GiB, "b2b", "prefetch_steady")]
    assert abs(pf["ratio_torch"]["median"] - pf["ratio_torch"]["median"]) == 0
    assert 4.5 < pf["ratio_torch"]["median"] < 6.6, pf["ratio_torch"]

    small = [
        {
            "name": "to_device_4k",
            "value": 10.0,
            "limit": 8.0 + 3,
            "ours_text": "10.0 us",
            "ref_text": "8.0 us",
            "target": "<= pinned .to(nb) + 3 us",
        },
        {
            "name": "small_64",
            "value": 400.0,
            "limit": 350.0,
            "ours_text": "400 us",
            "ref_text": "2137 us",
            "target": "<= 350 us",
        },
        {
            "name": "small_64 x torch",
            "value": 0.9,
            "limit": 1.0,
            "cmp": ">=",
            "ours_text": "0.90x",
            "ref_text": "torch_to",
            "target": "x torch >= 1",
        },
        {
            "name": "idle_cpu",
            "value": None,
            "limit": 0.005,
            "ours_text": "-",
            "ref_text": "-",
            "target": "<= 5 ms CPU in 1 s",
        },
    ]
    judge_small(small)
    assert [r["verdict"] for r in small] == ["PASS", "MISS", "MISS", None]
    table = compact_table(rows, small)
    lines = table.splitlines()
    assert len(lines) == 2 + len(SIZES) * len(PATTERNS) + 2 + len(small) + 1, len(lines)
    line_1m = next(ln for ln in lines if ln.strip().startswith("1MiB sleep"))
    assert "MISS td xp<0.5" in line_1m and "td,batch xp>=0.5" in line_1m, line_1m
    line_8m = next(ln for ln in lines if ln.strip().startswith("8MiB gpu"))
    assert line_8m.rstrip().endswith("PASS"), line_8m
    assert lines[-1].startswith("targets: ") and "MISS" in lines[-1]
    detail = detail_table(rows)
    assert len(detail.splitlines()) == 1 + len(rows)
    json.dumps({"rows": rows, "small": small})  # serialisable
    print(detail.splitlines()[0])
    print("\n".join(detail.splitlines()[1:12]))
    print(table)

    # --process-per-size: a child per size, largest first, the budget shared, and cells
    # merged only under the size each child was given.
    ns = argparse.Namespace(budget=100.0, producer="thread", kind="h200", quick=False)
    commands = per_size_commands("bench_loop.py", [4 * KiB, GiB], ns, "/tmp/d")
    assert [n for n, _, _ in commands] == [GiB, 4 * KiB], commands
    for nbytes, argv, path in commands:
        assert argv[argv.index("--sizes") + 1] == size_label(nbytes), argv
        assert argv[argv.index("--budget") + 1] == "50.000" and "--no-small" in argv, argv
        assert argv[argv.index("--json") + 1] == path and path.startswith("/tmp/d/"), argv
        assert argv[argv.index("--producer") + 1] == "thread" and "--quick" not in argv, argv
    assert len({path for _, _, path in commands}) == 2
    merged, gaps = merge_size_runs(
        [
            (GiB, {"cells": [{"bytes": GiB}] * 3, "gaps": {"g": 1}}),
            (MiB, {"cells": [{"bytes": MiB}]}),
        ]
    )
    assert [c["bytes"] for c in merged] == [GiB] * 3 + [MiB] and gaps == {
        "1GiB": {"g": 1},
        "1MiB": None,
    }
    refusal = ""
    try:
        merge_size_runs([(MiB, {"cells": [{"bytes": MiB}, {"bytes": GiB}]})])
    except ValueError as err:
        refusal = str(err)
    assert "1MiB" in refusal and "1GiB" in refusal, "took a child's cells of another size"
    print("bench_loop self-test OK")
    return 0


# ---------------------------------------------------------------- the GPU benchmark


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        from bench_bus import cpu_seconds  # this script's directory is on sys.path

        import pinxfer

        self.px = pinxfer
        self.cpu_seconds = cpu_seconds
        self.args = args
        self.dev = torch.device("cuda", torch.cuda.current_device())
        self.stream_sync = lambda: torch.cuda.current_stream(self.dev).synchronize()
        self.sync = lambda: torch.cuda.synchronize(self.dev)
        self.gpu_cycles = self.calibrate_gpu_sleep()
        self.gaps = {"b2b": None, "sleep": lambda: time.sleep(GAP_S), "gpu": self.gpu_gap}
        self.deadline = time.perf_counter() + args.budget

    # -- gaps
    def calibrate_gpu_sleep(self) -> int:
        """Cycles of torch.cuda._sleep that take GAP_S here, from measurement."""
        return gpu_sleep_cycles(GAP_S, self.stream_sync)

    def gpu_gap(self) -> None:
        torch.cuda._sleep(self.gpu_cycles)
        self.stream_sync()

    def measured_gaps(self) -> dict:
        out = {"sleep_target_ms": GAP_S * 1e3, "gpu_sleep_cycles": self.gpu_cycles}
        for name in ("sleep", "gpu"):
            ts = []
            for _ in range(5):
                t0 = time.perf_counter()
                self.gaps[name]()
                ts.append(time.perf_counter() - t0)
            out[f"{name}_gap_ms_median"] = statistics.median(ts) * 1e3
        return out

    # -- budget
    def cell_budget(self, cells_left: int) -> float:
        return max(0.0, self.deadline - time.perf_counter()) / max(1, cells_left)

    # -- data
    @staticmethod
    def filled(numel: int, seed: int, dtype: Any = None) -> Any:
        """A pageable tensor, every page touched: random values (a random 4 MiB block
        repeated beyond that: randn of a whole GiB takes seconds)."""
        g = torch.Generator().manual_seed(seed)
        block = 1 << 20
        if dtype is None:
            base = torch.randn(min(numel, block), generator=g)
        else:
            base = torch.randint(0, 1 << 30, (min(numel, block),), generator=g, dtype=dtype)
        if numel <= block:
            return base
        t = torch.empty(numel, dtype=base.dtype)
        whole = numel // block * block
        t[:whole].view(-1, block).copy_(base)
        t[whole:] = base[: numel - whole]
        return t

    def make_batch(self, nbytes: int, seed: int) -> dict:
        lay = batch_layout(nbytes)
        return {
            "x": self.filled(lay["x"] // 4, seed),
            "y": self.filled(lay["y"] // 8, seed + 1000, torch.int64),
            "meta": [torch.tensor(seed), torch.tensor(nbytes)],
        }

    def to_cuda_plain(self, b: dict) -> dict:
        return torch_batch_to(b, self.dev, pin=False)

    # -- one (size, pattern): the per-call ways
    def calls_cell(self, ways: dict, nbytes: int, pattern: str, cells_left: int) -> dict:
        gap, warm_each = self.gaps[pattern], pattern == "b2b"
        for _ in range(2):  # warm-up rounds (pools, torch's host cache); the second is timed
            t0 = time.perf_counter()
            for fn in ways.values():
                out = fn()
                self.sync()
                del out
            warm = time.perf_counter() - t0
        round_s = warm * (2 if warm_each else 1) + (len(ways) * GAP_S if gap else 0)
        n = plan_samples(round_s, self.cell_budget(cells_left), nbytes, self.args.quick)
        times, cpu = run_rounds(ways, n, self.sync, gap, warm_each, cpu_clock=self.cpu_seconds)
        return {w: summarize(times[w], nbytes, cpu[w]) for w in ways}

    # -- one (size, pattern): prefetch passes against the plain loop
    def prefetch_cell(self, batches: list, nbytes: int, pattern: str, cells_left: int) -> dict:
        gap = self.gaps[pattern]
        sync = self.stream_sync

        def consume(it: Any) -> tuple[float, list[float]]:
            waits = []
            for i in range(len(batches)):
                if i and gap is not None:
                    gap()  # the consumer's step between batches
                t = time.perf_counter()
                b = next(it)
                sync()  # the batch is usable on the consumer's stream
                waits.append(time.perf_counter() - t)
                del b
            return waits

        def prefetch_pass() -> tuple[float, list[float]]:
            t0 = time.perf_counter()
            it = iter(self.px.prefetch(batches, device=self.dev, producer=self.args.producer))
            start = time.perf_counter() - t0
            waits = consume(it)
            for _ in it:  # ends the pass (joins its thread)
                pass
            return start, waits

        def loop_pass() -> tuple[float, list[float]]:
            t0 = time.perf_counter()
            it = (self.to_cuda_plain(b) for b in batches)
            start = time.perf_counter() - t0
            return start, consume(it)

        ways = {"prefetch": prefetch_pass, "loop": loop_pass}
        t0 = time.perf_counter()
        for fn in ways.values():  # warm-up pass of each
            fn()
        round_s = time.perf_counter() - t0
        n = plan_samples(round_s, self.cell_budget(cells_left), nbytes, self.args.quick)
        passes: dict[str, list] = {w: [] for w in ways}
        names = list(ways)
        for r in range(n):
            for name in names[r % 2 :] + names[: r % 2]:
                passes[name].append(ways[name]())
                self.sync()
        out = {}
        for name in names:
            ps = pass_samples(passes[name])
            out[f"{name}_steady"] = summarize(ps["steady"], nbytes)
            out[f"{name}_pass"] = summarize(ps["pass"], nbytes)
        out["batches_per_pass"] = len(batches)
        return out

    def matrix(self, sizes: list[int]) -> list[dict]:
        px, dev = self.px, self.dev
        cells = []
        cells_left = 2 * len(sizes) * len(PATTERNS)
        for nbytes in sorted(sizes, reverse=True):  # largest first: they get their minimum
            t = self.filled(nbytes // 4, 12345)
            pinned = t.pin_memory()
            batch = self.make_batch(nbytes, 0)
            pinned_batch = torch.utils._pytree.tree_map(torch.Tensor.pin_memory, batch)
            got = px.to_device(t, dev)
            assert torch.equal(got.cpu(), t), "to_device changed the bytes"
            gb = px.to_device(batch, dev)
            assert torch.equal(gb["x"].cpu(), batch["x"]) and torch.equal(gb["y"].cpu(), batch["y"])
            assert [int(m) for m in gb["meta"]] == [0, nbytes]
            del got, gb
            ways = call_ways(px, t, pinned, batch, dev, pinned_batch)
            k = 16 if nbytes <= 64 * MiB else 8 if nbytes <= 256 * MiB else 4
            batches = [batch] + [self.make_batch(nbytes, i) for i in range(1, k)]
            for pattern in PATTERNS:
                t0 = time.perf_counter()
                calls = self.calls_cell(ways, nbytes, pattern, cells_left)
                cells_left -= 1
                kk = k if pattern == "b2b" else max(4, k // 2)
                pre = self.prefetch_cell(batches[:kk], nbytes, pattern, cells_left)
                cells_left -= 1
                cells.append(
                    {
                        "bytes": nbytes,
                        "pattern": pattern,
                        "calls": calls,
                        "prefetch": {k2: v for k2, v in pre.items() if k2 != "batches_per_pass"},
                        "batches_per_pass": pre["batches_per_pass"],
                        "seconds": time.perf_counter() - t0,
                    }
                )
                print(
                    f"  {size_label(nbytes):>7} {pattern:5} n={calls['to_device']['n']:2d} "
                    f"to_device {calls['to_device']['median_us']:9.1f} us  pinned "
                    f"{calls['torch_pinned_to']['median_us']:9.1f}  torch_to "
                    f"{calls['torch_to']['median_us']:9.1f}  prefetch steady "
                    f"{pre['prefetch_steady']['median_us']:9.1f}  loop "
                    f"{pre['loop_steady']['median_us']:9.1f}  "
                    f"({time.perf_counter() - t0:.1f} s)",
                    flush=True,
                )
            del batches, ways
            # Freed by rebinding, not del: the closures above read them (ruff's F821).
            t = pinned = batch = pinned_batch = None
        return cells

    # -- issue 22's small-call rows, CPU per GB, idle CPU, then install() last
    def per_call(self, fns: dict, calls: int, reps: int, sync: bool) -> dict:
        """µs per call: `reps` samples of `calls` calls (each synced if `sync`), interleaved."""

        def sample(fn: Callable[[], Any]) -> float:
            t0 = time.perf_counter()
            for _ in range(calls):
                out = fn()
                if sync:
                    self.sync()
                del out
            return (time.perf_counter() - t0) / calls

        for fn in fns.values():
            sample(fn)
        times: dict[str, list[float]] = {k: [] for k in fns}
        for order in balanced_rounds(list(fns), reps):
            for name in order:
                times[name].append(sample(fns[name]))
        return {k: summarize(v, 1) for k, v in times.items()}

    def installed_vs_own(self, calls: int, reps: int) -> tuple[dict, dict]:
        """µs per torch.empty(16 KiB, pin_memory=True) with torch's own host allocator and
        with pinxfer.install()ed, alternated within the rounds (balanced_rounds) as every other
        pair in this table: the row compares two figures of about 1.5 µs, and measured one
        after the other a host that drifts between them is read as the allocator's cost (the
        session-33 table had 1.30x on a path that measured 0.98x in session 31)."""
        px = self.px
        torch_fn = lambda: torch.empty(16384, pin_memory=True)  # noqa: E731

        def sample(installed: bool) -> float:
            if installed:
                px.install()
            try:
                t0 = time.perf_counter()
                for _ in range(calls):
                    out = torch_fn()
                    del out
                return (time.perf_counter() - t0) / calls
            finally:
                if installed:
                    px.uninstall()

        sample(False)  # each allocator's cache warm before the rounds
        sample(True)
        times: dict[str, list[float]] = {"torch": [], "torch_installed": []}
        for order in balanced_rounds(list(times), reps):
            for name in order:
                times[name].append(sample(name == "torch_installed"))
        return summarize(times["torch"], 1), summarize(times["torch_installed"], 1)

    def small_rows(self) -> tuple[list[dict], dict]:
        px, dev = self.px, self.dev
        q = self.args.quick
        calls, reps = (200, 5) if q else (1000, 9)
        rows: list[dict] = []
        raw: dict[str, Any] = {}

        def add(name, ours_us, ref_us, limit, target, ours_text=None, ref_text=None, cmp="<="):
            rows.append(
                {
                    "name": name,
                    "value": ours_us,
                    "ref": ref_us,
                    "limit": limit,
                    "cmp": cmp,
                    "target": target,
                    "ours_text": ours_text or f"{ours_us:.2f} us",
                    "ref_text": ref_text or ("-" if ref_us is None else f"{ref_us:.2f} us"),
                }
            )

        x4 = torch.randint(0, 255, (4 * KiB,), dtype=torch.uint8)
        x4p = x4.pin_memory()
        m = self.per_call(
            {
                "pinxfer": lambda: px.to_device(x4, dev),
                "torch_pinned": lambda: x4p.to(dev, non_blocking=True),
                "torch_to": lambda: x4.to(dev),
            },
            calls // 2,
            reps,
            sync=True,
        )
        raw["to_device_4k"] = m
        add(
            "to_device_4k (synced)",
            m["pinxfer"]["median_us"],
            m["torch_pinned"]["median_us"],
            m["torch_pinned"]["median_us"] + 3,
            "<= pinned .to(nb) + 3 us",
        )

        x64 = torch.randn(16 * KiB)
        m = self.per_call(
            {"pinxfer": lambda: px.pin_memory(x64), "torch": lambda: x64.pin_memory()},
            calls,
            reps,
            sync=False,
        )
        raw["pin_memory_64k"] = m
        add(
            "pin_memory_64k hit",
            m["pinxfer"]["median_us"],
            m["torch"]["median_us"],
            m["torch"]["median_us"],
            "<= x.pin_memory()",
        )

        m = self.per_call(
            {
                "pinxfer": lambda: px.empty(16384),
                "torch": lambda: torch.empty(16384, pin_memory=True),
            },
            calls,
            reps,
            sync=False,
        )
        raw["empty_16k"] = m
        add(
            "empty(16384)",
            m["pinxfer"]["median_us"],
            m["torch"]["median_us"],
            m["torch"]["median_us"],
            "<= torch.empty(pin_memory=True)",
        )

        from bench_small_calls import the_batch  # 64 uint8 tensors, 4-256 KiB
        from torch.utils.data._utils.pin_memory import pin_memory as dataloader_pin

        b64 = the_batch()
        m = self.per_call(
            {
                "pinxfer": lambda: px.to_device(b64, dev),
                "torch_to": lambda: {k: v.to(dev) for k, v in b64.items()},
                "torch_to_nb": lambda: {k: v.to(dev, non_blocking=True) for k, v in b64.items()},
                "torch_pin_to": lambda: {
                    k: v.to(dev, non_blocking=True) for k, v in dataloader_pin(b64).items()
                },
            },
            max(10, calls // 20),
            reps,
            sync=True,
        )
        raw["small_64"] = m
        best = min(("torch_to", "torch_to_nb", "torch_pin_to"), key=lambda k: m[k]["median_us"])
        add(
            "64 small -> GPU",
            m["pinxfer"]["median_us"],
            m[best]["median_us"],
            350.0,
            "<= 350 us",
            ref_text=f"{m[best]['median_us']:.0f} us",
        )
        speed = m[best]["median_us"] / m["pinxfer"]["median_us"]
        add(
            "64 small x torch best",
            speed,
            None,
            1.0,
            "x torch >= 1 (speed)",
            ours_text=f"{speed:.2f}x",
            ref_text=best,
            cmp=">=",
        )

        # CPU seconds per GB, 1 GiB, back to back, interleaved
        t = self.filled(GiB // 4, 54321)
        times, cpu = run_rounds(
            {"pinxfer": lambda: px.to_device(t, dev), "torch_to": lambda: t.to(dev)},
            3 if q else 5,
            self.sync,
            warm_each=True,
            cpu_clock=self.cpu_seconds,
        )
        cpg = {k: summarize(times[k], GiB, cpu[k]) for k in times}
        raw["cpu_per_gb_1g"] = cpg
        ours, ref = cpg["pinxfer"]["cpu_s_per_gb"], cpg["torch_to"]["cpu_s_per_gb"]
        add(
            "CPU s/GB 1 GiB",
            ours,
            ref,
            1.5 * ref,
            "<= 1.5x t.to()",
            ours_text=f"{ours:.3f} s/GB",
            ref_text=f"{ref:.3f} s/GB",
        )
        # Freed by rebinding, not del: the closures above read it (ruff's F821).
        t = None

        # idle CPU of the process after the transfers
        self.sync()
        time.sleep(0.05)
        c0, t0 = self.cpu_seconds(), time.perf_counter()
        time.sleep(1.0)
        idle = self.cpu_seconds() - c0
        raw["idle_cpu"] = {"cpu_s": idle, "wall_s": time.perf_counter() - t0}
        add(
            "idle CPU over 1 s",
            idle,
            None,
            IDLE_CPU_LIMIT_S,
            f"<= {IDLE_CPU_LIMIT_S * 1e3:.0f} ms (copy threads: none)",
            ours_text=f"{idle * 1e3:.2f} ms",
        )

        # last: with install(), torch's own pinned allocation
        before, after = self.installed_vs_own(calls, reps)
        raw["installed_empty_16k"] = {"torch": before, "torch_installed": after}
        add(
            "install: torch.empty 16k",
            after["median_us"],
            before["median_us"],
            1.05 * before["median_us"],
            "<= 1.05x torch's own",
        )
        judge_small(rows)
        return rows, raw


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", help="comma list, e.g. 4K,1M,1G (default: all ten)")
    ap.add_argument(
        "--quick",
        action="store_true",
        help=f"sizes {','.join(size_label(s) for s in QUICK_SIZES)}, budget 45 s, fewer samples",
    )
    ap.add_argument(
        "--budget",
        type=float,
        default=None,
        help="seconds for the size x pattern matrix (default 240; --quick 45)",
    )
    ap.add_argument("--json", help="JSON path (default benchmarks/results/<kind>/loop.json)")
    ap.add_argument(
        "--kind", default=None, help="machine kind (default PINXFER_MACHINE_KIND or the GPU's name)"
    )
    ap.add_argument("--no-small", action="store_true", help="skip the small-call/CPU rows")
    ap.add_argument(
        "--process-per-size",
        action="store_true",
        help="measure each size in a fresh process of its own (a child bench_loop per size, "
        "an equal share of the budget), so that no row follows another size's history",
    )
    ap.add_argument(
        "--producer",
        default="auto",
        choices=("auto", "caller", "thread"),
        help="pinxfer.prefetch's producer for the prefetch rows (default auto)",
    )
    ap.add_argument(
        "--self-test",
        action="store_true",
        help="check the statistics and table code on the CPU (no CUDA, no pinxfer)",
    )
    args = ap.parse_args(argv)
    if args.self_test:
        return self_test()
    global torch
    import torch

    sizes = parse_sizes(args.sizes) if args.sizes else (QUICK_SIZES if args.quick else SIZES)
    if args.budget is None:
        args.budget = 45.0 if args.quick else 240.0

    sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_bus, bench_small_calls
    sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # pinxfer from a checkout
    from bench_bus import results_dir

    import pinxfer

    reason = pinxfer.cuda_unavailable_reason()  # makes no CUDA context
    if reason is not None:
        print(
            f"bench_loop: needs a CUDA device ({reason}); --self-test runs without one",
            file=sys.stderr,
        )
        return 2
    started = time.perf_counter()
    per_size = args.process_per_size and len(sizes) > 1
    if per_size:
        # Before this process makes a CUDA context or any pool: the children measure alone.
        with tempfile.TemporaryDirectory(prefix="bench_loop_sizes_") as json_dir:
            size_cells, size_gaps = cells_in_fresh_processes(
                str(Path(__file__).resolve()), sizes, args, json_dir
            )
    kind = kind_slug(
        args.kind or os.environ.get("PINXFER_MACHINE_KIND"), torch.cuda.get_device_name()
    )
    bench = Bench(args)
    names, values, sources, _docs = zip(*pinxfer._C.settings())
    report: dict[str, Any] = {
        "benchmark": "bench_loop",
        "issue": 22,
        "kind": kind,
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "host_cpus": os.cpu_count(),
        "affinity_cpus": len(os.sched_getaffinity(0)),
        # Every way reads the same source tensor round after round: up to about this size it
        # stays in the host's caches, which flatters the staging ways against the pinned copy
        # (a pure DMA) more than a loop whose batches are fresh (methodology review, s45).
        "last_level_cache_bytes": last_level_cache_bytes(),
        "pinxfer_settings": {
            n: {"value": v, "source": s} for n, v, s in zip(names, values, sources)
        },
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "sizes": sizes,
        "patterns": PATTERNS,
        "budget_s": args.budget,
        "quick": args.quick,
        "prefetch_producer": args.producer,
        "gaps": bench.measured_gaps(),
        "process_per_size": per_size,
        "ratios": "speed ratios: reference time / pinxfer time (> 1: pinxfer faster)",
    }
    print(
        f"bench_loop on {kind} ({report['gpu']}), torch {torch.__version__}; gaps {report['gaps']}",
        flush=True,
    )
    if per_size:
        cells = size_cells
        report["gaps_per_size"] = size_gaps
    else:
        cells = bench.matrix(sizes)
    rows = build_rows(cells)
    report["cells"] = cells
    report["rows"] = rows
    small: list[dict] = []
    if not args.no_small:
        small, raw = bench.small_rows()
        report["small_rows"] = small
        report["small_raw"] = raw
    verdicts = [r["verdict"] for r in rows + small if r.get("verdict")]
    report["targets"] = {"pass": verdicts.count("PASS"), "miss": verdicts.count("MISS")}
    report["elapsed_s"] = time.perf_counter() - started

    out = Path(args.json) if args.json else results_dir(kind) / "loop.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(detail_table(rows))
    print(f"wrote {out} ({report['elapsed_s']:.0f} s)")
    print(compact_table(rows, small))
    return 0


if __name__ == "__main__":
    sys.exit(main())
