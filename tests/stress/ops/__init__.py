"""The stress operations and their table: name, weight (how often a thread draws it), what it
needs. ``plan`` says which run in a mode on this machine and why the others do not."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tests.stress.env import Env
from tests.stress.ops import allocator, graphs, pinning, prefetch, transfers

if TYPE_CHECKING:
    from tests.stress.worker import Worker


@dataclass(frozen=True)
class Op:
    name: str
    run: Callable[[Worker], None]
    weight: float
    needs_cuda: bool = True
    install_only: bool = False  # torch's own pinned paths, which reach the pool once installed
    # Runs with no other operation in flight in the process (a graph capture).
    alone: bool = False
    checks_bytes: bool = True  # its calls end in byte checks (the report must show some)
    # Why it cannot run on this machine (None: it can); asked once per mode.
    unavailable: Callable[[Env], str | None] | None = None
    # Run once by each thread after its last operation (blocks kept alive are checked).
    finish: Callable[[Worker], None] | None = None


OPS = [
    Op("to_device", transfers.to_device, 30),
    Op("to_device_batch", transfers.to_device_batch, 20),
    Op("prefetch", prefetch.prefetch, 6, needs_cuda=False),
    Op("to_host", transfers.to_host, 12),
    Op("pool_side_h2d", allocator.pool_side_h2d, 8),
    Op("pool_d2h_free", allocator.pool_d2h_free, 8),
    Op("pool_hold", allocator.pool_hold, 6, needs_cuda=False, finish=allocator.release_held),
    Op("pin_memory", pinning.pin_memory, 10, needs_cuda=False),
    Op(
        "pin_inplace",
        pinning.pin_inplace,
        4,
        needs_cuda=False,
        unavailable=pinning.pin_in_place_unavailable,
    ),
    Op("maintenance", allocator.maintenance, 0.3, needs_cuda=False, checks_bytes=False),
    Op("graph", graphs.graph, 1.5, alone=True),
    Op("torch_pinned_side_h2d", allocator.torch_pinned_side_h2d, 5, install_only=True),
    Op("torch_pin_memory", pinning.torch_pin_memory, 5, install_only=True),
    Op("item", allocator.item, 4, install_only=True),
    Op("copy_nb_del", allocator.copy_nb_del, 5, install_only=True),
    Op("torch_pinned_d2h_free", allocator.torch_pinned_d2h_free, 5, install_only=True),
]


def plan(env: Env, installed: bool) -> tuple[list[Op], dict[str, str]]:
    """The operations of a mode here, and {name: why not} for those of the mode that
    cannot run on this machine."""
    runnable, skipped = [], {}
    for op in OPS:
        if op.install_only and not installed:
            continue  # not part of this mode
        if op.needs_cuda and not env.cuda:
            skipped[op.name] = "needs a CUDA device"
            continue
        reason = op.unavailable(env) if op.unavailable else None
        if reason:
            skipped[op.name] = reason
            continue
        runnable.append(op)
    return runnable, skipped
