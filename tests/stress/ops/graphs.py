"""CUDA graph capture and replay of pinned copies (issue 23: graph pools of the installed
host allocator)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

import pinxfer
from tests.stress.tensors import MiB

if TYPE_CHECKING:
    from tests.stress.worker import Worker


def graph(w: Worker) -> None:
    """H2D copy_(non_blocking=True) from a pool-pinned buffer allocated before the capture (a
    static input) and, installed, D2H into a pinned buffer allocated inside it (the graph's
    private pool) plus one allocated and freed there; replayed with new host bytes from R,
    each replay checked. Runs with no other stress operation in flight (Op.alone:
    torch.cuda.Stream() hands out streams from a shared pool of 32, so a capture would take
    in another thread's work on the same stream), in relaxed capture mode (a graph pool
    maps and registers segments while its thread captures)."""
    env, rng = w.env, w.rng
    nbytes = rng.choice([1, 4096, 65536 + 3, 1 * MiB, 3 * MiB + 5])
    host_in = pinxfer.empty(nbytes, dtype=torch.uint8)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=env.device)
    cur = torch.cuda.current_stream()
    g = torch.cuda.CUDAGraph()
    w.side.wait_stream(cur)
    with torch.cuda.graph(g, stream=w.side, capture_error_mode="relaxed"):
        dev.copy_(host_in, non_blocking=True)
        dev2 = dev.add(1)
        host_out = None
        if w.installed:
            host_out = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            host_out.copy_(dev2, non_blocking=True)
            # Allocated and freed at once: free again, for this graph pool only.
            torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    cur.wait_stream(w.side)
    for _ in range(rng.randint(1, 3)):
        _off, g_bytes, h_bytes = w.sources.r_slice(torch.uint8, nbytes)
        host_in.copy_(h_bytes)
        g.replay()  # on the current stream
        env.sync(cur)
        w.checker.check("graph", [dev2.clone()], [g_bytes.add(1)], [{"nbytes": nbytes}])
        if host_out is not None:
            w.checker.check(
                "graph",
                [host_out.to(env.device)],
                [g_bytes.add(1)],
                [{"nbytes": nbytes, "d2h": True}],
            )
        w.rec.moved("graph", nbytes)
    env.sync(cur)
    del g, host_out, dev2  # releases the graph pool (installed: after a device sync)
