"""Where the stress runs: a CUDA device (every stream call real) or the CPU (no streams; the
operations that need a GPU are not drawn, see ops.plan)."""

from __future__ import annotations

import contextlib

import torch

from tests.stress.tensors import MiB


class Env:
    def __init__(self, device: torch.device, inject: float = 0.0, max_bytes: int = 64 * MiB):
        self.device = device
        self.cuda = device.type == "cuda"
        # Results on the device are contiguous and pinned where the docs say so; on the CPU
        # the pinned results keep their source's strides (pin_memory) and nothing is checked
        # for contiguity.
        self.strict = self.cuda
        self.inject = inject  # fraction of checks that get one corrupted byte (checker sanity)
        self.max_bytes = max_bytes
        self.r_bytes = max_bytes + MiB  # size of each thread's random buffer
        self.argmax_u8 = True  # argmax over uint8 works (else int32, more memory)
        # Host memory kinds a source can live in: torch's pinned memory needs a GPU.
        self.host_memories = (
            ("pageable", "pool", "torch_pinned") if self.cuda else ("pageable", "pool")
        )

    def probe(self) -> str:
        """Checks the reductions the checker uses on this device; returns a note."""
        flags = torch.tensor([0, 0, 1, 0, 1], dtype=torch.uint8, device=self.device)
        try:
            first = int(flags.argmax().item())
        except RuntimeError as err:
            self.argmax_u8 = False
            first = int(flags.to(torch.int32).argmax().item())
            note = f"argmax on uint8 failed ({str(err).splitlines()[0]}): using int32. "
        else:
            note = ""
        if first != 2:
            note += (
                f"argmax returned {first}, not the first maximum: first_bad_byte is some bad byte"
            )
        return note

    def first_true(self, ne: torch.Tensor) -> torch.Tensor:
        """Index of the first True of a 1-D bool tensor (0 if none), on the device."""
        if self.argmax_u8:
            return ne.view(torch.uint8).argmax()
        return ne.to(torch.int32).argmax()

    # streams (no-ops on the CPU)
    def new_stream(self):
        return torch.cuda.Stream(self.device) if self.cuda else None

    def stream_ctx(self, s):
        return torch.cuda.stream(s) if self.cuda else contextlib.nullcontext()

    def current_stream(self):
        return torch.cuda.current_stream(self.device) if self.cuda else None

    def wait_stream(self, waiter, signaller) -> None:
        if self.cuda:
            waiter.wait_stream(signaller)

    def sync(self, s) -> None:
        if self.cuda:
            s.synchronize()

    def sleep(self, cycles: int) -> None:
        """Delays the current stream (a copy queued next starts late)."""
        if self.cuda and hasattr(torch.cuda, "_sleep"):
            torch.cuda._sleep(cycles)

    def torch_pinned_empty(self, shape, dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def h2d_trusted(self, t: torch.Tensor) -> torch.Tensor:
        """A host tensor's values where the checker compares them: on a GPU torch's
        synchronous host -> device copy (the reference path; it keeps strides); on the CPU
        a copy, so that later writes to ``t`` do not change what is checked."""
        return t.to(self.device) if self.cuda else t.clone()
