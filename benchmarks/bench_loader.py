"""DataLoader workers -> GPU: pin_memory=True, pinxfer staging and pinxfer slots (issue 13).

Issue 13 ("DataLoader workers write batches straight into pinned slots") asks for this
measurement before ``slots=True`` can become the default. One trainer process per GPU (or
one per rank under torchrun) feeds a GPU step from a DataLoader with 8 workers, three ways:

  pin_memory  ``DataLoader(pin_memory=True)``, then ``.to(device, non_blocking=True)`` per
              batch (torch's idiom: the workers write the batch to shared memory, the
              trainer's pin thread copies it again into pinned memory, then the DMA)
  staging     ``pinxfer.prefetch(DataLoader(pin_memory=False), slots=False)`` (the trainer's
              copy threads stage the shared-memory batch into pinned chunks)
  slots       ``pinxfer.prefetch(DataLoader(pin_memory=False), slots=True, slot_bytes=...)``
              (the workers collate straight into a pinned ring; the DMA reads it there)

The dataset is in RAM: N uint8 images 3x(H+pad)x(W+pad) in one tensor made once in the main
process (forked workers share it); ``__getitem__`` crops 3xHxW and casts to float32 (float16
with ``--dtype``), the light work a real image loader does; default collate with
``batch_size`` (64), so one batch is images (B,3,H,W) plus int64 labels (B,). H = W are
chosen so that a batch is ``--batch-mib`` (16 and 64 MiB; exactly that is impossible with 3
channels, the real bytes are in the JSON).

Two steps: ``transfer_bound`` (``x.sum()``) and ``compute_bound`` (``x.sum()`` then k
2048x2048 fp32 matmuls, k chosen so that a step takes ``--compute-factor`` (3) times the
slowest way's transfer-bound time per batch; the same steps on a GPU-resident batch give
the pure compute time, and ``step_vs_pure_compute`` is the fed loop over that).

Every (batch size, step, way) is timed ``--repeats`` (3) times, a fresh pass (fresh workers)
each time, the ways interleaved, in bench_loop's balanced orders (every way runs right
after every other equally often, and first equally often; the same on every rank). A pass
is ``warmup`` batches (worker start-up, not timed), ``--batches`` (30) timed batches, then
a tail drained untimed (enough that the workers stay busy until the last timed batch, and so
that the pass ends normally and its workers are joined). JSON keeps the median and the best
of the repeats.

Per way: batches/s, GB/s (1e9 B/s of batch bytes), and trainer CPU seconds per GB:
``getrusage(RUSAGE_SELF)`` user+sys around the timed batches -- every thread of the trainer
(pin thread, prefetch thread, pinxfer copy threads, unpickling), never the workers. Worker
CPU comes from ``getrusage(RUSAGE_CHILDREN)`` around the whole pass: it counts only children
that were reaped (joined), i.e. all of the pass's workers once it has ended, and so includes
their start-up, the warm-up and the tail batches (it is divided by every batch of the pass).

The first batch of the first pass of every way is compared byte for byte with the dataset
(crop offsets are a hash of the index, so the trainer can rebuild the batch).

Usage:
  python3 benchmarks/bench_loader.py --kind nvidia-h100-x1        # results/h100/loader.json
  torchrun --nproc-per-node 8 benchmarks/bench_loader.py --kind nvidia-h200-x8
  python3 benchmarks/bench_loader.py --quick --out /tmp/loader.json
  python3 benchmarks/bench_loader.py --cpu-smoke --out /tmp/loader_smoke.json   # no GPU
Without CUDA (and without --cpu-smoke) every row is skipped, said so in the JSON, exit 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing
import os
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from bench_loop import balanced_rounds  # the script's folder; bench_loop imports no torch
from torch.utils.data import DataLoader, Dataset

try:
    import pinxfer
except ImportError:  # run from a checkout with the extension built in place
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import pinxfer

MiB = 1 << 20
RESULTS = Path(__file__).resolve().parent / "results"
PREFETCH_FACTOR = 2  # torch's default; the loaders below do not set it
DEPTH = 2  # pinxfer.prefetch's default depth
STEPS = ("transfer_bound", "compute_bound")
WAYS = {  # key -> what it is
    "pin_memory": "DataLoader(pin_memory=True) + .to(device, non_blocking=True)",
    "staging": "pinxfer.prefetch(DataLoader(pin_memory=False), slots=False)",
    "slots": "pinxfer.prefetch(DataLoader(pin_memory=False), slots=True, slot_bytes=batch bytes)",
}
# Issue 13's targets: (ratio name, comparison, bound, the step kind it applies to).
TARGETS: list[tuple[str, str, float, str]] = [
    ("slots_vs_pin_memory_batches_per_s", ">=", 1.5, "transfer_bound"),
    ("slots_vs_staging_batches_per_s", ">=", 1.0, "transfer_bound"),
    ("slots_vs_pin_memory_trainer_cpu_per_gb", "<=", 0.25, "any"),
    ("slots_vs_staging_trainer_cpu_per_gb", "<=", 0.5, "any"),
    ("step_vs_pure_compute", "<=", 1.02, "compute_bound"),
]


# ---- small helpers ----


def self_cpu() -> float:
    """CPU seconds of every thread of this (the trainer) process; workers not included."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def children_cpu() -> float:
    """CPU seconds of reaped children (waited for: the joined DataLoader workers)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def med_best(values: list[float]) -> dict[str, Any]:
    """Median and best (smallest: seconds, CPU per GB) of the repeats, and each of them."""
    return {"median": statistics.median(values), "best": min(values), "all": values}


class Dist:
    """torchrun ranks (WORLD_SIZE > 1) start every pass together (gloo barrier), as in
    bench_bus.py, so that the ranks' loaders and copies share the host at the same time."""

    def __init__(self, init: bool = True) -> None:
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self._dist: Any = None
        if init and self.world > 1:
            import torch.distributed as dist

            dist.init_process_group("gloo")
            self._dist = dist

    def barrier(self) -> None:
        if self._dist is not None:
            self._dist.barrier()

    def close(self) -> None:
        if self._dist is not None:
            self._dist.destroy_process_group()


# ---- the data ----


@dataclasses.dataclass(frozen=True)
class Shape:
    """One batch configuration: B images 3 x side x side of dtype, plus B int64 labels."""

    batch_mib: float
    batch_size: int
    side: int
    pad: int
    dtype: torch.dtype

    @staticmethod
    def for_mib(batch_mib: float, batch_size: int, pad: int, dtype: torch.dtype) -> Shape:
        esize = torch.empty((), dtype=dtype).element_size()
        side = max(8, round(math.sqrt(batch_mib * MiB / (batch_size * 3 * esize))))
        return Shape(batch_mib, batch_size, side, pad, dtype)

    @property
    def image_bytes(self) -> int:
        esize = torch.empty((), dtype=self.dtype).element_size()
        return self.batch_size * 3 * self.side * self.side * esize

    @property
    def label_bytes(self) -> int:
        return self.batch_size * 8

    @property
    def batch_bytes(self) -> int:
        return self.image_bytes + self.label_bytes

    @property
    def slot_bytes(self) -> int:
        """What a slot must hold: the images at offset 0, the labels at the next 64-byte
        boundary (slots.py's layout), so no batch falls back as too big."""
        return (self.image_bytes + 63) // 64 * 64 + self.label_bytes

    def describe(self) -> dict[str, Any]:
        return {
            "batch_mib_asked": self.batch_mib,
            "batch_size": self.batch_size,
            "image_chw": [3, self.side, self.side],
            "stored_chw": [3, self.side + self.pad, self.side + self.pad],
            "dtype": str(self.dtype).removeprefix("torch."),
            "batch_bytes": self.batch_bytes,
            "batch_mib": self.batch_bytes / MiB,
            "slot_bytes": self.slot_bytes,
        }


def crop_offsets(i: int, pad: int) -> tuple[int, int]:
    """The 'random' crop of sample i: a multiplicative hash of the index, so it is the same
    in every worker and in the trainer (which rebuilds a batch to check it)."""
    k = (i * 2654435761) & 0xFFFFFFFF
    return k % (pad + 1), (k >> 16) % (pad + 1)


class CropImages(Dataset):
    """``length`` samples over ``images`` (N, 3, side+pad, side+pad) uint8 held in RAM.

    Sample i: image i % N cropped to 3 x side x side and cast to ``dtype`` (a new
    contiguous tensor, as a real transform pipeline makes), and its index as the label.
    """

    def __init__(self, images: torch.Tensor, shape: Shape, length: int) -> None:
        self.images, self.shape, self.length = images, shape, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        s = self.shape
        top, left = crop_offsets(i, s.pad)
        img = self.images[i % len(self.images)]
        return img[:, top : top + s.side, left : left + s.side].to(s.dtype), i


def make_images(shape: Shape, n: int) -> torch.Tensor:
    """The in-RAM dataset, made once in the main process before any worker forks."""
    g = torch.Generator().manual_seed(13)
    hw = shape.side + shape.pad
    return torch.randint(0, 256, (n, 3, hw, hw), dtype=torch.uint8, generator=g)


def make_loader(ds: Dataset, shape: Shape, workers: int, pin: bool) -> DataLoader:
    return DataLoader(
        ds,
        batch_size=shape.batch_size,
        shuffle=False,
        num_workers=workers,
        pin_memory=pin,
        persistent_workers=False,
    )  # default prefetch_factor


# ---- the three ways ----


class Way:
    """One way of getting the loader's batches onto the device. ``batches()`` starts one
    pass (fresh workers) and yields (images, labels) already on (or queued to) the device."""

    key = ""

    def batches(self) -> Iterator[Any]:
        raise NotImplementedError

    def close(self) -> dict[str, Any]:
        """Frees what the way holds; returns facts to keep in its row."""
        return {}


class PinMemoryWay(Way):
    key = "pin_memory"

    def __init__(self, ds: Dataset, shape: Shape, workers: int, dev: torch.device) -> None:
        self.loader: DataLoader | None = make_loader(ds, shape, workers, pin=True)
        self.dev = dev

    def batches(self) -> Iterator[Any]:
        dev = self.dev
        # Leaving (or exhausting) this generator drops the loader's iterator: workers and pin
        # thread are shut down and joined.
        for x, y in self.loader:  # type: ignore[union-attr]
            yield x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)

    def close(self) -> dict[str, Any]:
        self.loader = None
        return {}


class PrefetchWay(Way):
    """pinxfer.prefetch over a DataLoader(pin_memory=False), staging or slots. One
    Prefetcher for all repeats of a group: each ``iter()`` is a new pass with fresh workers,
    and with slots the ring is made and page-locked once, as in a training run's epochs."""

    def __init__(
        self, ds: Dataset, shape: Shape, workers: int, dev: torch.device, slots: bool
    ) -> None:
        self.key = "slots" if slots else "staging"
        loader = make_loader(ds, shape, workers, pin=False)
        # slot_bytes given: the ring is sized (and pinned) now, so no warm-up batch falls
        # back for 'sizing' and the first pass already runs on slots.
        self.pf: pinxfer.Prefetcher | None = pinxfer.prefetch(
            loader,
            device=dev,
            depth=DEPTH,
            slots=slots,
            slot_bytes=shape.slot_bytes if slots else None,
        )

    def batches(self) -> Iterator[Any]:
        return iter(self.pf)  # type: ignore[arg-type]

    def close(self) -> dict[str, Any]:
        pf, self.pf = self.pf, None
        if pf is None:
            return {}
        pf.close()  # the pass's thread joined first: nothing uses the ring after this
        if pf.slots is None:
            return {}
        st = pf.slots.stats()
        pf.slots.close()  # unpins and frees the ring now, not whenever pf is collected
        return {"slot_stats": st, "fallbacks_total": sum(st["fallbacks"].values())}


def make_way(key: str, ds: Dataset, shape: Shape, workers: int, dev: torch.device) -> Way:
    if key == "pin_memory":
        return PinMemoryWay(ds, shape, workers, dev)
    return PrefetchWay(ds, shape, workers, dev, slots=(key == "slots"))


# ---- steps ----


class Compute:
    """The compute-bound step's matmuls: k products of one square matrix into a fixed
    output (no allocation, no growth of the values), calibrated on this device."""

    def __init__(self, dev: torch.device, n: int) -> None:
        self.dev = dev
        self.a = torch.randn(n, n, device=dev) / math.sqrt(n)
        self.out = torch.empty_like(self.a)
        self.k = 1

    def run(self, k: int) -> None:
        for _ in range(k):
            torch.mm(self.a, self.a, out=self.out)

    def seconds_per_matmul(self) -> float:
        self.run(5)  # warm (cuBLAS handle, kernels)
        sync(self.dev)
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            self.run(20)
            sync(self.dev)
            times.append((time.perf_counter() - t0) / 20)
        return statistics.median(times)


def make_step(kind: str, compute: Compute | None) -> Callable[[torch.Tensor], None]:
    if kind == "transfer_bound":
        return lambda x: x.sum()  # reads the batch: queued after its copy, nothing more

    assert compute is not None

    def step(x: torch.Tensor) -> None:
        x.sum()
        compute.run(compute.k)

    return step


# ---- one pass ----


@dataclasses.dataclass(frozen=True)
class Counts:
    warm: int  # first batches, with the workers' start-up: not timed
    timed: int
    tail: int  # drained untimed: keeps the workers busy until the last timed batch

    @property
    def total(self) -> int:
        return self.warm + self.timed + self.tail


def run_pass(
    way: Way,
    step: Callable[[torch.Tensor], None],
    counts: Counts,
    dev: torch.device,
    dist: Dist,
    check: Callable[[torch.Tensor, torch.Tensor], bool] | None,
) -> dict[str, Any]:
    """One pass: warm-up, timed batches (wall and trainer CPU), untimed tail to the end."""
    children0 = children_cpu()
    dist.barrier()  # before the workers start, not after the warm-up: waiting there would
    # let every loader queue fill up and the timed loop start on a backlog
    wall0 = time.perf_counter()
    it = way.batches()
    checked: bool | None = None
    for k in range(counts.warm):
        x, y = next(it)
        if k == 0 and check is not None:
            checked = check(x, y)
        step(x)
    sync(dev)
    cpu0, t0 = self_cpu(), time.perf_counter()
    for _ in range(counts.timed):
        x, y = next(it)
        step(x)
    sync(dev)
    seconds = time.perf_counter() - t0
    cpu = self_cpu() - cpu0
    del x, y
    # The tail runs the pass to its end: the loader shuts its workers down and joins them,
    # so RUSAGE_CHILDREN now holds their CPU time.
    drained = sum(1 for _ in it)
    del it
    sync(dev)
    if drained != counts.tail:
        raise RuntimeError(
            f"{way.key}: the pass yielded {counts.warm + counts.timed + drained} "
            f"batches, expected {counts.total}"
        )
    return {
        "seconds": seconds,
        "trainer_cpu_s": cpu,
        "worker_cpu_s_reaped": children_cpu() - children0,
        "check_ok": checked,
        "pass_wall_s": time.perf_counter() - wall0,
    }


def make_check(ds: CropImages, shape: Shape) -> Callable[[torch.Tensor, torch.Tensor], bool]:
    """The first batch of a pass rebuilt in the trainer: the bytes the way delivered must
    equal it (slots have never run on a GPU: a wrong offset would show here)."""
    want_x = torch.stack([ds[i][0] for i in range(shape.batch_size)])
    want_y = torch.arange(shape.batch_size)

    def check(x: torch.Tensor, y: torch.Tensor) -> bool:
        return bool(torch.equal(x.cpu(), want_x) and torch.equal(y.cpu(), want_y))

    return check


# ---- a group: one batch shape, one step kind, every way, every repeat ----


def run_group(
    shape: Shape,
    images: torch.Tensor,
    kind: str,
    ways: list[str],
    counts: Counts,
    repeats: int,
    workers: int,
    dev: torch.device,
    dist: Dist,
    compute: Compute | None,
) -> list[dict]:
    ds = CropImages(images, shape, counts.total * shape.batch_size)
    check = make_check(ds, shape)
    step = make_step(kind, compute)
    gb_timed = counts.timed * shape.batch_bytes / 1e9
    gb_pass = counts.total * shape.batch_bytes / 1e9
    made = {key: make_way(key, ds, shape, workers, dev) for key in ways}
    runs: dict[str, list[dict]] = {key: [] for key in ways}
    try:
        # Interleaved: drift over the run (clocks, page cache, other ranks) falls on every way
        # alike. In bench_loop's balanced orders: no way is always first after a barrier, nor
        # always after the same other way (what a way leaves behind falls on all alike), and
        # every rank runs the same orders.
        for r, order in enumerate(balanced_rounds(ways, repeats)):
            for key in order:
                runs[key].append(
                    run_pass(made[key], step, counts, dev, dist, check if r == 0 else None)
                )
    finally:
        extras = {key: way.close() for key, way in made.items()}
    rows = []
    for key in ways:
        secs = [p["seconds"] for p in runs[key]]
        cpu = [p["trainer_cpu_s"] / gb_timed for p in runs[key]]
        wcpu = [p["worker_cpu_s_reaped"] / gb_pass for p in runs[key]]
        rows.append(
            {
                "batch_mib": shape.batch_mib,
                "step": kind,
                "way": key,
                "way_desc": WAYS[key],
                "batch_bytes": shape.batch_bytes,
                "repeats": repeats,
                "timed_batches": counts.timed,
                "warmup_batches": counts.warm,
                "tail_batches": counts.tail,
                "workers": workers,
                "seconds": med_best(secs),
                "batches_per_s": {
                    "median": counts.timed / statistics.median(secs),
                    "best": counts.timed / min(secs),
                },
                "gbps": {
                    "median": gb_timed / statistics.median(secs),
                    "best": gb_timed / min(secs),
                },
                "trainer_cpu_s_per_gb": med_best(cpu),
                "worker_cpu_s_per_gb_reaped_children": med_best(wcpu),
                # the whole pass: worker start-up, warm-up, timed, tail, shutdown (for budgeting)
                "pass_wall_s": statistics.median([p["pass_wall_s"] for p in runs[key]]),
                "check_ok": runs[key][0]["check_ok"],
                **extras[key],
            }
        )
    return rows


# ---- ratios and targets ----


def target_for(name: str, kind: str) -> tuple[str, float] | None:
    for tname, op, bound, applies in TARGETS:
        if tname == name and applies in ("any", kind):
            return op, bound
    return None


def ratio_entry(name: str, kind: str, median: float, best: float) -> dict[str, Any]:
    entry: dict[str, Any] = {"median": median, "best": best}
    t = target_for(name, kind)
    if t is not None:
        op, bound = t
        entry["target"] = f"{op} {bound}"
        entry["met"] = median >= bound if op == ">=" else median <= bound
    return entry


def summarize(rows: list[dict], kind: str, pure: dict | None) -> dict[str, Any]:
    """Issue 13's ratios for one (batch size, step) group; each with the median of the
    repeats (ratio of medians) and the best (ratio of the best runs)."""
    by = {r["way"]: r for r in rows}
    out: dict[str, Any] = {"batch_mib": rows[0]["batch_mib"], "step": kind}
    s = by.get("slots")
    for other in ("pin_memory", "staging"):
        o = by.get(other)
        if s is None or o is None:
            continue
        out[f"slots_vs_{other}_batches_per_s"] = ratio_entry(
            f"slots_vs_{other}_batches_per_s",
            kind,
            s["batches_per_s"]["median"] / o["batches_per_s"]["median"],
            s["batches_per_s"]["best"] / o["batches_per_s"]["best"],
        )
        out[f"slots_vs_{other}_trainer_cpu_per_gb"] = ratio_entry(
            f"slots_vs_{other}_trainer_cpu_per_gb",
            kind,
            s["trainer_cpu_s_per_gb"]["median"] / o["trainer_cpu_s_per_gb"]["median"],
            s["trainer_cpu_s_per_gb"]["best"] / o["trainer_cpu_s_per_gb"]["best"],
        )
    if pure is not None:
        out["pure_compute_seconds"] = {"median": pure["median"], "best": pure["best"]}
        out["pure_compute_trainer_cpu_s"] = pure["trainer_cpu_s"]
        # The fed loop's CPU less what the same steps cost on a resident batch: the data
        # path's own CPU per GB (raw figures stay in trainer_cpu_s_per_gb).
        for r in rows:
            gb = r["timed_batches"] * r["batch_bytes"] / 1e9
            net = {
                q: max(0.0, r["trainer_cpu_s_per_gb"][q] - pure["trainer_cpu_s"][q] / gb)
                for q in ("median", "best")
            }
            r["trainer_data_cpu_s_per_gb"] = net
        for other in ("pin_memory", "staging"):
            o = by.get(other)
            if s is None or o is None or not o["trainer_data_cpu_s_per_gb"]["median"]:
                continue
            out[f"slots_vs_{other}_trainer_data_cpu_per_gb"] = ratio_entry(
                f"slots_vs_{other}_trainer_cpu_per_gb",
                kind,
                s["trainer_data_cpu_s_per_gb"]["median"] / o["trainer_data_cpu_s_per_gb"]["median"],
                s["trainer_data_cpu_s_per_gb"]["best"]
                / max(o["trainer_data_cpu_s_per_gb"]["best"], 1e-12),
            )
        out["step_vs_pure_compute"] = {}
        for r in rows:
            e = ratio_entry(
                "step_vs_pure_compute",
                kind,
                r["seconds"]["median"] / pure["median"],
                r["seconds"]["best"] / pure["best"],
            )
            r["step_vs_pure_compute"] = e
            out["step_vs_pure_compute"][r["way"]] = e
    out["all_checks_ok"] = all(r["check_ok"] is not False for r in rows)
    out["fallbacks_total"] = by["slots"]["fallbacks_total"] if "slots" in by else None
    return out


def pure_compute(
    step: Callable[[torch.Tensor], None],
    counts: Counts,
    repeats: int,
    dev: torch.device,
    dist: Dist,
    batch: torch.Tensor,
) -> dict:
    """The timed steps on a batch already on the device: what the fed loop should match.
    Also the trainer CPU those steps cost by themselves (launches, the final sync's wait),
    which the fed loops spend too: ``summarize`` subtracts it to give the data path's CPU."""
    x = batch.to(dev)
    for _ in range(2):
        step(x)
    sync(dev)
    times, cpus = [], []
    for _ in range(repeats):
        dist.barrier()
        cpu0, t0 = self_cpu(), time.perf_counter()
        for _ in range(counts.timed):
            step(x)
        sync(dev)
        times.append(time.perf_counter() - t0)
        cpus.append(self_cpu() - cpu0)
    return {**med_best(times), "trainer_cpu_s": med_best(cpus)}


# ---- driver ----


def machine_info(kind: str, dev: torch.device | None) -> dict[str, Any]:
    names, values, sources, _docs = zip(*pinxfer._C.settings())
    settings = {n: {"value": v, "source": s} for n, v, s in zip(names, values, sources)}
    cpu_model = None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu_model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info: dict[str, Any] = {
        "kind": kind,
        "host_cpus": os.cpu_count(),
        "affinity_cpus": len(os.sched_getaffinity(0)),
        "cpu_model": cpu_model,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "pinxfer": pinxfer.__version__,
        "build_info": pinxfer.build_info()._asdict(),
        # pinxfer.install() would make the pin_memory way use pinxfer's pool: it must not be
        "pinxfer_is_torch_host_allocator": pinxfer.is_installed(),
        "mp_start_method": multiprocessing.get_start_method(),
        "memlock_rlimit": list(resource.getrlimit(resource.RLIMIT_MEMLOCK)),
        "copy_threads": settings.get("PINXFER_NUM_THREADS", {}).get("value"),
        "settings": settings,
    }
    if dev is not None and dev.type == "cuda":
        info.update(
            gpu=torch.cuda.get_device_name(dev),
            gpu_index=dev.index,
            gpus_visible=torch.cuda.device_count(),
        )
    return info


def cuda_skip_reason() -> str | None:
    if not torch.cuda.is_available():
        why = pinxfer.cuda_unavailable_reason()
        return "torch.cuda.is_available() is False" + (f" ({why})" if why else "")
    return pinxfer.cuda_unavailable_reason()


def fmt(d: dict[str, float], spec: str) -> str:
    return f"{d['median']:{spec}} ({d['best']:{spec}})"


def print_rows(rows: list[dict], summary: dict, prefix: str = "") -> None:
    """One line per way (median (best)), then the group's ratios against their targets."""
    for r in rows:
        line = (
            f"{prefix}{r['batch_mib']:>5g} MiB {r['step']:15s} {r['way']:10s} "
            f"batches/s {fmt(r['batches_per_s'], '7.1f')}  GB/s {fmt(r['gbps'], '6.2f')}  "
            f"trainer CPU s/GB {fmt(r['trainer_cpu_s_per_gb'], '.3f')}  "
            f"worker CPU s/GB* {r['worker_cpu_s_per_gb_reaped_children']['median']:.3f}"
        )
        if "step_vs_pure_compute" in r:
            line += f"  step/pure {fmt(r['step_vs_pure_compute'], '.3f')}"
        if "trainer_data_cpu_s_per_gb" in r:
            line += f"  data-path CPU s/GB {fmt(r['trainer_data_cpu_s_per_gb'], '.3f')}"
        if "fallbacks_total" in r:
            st = r["slot_stats"]
            line += (
                f"  fallbacks {r['fallbacks_total']} of {st['batches']}"
                f" (pinned {st['pinned']}, {st['lock_kind']})"
            )
        if r["check_ok"] is False:
            line += "  BYTES DIFFER"
        print(line)
    for name, e in summary.items():
        if isinstance(e, dict) and "median" in e and name != "pure_compute_seconds":
            tgt = ""
            if "target" in e:
                tgt = f"  target {e['target']}: {'met' if e['met'] else 'NOT met'}"
            print(f"{prefix}      {name:42s} {e['median']:.3f} (best {e['best']:.3f}){tgt}")
    for way, e in summary.get("step_vs_pure_compute", {}).items():
        print(
            f"{prefix}      step_vs_pure_compute {way:21s} {e['median']:.3f} "
            f"(best {e['best']:.3f})"
            f"  target {e['target']}: {'met' if e['met'] else 'NOT met'}"
        )


def results_dir(kind: str) -> Path:
    """benchmarks/results/<kind without 'nvidia-' and '-x1'>, as bench_bus.py."""
    return RESULTS / kind.removeprefix("nvidia-").removesuffix("-x1")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--kind",
        default=os.environ.get("PINXFER_MACHINE_KIND", "unknown"),
        help="machine kind, e.g. nvidia-h100-x1 (stored; names the results folder)",
    )
    ap.add_argument(
        "--out",
        help="JSON path (default benchmarks/results/<kind>/loader.json; "
        "_rank<N> added under torchrun)",
    )
    ap.add_argument("--quick", action="store_true", help="half the timed batches, 2 repeats")
    ap.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="device='cpu', 2 workers, 4 MiB batches, few batches: the plumbing only",
    )
    ap.add_argument("--batch-mib", default="16,64", help="comma list of batch sizes in MiB")
    ap.add_argument("--batch-size", type=int, default=64, help="samples per batch")
    ap.add_argument("--dtype", choices=("float32", "float16"), default="float32")
    ap.add_argument("--pad", type=int, default=32, help="stored image side minus crop side")
    ap.add_argument("--workers", type=int, default=8, help="DataLoader workers per rank")
    ap.add_argument("--batches", type=int, default=30, help="timed batches per pass")
    ap.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="untimed first batches per pass (default workers + 2)",
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--compute-factor",
        type=float,
        default=3.0,
        help="compute-bound step = this x the slowest way's transfer-bound batch time",
    )
    args = ap.parse_args(argv)

    smoke = args.cpu_smoke
    if smoke:  # small enough for a 2-core machine without a GPU
        args.workers, args.batch_mib, args.batch_size = 2, "4", 16
        args.batches, args.repeats = 6, 2
        args.warmup = 2 if args.warmup is None else args.warmup
    if args.quick:
        args.batches, args.repeats = max(2, args.batches // 2), min(args.repeats, 2)
    warm = args.workers + 2 if args.warmup is None else args.warmup
    # Tail: the loader dispatches up to workers * prefetch_factor batches ahead of the
    # batch it yields, and prefetch holds depth + 1 more: that many after the last timed
    # batch keep every worker busy through it.
    counts = Counts(max(1, warm), args.batches, args.workers * PREFETCH_FACTOR + DEPTH + 2)
    dtype = getattr(torch, args.dtype)
    shapes = [
        Shape.for_mib(float(m), args.batch_size, args.pad, dtype) for m in args.batch_mib.split(",")
    ]

    skip = None if smoke else cuda_skip_reason()
    dist = Dist(init=skip is None)
    dev: torch.device | None = None
    if smoke:
        dev = torch.device("cpu")
    elif skip is None:
        dev = torch.device("cuda", dist.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(dev)

    report: dict[str, Any] = {
        "benchmark": "bench_loader",
        "issue": 13,
        "kind": args.kind,
        "rank": dist.rank,
        "world_size": dist.world,
        "local_rank": dist.local_rank,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "quick": args.quick,
        "cpu_smoke": smoke,
        "machine": machine_info(args.kind, dev),
        "config": {
            "device": str(dev) if dev is not None else None,
            "workers": args.workers,
            "prefetch_factor": PREFETCH_FACTOR,
            "prefetch_depth": DEPTH,
            "persistent_workers": False,
            "repeats": args.repeats,
            "warmup_batches": counts.warm,
            "timed_batches": counts.timed,
            "tail_batches": counts.tail,
            "compute_factor": args.compute_factor,
            "shapes": [s.describe() for s in shapes],
        },
        "targets": [{"ratio": n, "op": op, "bound": b, "step": k} for n, op, b, k in TARGETS],
        "notes": [
            "GB/s: 1e9 bytes of batch (images + labels) per second, timed batches only.",
            "trainer_cpu_s_per_gb: getrusage(RUSAGE_SELF) user+sys over the timed batches, every "
            "thread of the trainer process (pin thread, prefetch thread, pinxfer copy threads); "
            "the DataLoader workers are other processes and are not in it.",
            "worker_cpu_s_per_gb_reaped_children: getrusage(RUSAGE_CHILDREN) over a whole pass "
            "divided by all its batches (warm-up, timed, tail); RUSAGE_CHILDREN counts only "
            "children already reaped, which the pass's workers are once it has ended (joined by "
            "the loader), so it includes their start-up.",
            "median / best: of the repeats; ratios are of medians and of the best runs.",
            "compute_bound: x.sum() + k matmuls of a 2048x2048 fp32 matrix (CPU smoke: 256), k so "
            "that a step is compute_factor x the slowest way's transfer-bound time per batch; "
            "step_vs_pure_compute: the fed timed loop over the same steps on a batch already on "
            "the device.",
            "check_ok: the first batch of each way's first pass equals the dataset's bytes.",
        ],
        "rows": [],
        "summary": [],
        "calibration": [],
        "skipped": [],
    }
    ways = list(WAYS)
    if smoke:
        report["notes"].append(
            "CPU smoke run: device='cpu' (prefetch moves nothing, slots' "
            "default transfer clones each slot); proves the plumbing, the "
            "figures mean nothing and the targets are not expected to be met."
        )
        if not torch.cuda.is_available():
            ways.remove("pin_memory")
            report["skipped"].append(
                {
                    "way": "pin_memory",
                    "reason": "DataLoader(pin_memory=True) needs an accelerator "
                    "and torch.cuda.is_available() is False (torch would not pin)",
                }
            )

    t_all = time.perf_counter()
    if skip is not None:
        for s in shapes:
            for kind in STEPS:
                for key in ways:
                    report["skipped"].append(
                        {"batch_mib": s.batch_mib, "step": kind, "way": key, "reason": skip}
                    )
        print(f"bench_loader: skipping every row: {skip}")
    else:
        assert dev is not None
        if smoke:
            # A 2-core machine: the trainer's intra-op threads would fight the 2 workers (and
            # each other: a 256x256 matmul on 2 threads took 16 ms here against 0.4 on one).
            torch.set_num_threads(1)
        compute = Compute(dev, 256 if smoke else 2048)
        prefix = f"[rank {dist.rank}] " if dist.world > 1 else ""
        print(
            f"{prefix}bench_loader on {report['machine'].get('gpu', dev)}: median (best) of "
            f"{args.repeats} repeats of {counts.timed} timed batches; worker CPU* is "
            "RUSAGE_CHILDREN of the reaped workers over whole passes"
        )
        for shape in shapes:
            t_shape = time.perf_counter()
            images = make_images(shape, 4 * shape.batch_size)
            rows_tb: list[dict] = []
            for kind in STEPS:
                pure = None
                if kind == "compute_bound":
                    # "A few times longer than a batch's production": the slowest way's
                    # transfer-bound time per batch, so that every way can keep up.
                    slowest = max(rows_tb, key=lambda r: r["seconds"]["median"])
                    period = slowest["seconds"]["median"] / counts.timed
                    per_mm = compute.seconds_per_matmul()
                    compute.k = max(1, math.ceil(args.compute_factor * period / per_mm))
                    report["calibration"].append(
                        {
                            "batch_mib": shape.batch_mib,
                            "period_s": period,
                            "period_from_way": slowest["way"],
                            "matmul_s": per_mm,
                            "matmuls_per_step": compute.k,
                            "target_step_s": args.compute_factor * period,
                        }
                    )
                    ds = CropImages(images, shape, shape.batch_size)
                    x0 = torch.stack([ds[i][0] for i in range(shape.batch_size)])
                    pure = pure_compute(
                        make_step(kind, compute), counts, args.repeats, dev, dist, x0
                    )
                    del ds, x0
                rows = run_group(
                    shape,
                    images,
                    kind,
                    ways,
                    counts,
                    args.repeats,
                    args.workers,
                    dev,
                    dist,
                    compute if kind == "compute_bound" else None,
                )
                summary = summarize(rows, kind, pure)
                print_rows(rows, summary, prefix)
                report["rows"] += rows
                report["summary"].append(summary)
                if kind == "transfer_bound":
                    rows_tb = rows
            del images
            shape_s = time.perf_counter() - t_shape
            report.setdefault("shape_seconds", {})[str(shape.batch_mib)] = shape_s
            if dev.type == "cuda":
                torch.cuda.empty_cache()
                if hasattr(torch._C, "_host_emptyCache"):  # the pin_memory way's pinned cache
                    torch._C._host_emptyCache()
    report["total_seconds"] = time.perf_counter() - t_all
    dist.close()

    name = "loader_cpu_smoke.json" if smoke else "loader.json"
    out = Path(args.out) if args.out else results_dir(args.kind) / name
    if dist.world > 1:
        out = out.with_name(f"{out.stem}_rank{dist.rank}{out.suffix}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str))
    print(f"wrote {out} ({report['total_seconds']:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
