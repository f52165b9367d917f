"""No leak over a million allocate/free cycles: after empty_cache() the pool's
reserved bytes and the process's locked memory (VmLck) are back where they
started, no block is active and every allocation was freed."""

from __future__ import annotations

import time

import pytest
import torch

import pinxfer

from .conftest import HAS_CUDA, vm_locked_kib

# A soak (a million allocate/free cycles; longer with CUDA, where every free records an
# event): deselected from the README's test command, run with `-m soak` by CI and
# scripts/gpu_check.sh (README "Tests").
pytestmark = pytest.mark.soak

MiB = 1 << 20


def test_million_cycles_leave_nothing_behind(fresh_pool):
    """10**6 pinxfer.empty calls of mixed sizes (small-pool sizes from 1 B to 1 MiB,
    large-pool sizes up to 6 MiB), 8 tensors alive at any time and a random one
    replaced each step, so blocks are split and coalesced all along (the large ones
    inside 32 MiB segments). Measured on the 2-core CI machine: about 15 s."""
    cycles, held = 10**6, 8
    g = torch.Generator().manual_seed(2024)
    # Three quarters small-pool requests (log-uniform 1 B .. 1 MiB), a quarter large
    # ones (1 MiB + 1 .. 6 MiB); drawn up front so the loop is allocations only.
    small = torch.exp2(torch.rand(cycles, generator=g) * 20).long().clamp_(1, MiB)
    large = torch.randint(MiB + 1, 6 * MiB, (cycles,), generator=g)
    is_large = torch.rand(cycles, generator=g) < 0.25
    sizes = torch.where(is_large, large, small).tolist()
    slots = torch.randint(0, held, (cycles,), generator=g).tolist()

    base_locked = vm_locked_kib()
    base = pinxfer.memory_stats()
    live: list = [None] * held
    empty, u8 = pinxfer.empty, torch.uint8
    start = time.perf_counter()
    for slot, n in zip(slots, sizes):
        live[slot] = empty(n, dtype=u8, numa_node=-1)  # frees the tensor it replaces
    elapsed = time.perf_counter() - start
    # The last tensors still work and do not overlap.
    for i, t in enumerate(live):
        t.fill_(i + 1)
    for i, t in enumerate(live):
        assert bool((t == i + 1).all())
    s = pinxfer.memory_stats()
    assert s["active_blocks.current"] == held
    assert s["num_allocs"] - s["num_frees"] == held
    live.clear()
    del t
    if HAS_CUDA:
        torch.cuda.synchronize()  # frees fenced on the current stream complete
    pinxfer.empty_cache()

    s = pinxfer.memory_stats()
    assert s["num_allocs"] == s["num_frees"] == cycles
    assert s["active_blocks.current"] == 0 and s["pending_blocks.current"] == 0
    assert s["requested_bytes.current"] == s["allocated_bytes.current"] == 0
    assert s["reserved_bytes.current"] == base["reserved_bytes.current"]
    assert s["segments.current"] == base["segments.current"]
    assert s["num_segment_maps"] == s["num_segment_unmaps"]
    assert s["num_cache_hits"] + s["num_cache_misses"] == cycles
    # The cache really served the loop. With CUDA every free is fenced on the current
    # stream, and a block is reused only once its event has completed.
    assert s["num_cache_hits"] > (0.5 if HAS_CUDA else 0.99) * cycles, s
    assert vm_locked_kib() <= base_locked + 4
    print(
        f"{cycles} cycles in {elapsed:.1f} s ({elapsed / cycles * 1e6:.1f} us each), "
        f"{s['num_segment_maps']} segment maps, reserved peak "
        f"{s['reserved_bytes.peak'] / MiB:.1f} MiB"
    )
