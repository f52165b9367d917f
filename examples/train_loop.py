"""A plain training loop fed through ``pinxfer.prefetch``.

The batches live in ordinary (pageable) host memory, as they do when a program
builds them itself. ``pinxfer.prefetch`` copies batch i+1 to the GPU through
pinned staging buffers on a side stream while the model trains on batch i, so
the copy hides under compute instead of adding to it.

    python examples/train_loop.py --steps 50

Exits 0 after training, 77 (SKIPPED) when it cannot run here (no usable CUDA device),
so a script or CI can tell a skip from a pass; any other code is a failure.
"""

from __future__ import annotations

import argparse
import time

import torch

import pinxfer

# Exit status of a run that could not happen here (the automake/ctest "skipped" code).
SKIPPED = 77


def synthetic_batches(steps: int, batch_size: int, features: int, classes: int, pool: int = 4):
    """`steps` (x, y) pairs on the CPU, cycling over a few pre-built batches so the
    host is not the bottleneck. Labels follow a fixed random linear teacher, so
    the loss can actually go down."""
    gen = torch.Generator().manual_seed(0)
    teacher = torch.randn(features, classes, generator=gen)
    made = []
    for _ in range(min(pool, steps)):
        x = torch.randn(batch_size, features, generator=gen)
        made.append((x, (x @ teacher).argmax(dim=1)))
    for i in range(steps):
        yield made[i % len(made)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--features", type=int, default=4096)
    p.add_argument("--depth", type=int, default=2, help="batches in flight (prefetch depth)")
    args = p.parse_args()

    reason = pinxfer.cuda_unavailable_reason()
    if reason is not None:
        print(f"train_loop: needs a CUDA device ({reason}); skipping (exit 77)")
        return SKIPPED
    device = torch.device("cuda", torch.cuda.current_device())
    classes = 16
    model = torch.nn.Sequential(
        torch.nn.Linear(args.features, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, classes)
    ).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loss_fn = torch.nn.CrossEntropyLoss()

    batches = synthetic_batches(args.steps, args.batch_size, args.features, classes)
    losses = []
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for x, y in pinxfer.prefetch(batches, device=device, depth=args.depth):
        # x and y are already on `device`; the next batch is in flight meanwhile.
        loss = loss_fn(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    first, last = float(losses[0]), float(losses[-1])
    print(
        f"train_loop: {len(losses)} steps on {torch.cuda.get_device_name(device)}, "
        f"loss {first:.3f} -> {last:.3f}, {len(losses) * args.batch_size / seconds:,.0f} samples/s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
