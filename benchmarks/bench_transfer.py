"""Host -> GPU transfers: torch's ways against pinxfer.to_device / pinxfer.prefetch.

Sections (issue 5, "Benchmarks"):
  1. pageable 8 MiB / 64 MiB / 1 GiB -> GPU: t.to("cuda") vs t.pin_memory().to(non_blocking)
     vs pinxfer.to_device (also forced all-nontemporal / all-cached staging).
  2. seed 000's double-buffer experiment (16384x4096 fp32 batches, 4096x4096 matmul, 10 steps):
     sync vs pinxfer.prefetch vs ideal (first copy + steps x max(copy, compute)).
  3. end to end, 64 MiB batches, a fixed GPU step (transfer-bound and compute-bound):
     a. in-memory source: DataLoader(pin_memory=True) + non_blocking vs pinxfer.prefetch, for
        a list of batch tensors and for a TensorDataset over one in-RAM tensor;
     b. 8 workers building each batch (torch.randn): DataLoader(pin_memory=True) vs
        pinxfer.prefetch(DataLoader(pin_memory=False)), with a time breakdown.

GB/s are 1e9 bytes/s. Every timing ends with torch.cuda.synchronize(). Medians of a few
repeats after a warm-up. Without a GPU every section is skipped (said so in the JSON).

Usage: python benchmarks/bench_transfer.py --out results/transfer.json [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

try:
    import pinxfer
except ImportError:  # run from a checkout with the extension built in place
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import pinxfer
import pinxfer.transfer

MiB = 1 << 20
GiB = 1 << 30


def sync() -> None:
    torch.cuda.synchronize()


def timed(fn: Callable[[], Any], repeats: int, warmup: int = 2) -> float:
    """Median seconds of fn() followed by a device sync."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


# ---- 1. single tensors ----


def section_bandwidth(quick: bool) -> list[dict]:
    rows = []
    sizes = [8 * MiB, 64 * MiB, GiB]
    for nbytes in sizes:
        t = torch.randn(nbytes // 4)  # pageable, touched
        reps = 20 if nbytes <= 64 * MiB else (3 if quick else 5)
        ref = None
        if nbytes <= 64 * MiB:
            ref = t.to("cuda")
        ways = {
            "torch t.to(cuda)": lambda: t.to("cuda"),
            "torch t.pin_memory().to(cuda, non_blocking)": lambda: t.pin_memory().to(
                "cuda", non_blocking=True
            ),
            "pinxfer.to_device": lambda: pinxfer.to_device(t),
            "pinxfer.to_device (all nontemporal staging)": lambda: pinxfer.to_device(
                t, staging="nt"
            ),
            "pinxfer.to_device (all cached staging)": lambda: pinxfer.to_device(t, staging="movsb"),
        }
        base = None
        for name, fn in ways.items():
            s = timed(fn, reps)
            row = {
                "section": "1_pageable_to_gpu",
                "bytes": nbytes,
                "way": name,
                "seconds": s,
                "gbps": gbps(nbytes, s),
            }
            if base is None:
                base = s
            row["speedup_vs_torch_to"] = base / s
            rows.append(row)
        if ref is not None:
            ok = torch.equal(pinxfer.to_device(t), ref)
            rows.append(
                {
                    "section": "1_pageable_to_gpu",
                    "bytes": nbytes,
                    "way": "check",
                    "pinxfer_equals_torch": bool(ok),
                }
            )
        ref = None
        torch.cuda.empty_cache()
    return rows


# ---- 2. seed 000's double buffer ----


def section_double_buffer(quick: bool) -> list[dict]:
    B, F, steps = 16384, 4096, 10
    w = torch.rand(F, F, device="cuda")
    batches = [torch.rand(B, F) for _ in range(steps)]  # pageable, 256 MiB each
    pinned = [b.pin_memory() for b in batches]
    nbytes = batches[0].nbytes

    def compute(x: torch.Tensor) -> torch.Tensor:
        return torch.matmul(x, w)

    g = batches[0].to("cuda")
    t_compute = timed(lambda: compute(g), 5)
    t_copy_pinned = timed(lambda: g.copy_(pinned[0], non_blocking=True), 5)
    t_copy_px = timed(lambda: pinxfer.to_device(batches[0]), 5)
    g = None

    def sync_run(src: list[torch.Tensor]) -> None:
        for b in src:
            compute(b.to("cuda", non_blocking=False))

    def prefetch_run(src: list[torch.Tensor]) -> None:
        for gb in pinxfer.prefetch(src, depth=2):
            compute(gb)

    rows = []
    ideal_pageable = t_copy_px + steps * max(t_copy_px, t_compute)
    ideal_pinned = t_copy_pinned + steps * max(t_copy_pinned, t_compute)
    for name, fn, ideal in [
        ("sync, pageable source (.to(cuda))", lambda: sync_run(batches), ideal_pageable),
        ("sync, pinned source (.to(cuda))", lambda: sync_run(pinned), ideal_pinned),
        ("pinxfer.prefetch, pageable source", lambda: prefetch_run(batches), ideal_pageable),
        ("pinxfer.prefetch, pinned source", lambda: prefetch_run(pinned), ideal_pinned),
    ]:
        s = timed(fn, 2 if quick else 3, warmup=1)
        rows.append(
            {
                "section": "2_double_buffer",
                "way": name,
                "seconds": s,
                "ideal_seconds": ideal,
                "ratio_to_ideal": s / ideal,
                "steps": steps,
                "batch_bytes": nbytes,
            }
        )
    rows.append(
        {
            "section": "2_double_buffer",
            "way": "components",
            "compute_ms": t_compute * 1e3,
            "copy_pinned_ms": t_copy_pinned * 1e3,
            "copy_pinxfer_pageable_ms": t_copy_px * 1e3,
            "ideal_formula": "first copy + steps * max(copy, compute)",
        }
    )
    return rows


# ---- 3. end to end ----

ROWS, COLS = 4096, 4096  # 64 MiB of fp32 per batch, 4096 samples


class InMemory(torch.utils.data.Dataset):
    def __init__(self, batches: list[torch.Tensor]):
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.batches[i]


class Built(torch.utils.data.Dataset):
    """Each item is built in the worker: torch.randn of one 64 MiB batch."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.randn(ROWS, COLS)


def make_step(kind: str) -> tuple[Callable[[torch.Tensor], Any], str]:
    w = torch.randn(COLS, COLS, device="cuda")
    if kind == "transfer_bound":
        return (lambda x: torch.matmul(x[:256], w)), "x[:256] @ W(4096x4096)"
    return (lambda x: torch.matmul(torch.matmul(x, w), w)), "(x @ W) @ W, x 4096x4096"


def run_loop(batches_iter, step: Callable, cuda_batches: bool) -> tuple[float, int]:
    """Runs step on every batch; returns (seconds, batches)."""
    n = 0
    sync()
    t0 = time.perf_counter()
    for b in batches_iter:
        x = b if cuda_batches else b.to("cuda", non_blocking=True)
        step(x)
        n += 1
    sync()
    return time.perf_counter() - t0, n


def e2e_row(
    section: str, bound: str, way: str, seconds: float, n: int, t_step: float, **extra: Any
) -> dict:
    nbytes = n * ROWS * COLS * 4
    compute = n * t_step
    return {
        "section": section,
        "bound": bound,
        "way": way,
        "batches": n,
        "seconds": seconds,
        "samples_per_s": n * ROWS / seconds,
        "delivered_gbps": gbps(nbytes, seconds),
        "pure_compute_seconds": compute,
        "gpu_idle_seconds": max(0.0, seconds - compute),
        "ratio_to_pure_compute": seconds / compute,
        **extra,
    }


def section_in_memory(quick: bool) -> list[dict]:
    n_distinct = 16
    steps = 24 if quick else 48
    source = [torch.randn(ROWS, COLS) for _ in range(n_distinct)]  # 1 GiB pageable
    seq = [source[i % n_distinct] for i in range(steps)]
    rows = []
    for bound in ("transfer_bound", "compute_bound"):
        step, desc = make_step(bound)
        g = source[0].to("cuda")
        t_step = timed(lambda: step(g), 10)
        g = None
        loader = torch.utils.data.DataLoader(InMemory(seq), batch_size=None, pin_memory=True)
        run_loop(iter(loader), step, False)  # warm: pinned cache, kernels
        s, n = run_loop(iter(loader), step, False)
        torch_row = e2e_row(
            "3a_in_memory",
            bound,
            "DataLoader(pin_memory=True) + non_blocking",
            s,
            n,
            t_step,
            step=desc,
        )
        run_loop(pinxfer.prefetch(seq[:4]), step, True)  # warm staging
        s, n = run_loop(pinxfer.prefetch(seq, depth=2), step, True)
        px_row = e2e_row("3a_in_memory", bound, "pinxfer.prefetch(list)", s, n, t_step, step=desc)
        px_row["speedup_vs_dataloader"] = px_row["samples_per_s"] / torch_row["samples_per_s"]
        rows += [torch_row, px_row]
    rows += section_in_memory_tensor(quick, source)
    return rows


def section_in_memory_tensor(quick: bool, source: list[torch.Tensor]) -> list[dict]:
    """The other in-memory source of the issue: a dataset over one in-RAM tensor.

    torch's idiom is TensorDataset + DataLoader(batch_size=...): each batch is
    4096 per-sample __getitem__ calls and a torch.stack by collate, then pinned.
    pinxfer's is prefetch over the tensor's batch views (x.split), no collate.
    Transfer-bound step only.
    """
    x = torch.cat(source)  # 16 batches of 4096 samples, 1 GiB
    step, desc = make_step("transfer_bound")
    g = source[0].to("cuda")
    t_step = timed(lambda: step(g), 10)
    g = None
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x), batch_size=ROWS, pin_memory=True
    )

    def torch_pass() -> tuple[float, int]:
        n = 0
        sync()
        t0 = time.perf_counter()
        for (b,) in loader:
            step(b.to("cuda", non_blocking=True))
            n += 1
        sync()
        return time.perf_counter() - t0, n

    torch_pass()  # warm
    s, n = torch_pass()
    torch_row = e2e_row(
        "3a_in_memory",
        "transfer_bound",
        "DataLoader(TensorDataset(x), batch_size=4096, pin_memory=True) + non_blocking",
        s,
        n,
        t_step,
        step=desc,
    )
    views = list(x.split(ROWS)) * (2 if quick else 3)
    run_loop(pinxfer.prefetch(views[:4]), step, True)
    s, n = run_loop(pinxfer.prefetch(views), step, True)
    px_row = e2e_row(
        "3a_in_memory", "transfer_bound", "pinxfer.prefetch(x.split(4096))", s, n, t_step, step=desc
    )
    px_row["speedup_vs_dataloader"] = px_row["samples_per_s"] / torch_row["samples_per_s"]
    return [torch_row, px_row]


def breakdown(quick: bool) -> dict:
    """Where a worker-fed batch's time goes, each stage measured on its own."""
    out: dict[str, Any] = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a DataLoader worker (and its pin thread) runs one thread
    try:
        t = time.perf_counter()
        for _ in range(3):
            x = torch.randn(ROWS, COLS)
        out["worker_build_ms"] = (time.perf_counter() - t) / 3 * 1e3
        t = time.perf_counter()
        for _ in range(3):
            y = torch.randn(ROWS, COLS).share_memory_()
        # share_memory_ (what sending a tensor from a worker costs there) minus the build
        out["worker_to_shm_ms"] = max(
            0.0, (time.perf_counter() - t) / 3 * 1e3 - out["worker_build_ms"]
        )
        res: dict[str, float] = {}

        def pin_in_thread() -> None:
            torch.set_num_threads(1)
            y.pin_memory()  # warm the pinned cache
            t0 = time.perf_counter()
            for _ in range(3):
                y.pin_memory()
            res["pin"] = (time.perf_counter() - t0) / 3 * 1e3

        th = threading.Thread(target=pin_in_thread)
        th.start()
        th.join()
        out["pin_thread_ms"] = res["pin"]
    finally:
        torch.set_num_threads(threads)
    p = y.pin_memory()
    g = torch.empty_like(p, device="cuda")
    out["h2d_pinned_ms"] = timed(lambda: g.copy_(p, non_blocking=True), 5) * 1e3
    out["pinxfer_to_device_from_shm_ms"] = timed(lambda: pinxfer.to_device(y), 5) * 1e3
    del x
    return out


def loader_only_rate(workers: int, pin: bool, n: int) -> float:
    loader = torch.utils.data.DataLoader(
        Built(n), batch_size=None, num_workers=workers, pin_memory=pin
    )
    it = iter(loader)
    for _ in range(min(4, n // 2)):
        next(it)
    t0 = time.perf_counter()
    k = 0
    for _ in it:
        k += 1
    return k / (time.perf_counter() - t0)


def section_workers(quick: bool) -> list[dict]:
    workers = 8
    steps = 24 if quick else 40
    warm = 4
    rows = []
    for bound in ("transfer_bound", "compute_bound"):
        step, desc = make_step(bound)
        g = torch.randn(ROWS, COLS, device="cuda")
        t_step = timed(lambda: step(g), 10)
        g = None
        first = len(rows)
        for way in (
            "DataLoader(pin_memory=True) + non_blocking",
            "pinxfer.prefetch(DataLoader(pin_memory=False))",
            "pinxfer.prefetch(DataLoader(pin_memory=False), slots=True)",
        ):
            torch_way = way.startswith("DataLoader")
            slots = way.endswith("slots=True)")
            loader = torch.utils.data.DataLoader(
                Built(steps + warm), batch_size=None, num_workers=workers, pin_memory=torch_way
            )
            pf = None
            if not torch_way:  # slots: sized up front so that no warm-up batch falls back
                pf = pinxfer.prefetch(
                    loader,
                    depth=2,
                    slots=slots,  # False: the staging way
                    slot_bytes=ROWS * COLS * 4 if slots else None,
                )
            it = iter(loader) if torch_way else iter(pf)
            for _ in range(warm):  # workers started, queues filled: steady state below
                b = next(it)
                step(b if not torch_way else b.to("cuda", non_blocking=True))
            s, n = run_loop(it, step, not torch_way)
            del it
            extra = {"slot_stats": pf.slots.stats()} if slots else {}
            if slots:
                pf.slots.close()
            rows.append(
                e2e_row(
                    "3b_workers",
                    bound,
                    way,
                    s,
                    n,
                    t_step,
                    step=desc,
                    workers=workers,
                    warmup_batches_excluded=warm,
                    **extra,
                )
            )
        for r in rows[first + 1 :]:
            r["speedup_vs_dataloader"] = r["samples_per_s"] / rows[first]["samples_per_s"]
    n = 16 if quick else 24
    bd = breakdown(quick)
    bd["loader_only_batches_per_s_pin_false"] = loader_only_rate(workers, False, n)
    bd["loader_only_batches_per_s_pin_true"] = loader_only_rate(workers, True, n)
    bd["batch_bytes"] = ROWS * COLS * 4
    bd["notes"] = (
        "per-batch stage costs measured separately on one thread each (as in a "
        "worker / the pin thread); loader_only rates iterate the 8-worker loader with no "
        "GPU work, so they bound what any consumer can get"
    )
    rows.append({"section": "3b_workers", "way": "breakdown", **bd})
    return rows


# ---- driver ----


def print_table(rows: list[dict]) -> None:
    for r in rows:
        keys = [k for k in ("section", "bound", "bytes", "way") if k in r]
        head = " | ".join(str(r[k]) for k in keys)
        vals = []
        for k in (
            "gbps",
            "speedup_vs_torch_to",
            "seconds",
            "ideal_seconds",
            "ratio_to_ideal",
            "samples_per_s",
            "delivered_gbps",
            "gpu_idle_seconds",
            "ratio_to_pure_compute",
            "speedup_vs_dataloader",
        ):
            if k in r:
                vals.append(f"{k}={r[k]:.3f}" if isinstance(r[k], float) else f"{k}={r[k]}")
        if r.get("way") in ("breakdown", "components", "check"):
            vals = [
                f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                for k, v in r.items()
                if k not in ("section", "way")
            ]
        print(f"{head:70s} {'  '.join(vals)}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--quick", action="store_true", help="fewer steps/repeats")
    ap.add_argument("--sections", default="1,2,3a,3b", help="comma list of 1,2,3a,3b")
    args = ap.parse_args(argv)
    wanted = set(args.sections.split(","))

    report: dict[str, Any] = {
        "benchmark": "bench_transfer",
        "torch": torch.__version__,
        "pinxfer": pinxfer.__version__,
        "build_info": pinxfer.build_info()._asdict(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "quick": args.quick,
        "notes": (
            "steps reduced to keep the run short: section 2 uses seed 000's 10 steps; "
            "section 3 uses 48 (a) / 40 (b) batches of 64 MiB per way (24 with --quick)"
        ),
        "results": [],
        "skipped": [],
    }
    reason = pinxfer.transfer.cuda_unavailable_reason()
    if reason is not None:
        report["device"] = None
        report["skipped"].append({"sections": sorted(wanted), "reason": reason})
        print(f"bench_transfer: skipping every section: {reason}")
    else:
        report["device"] = torch.cuda.get_device_name()
        torch.cuda.init()
        t_all = time.perf_counter()
        for key, fn in [
            ("1", section_bandwidth),
            ("2", section_double_buffer),
            ("3a", section_in_memory),
            ("3b", section_workers),
        ]:
            if key not in wanted:
                continue
            t0 = time.perf_counter()
            rows = fn(args.quick)
            print_table(rows)
            report["results"] += rows
            report.setdefault("section_seconds", {})[key] = time.perf_counter() - t0
            torch.cuda.empty_cache()
        report["total_seconds"] = time.perf_counter() - t_all
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
