"""What prefetch's own Python costs a steady step on the sender road, with no GPU.

The caller's road hands a batch of plain CPU tensors to the device's C++ BatchSender
(submit_batch_if_plain of the next batch, take_batch of this one); everything else in a
step is prefetch's Python: the gate (capture check, one consumer at a time), the source's
next batch as a lease, the profiler check, the ticket's bookkeeping. diag_sender.py times
that on a GPU against the sender's real calls; this times it anywhere, by giving a pass a
stand-in sender whose two calls return at once (a token, then the batch), so that a change
to the step's Python can be measured on the machine it is written on.

    python benchmarks/diag_step_python.py [--steps 200000] [--rounds 5] [--json PATH]

Reported, microseconds per step, the minimum over rounds (the least disturbed): step
(Prefetcher iteration through the pass, as `for b in prefetch(...)` runs it), calls (the
stand-in's two calls alone, the floor), and python_us = step - calls. Without a usable CUDA
device the capture check (torch's C function, and its Python wrapper) is replaced by one
that answers False (there is no stream to ask); with one, the real check runs. Nothing here
touches a GPU or the sender: the figures are the step's Python only, never a transfer's.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import os
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
prefetch_mod = importlib.import_module("pinxfer.prefetch")  # pinxfer.prefetch is the function


class StandInSender:
    """BatchSender's two calls of a steady step, returning at once: the ticket is the
    batch itself, and take_batch gives it back."""

    def submit_batch_if_plain(self, batch: Any, chunk_bytes: int, num_buffers: int) -> Any:
        return batch

    def take_batch(self, ticket: Any) -> Any:
        return ticket

    def settle(self, ticket: Any) -> None:
        pass


def steady_pass(batches: list[dict]) -> Any:
    """A caller's-road pass over ``batches`` (repeated forever) whose sender is the
    stand-in, already in its steady state: one batch at the sender, as after next() has
    handed out the pass's first batch."""

    to = prefetch_mod.Delivery(torch.device("cuda", 0), None, 1 << 20, 4)
    leases = iter(prefetch_mod.StagedSource(itertools.cycle(batches)))
    p = prefetch_mod._CallerPass(leases, to, 2, False)
    p.sender = StandInSender()
    first = next(leases).batch  # batch 0: at the sender
    p.step = 1
    p.ahead = (
        prefetch_mod._SENT,
        prefetch_mod._Sent(first, prefetch_mod._TAKEN_APART_IN_C, first, 0),
        None,
    )
    return p


def time_steps(step: Any, steps: int, rounds: int) -> float:
    """The minimum over ``rounds`` of the mean microseconds of ``steps`` calls of step()."""
    for _ in range(min(steps, 1000)):
        step()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        best = min(best, (time.perf_counter() - t0) / steps * 1e6)
    return best


def measure(steps: int, rounds: int) -> dict[str, Any]:
    stand_in_capture = not torch.cuda.is_available()
    # The C function, and torch's Python wrapper of it (which older trees called).
    real_capture = (torch._C._cuda_isCurrentStreamCapturing, torch.cuda.is_current_stream_capturing)
    if stand_in_capture:
        torch._C._cuda_isCurrentStreamCapturing = lambda: False
        torch.cuda.is_current_stream_capturing = lambda: False
    try:
        batches = [{"x": torch.full((4,), float(i)), "y": torch.full((2,), i)} for i in range(8)]
        p = steady_pass(batches)

        def generate():  # Prefetcher._generate's loop
            while True:
                b = p.next()
                yield b
                del b

        it = generate()
        got = [int(next(it)["y"][0]) for _ in range(2 * len(batches))]
        assert got == [i % len(batches) for i in range(2 * len(batches))], got
        step_us = time_steps(it.__next__, steps, rounds)
        sender = StandInSender()
        calls_us = time_steps(
            lambda: sender.take_batch(sender.submit_batch_if_plain(batches[0], 1 << 20, 4)),
            steps,
            rounds,
        )
    finally:
        torch._C._cuda_isCurrentStreamCapturing, torch.cuda.is_current_stream_capturing = (
            real_capture
        )
    return {
        "step_us": step_us,
        "calls_us": calls_us,
        "python_us": step_us - calls_us,
        "capture_check": "stand-in (no CUDA)" if stand_in_capture else "torch's",
        "steps": steps,
        "rounds": rounds,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200_000, help="steps per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args()
    result = measure(args.steps, args.rounds)
    print(
        f"prefetch steady step with a stand-in sender: {result['step_us']:.2f} us "
        f"(the stand-in's calls {result['calls_us']:.2f}; prefetch's Python "
        f"{result['python_us']:.2f}; capture check: {result['capture_check']})"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
