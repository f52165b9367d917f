"""PyTorch Lightning: move batches with ``pinxfer.to_device``.

Lightning calls ``LightningModule.transfer_batch_to_device`` for every batch;
overriding it routes the host-to-GPU copy through pinxfer's pinned staging
buffers (chunked and pipelined) instead of ``batch.to(device)`` from pageable
memory. Skips cleanly when Lightning is not installed.

    pip install lightning
    python examples/lightning_hook.py --steps 50

Exits 0 after training, 77 (SKIPPED) when it cannot run here (no usable CUDA device, or
Lightning not installed), so a script or CI can tell a skip from a pass; any other code is
a failure.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import pinxfer

try:
    import lightning.pytorch as pl
except ImportError:
    try:
        import pytorch_lightning as pl  # the older package name
    except ImportError:
        pl = None


# Exit status of a run that could not happen here (the automake/ctest "skipped" code).
SKIPPED = 77


def make_module(features: int, classes: int):
    class PinxferModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(features, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, classes)
            )
            self.losses: list[float] = []

        def transfer_batch_to_device(self, batch, device, dataloader_idx):
            # pinxfer.to_device walks tuples/lists/dicts like Lightning's default
            # and stages pageable tensors through pinned memory.
            return pinxfer.to_device(batch, device=device)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.cross_entropy(self.net(x), y)
            self.losses.append(float(loss.detach()))
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    return PinxferModule()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--features", type=int, default=2048)
    args = p.parse_args()

    if pl is None:
        print("lightning_hook: Lightning not installed, skipping (exit 77; pip install lightning)")
        return SKIPPED
    reason = pinxfer.cuda_unavailable_reason()
    if reason is not None:
        print(f"lightning_hook: needs a CUDA device ({reason}); skipping (exit 77)")
        return SKIPPED

    classes = 16
    gen = torch.Generator().manual_seed(0)
    teacher = torch.randn(args.features, classes, generator=gen)
    x = torch.randn(args.steps * args.batch_size, args.features, generator=gen)
    data = torch.utils.data.TensorDataset(x, (x @ teacher).argmax(dim=1))
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch_size, pin_memory=False)

    module = make_module(args.features, classes)
    trainer = pl.Trainer(
        accelerator="gpu",
        devices=1,
        max_steps=args.steps,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    t0 = time.perf_counter()
    trainer.fit(module, loader)
    seconds = time.perf_counter() - t0
    losses = module.losses
    print(
        f"lightning_hook: {len(losses)} steps in {seconds:.2f} s, "
        f"loss {losses[0]:.3f} -> {losses[-1]:.3f} (batches moved by pinxfer.to_device)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
