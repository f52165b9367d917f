"""Where a small call's time goes (issue 22): the native pieces, timed alone in C++
(pinxfer._C._call_breakdown), and the Python-level calls they add up to, with torch's
equivalents in the same process. Microseconds per call, median of 7 rounds.

    python benchmarks/diag_small_calls.py [--json PATH]

Writes benchmarks/results/<kind>/small_breakdown.json by default (kind from
PINXFER_MACHINE_KIND, e.g. nvidia-h100-x1 -> h100).
"""

from __future__ import annotations

import argparse
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
from pinxfer import _ops


def us_per_call(
    fn: Callable[[], Any], calls: int = 2000, rounds: int = 7, sync: bool = False
) -> float:
    fn()
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
            if sync:
                torch.cuda.synchronize()
        if not sync and torch.cuda.is_available():
            torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) / calls * 1e6)
    return round(statistics.median(samples), 3)


def kind_dir() -> str:
    kind = os.environ.get("PINXFER_MACHINE_KIND", "local")
    return {"nvidia-h100-x1": "h100", "nvidia-h200": "h200", "nvidia-h200-x2": "h200-x2"}.get(
        kind, kind
    )


def fence_and_install_rows(calls: dict[str, Callable[[], Any]], x64k: torch.Tensor) -> dict:
    """The free fence in this process: `empty` and `pin_memory` (every free fenced: no
    recorded use) while the current stream is idle and while a GPU kernel keeps it busy
    (few calls: blocks freed behind a busy stream wait for their batch's event, so calls
    map new memory), with the pool's events counted; and torch's own calls with pinxfer
    installed as its host allocator (no fence: torch reports its copies)."""
    fenced = ("pinxfer.empty(16384)", "pinxfer.pin_memory(64KiB)")
    out: dict[str, dict[str, float]] = {"fence_idle_us": {}, "fence_busy_us": {}}
    for name in fenced:
        out["fence_idle_us"][name] = us_per_call(calls[name])
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time: the stream stays busy
        out["fence_busy_us"][name] = us_per_call(calls[name], calls=100, rounds=3)
        torch.cuda.synchronize()
        pinxfer.empty_cache()
    pinxfer.install()
    try:
        out["installed_us"] = {
            "torch.empty(16384, pin_memory=True)": us_per_call(
                lambda: torch.empty(16384, pin_memory=True)
            ),
            "x.pin_memory() 64KiB": us_per_call(lambda: x64k.pin_memory()),
        }
    finally:
        pinxfer.uninstall()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.init()
    result: dict[str, Any] = {
        "torch": torch.__version__,
        "kind": os.environ.get("PINXFER_MACHINE_KIND", "local"),
        "native_ns": pinxfer._C._call_breakdown(20000),
    }
    x64k = torch.randn(16384)
    calls: dict[str, Callable[[], Any]] = {
        "pinxfer.empty(16384)": lambda: pinxfer.empty(16384),
        "_C.empty_if_eager": lambda: _ops.fast.empty_if_eager([16384], torch.float32, None),
        "torch.empty(16384)": lambda: torch.empty(16384),
        "pinxfer.pin_memory(64KiB)": lambda: pinxfer.pin_memory(x64k),
        "_C.pin_memory_if_plain(64KiB)": lambda: _ops.fast.pin_memory_if_plain(x64k, None, 0, True),
    }
    if cuda:
        dev = torch.device("cuda")
        t4k = torch.randn(1024)
        p4k = t4k.pin_memory()
        calls.update(
            {
                "torch.empty(16384, pin_memory=True)": lambda: torch.empty(16384, pin_memory=True),
                "x.pin_memory() 64KiB": lambda: x64k.pin_memory(),
                "pinxfer.to_device(4KiB)": lambda: pinxfer.to_device(t4k),
                "_C.to_device(4KiB)": lambda: _ops.fast.to_device(t4k, dev, 16 << 20, 4, "auto"),
                "_C.to_device_if_plain(4KiB)": lambda: _ops.fast.to_device_if_plain(
                    t4k, dev, 16 << 20, 4
                ),
                "pinned.to(nb) 4KiB": lambda: p4k.to(dev, non_blocking=True),
                "t.to(cuda) 4KiB": lambda: t4k.to(dev),
                "torch.empty(1024, device=cuda)": lambda: torch.empty(1024, device=dev),
            }
        )
    result["python_us"] = {name: us_per_call(fn) for name, fn in calls.items()}
    if cuda:
        synced = {
            k: calls[k]
            for k in (
                "pinxfer.to_device(4KiB)",
                "_C.to_device(4KiB)",
                "_C.to_device_if_plain(4KiB)",
                "pinned.to(nb) 4KiB",
                "t.to(cuda) 4KiB",
            )
        }
        result["python_us_synced"] = {
            name: us_per_call(fn, calls=500, sync=True) for name, fn in synced.items()
        }
    if cuda:
        result.update(fence_and_install_rows(calls, x64k))
    out = args.json or os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "results", kind_dir(), "small_breakdown.json"
    )
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    for section in (
        "native_ns",
        "python_us",
        "python_us_synced",
        "fence_idle_us",
        "fence_busy_us",
        "installed_us",
    ):
        print(f"== {section}")
        for k, v in result.get(section, {}).items():
            print(f"  {k:40} {v:10.3f}")


if __name__ == "__main__":
    main()
