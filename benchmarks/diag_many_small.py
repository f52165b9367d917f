"""Where the time of "64 small tensors -> GPU" goes (issue 22: goal <= 350 us).

bench_loop's row sends bench_small_calls.the_batch() (a dict of 64 uint8 tensors of 4-256 KiB,
about 4.5 MiB) with pinxfer.to_device, each call synchronized, back to back. This script
times that call and its layers in one process, microseconds per call (median of rounds; every
way once a round, in bench_loop's balanced orders, after an untimed warm-up round):

  whole           pinxfer.to_device(batch)
  python_walk     the Python around the kernel: tensors_in, the plain-dense checks, map_tensors
  kernel          pinxfer._C.to_device_many(leaves) (pack, one copy per >= 1 MiB group, views)
  packed_op       torch.ops.pinxfer.to_device_packed(leaves) (no views)
  cat_then_send   torch.cat of the flat leaves (torch's copy kernels) + pinxfer.to_device
  floor_pinned    one pinned tensor of the batch's bytes, .to(non_blocking=True): the DMA
  torch_nb        torch's best way in bench_loop: .to(non_blocking=True) per tensor

Each after a torch CPU op (team awake) and after 20 ms of sleep (team asleep), and with the
team road off in a child process (PINXFER_TORCH_TEAM=off).

    python benchmarks/diag_many_small.py [--json PATH] [--rounds 9]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _child import run_child

HERE = Path(__file__).resolve().parent


def measure(rounds: int) -> dict:
    sys.path.insert(0, str(HERE.parent))
    sys.path.insert(0, str(HERE))
    from bench_loop import balanced_rounds
    from bench_small_calls import the_batch

    import pinxfer
    from pinxfer import _C
    from pinxfer._batch import map_tensors, tensors_in
    from pinxfer._ops import plain_dense_cpu

    dev = torch.device("cuda", 0)
    batch = the_batch()
    leaves = list(batch.values())
    total = sum(t.nbytes for t in leaves)
    pinned = torch.empty(total, dtype=torch.uint8).pin_memory()
    flat = [t.view(-1) for t in leaves]
    warm_op = torch.randn(1 << 20)

    def python_walk() -> Any:
        ls = tensors_in(batch)
        assert all(plain_dense_cpu(t) for t in ls)
        it = iter(ls)
        return map_tensors(batch, lambda _t: next(it))

    ways: dict[str, Callable[[], Any]] = {
        "whole": lambda: pinxfer.to_device(batch, dev),
        "python_walk": python_walk,
        "kernel": lambda: _C.to_device_many(leaves, dev),
        "packed_op": lambda: torch.ops.pinxfer.to_device_packed(leaves, dev),
        "cat_then_send": lambda: pinxfer.to_device(torch.cat(flat), dev),
        "floor_pinned": lambda: pinned.to(dev, non_blocking=True),
        "torch_nb": lambda: {k: v.to(dev, non_blocking=True) for k, v in batch.items()},
    }
    preludes: dict[str, Callable[[], None]] = {
        "after_torch_op": lambda: warm_op.mul_(1.0),  # torch's team spins after it
        "after_sleep": lambda: time.sleep(0.02),
    }
    out: dict = {"total_bytes": total, "us": {}}
    for pname, prelude in preludes.items():
        samples: dict[str, list[float]] = {k: [] for k in ways}
        names = list(ways)
        # A first round untimed (warm-up, in the list's order), then `rounds` timed rounds
        # in bench_loop's balanced orders.
        for r, order in enumerate([names, *balanced_rounds(names, rounds)]):
            for name in order:
                fn = ways[name]
                ts = []
                for _ in range(5):
                    prelude()
                    t = time.perf_counter()
                    res = fn()
                    torch.cuda.synchronize()
                    ts.append(time.perf_counter() - t)
                    del res
                if r:
                    samples[name].append(statistics.median(ts) * 1e6)
        out["us"][pname] = {
            k: {"median": round(statistics.median(v), 1), "min": round(min(v), 1)}
            for k, v in samples.items()
        }
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.rounds)))
        return 0
    result: dict = {"gpu": torch.cuda.get_device_name(0), "variants": {}}
    for variant, env in {"default": {}, "team_off": {"PINXFER_TORCH_TEAM": "off"}}.items():
        result["variants"][variant] = run_child(
            __file__, ["--child", "--rounds", str(args.rounds)], env
        )
    for variant, res in result["variants"].items():
        print(f"{variant}: {res['total_bytes'] / 2**20:.2f} MiB")
        for pname, rows in res["us"].items():
            cells = "  ".join(f"{k} {v['median']:.0f}/{v['min']:.0f}" for k, v in rows.items())
            print(f"  {pname:15} {cells}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
