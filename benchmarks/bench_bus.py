"""How close pinxfer gets to the bus on this machine: one command, ratios, JSON.

Every figure is a ratio to the *pinned ceiling measured in the same run*: a
pinned host tensor of the same size copied with ``.to(device, non_blocking=True)``
(under torchrun, all ranks copy at once, so the ceiling is the shared bus).
Each measurement is repeated ``--runs`` times (default 5); the JSON keeps the
median and the minimum seconds, and the GB/s and ratios of both. The ways
compared in one row run interleaved, round by round, so that the host's drift
(shared machines) falls on all of them alike.

Rows:
  to_device_<size>      pageable tensor -> GPU; ``t.to()`` of the same tensor beside it
  shared_link           two threads each sending their own 256 MiB to the same GPU at once
  prefetch_<size>       ``pinxfer.prefetch`` over an in-memory list of pageable batches, and
                        ``to_device`` of the same batches one after another; the pass
                        as a whole, and after its first batch is on the GPU ("steady")
  compute_bound         a step that computes longer than a batch takes to copy, fed by
                        prefetch, against the same steps on data already on the GPU:
                        per step once the first batch is there, and the whole loop
  cpu_seconds_per_gb    getrusage (all threads) per GB moved, pinxfer and ``t.to()``
  idle_cpu              CPU seconds the process used during 1 s of idle after transfers
  timeline              per batch, prefetch and one-after-another: host time in to_device and
                        between calls, copy-stream time per batch and idle between batches
  multi_gpu             (2+ GPUs, one process) one thread per GPU, to_device at once

Usage:
  python3 benchmarks/bench_bus.py --kind nvidia-h100-x1            # results/h100/bus.json
  torchrun --nproc-per-node 2 benchmarks/bench_bus.py --kind nvidia-h200-x2
  python3 benchmarks/bench_bus.py --quick --out /tmp/bus.json      # fewer, smaller runs
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import resource
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _checkout  # noqa: F401  (pinxfer from this checkout if not installed)
import torch
from bench_loop import balanced_rounds

import pinxfer

MiB = 1 << 20
GiB = 1 << 30
SECTIONS = (
    "to_device",
    "shared_link",
    "prefetch",
    "compute_bound",
    "idle_cpu",
    "timeline",
    "multi_gpu",
)
RESULTS = Path(__file__).resolve().parent / "results"


def cpu_seconds() -> float:
    """CPU time of every thread of this process so far."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class Dist:
    """torchrun ranks (WORLD_SIZE > 1) start every timed run together."""

    def __init__(self) -> None:
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if self.world > 1:
            import torch.distributed as dist

            dist.init_process_group("gloo")
            self._dist = dist

    def barrier(self) -> None:
        if self.world > 1:
            self._dist.barrier()

    def close(self) -> None:
        if self.world > 1:
            self._dist.destroy_process_group()


def _stats(times: list[float], cpu: float, nbytes: int, runs: int) -> dict[str, float]:
    med, best = statistics.median(times), min(times)
    return {
        "median_s": med,
        "min_s": best,
        "gbps_median": nbytes / med / 1e9,
        "gbps_best": nbytes / best / 1e9,
        "cpu_s_per_gb": cpu / (runs * nbytes / 1e9),
    }


def measure(
    fn: Callable[[], Any], nbytes: int, runs: int, dist: Dist, device: torch.device, warmup: int = 1
) -> dict[str, float]:
    """Median and minimum seconds of `runs` calls of fn (each synced), GB/s of
    both, and CPU seconds per GB over all runs."""
    return measure_set({"only": fn}, nbytes, runs, dist, device, warmup)["only"]


def measure_set(
    fns: dict[str, Callable[[], Any]],
    nbytes: int,
    runs: int,
    dist: Dist,
    device: torch.device,
    warmup: int = 1,
) -> dict[str, dict[str, Any]]:
    """measure() for several ways of moving the same bytes, interleaved: each round
    runs every way once (after `warmup` untimed calls of it), so the host's drift (these
    are shared machines) falls on all of them alike and their ratios are taken between
    neighbours in time; the rounds' orders are bench_loop's balanced orders (every way
    runs right after every other equally often, and first equally often), the same on
    every rank.

    A way may return {"fill_s": s, "fill_bytes": b}: the part of its time spent
    before its first batch was usable (a pipeline's start). Its entry then also
    holds "steady": the same statistics over the time and bytes after the fill.
    """
    names = list(fns)
    times: dict[str, list[float]] = {n: [] for n in names}
    steady: dict[str, list[float]] = {n: [] for n in names}
    fill_bytes: dict[str, int] = {}
    cpu = dict.fromkeys(names, 0.0)
    for order in balanced_rounds(names, runs):
        for name in order:
            # Untimed calls of the same way first: each timed call finds the state its
            # own way leaves (caches, awake copy threads, pooled blocks), as in a loop
            # of that way alone, not the state the previous way left.
            for _ in range(warmup):
                fns[name]()
            torch.cuda.synchronize(device)
            dist.barrier()
            c0, t0 = cpu_seconds(), time.perf_counter()
            info = fns[name]()
            torch.cuda.synchronize(device)
            elapsed = time.perf_counter() - t0
            cpu[name] += cpu_seconds() - c0
            times[name].append(elapsed)
            if isinstance(info, dict) and "fill_s" in info:
                steady[name].append(elapsed - info["fill_s"])
                fill_bytes[name] = info["fill_bytes"]
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        out[name] = _stats(times[name], cpu[name], nbytes, runs)
        if steady[name]:
            fills = [t - s for t, s in zip(times[name], steady[name])]
            out[name]["fill_s_median"] = statistics.median(fills)
            out[name]["steady"] = _stats(steady[name], cpu[name], nbytes - fill_bytes[name], runs)
    return out


def ratio(a: dict, b: dict) -> dict[str, float]:
    """a's GB/s over b's: by medians, and by best runs."""
    return {"median": a["gbps_median"] / b["gbps_median"], "best": a["gbps_best"] / b["gbps_best"]}


def section_to_device(sizes: list[int], runs: int, dist: Dist, dev: torch.device) -> list[dict]:
    rows = []
    for nbytes in sizes:
        t = torch.randn(nbytes // 4)  # pageable, touched
        pinned = t.pin_memory()
        m = measure_set(
            {
                "ceiling": lambda: pinned.to(dev, non_blocking=True),
                "pinxfer": lambda: pinxfer.to_device(t, dev),
                "torch_to": lambda: t.to(dev),
            },
            nbytes,
            runs,
            dist,
            dev,
        )
        ceiling, ours, torch_to = m["ceiling"], m["pinxfer"], m["torch_to"]
        assert torch.equal(pinxfer.to_device(t, dev).cpu(), t), "to_device changed the bytes"
        rows.append(
            {
                "row": f"to_device_{nbytes // MiB}MiB",
                "bytes": nbytes,
                "ceiling_pinned": ceiling,
                "pinxfer": ours,
                "torch_to": torch_to,
                "pinxfer_vs_ceiling": ratio(ours, ceiling),
                "pinxfer_vs_torch_to": ratio(ours, torch_to),
                # issue 22's target: at most 1.5
                "cpu_s_per_gb_vs_torch_to": ours["cpu_s_per_gb"] / torch_to["cpu_s_per_gb"],
            }
        )
    return rows


def section_shared_link(nbytes: int, senders: int, runs: int, dev: torch.device) -> dict:
    """`senders` threads each send their own pageable tensor to the same GPU at once, so each
    transfer gets part of the link and its copy threads could outrun its DMAs (issue 22's CPU
    seconds per GB). Per way, interleaved round by round: the group's wall time (GB/s of all
    the bytes) and the CPU seconds per GB."""
    srcs = [torch.randn(nbytes // 4) for _ in range(senders)]
    pinned = [s.pin_memory() for s in srcs]

    def together(fn: Callable[[int], Any]) -> tuple[float, float]:
        barrier = threading.Barrier(senders + 1)
        errors: list[BaseException] = []

        def body(i: int) -> None:
            try:
                torch.cuda.set_device(dev)
                barrier.wait()
                fn(i)
                torch.cuda.synchronize(dev)
            except BaseException as err:  # noqa: BLE001 - re-raised below
                errors.append(err)

        threads = [threading.Thread(target=body, args=(i,)) for i in range(senders)]
        for th in threads:
            th.start()
        c0 = cpu_seconds()
        barrier.wait()
        t0 = time.perf_counter()
        for th in threads:
            th.join()
        wall, cpu = time.perf_counter() - t0, cpu_seconds() - c0
        if errors:
            raise errors[0]
        return wall, cpu

    ways: dict[str, Callable[[int], Any]] = {
        "ceiling": lambda i: pinned[i].to(dev, non_blocking=True),
        "pinxfer": lambda i: pinxfer.to_device(srcs[i], dev),
        "torch_to": lambda i: srcs[i].to(dev),
    }
    walls: dict[str, list[float]] = {n: [] for n in ways}
    cpus = dict.fromkeys(ways, 0.0)
    names = list(ways)
    for order in balanced_rounds(names, runs):  # bench_loop's balanced orders
        for name in order:
            together(ways[name])  # untimed: the state this way leaves
            wall, cpu = together(ways[name])
            walls[name].append(wall)
            cpus[name] += cpu
    moved = senders * nbytes
    stats = {n: _stats(walls[n], cpus[n], moved, runs) for n in names}
    for i in range(senders):
        assert torch.equal(pinxfer.to_device(srcs[i], dev).cpu(), srcs[i])
    return {
        "row": "shared_link",
        "senders": senders,
        "bytes_per_sender": nbytes,
        "ceiling_pinned": stats["ceiling"],
        "pinxfer": stats["pinxfer"],
        "torch_to": stats["torch_to"],
        "pinxfer_vs_ceiling": ratio(stats["pinxfer"], stats["ceiling"]),
        "pinxfer_vs_torch_to": ratio(stats["pinxfer"], stats["torch_to"]),
        "cpu_s_per_gb_vs_torch_to": stats["pinxfer"]["cpu_s_per_gb"]
        / stats["torch_to"]["cpu_s_per_gb"],
    }


def section_prefetch(
    sizes: list[int], total: int, runs: int, dist: Dist, dev: torch.device
) -> list[dict]:
    rows = []
    for nbytes in sizes:
        n = max(4, total // nbytes)
        batches = [torch.randn(nbytes // 4) for _ in range(n)]
        pinned = [b.pin_memory() for b in batches[:2]]
        moved = n * nbytes

        def ceiling_run() -> None:
            for i in range(n):
                pinned[i % 2].to(dev, non_blocking=True)

        def prefetch_run() -> dict[str, float]:
            t0 = time.perf_counter()
            it = iter(pinxfer.prefetch(batches, device=dev))
            next(it)
            torch.cuda.current_stream(dev).synchronize()  # the first batch is usable
            fill = time.perf_counter() - t0
            for _ in it:
                pass
            return {"fill_s": fill, "fill_bytes": nbytes}

        def sequential_run() -> None:
            for b in batches:
                pinxfer.to_device(b, dev)

        m = measure_set(
            {"ceiling": ceiling_run, "prefetch": prefetch_run, "sequential": sequential_run},
            moved,
            runs,
            dist,
            dev,
        )
        ceiling, pre, seq = m["ceiling"], m["prefetch"], m["sequential"]
        rows.append(
            {
                "row": f"prefetch_{nbytes // MiB}MiB",
                "bytes": moved,
                "batches": n,
                "ceiling_pinned": ceiling,
                "prefetch": pre,
                "to_device_sequential": seq,
                "prefetch_vs_ceiling": ratio(pre, ceiling),
                # after the pass's first batch is on the GPU (thread start and one
                # unhidden batch excluded): the rate an epoch of many batches runs at
                "prefetch_steady_vs_ceiling": ratio(pre["steady"], ceiling),
                "prefetch_vs_sequential": ratio(pre, seq),
            }
        )
    return rows


def section_compute_bound(
    nbytes: int, steps: int, runs: int, dist: Dist, dev: torch.device
) -> dict:
    """A step whose compute takes about 2x a batch's copy: prefetch must hide the copies."""
    batches = [torch.randn(nbytes // 4) for _ in range(4)]
    on_gpu = [b.to(dev) for b in batches]
    w = torch.randn(4096, 4096, device=dev)
    pinned = batches[0].pin_memory()
    copy = measure(lambda: pinned.to(dev, non_blocking=True), nbytes, 3, dist, dev)["median_s"]

    def matmuls(k: int) -> None:
        x = w
        for _ in range(k):
            x = torch.mm(x, w)

    # Calibrate the number of matmuls per step to ~2x the copy time.
    probe = measure(lambda: matmuls(10), nbytes, 3, dist, dev)["median_s"] / 10
    per_step = max(1, round(2 * copy / probe))

    def step(batch: torch.Tensor) -> None:
        batch.sum()
        matmuls(per_step)

    source = [batches[i % len(batches)] for i in range(steps)]

    def fed_run() -> dict[str, float]:
        t0 = time.perf_counter()
        it = iter(pinxfer.prefetch(source, device=dev))
        first = next(it)
        torch.cuda.current_stream(dev).synchronize()  # the first step can start
        fill = time.perf_counter() - t0
        step(first)
        for b in it:
            step(b)
        return {"fill_s": fill, "fill_bytes": 0}

    m = measure_set(
        {"pure": lambda: [step(on_gpu[i % len(on_gpu)]) for i in range(steps)], "fed": fed_run},
        steps * nbytes,
        runs,
        dist,
        dev,
    )
    pure, fed = m["pure"], m["fed"]
    return {
        "row": "compute_bound",
        "batch_bytes": nbytes,
        "steps": steps,
        "matmuls_per_step": per_step,
        "copy_s": copy,
        "pure_compute": pure,
        "prefetch_fed": fed,
        # steps once the first batch is on the GPU, against the same steps on data
        # already there: the per-step cost of feeding them
        "step_time_vs_pure_compute": {
            "median": fed["steady"]["median_s"] / pure["median_s"],
            "best": fed["steady"]["min_s"] / pure["min_s"],
        },
        # the whole loop, the first batch's copy (which nothing can hide) included
        "loop_time_vs_pure_compute": {
            "median": fed["median_s"] / pure["median_s"],
            "best": fed["min_s"] / pure["min_s"],
        },
    }


def section_idle_cpu(dev: torch.device) -> dict:
    t = torch.randn(64 * MiB // 4)
    for _ in range(3):
        pinxfer.to_device(t, dev)
    torch.cuda.synchronize(dev)
    c0, t0 = cpu_seconds(), time.perf_counter()
    time.sleep(1.0)
    return {"row": "idle_cpu", "wall_s": time.perf_counter() - t0, "cpu_s": cpu_seconds() - c0}


def section_timeline(nbytes: int, n: int, dev: torch.device) -> dict:
    """Where the time of a batch goes, prefetch against to_device one after another.

    No profiler (its per-range overhead on 12 copy threads doubles the time). Each
    batch's to_device is bracketed by host timestamps and by timing events on pinxfer's
    copy stream: the event before a batch completes when the stream has finished the
    earlier batches, so elapsed(end of batch k, start of batch k+1) is how long the copy
    engine sat idle between batches, and host time between two to_device calls is the
    caller's own overhead (Python, the prefetch queue and slots, the source).
    """
    batches = [torch.randn(nbytes // 4) for _ in range(n)]
    copy = pinxfer.transfer.copy_stream(dev)

    def instrumented(marks: list) -> Callable[[Any], Any]:
        def transfer(batch: torch.Tensor) -> torch.Tensor:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(copy)
            h0 = time.perf_counter()
            out = pinxfer.to_device(batch, dev)
            h1 = time.perf_counter()
            end.record(copy)
            marks.append((h0, h1, start, end))
            return out

        return transfer

    def summarize(marks: list, wall: float) -> dict[str, Any]:
        torch.cuda.synchronize(dev)
        med = statistics.median
        host_call = [(h1 - h0) * 1e6 for h0, h1, _, _ in marks]
        between_calls = [(b[0] - a[1]) * 1e6 for a, b in itertools.pairwise(marks)]
        engine_batch = [s.elapsed_time(e) * 1e3 for _, _, s, e in marks]
        engine_idle = [a[3].elapsed_time(b[2]) * 1e3 for a, b in itertools.pairwise(marks)]
        return {
            "gbps": n * nbytes / wall / 1e9,
            "host_to_device_call_us_median": med(host_call),
            "host_between_calls_us_median": med(between_calls),
            "host_between_calls_us_max": max(between_calls),
            "copy_stream_batch_us_median": med(engine_batch),
            "copy_stream_idle_between_batches_us_median": med(engine_idle),
            "copy_stream_idle_between_batches_us_total": sum(engine_idle),
        }

    for _ in pinxfer.prefetch(batches[:2], device=dev):  # warm the pools and the thread
        pass
    result: dict[str, Any] = {"row": "timeline", "batch_bytes": nbytes, "batches": n}
    marks: list = []
    torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    for _ in pinxfer.prefetch(batches, device=dev, transfer=instrumented(marks)):
        pass
    torch.cuda.synchronize(dev)
    result["prefetch"] = summarize(marks, time.perf_counter() - t0)
    marks = []
    send = instrumented(marks)
    t0 = time.perf_counter()
    for b in batches:
        send(b)
    torch.cuda.synchronize(dev)
    result["sequential"] = summarize(marks, time.perf_counter() - t0)
    return result


def section_multi_gpu(nbytes: int, runs: int) -> dict | None:
    """One process, one thread per GPU, each sending its own tensor at once."""
    count = torch.cuda.device_count()
    if count < 2:
        return None
    devs = [torch.device("cuda", i) for i in range(count)]
    srcs = [torch.randn(nbytes // 4) for _ in devs]
    pinned = [s.pin_memory() for s in srcs]

    def together(fn: Callable[[int], Any]) -> float:
        barrier = threading.Barrier(count)
        times = [0.0] * count
        errors: list[BaseException] = []

        def body(i: int) -> None:
            try:
                torch.cuda.set_device(devs[i])
                barrier.wait()
                t0 = time.perf_counter()
                fn(i)
                torch.cuda.synchronize(devs[i])
                times[i] = time.perf_counter() - t0
            except BaseException as err:  # noqa: BLE001 - re-raised below
                errors.append(err)

        threads = [threading.Thread(target=body, args=(i,)) for i in range(count)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        if errors:
            raise errors[0]
        return max(times)

    def rows(fn: Callable[[int], Any]) -> dict[str, float]:
        together(fn)
        ts = [together(fn) for _ in range(runs)]
        med, best = statistics.median(ts), min(ts)
        return {
            "median_s": med,
            "min_s": best,
            "gbps_per_gpu_median": nbytes / med / 1e9,
            "gbps_per_gpu_best": nbytes / best / 1e9,
        }

    ceiling = rows(lambda i: pinned[i].to(devs[i], non_blocking=True))
    ours = rows(lambda i: pinxfer.to_device(srcs[i], devs[i]))
    for i in range(count):
        assert torch.equal(pinxfer.to_device(srcs[i], devs[i]).cpu(), srcs[i])
    return {
        "row": "multi_gpu",
        "gpus": count,
        "bytes_per_gpu": nbytes,
        "ceiling_pinned": ceiling,
        "pinxfer": ours,
        "pinxfer_vs_ceiling": {
            "median": ours["gbps_per_gpu_median"] / ceiling["gbps_per_gpu_median"],
            "best": ours["gbps_per_gpu_best"] / ceiling["gbps_per_gpu_best"],
        },
    }


def print_summary(report: dict) -> None:
    who = f"{report['kind']} rank {report['rank']}/{report['world_size']}"
    print(f"== {who}: {report['gpu']}, {report['copy_threads']}")
    for r in report["rows"]:
        name = r["row"]
        if name.startswith("to_device_"):
            print(
                f"{name:18s} pinxfer {r['pinxfer']['gbps_median']:6.1f} GB/s  ceiling "
                f"{r['ceiling_pinned']['gbps_median']:6.1f}  ratio "
                f"{r['pinxfer_vs_ceiling']['median']:.2f} "
                f"(best {r['pinxfer_vs_ceiling']['best']:.2f})"
                f"  t.to {r['torch_to']['gbps_median']:5.1f}  cpu s/GB pinxfer "
                f"{r['pinxfer']['cpu_s_per_gb']:.3f} t.to {r['torch_to']['cpu_s_per_gb']:.3f}"
                f" ({r['cpu_s_per_gb_vs_torch_to']:.2f}x)"
            )
        elif name == "shared_link":
            print(
                f"{name:18s} {r['senders']} senders of {r['bytes_per_sender'] // MiB} MiB at once: "
                f"pinxfer {r['pinxfer']['gbps_median']:6.1f} GB/s  ceiling "
                f"{r['ceiling_pinned']['gbps_median']:6.1f}  t.to "
                f"{r['torch_to']['gbps_median']:5.1f}  cpu s/GB pinxfer "
                f"{r['pinxfer']['cpu_s_per_gb']:.3f} t.to "
                f"{r['torch_to']['cpu_s_per_gb']:.3f} ({r['cpu_s_per_gb_vs_torch_to']:.2f}x)"
            )
        elif name.startswith("prefetch_"):
            print(
                f"{name:18s} prefetch {r['prefetch']['gbps_median']:6.1f} GB/s  ceiling "
                f"{r['ceiling_pinned']['gbps_median']:6.1f}  ratio "
                f"{r['prefetch_vs_ceiling']['median']:.2f} "
                f"(best {r['prefetch_vs_ceiling']['best']:.2f})"
                f"  after the first batch {r['prefetch_steady_vs_ceiling']['median']:.2f}"
                f" (first batch {r['prefetch']['fill_s_median'] * 1e3:.2f} ms)"
                f"  vs sequential to_device {r['prefetch_vs_sequential']['median']:.2f}  cpu s/GB "
                f"{r['prefetch']['cpu_s_per_gb']:.3f}"
            )
        elif name == "compute_bound":
            print(
                f"{name:18s} step / pure compute {r['step_time_vs_pure_compute']['median']:.3f} "
                f"(best {r['step_time_vs_pure_compute']['best']:.3f}); whole loop with the "
                f"first batch's copy {r['loop_time_vs_pure_compute']['median']:.3f}"
            )
        elif name == "idle_cpu":
            print(f"{name:18s} {r['cpu_s'] * 1e3:.1f} ms CPU in {r['wall_s']:.2f} s idle")
        elif name == "timeline":
            for way in ("prefetch", "sequential"):
                w = r[way]
                print(
                    f"timeline {way:10s} {w['gbps']:5.1f} GB/s  to_device call "
                    f"{w['host_to_device_call_us_median']:.0f} us, between calls "
                    f"{w['host_between_calls_us_median']:.0f} us (max "
                    f"{w['host_between_calls_us_max']:.0f}); copy stream per batch "
                    f"{w['copy_stream_batch_us_median']:.0f} us, idle between batches "
                    f"{w['copy_stream_idle_between_batches_us_median']:.0f} us"
                )
        elif name == "multi_gpu":
            print(
                f"{name:18s} {r['gpus']} GPUs at once: {r['pinxfer']['gbps_per_gpu_median']:.1f} "
                f"GB/s each, ceiling {r['ceiling_pinned']['gbps_per_gpu_median']:.1f}, ratio "
                f"{r['pinxfer_vs_ceiling']['median']:.2f}"
            )


def results_dir(kind: str) -> Path:
    """benchmarks/results/<kind without 'nvidia-' and '-x1'>, as the other results."""
    short = kind.removeprefix("nvidia-").removesuffix("-x1")
    return RESULTS / short


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--kind",
        default=os.environ.get("PINXFER_MACHINE_KIND", "unknown"),
        help="machine kind, e.g. nvidia-h100-x1 (names the results folder)",
    )
    ap.add_argument("--out", help="JSON path (default: benchmarks/results/<kind>/bus[_rankN].json)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="small sizes, 3 runs (a smoke test)")
    ap.add_argument(
        "--sizes", help="to_device sizes instead of the default ones, e.g. 256M,1G (binary units)"
    )
    ap.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"which rows to run, comma-separated, from {','.join(SECTIONS)} (default: all)",
    )
    args = ap.parse_args(argv)
    sections = set(args.sections.split(","))
    if not sections <= set(SECTIONS):
        ap.error(f"--sections: expected names from {','.join(SECTIONS)}, got {args.sections}")
    reason = pinxfer.cuda_unavailable_reason()
    if reason is not None:
        print(f"bench_bus: needs a CUDA device ({reason})", file=sys.stderr)
        return 2
    dist = Dist()
    dev = torch.device("cuda", dist.local_rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    runs = 3 if args.quick else args.runs
    sizes = [8 * MiB, 16 * MiB] if args.quick else [8 * MiB, 64 * MiB, GiB]
    if args.sizes:
        sizes = [pinxfer._ops.parse_byte_size(text) for text in args.sizes.split(",")]
    batch_sizes = [16 * MiB] if args.quick else [16 * MiB, 64 * MiB]
    total = 128 * MiB if args.quick else GiB

    names, values, sources, _docs = zip(*pinxfer._C.settings())
    settings = {n: {"value": v, "source": s} for n, v, s in zip(names, values, sources)}
    report: dict[str, Any] = {
        "benchmark": "bench_bus",
        "kind": args.kind,
        "rank": dist.rank,
        "world_size": dist.world,
        "gpu": torch.cuda.get_device_name(dev),
        "gpus_visible": torch.cuda.device_count(),
        "host_cpus": os.cpu_count(),
        "affinity_cpus": len(os.sched_getaffinity(0)),
        "copy_threads": settings["PINXFER_NUM_THREADS"]["value"],
        "settings": settings,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "runs": runs,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "rows": [],
    }
    rows = report["rows"]
    if "to_device" in sections:
        rows += section_to_device(sizes, runs, dist, dev)
    if "shared_link" in sections:
        rows.append(section_shared_link(16 * MiB if args.quick else 256 * MiB, 2, runs, dev))
    if "prefetch" in sections:
        rows += section_prefetch(batch_sizes, total, runs, dist, dev)
    if "compute_bound" in sections:
        steps = 8 if args.quick else 24
        rows.append(section_compute_bound(batch_sizes[-1], steps, runs, dist, dev))
    if "idle_cpu" in sections:
        rows.append(section_idle_cpu(dev))
    if "timeline" in sections:
        rows.append(section_timeline(batch_sizes[-1], 8 if args.quick else 16, dev))
    if dist.world == 1 and "multi_gpu" in sections:
        multi = section_multi_gpu(256 * MiB if not args.quick else 16 * MiB, runs)
        if multi is not None:
            rows.append(multi)
    dist.close()

    out = Path(args.out) if args.out else results_dir(args.kind) / "bus.json"
    if dist.world > 1:
        out = out.with_name(f"{out.stem}_rank{dist.rank}{out.suffix}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print_summary(report)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
