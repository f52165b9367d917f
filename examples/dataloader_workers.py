"""A DataLoader with worker processes, its batches moved by ``pinxfer.prefetch``.

With ``pin_memory=False`` (no pin thread, no second pass over every batch in the
main process) ``pinxfer.prefetch`` takes the loader as it is: its workers collate
each batch straight into a pinned shared-memory slot, and the copy to the GPU reads
it there on a side stream, a batch ahead of the model. ``--no-slots`` opts out:
workers build batches in shared memory and pinxfer stages them through pinned buffers.

    python examples/dataloader_workers.py --steps 50 --workers 4
    python examples/dataloader_workers.py --no-slots

Exits 0 after training, 77 (SKIPPED) when it cannot run here (no usable CUDA device),
so a script or CI can tell a skip from a pass; any other code is a failure.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.utils.data import DataLoader, Dataset

import pinxfer

# Exit status of a run that could not happen here (the automake/ctest "skipped" code).
SKIPPED = 77


class SyntheticImages(Dataset):
    """Deterministic fake images: sample i is the same in every worker and run."""

    def __init__(
        self, length: int, shape: tuple[int, ...] = (3, 224, 224), classes: int = 10
    ) -> None:
        self.length, self.shape, self.classes = length, shape, classes

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        gen = torch.Generator().manual_seed(i)
        return torch.rand(self.shape, generator=gen), i % self.classes


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20, help="batches to consume (default 20)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=2, help="DataLoader worker processes (default 2)")
    p.add_argument(
        "--no-slots",
        action="store_true",
        help="prefetch(loader, slots=False): stage batches instead of batch slots",
    )
    args = p.parse_args()

    reason = pinxfer.cuda_unavailable_reason()
    if reason is not None:
        print(f"dataloader_workers: needs a CUDA device ({reason}); skipping (exit 77)")
        return SKIPPED
    device = torch.device("cuda", torch.cuda.current_device())
    loader = DataLoader(
        SyntheticImages(args.steps * args.batch_size),
        batch_size=args.batch_size,
        num_workers=args.workers,
        pin_memory=False,  # the workers write pinned slots; no pin thread needed
        persistent_workers=False,
    )
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, stride=2),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(16, 10),
    ).to(device)

    n = 0
    checksum = torch.zeros((), device=device)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    slots = False if args.no_slots else None  # None: slots, as for any worker-fed loader
    for images, labels in pinxfer.prefetch(loader, device=device, slots=slots):
        assert images.device == device and labels.device == device
        with torch.no_grad():
            checksum += model(images).float().sum() + labels.sum()
        n += images.shape[0]
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    print(
        f"dataloader_workers: {n} samples in {seconds:.2f} s ({n / seconds:,.0f} samples/s) with "
        f"{args.workers} workers on {torch.cuda.get_device_name(device)}, "
        f"checksum {float(checksum):.1f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
