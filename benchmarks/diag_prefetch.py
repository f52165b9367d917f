"""Why prefetch lags to_device one after another: variants side by side, one process.

Each variant moves the same in-memory pageable batches to the GPU; median of
--runs runs (GB/s) and CPU seconds per GB. Variants isolate one suspect each:

  seq_main        to_device one after another from the main thread
  seq_thread      the same loop in one Python thread (main thread joins it)
  seq_thread_raw  that thread calling the op directly (no Python wrapper)
  prefetch_dN     pinxfer.prefetch(depth=N)
  prefetch_switch prefetch(depth=2) with sys.setswitchinterval(50 us)
  minimal_d2      the least a Python producer thread can do: stream set once, the op called
                  directly, an event and a queue per batch (what prefetch's machinery costs)
  spin_100us      a child process with PINXFER_SPIN_US=100 (the fixed spin before the
                  adaptive one): seq_thread and prefetch_d2 again
  spin_1ms        the same with PINXFER_SPIN_US=1000 (copy threads stay awake across the
                  producer's gaps)
  first_batch_us  time from prefetch() to the first batch on the GPU
  gil_released    whether another Python thread runs while to_device runs

Usage: python3 benchmarks/diag_prefetch.py [--out diag.json]
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import sys
import threading
import time

import _checkout  # noqa: F401  (pinxfer from this checkout if not installed)
import torch
from _child import run_child
from bench_bus import cpu_seconds  # this script's directory is on sys.path

import pinxfer
from pinxfer import _ops

MiB = 1 << 20


def timed(fn, nbytes: int, runs: int, dev) -> dict:
    fn()
    torch.cuda.synchronize(dev)
    times, cpu = [], 0.0
    for _ in range(runs):
        c0, t0 = cpu_seconds(), time.perf_counter()
        fn()
        torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t0)
        cpu += cpu_seconds() - c0
    med = statistics.median(times)
    return {
        "gbps_median": nbytes / med / 1e9,
        "gbps_best": nbytes / min(times) / 1e9,
        "cpu_s_per_gb": cpu / (runs * nbytes / 1e9),
    }


def in_thread(fn):
    def run():
        th = threading.Thread(target=fn)
        th.start()
        th.join()

    return run


def minimal_prefetch(batches, dev, depth: int = 2):
    """A bare producer thread: the lower bound of a Python-thread prefetcher."""
    q: queue.SimpleQueue = queue.SimpleQueue()
    slots = threading.Semaphore(depth)

    def produce():
        torch.cuda.set_device(dev)
        stream = torch.cuda.Stream(dev)
        torch.cuda.set_stream(stream)
        for b in batches:
            slots.acquire()
            out = _ops.to_device(b, dev, 16 << 20, 4)
            ev = torch.cuda.Event()
            ev.record(stream)
            q.put((out, ev))
        q.put(None)

    th = threading.Thread(target=produce)
    th.start()
    cur = torch.cuda.current_stream(dev)
    while True:
        item = q.get()
        if item is None:
            break
        slots.release()
        cur.wait_event(item[1])
        item[0].record_stream(cur)
    th.join()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--child", action="store_true", help="only seq_thread and prefetch_d2, as JSON")
    args = ap.parse_args()
    dev = torch.device("cuda", 0)
    report: dict = {"rows": []}
    for nbytes, n in ((16 * MiB, 64), (64 * MiB, 16)):
        batches = [torch.randn(nbytes // 4) for _ in range(n)]
        pinned = [b.pin_memory() for b in batches[:2]]
        moved = nbytes * n
        row: dict = {"batch_mib": nbytes // MiB, "batches": n}

        def ceiling():
            for i in range(n):
                pinned[i % 2].to(dev, non_blocking=True)

        def seq():
            for b in batches:
                pinxfer.to_device(b, dev)

        def seq_raw():
            for b in batches:
                _ops.to_device(b, dev, 16 << 20, 4)

        def pre(depth):
            def run():
                for _ in pinxfer.prefetch(batches, device=dev, depth=depth):
                    pass

            return run

        row["ceiling"] = timed(ceiling, moved, args.runs, dev)
        if args.child:
            row["seq_thread"] = timed(in_thread(seq), moved, args.runs, dev)
            row["prefetch_d2"] = timed(pre(2), moved, args.runs, dev)
            report["rows"].append(row)
            continue
        row["seq_main"] = timed(seq, moved, args.runs, dev)
        row["seq_thread"] = timed(in_thread(seq), moved, args.runs, dev)
        row["seq_thread_raw"] = timed(in_thread(seq_raw), moved, args.runs, dev)
        for d in (1, 2, 4, 8):
            row[f"prefetch_d{d}"] = timed(pre(d), moved, args.runs, dev)
        old = sys.getswitchinterval()
        sys.setswitchinterval(50e-6)
        row["prefetch_switch"] = timed(pre(2), moved, args.runs, dev)
        sys.setswitchinterval(old)
        row["minimal_d2"] = timed(lambda: minimal_prefetch(batches, dev), moved, args.runs, dev)
        firsts = []
        for _ in range(5):
            torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            it = iter(pinxfer.prefetch(batches, device=dev))
            first = next(it)
            torch.cuda.current_stream(dev).synchronize()
            firsts.append((time.perf_counter() - t0) * 1e6)
            del first
            it.close()
        row["first_batch_us"] = statistics.median(firsts)
        report["rows"].append(row)
        print(json.dumps(row))

    if args.child:
        print(json.dumps(report))
        return 0
    for label, spin in (("spin_100us", "100"), ("spin_1ms", "1000")):
        report[label] = run_child(
            __file__, ["--child", "--runs", str(args.runs)], {"PINXFER_SPIN_US": spin}, timeout=120
        )["rows"]
        for r in report[label]:
            print(
                label,
                r["batch_mib"],
                "MiB: seq_thread {:.1f} prefetch_d2 {:.1f} ceiling {:.1f}".format(
                    r["seq_thread"]["gbps_median"],
                    r["prefetch_d2"]["gbps_median"],
                    r["ceiling"]["gbps_median"],
                ),
            )

    # Does the op release the GIL? Count a Python loop's iterations during 20 calls.
    big = torch.randn(256 * MiB // 4)
    count = [0]
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            count[0] += 1

    th = threading.Thread(target=spin)
    th.start()
    time.sleep(0.01)
    c0 = count[0]
    for _ in range(20):
        _ops.to_device(big, dev, 16 << 20, 4)
    torch.cuda.synchronize(dev)
    stop.set()
    th.join()
    report["gil_spin_iterations_during_20_calls"] = count[0] - c0
    print("gil_spin_iterations_during_20_calls", count[0] - c0)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
