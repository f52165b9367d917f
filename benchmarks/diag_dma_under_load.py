"""Does the copy engine read host memory slower while the CPU copies beside it, and do DMAs
split over two or four streams, or a GPU kernel reading the pinned bytes itself, get that rate
back? (issue 22: the mid-size engine phase.)

diag_chunk_timeline shows a staged 8-64 MiB to_device's DMAs running at 41-46 GB/s on the
H100, where torch's pinned copy of the same size runs at 53-55, while pinxfer's threads stage
beside them. This times, torch only (no pinxfer), a pinned source sent to the GPU:

  alone_1       one DMA, the host idle
  load_1        one DMA while the main thread runs a host copy of `--load-factor` times the
                size (torch's copy_ of a pageable tensor into a pinned one: its OpenMP team)
  alone_S / load_S   the same bytes in S equal parts, part i on stream i (S = 2, 4), all
                queued before the first starts (the streams wait on one start event)
  written_1     one DMA of a source the main thread has just rewritten (torch's copy_ from a
                pageable tensor: cached stores, so its lines are dirty in the writers' caches,
                as pinxfer's cached staging stores leave them), the host idle
  sm_alone / sm_load / sm_written   no DMA: a kernel on the GPU's SMs reads the pinned source
                through its device mapping (unified addressing: the host pointer is valid on
                the device) and writes the destination (torch's bitwise_or with 0 over int32
                views). The copy engine keeps a bounded number of reads in flight over the
                bus, so when host memory answers slowly (the CPU loading it, or lines dirty in
                a core's cache) its rate falls; a kernel of many threads keeps far more in
                flight. This asks whether that holds on these hosts.
  mix_alone / mix_load   half the bytes by one DMA on stream 0, half by the kernel on stream 1
  kB_alone / kB_load / kB_written   (--grid B,...) the same read by a kernel of B blocks of 512
                threads (built here with torch.utils.cpp_extension.load_inline: 16-byte loads,
                four in flight per thread), to ask how few SMs keep the bus busy

Each timed by CUDA events (a start on the first stream, which the others wait on, and an end on
each stream: the latest end counts), behind a GPU sleep of about half a millisecond so that
every part is queued before the engine starts (`late_calls` counts calls where it was not); the
host load begins when the GPU reaches the start (the main thread waits for it after the
queueing), and lasts longer than the DMAs. Until a review of session 56 the sleep was about 30
µs and the load began right after the queueing on the main thread: the two- and four-stream
figures of session 56's files (`results/h100/dma_under_load*_2026-12-07_s56.json`) may hold some
of their queueing. Ways run in balanced orders, 20 rounds; median and minimum µs and GB/s.

    python benchmarks/diag_dma_under_load.py OUT.json [--sizes 8M,32M] [--rounds 20]
        [--load-factor 4]      (results/h100/dma_under_load*_2026-12-07_s56.json)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_loop import balanced_rounds, parse_sizes, size_label

STREAMS = (1, 2, 4)


def device_view(pinned: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """An int32 CUDA tensor over a pinned uint8 tensor's bytes (its host pointer, valid on the
    device under unified addressing; torch's pinned memory is mapped). It does not own them:
    `pinned` must outlive it."""
    storage = torch._C._construct_storage_from_data_pointer(pinned.data_ptr(), dev, pinned.numel())
    return torch.empty(0, dtype=torch.int32, device=dev).set_(
        storage, 0, (pinned.numel() // 4,), (1,)
    )


def kernel_read(src_view: torch.Tensor, dst: torch.Tensor, blocks: int = 0) -> None:
    """dst's bytes = the pinned bytes src_view maps, read by a kernel: torch's bitwise_or with
    0 (blocks 0: its own grid, over every SM) or the inline kernel of `blocks` blocks."""
    if blocks:
        _grid_kernel().read_host(src_view, dst.view(torch.int32), blocks)
    else:
        torch.bitwise_or(src_view, 0, out=dst.view(torch.int32))


_GRID_KERNEL_CUDA = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>

// Grid-stride copy in 16-byte words, four loads in flight per thread before their stores.
__global__ void read_host_kernel(const int4* __restrict__ src, int4* __restrict__ dst, size_t n) {
  const size_t stride = (size_t)gridDim.x * blockDim.x;
  size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
    const int4 a = src[i], b = src[i + stride], c = src[i + 2 * stride], d = src[i + 3 * stride];
    dst[i] = a; dst[i + stride] = b; dst[i + 2 * stride] = c; dst[i + 3 * stride] = d;
  }
  for (; i < n; i += stride) dst[i] = src[i];
}

void read_host(torch::Tensor src, torch::Tensor dst, int64_t blocks) {
  TORCH_CHECK(src.nbytes() == dst.nbytes() && src.nbytes() % 16 == 0, "sizes");
  read_host_kernel<<<blocks, 512, 0, c10::cuda::getCurrentCUDAStream()>>>(
      static_cast<const int4*>(src.data_ptr()), static_cast<int4*>(dst.data_ptr()),
      src.nbytes() / 16);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}
"""
_grid_module: Any = None


def _grid_kernel() -> Any:
    """The inline kernel's module, built on first use (about a minute)."""
    global _grid_module
    if _grid_module is None:
        from torch.utils.cpp_extension import load_inline

        _grid_module = load_inline(
            "pinxfer_diag_read_host",
            cpp_sources="void read_host(torch::Tensor src, torch::Tensor dst, int64_t blocks);",
            cuda_sources=_GRID_KERNEL_CUDA,
            functions=["read_host"],
            extra_cuda_cflags=["-O3"],
        )
    return _grid_module


def timed_send(
    src: torch.Tensor,
    dst: torch.Tensor,
    streams: list[torch.cuda.Stream],
    load: tuple[torch.Tensor, torch.Tensor] | None,
    rewrite: torch.Tensor | None = None,
    readers: tuple[str, ...] | None = None,
    src_view: torch.Tensor | None = None,
    blocks: int = 0,
) -> tuple[float, bool]:
    """(µs from the first DMA's start to the last one's end, by CUDA events; whether the GPU
    reached the start before every part was queued, which would put the queueing in the
    figure). The bytes go split evenly over `streams`, part i read by readers[i] ("dma": a
    copy_; "sm": kernel_read of `blocks` from src_view, src's device view; default all "dma");
    `load` (dst, src) is copied on the host from when the GPU reaches the start; `rewrite` is
    copied into `src` on the host just before."""
    readers = readers or ("dma",) * len(streams)
    if rewrite is not None:
        src.copy_(rewrite)
    first = streams[0]
    start = torch.cuda.Event(enable_timing=True)
    n = src.numel()
    bounds = [n * i // len(streams) for i in range(len(streams) + 1)]
    with torch.cuda.stream(first):
        torch.cuda._sleep(1_000_000)  # ~0.5 ms: every part queued before the engine starts
        start.record(first)
    ends = []
    for i, s in enumerate(streams):
        s.wait_event(start)
        with torch.cuda.stream(s):
            part = slice(bounds[i], bounds[i + 1])
            if readers[i] == "sm":
                assert src_view is not None and bounds[i] % 4 == 0 and bounds[i + 1] % 4 == 0
                kernel_read(src_view[bounds[i] // 4 : bounds[i + 1] // 4], dst[part], blocks)
            else:
                dst[part].copy_(src[part], non_blocking=True)
            e = torch.cuda.Event(enable_timing=True)
            e.record(s)
            ends.append(e)
    late = start.query()
    if load is not None:
        while not start.query():  # the load begins with the DMAs, not during the sleep
            pass
        load[0].copy_(load[1])
    for e in ends:
        e.synchronize()
    return max(start.elapsed_time(e) for e in ends) * 1e3, late


def measure(nbytes: int, rounds: int, load_factor: float, grids: list[int]) -> dict[str, Any]:
    dev = torch.device("cuda", torch.cuda.current_device())
    src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    src.random_(0, 255)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    load_n = int(nbytes * load_factor)
    load = (
        torch.empty(load_n, dtype=torch.uint8).pin_memory(),
        torch.randint(0, 255, (load_n,), dtype=torch.uint8),
    )
    streams = [torch.cuda.current_stream(dev)] + [torch.cuda.Stream(dev) for _ in range(3)]
    rewrite = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    src_view = device_view(src, dev)
    # way: (streams, host side, the reader of each stream's part, the kernel's blocks)
    ways: dict[str, tuple[int, str, tuple[str, ...], int]] = {
        f"{kind}_{s}": (s, kind, ("dma",) * s, 0) for kind in ("alone", "load") for s in STREAMS
    }
    ways["written_1"] = (1, "written", ("dma",), 0)
    for kind in ("alone", "load", "written"):
        ways[f"sm_{kind}"] = (1, kind, ("sm",), 0)
        for b in grids:
            ways[f"k{b}_{kind}"] = (1, kind, ("sm",), b)
    for kind in ("alone", "load"):
        ways[f"mix_{kind}"] = (2, kind, ("dma", "sm"), 0)

    late: dict[str, int] = dict.fromkeys(ways, 0)

    def send(way: str) -> float:
        s, kind, readers, blocks = ways[way]
        us, was_late = timed_send(
            src,
            dst,
            streams[:s],
            load if kind == "load" else None,
            rewrite if kind == "written" else None,
            readers,
            src_view,
            blocks,
        )
        late[way] += was_late
        return us

    times: dict[str, list[float]] = {w: [] for w in ways}
    for w in ways:  # warm-up
        send(w)
    torch.cuda.synchronize()
    expected = src.to(dev)
    for w in ways:  # every way delivers the source's bytes
        dst.zero_()
        s, kind, readers, blocks = ways[w]
        timed_send(src, dst, streams[:s], None, None, readers, src_view, blocks)
        torch.cuda.synchronize()
        assert torch.equal(dst, expected), f"{w}: wrong bytes"
    for order in balanced_rounds(list(ways), rounds):
        for w in order:
            times[w].append(send(w))
    out: dict[str, Any] = {}
    for w, ts in times.items():
        med, lo = statistics.median(ts), min(ts)
        out[w] = {
            "median_us": round(med, 1),
            "min_us": round(lo, 1),
            "gbps_median": round(nbytes / med / 1e3, 2),
            "late_calls": late[w],  # warm-up included: should be 0
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json_path")
    ap.add_argument("--sizes", default="8M,32M")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--load-factor", type=float, default=4.0)
    ap.add_argument(
        "--grid", default="", help="blocks of the inline kernel's ways, e.g. 8,16,32 (none: off)"
    )
    args = ap.parse_args()
    grids = [int(b) for b in args.grid.split(",") if b]
    result: dict[str, Any] = {
        "benchmark": "diag_dma_under_load",
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(),
        "kind": os.environ.get("PINXFER_MACHINE_KIND", "unknown"),
        "rounds": args.rounds,
        "load_factor": args.load_factor,
        "grids": grids,
        "sizes": {},
    }
    for nbytes in parse_sizes(args.sizes):
        cells = measure(nbytes, args.rounds, args.load_factor, grids)
        result["sizes"][size_label(nbytes)] = cells
        for w, c in cells.items():
            print(
                f"{size_label(nbytes):>6} {w:10} {c['median_us']:9.1f} us (min {c['min_us']:9.1f})"
                f" {c['gbps_median']:6.2f} GB/s"
            )
    with open(args.json_path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
