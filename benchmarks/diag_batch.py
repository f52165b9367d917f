"""Where a nested batch's time goes (issue 22): pinxfer.to_device of a batch and prefetch's
per-batch hand-over, peeled layer by layer, with torch's plain loop in the same process.
Microseconds per call (median of 7 rounds of N calls, each call followed by a synchronize
where the row says "synced"), back to back.

With ``--gaps sleep,gpu``, also each way called once right after a 20 ms gap (a sleep, or
a GPU kernel the host waits on), the ways in bench_loop's balanced orders (each first, and
right after every other, equally often), and the call and its synchronize timed
(``after_gap_us``, median and minimum). Among them the batch's two sends taken apart and in
both orders (its larger leaf alone, its small leaves packed, then one after the other), which
says whether a batch's extra cost after a gap is the packed send itself or where it comes;
and every leaf packed into one copy (one staging block, one DMA, one device allocation), a
batch with fewer CUDA calls.

    python benchmarks/diag_batch.py [--json PATH] [--sizes 4K,1M] [--gaps sleep,gpu]

The batch is bench_loop.py's: {"x": float32 (~size*63/64), "y": int64 (size/64),
"meta": [two int64 scalars]}. Writes benchmarks/results/<kind>/diag_batch.json by default.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import pinxfer
from pinxfer import _check, _ops, transfer
from pinxfer._batch import map_tensors, tensors_in

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_loop import balanced_rounds, batch_layout, parse_sizes
from diag_small_calls import us_per_call


def make_batch(nbytes: int) -> dict:
    lay = batch_layout(nbytes)
    return {
        "x": torch.randn(lay["x"] // 4),
        "y": torch.randint(0, 1 << 30, (lay["y"] // 8,), dtype=torch.int64),
        "meta": [torch.tensor(1), torch.tensor(nbytes)],
    }


def prefetch_us(batches: list, **kw: Any) -> float:
    """Per batch over a pass, the consumer taking each batch and syncing its stream."""
    sync = torch.cuda.current_stream().synchronize
    best = []
    for _ in range(5):
        t0 = time.perf_counter()
        for b in pinxfer.prefetch(batches, **kw):
            sync()
            del b
        best.append((time.perf_counter() - t0) / len(batches) * 1e6)
    return round(statistics.median(best), 2)


GAP_S = 0.02


def gpu_sleep_cycles(dev: torch.device) -> int:
    """Cycles of torch.cuda._sleep that take about GAP_S here."""
    sync = torch.cuda.current_stream(dev).synchronize
    cycles = 1 << 20
    while True:
        t0 = time.perf_counter()
        torch.cuda._sleep(cycles)
        sync()
        took = time.perf_counter() - t0
        if took >= GAP_S / 4:
            return int(cycles * GAP_S / took)
        cycles *= 4


def after_gap_us(ways: dict[str, Callable[[], Any]], gap: Callable[[], None], rounds: int) -> dict:
    """Each way called right after a gap and synchronized, each round in bench_loop's balanced
    orders (every way runs right after every other equally often)."""
    sync = torch.cuda.synchronize
    names = list(ways)
    times: dict[str, list[float]] = {n: [] for n in names}
    for order in balanced_rounds(names, rounds):
        for name in order:
            gap()
            t0 = time.perf_counter()
            out = ways[name]()
            sync()
            times[name].append((time.perf_counter() - t0) * 1e6)
            del out
    return {
        n: {"median_us": round(statistics.median(v), 1), "min_us": round(min(v), 1)}
        for n, v in times.items()
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--sizes", default="4K,64K,1M")
    ap.add_argument("--gaps", default="", help="comma list of sleep,gpu (default: none)")
    ap.add_argument("--gap-rounds", type=int, default=24)
    args = ap.parse_args()
    torch.cuda.init()
    dev = torch.device("cuda", torch.cuda.current_device())
    result: dict[str, Any] = {"torch": torch.__version__, "sizes": {}}
    stream = torch.cuda.Stream()
    ev = torch.cuda.Event()
    ev.record()
    gpu_t = torch.empty(1024, device=dev)
    result["pieces_us"] = {
        name: us_per_call(fn, calls=5000)
        for name, fn in {
            "_check.device(cuda)": lambda: _check.device("cuda", "x"),
            "_check.device(torch.device)": lambda: _check.device(dev, "x"),
            "torch.cuda.current_stream()": lambda: torch.cuda.current_stream(dev),
            "torch.cuda.set_stream x2": lambda: (
                torch.cuda.set_stream(stream),
                torch.cuda.set_stream(torch.cuda.default_stream(dev)),
            ),
            "torch.cuda.Event()+record": lambda: torch.cuda.Event().record(stream),
            "stream.wait_event": lambda: torch.cuda.current_stream(dev).wait_event(ev),
            "t.record_stream": lambda: gpu_t.record_stream(stream),
            "is_current_stream_capturing": torch.cuda.is_current_stream_capturing,
            "_ops.eager()": _ops.eager,
        }.items()
    }
    for nbytes in parse_sizes(args.sizes):
        b = make_batch(nbytes)
        leaves = tensors_in(b)
        small = [t for t in leaves if t.nbytes <= transfer.SMALL_TENSOR_BYTES]
        fast_many = _ops._fast_to_device_many
        pinned_x = b["x"].pin_memory()
        calls = max(200, min(5000, (64 << 20) // max(nbytes, 1)))

        def loop(b: dict = b) -> dict:
            return {
                "x": b["x"].to(dev, non_blocking=True),
                "y": b["y"].to(dev, non_blocking=True),
                "meta": [m.to(dev, non_blocking=True) for m in b["meta"]],
            }

        rows: dict[str, Callable[[], Any]] = {
            "pinxfer.to_device(batch)": lambda b=b: pinxfer.to_device(b, dev),
            "_send_leaves(leaves)": lambda leaves=leaves: transfer._send_leaves(
                leaves, dev, True, transfer.DEFAULT_CHUNK_BYTES, transfer.DEFAULT_NUM_BUFFERS
            ),
            "_C.to_device_many(small leaves)": lambda s=small: (
                fast_many(s, dev) if len(s) > 1 else None
            ),
            # Every leaf in one staging block and one DMA (the large one too): how a batch
            # with fewer CUDA calls would do, against the batch rule's two sends.
            "_C.to_device_many(all leaves)": lambda ls=leaves: fast_many(ls, dev),
            "pinxfer.to_device(x)": lambda b=b: pinxfer.to_device(b["x"], dev),
            "torch loop (4 x .to(nb))": loop,
            "pinned x.to(nb)": lambda p=pinned_x: p.to(dev, non_blocking=True),
        }
        py_only = {
            "tensors_in(batch)": lambda b=b: tensors_in(b),
            "map_tensors(batch, id)": lambda b=b: map_tensors(b, lambda t: t),
        }
        sz: dict[str, Any] = {
            "synced_us": {
                k: us_per_call(fn, calls=calls // 4 + 50, sync=True) for k, fn in rows.items()
            },
            "unsynced_us": {k: us_per_call(fn, calls=calls) for k, fn in rows.items()},
            "python_us": {k: us_per_call(fn, calls=5000) for k, fn in py_only.items()},
        }
        batches = [make_batch(nbytes) for _ in range(64)]
        sz["prefetch_per_batch_us"] = {"prefetch": prefetch_us(batches, device=dev)}
        for extra in ({"producer": "caller"}, {"producer": "thread"}):
            with contextlib.suppress(TypeError):  # a build without the producer= argument
                sz["prefetch_per_batch_us"][str(extra)] = prefetch_us(batches, device=dev, **extra)
        sync = torch.cuda.current_stream().synchronize

        def loop_pass(batches: list = batches) -> float:
            t0 = time.perf_counter()
            for bb in batches:
                out = loop(bb)
                sync()
                del out
            return (time.perf_counter() - t0) / len(batches) * 1e6

        sz["prefetch_per_batch_us"]["plain loop"] = round(
            statistics.median(loop_pass() for _ in range(5)), 2
        )
        if args.gaps:
            cycles = gpu_sleep_cycles(dev)
            gaps = {
                "sleep": lambda: time.sleep(GAP_S),
                "gpu": lambda: (torch.cuda._sleep(cycles), torch.cuda.synchronize()),
            }
            large = [t for t in leaves if t.nbytes > transfer.SMALL_TENSOR_BYTES]
            gap_ways: dict[str, Callable[[], Any]] = {
                "pinxfer.to_device(batch)": lambda b=b: pinxfer.to_device(b, dev),
                "torch loop (4 x .to(nb))": loop,
            }
            if large and len(small) > 1:
                gap_ways.update(
                    {
                        "large leaf alone": lambda: pinxfer.to_device(large[0], dev),
                        "small leaves packed": lambda: fast_many(small, dev),
                        "large, then small": lambda: (
                            pinxfer.to_device(large[0], dev),
                            fast_many(small, dev),
                        ),
                        "small, then large": lambda: (
                            fast_many(small, dev),
                            pinxfer.to_device(large[0], dev),
                        ),
                        "all leaves packed": lambda: fast_many(leaves, dev),
                    }
                )
            sz["after_gap_us"] = {
                name: after_gap_us(gap_ways, gaps[name], args.gap_rounds)
                for name in args.gaps.split(",")
            }
        result["sizes"][str(nbytes)] = sz
    out = args.json or os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "results", "local", "diag_batch.json"
    )
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
