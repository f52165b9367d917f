"""The pinned pool on a real GPU: DMA-pinned memory, correct copies, and
event-gated reuse (a block is never handed out while a copy may read it)."""

from __future__ import annotations

import pytest
import torch

import pinxfer

pytestmark = pytest.mark.gpu
MiB = 1 << 20
KiB = 1 << 10
SLEEP_CYCLES = 2_000_000_000  # ~1 s of GPU time on an H100/H200 at ~1.9 GHz


@pytest.fixture(autouse=True)
def _clean(fresh_pool):
    torch.cuda.synchronize()
    yield
    torch.cuda.synchronize()


def test_pool_tensor_is_pinned_for_cuda():
    t = pinxfer.empty(1000, dtype=torch.float32)
    assert t.is_pinned()
    assert pinxfer.lock_kind(t) == "cuda_registered"
    assert pinxfer.memory_stats()["reserved_bytes.cuda_registered"] > 0


@pytest.mark.parametrize("nbytes", [1, 4097, 3 * MiB + 3, 64 * MiB])
def test_h2d_and_d2h_round_trip_random_data(nbytes):
    src = pinxfer.empty(nbytes, dtype=torch.uint8)
    src.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev.copy_(src, non_blocking=True)
    back = pinxfer.empty(nbytes, dtype=torch.uint8)
    back.fill_(0)
    back.copy_(dev, non_blocking=True)
    torch.cuda.current_stream().synchronize()
    assert torch.equal(back, src)


def test_block_not_reused_while_a_slow_copy_on_another_stream_reads_it():
    side = torch.cuda.Stream()
    a = pinxfer.empty(8 * MiB, dtype=torch.uint8)
    a.copy_(torch.randint(0, 256, (8 * MiB,), dtype=torch.uint8))
    expected = a.clone()
    ptr = a.data_ptr()
    dev = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)  # the copy below starts ~1 s from now
        dev.copy_(a, non_blocking=True)
        pinxfer.record_stream(a, side)
    del a  # freed while the copy is still queued behind the sleep
    s = pinxfer.memory_stats()
    assert s["pending_blocks.current"] == 1
    b = pinxfer.empty(8 * MiB, dtype=torch.uint8)
    assert b.data_ptr() != ptr, "a block was handed out while a copy could still read it"
    b.fill_(0xEE)  # scribbling on the new block must not reach the copy
    side.synchronize()
    assert torch.equal(dev.cpu(), expected)
    del b
    c = pinxfer.empty(8 * MiB, dtype=torch.uint8)  # the event completed: reuse is allowed
    assert c.data_ptr() in (ptr,) or pinxfer.memory_stats()["pending_blocks.current"] == 0


@pytest.mark.parametrize("skip_idle", [False, True], ids=["events", "idle_shortcut"])
def test_free_without_record_is_fenced_on_the_current_stream(skip_idle):
    # With the idle-stream shortcut on, a busy stream still gets its event.
    previous = pinxfer._C._set_skip_idle_streams(skip_idle)
    try:
        a = pinxfer.empty(4 * MiB, dtype=torch.uint8)
        a.fill_(9)
        ptr = a.data_ptr()
        dev = torch.empty(4 * MiB, dtype=torch.uint8, device="cuda")
        torch.cuda._sleep(SLEEP_CYCLES)
        dev.copy_(a, non_blocking=True)  # torch tells only its own allocator
        pending = pinxfer.memory_stats()["pending_blocks.current"]
        del a
    finally:
        pinxfer._C._set_skip_idle_streams(previous)
    assert pinxfer.memory_stats()["num_fenced_frees"] == 1
    assert pinxfer.memory_stats()["pending_blocks.current"] == pending + 1
    b = pinxfer.empty(4 * MiB, dtype=torch.uint8)
    assert b.data_ptr() != ptr
    b.fill_(1)
    torch.cuda.synchronize()
    assert bool((dev == 9).all())


@pytest.mark.parametrize("recorded", [True, False], ids=["recorded_use", "fenced"])
def test_a_block_freed_while_its_stream_is_idle_waits_for_no_event(recorded):
    # Every copy queued on the stream is done, so the free records no event and the block is
    # free at once; with the shortcut off the same free leaves it pending behind an event.
    stream = torch.cuda.Stream() if recorded else torch.cuda.current_stream()
    dev = torch.empty(2 * MiB, dtype=torch.uint8, device="cuda")
    for skip in (False, True):
        previous = pinxfer._C._set_skip_idle_streams(skip)
        try:
            a = pinxfer.empty(2 * MiB, dtype=torch.uint8)
            a.fill_(7)
            with torch.cuda.stream(stream):
                dev.copy_(a, non_blocking=True)
                if recorded:
                    pinxfer.record_stream(a, stream)
            stream.synchronize()  # the copy has read the block: the stream is idle
            before = pinxfer.memory_stats()
            del a
            after = pinxfer.memory_stats()
            pending = after["pending_blocks.current"] - before["pending_blocks.current"]
            assert pending == (0 if skip else 1), (skip, before, after)
            assert after["num_fenced_frees"] - before["num_fenced_frees"] == (0 if recorded else 1)
            assert bool((dev == 7).all())
        finally:
            pinxfer._C._set_skip_idle_streams(previous)
            torch.cuda.synchronize()


def test_a_small_block_goes_to_the_bin_of_its_size_once_its_copy_is_done():
    side = torch.cuda.Stream()
    dev = torch.empty(64 * KiB, dtype=torch.uint8, device="cuda")
    a = pinxfer.empty(64 * KiB, dtype=torch.uint8)
    a.fill_(8)
    ptr = a.data_ptr()
    neighbour = pinxfer.empty(32 * KiB, dtype=torch.uint8)  # a's block cannot merge onwards
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES // 8)
        dev.copy_(a, non_blocking=True)
        pinxfer.record_stream(a, side)
    del a
    meanwhile = pinxfer.empty(64 * KiB, dtype=torch.uint8)  # kept: one block in the bin below
    assert meanwhile.data_ptr() != ptr  # a's block is still read
    side.synchronize()
    # The next allocation sees the event done and bins the block: best fit from the free
    # set would have split it for this smaller request.
    other = pinxfer.empty(32 * KiB, dtype=torch.uint8)
    assert other.data_ptr() != ptr
    again = pinxfer.empty(64 * KiB, dtype=torch.uint8)
    assert again.data_ptr() == ptr
    assert bool((dev == 8).all())
    del neighbour, other, again, meanwhile


def test_per_stream_queues_have_no_head_of_line_blocking():
    slow, fast = torch.cuda.Stream(), torch.cuda.Stream()
    x = pinxfer.empty(2 * MiB, dtype=torch.uint8)
    y = pinxfer.empty(6 * MiB, dtype=torch.uint8)
    y_ptr = y.data_ptr()
    dx = torch.empty(2 * MiB, dtype=torch.uint8, device="cuda")
    dy = torch.empty(6 * MiB, dtype=torch.uint8, device="cuda")
    with torch.cuda.stream(slow):
        torch.cuda._sleep(SLEEP_CYCLES)
        dx.copy_(x, non_blocking=True)
        pinxfer.record_stream(x, slow)
    with torch.cuda.stream(fast):
        dy.copy_(y, non_blocking=True)
        pinxfer.record_stream(y, fast)
    del x  # pending behind the slow stream
    del y
    fast.synchronize()
    z = pinxfer.empty(6 * MiB, dtype=torch.uint8)
    assert z.data_ptr() == y_ptr  # y came back although x, freed first, still waits
    assert pinxfer.memory_stats()["pending_blocks.current"] == 1
    slow.synchronize()


def test_cap_waits_for_in_flight_copies_before_out_of_memory():
    # Room for one more 8 MiB block on top of what is pinned now (memory that
    # earlier tests or to_device's copy machinery still hold counts against the cap).
    pinxfer.set_max_pinned_bytes(pinxfer.memory_stats()["reserved_bytes.current"] + 8 * MiB)
    side = torch.cuda.Stream()
    a = pinxfer.empty(8 * MiB, dtype=torch.uint8)
    dev = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES // 4)
        dev.copy_(a, non_blocking=True)
        pinxfer.record_stream(a, side)
    del a
    b = pinxfer.empty(8 * MiB, dtype=torch.uint8)  # must wait for the copy, then reuse
    assert b.numel() == 8 * MiB
    assert pinxfer.memory_stats()["num_event_waits"] >= 1


def test_install_routes_torch_pinned_allocations_and_events_to_the_pool():
    pinxfer.install()
    try:
        assert pinxfer.is_installed()
        t = torch.empty(3 * MiB, dtype=torch.uint8, pin_memory=True)
        assert pinxfer.is_pool_tensor(t) and t.is_pinned()
        p = torch.randn(1000).pin_memory()
        assert pinxfer.is_pool_tensor(p)
        # torch's copy_(non_blocking=True) now records its event with us.
        t.fill_(4)
        ptr = t.data_ptr()
        side = torch.cuda.Stream()
        dev = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda")
        with torch.cuda.stream(side):
            torch.cuda._sleep(SLEEP_CYCLES)
            dev.copy_(t, non_blocking=True)
        del t
        assert pinxfer.memory_stats()["pending_blocks.current"] >= 1
        u = torch.empty(3 * MiB, dtype=torch.uint8, pin_memory=True)
        assert u.data_ptr() != ptr
        u.fill_(0)
        side.synchronize()
        assert bool((dev == 4).all())
    finally:
        pinxfer.uninstall()
    assert not pinxfer.is_installed()
    v = torch.empty(1000, pin_memory=True)
    assert not pinxfer.is_pool_tensor(v) and v.is_pinned()


def test_memory_is_placed_on_the_gpu_numa_node():
    t = pinxfer.empty(16 * MiB, dtype=torch.uint8, numa_node=0)
    nodes = set(torch.ops.pinxfer.page_nodes(t))
    assert nodes == {0}, nodes
