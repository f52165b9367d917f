"""Distributed data parallel, one process per GPU, each prefetching to its own GPU.

Each rank selects its GPU before anything else, so pinxfer stages through
pinned memory on that GPU's NUMA node, and wraps its batches in
``pinxfer.prefetch(..., device=its GPU)``.

    torchrun --nproc_per_node=NUM_GPUS examples/ddp_torchrun.py --steps 50
    python examples/ddp_torchrun.py          # also runs alone, as a world of one

Exits 0 after training, 77 (SKIPPED) when it cannot run here (no usable CUDA device),
so a script or CI can tell a skip from a pass; any other code is a failure.
"""

from __future__ import annotations

import argparse
import os
import socket
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import pinxfer

# Exit status of a run that could not happen here (the automake/ctest "skipped" code).
SKIPPED = 77


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20, help="training steps per rank (default 20)")
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--features", type=int, default=4096)
    args = p.parse_args()

    reason = pinxfer.cuda_unavailable_reason()
    if reason is not None:
        print(f"ddp_torchrun: needs a CUDA device ({reason}); skipping (exit 77)")
        return SKIPPED
    # Outside torchrun: a world of one on this host.
    if "RANK" not in os.environ:
        os.environ.update(
            RANK="0",
            LOCAL_RANK="0",
            WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(_free_port()),
        )
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)  # first: pinxfer places staging memory by the current GPU
    dist.init_process_group("nccl", device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()

    classes = 16
    gen = torch.Generator().manual_seed(1234)  # same teacher on every rank
    teacher = torch.randn(args.features, classes, generator=gen)
    gen.manual_seed(rank)  # each rank its own shard of data
    pool = []
    for _ in range(min(4, args.steps)):
        x = torch.randn(args.batch_size, args.features, generator=gen)
        pool.append((x, (x @ teacher).argmax(dim=1)))
    batches = (pool[i % len(pool)] for i in range(args.steps))

    model = DDP(
        torch.nn.Sequential(
            torch.nn.Linear(args.features, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, classes)
        ).to(device),
        device_ids=[local_rank],
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    losses = []
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for x, y in pinxfer.prefetch(batches, device=device):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    summary = torch.tensor([float(losses[0]), float(losses[-1])], device=device)
    dist.all_reduce(summary)
    summary /= world
    if rank == 0:
        print(
            f"ddp_torchrun: world {world}, {len(losses)} steps per rank in {seconds:.2f} s, "
            f"mean loss {summary[0]:.3f} -> {summary[1]:.3f}, "
            f"{world * len(losses) * args.batch_size / seconds:,.0f} samples/s"
        )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
