"""A DataLoader with worker processes, its batches moved by ``pinxfer.prefetch``.

Workers build batches in pageable memory (``pin_memory=False``: no pin thread,
no second pass over every batch in the main process). ``pinxfer.prefetch`` takes
the loader as it is and stages each batch to the GPU through pinned buffers on a
side stream, a batch ahead of the model.

    python examples/dataloader_workers.py --steps 50 --workers 4
    python examples/dataloader_workers.py --slots   # opt-in: workers write into pinned slots
"""
from __future__ import annotations

import argparse
import itertools
import time

import torch
from torch.utils.data import DataLoader, Dataset

import pinxfer


class SyntheticImages(Dataset):
    """Deterministic fake images: sample i is the same in every worker and run."""

    def __init__(self, length: int, shape: tuple[int, ...] = (3, 224, 224), classes: int = 10) -> None:
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
    p.add_argument("--slots", action="store_true",
                   help="prefetch(loader, slots=True): workers collate into pinned shared-memory slots")
    args = p.parse_args()

    reason = pinxfer.cuda_unavailable_reason()
    if reason is not None:
        print(f"dataloader_workers: needs a CUDA device ({reason}); skipping")
        return 0
    device = torch.device("cuda", torch.cuda.current_device())
    loader = DataLoader(
        SyntheticImages(args.steps * args.batch_size),
        batch_size=args.batch_size,
        num_workers=args.workers,
        pin_memory=False,  # pinxfer stages the copy; no pin thread needed
        persistent_workers=False,
    )
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, stride=2), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(), torch.nn.Linear(16, 10),
    ).to(device)

    n = 0
    checksum = torch.zeros((), device=device)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    source = loader if args.slots else itertools.islice(loader, args.steps)  # slots needs the loader
    for images, labels in pinxfer.prefetch(source, device=device, slots=args.slots):
        assert images.device == device and labels.device == device
        with torch.no_grad():
            checksum += model(images).float().sum() + labels.sum()
        n += images.shape[0]
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    print(f"dataloader_workers: {n} samples in {seconds:.2f} s ({n / seconds:,.0f} samples/s) with "
          f"{args.workers} workers on {torch.cuda.get_device_name(device)}, checksum {float(checksum):.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
