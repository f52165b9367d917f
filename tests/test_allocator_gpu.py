"""The pinned pool on a real GPU: DMA-pinned memory, correct copies, and
event-gated reuse (a block is never handed out while a copy may read it)."""

from __future__ import annotations

import gc
import os
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

import pinxfer
from tests import fresh

pytestmark = pytest.mark.gpu
MiB = 1 << 20
KiB = 1 << 10
REPO = str(Path(__file__).resolve().parent.parent)
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


def _slow_copy_of_a_random_block(nbytes: int):
    """A pool tensor of random bytes and a copy of it to the GPU, queued on a side stream
    behind a ~1 s sleep and recorded there: (tensor, its bytes, the copy's target, stream)."""
    side = torch.cuda.Stream()
    a = pinxfer.empty(nbytes, dtype=torch.uint8)
    a.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
    expected = a.clone()
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)  # the copy below starts ~1 s from now
        dev.copy_(a, non_blocking=True)
        pinxfer.record_stream(a, side)
    return a, expected, dev, side


def test_block_not_reused_while_a_slow_copy_on_another_stream_reads_it():
    a, expected, dev, side = _slow_copy_of_a_random_block(8 * MiB)
    ptr = a.data_ptr()
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


@pytest.mark.parametrize("grow", [True, False], ids=["grow", "shrink"])
def test_resize_keeps_the_old_block_from_reuse_behind_its_copy(grow):
    """A pool tensor's storage resizes as torch's pinned ones do (session 31): resize_ takes a
    new block from the pool, copies the bytes both hold and frees the old block through the
    pool. A copy on another stream still reading the old block keeps it out of the pool until
    that copy is done; the new memory is pinned for CUDA and sends as a pinned source."""
    a, expected, dev, side = _slow_copy_of_a_random_block(8 * MiB)
    old_ptr = a.data_ptr()
    new_bytes = 12 * MiB if grow else 3 * MiB
    a.untyped_storage().resize_(new_bytes)  # the old block is freed behind the queued copy
    assert a.data_ptr() != old_ptr and a.untyped_storage().nbytes() == new_bytes
    assert pinxfer.is_pool_tensor(a) and a.is_pinned()
    assert pinxfer.lock_kind(a) == "cuda_registered"
    assert pinxfer.memory_stats()["pending_blocks.current"] >= 1
    kept = min(new_bytes, 8 * MiB)
    resized = torch.empty(0, dtype=torch.uint8).set_(a.untyped_storage())
    assert torch.equal(resized[:kept], expected[:kept])
    others = [pinxfer.empty(8 * MiB, dtype=torch.uint8) for _ in range(3)]
    for o in others:
        assert o.data_ptr() != old_ptr, "a block was handed out while a copy could still read it"
        o.fill_(0xEE)  # scribbling on new blocks must not reach the queued copy
    side.synchronize()
    assert torch.equal(dev.cpu(), expected)
    # The resized tensor is a pinned source: one DMA, exact bytes.
    resized.copy_(torch.randint(0, 256, (new_bytes,), dtype=torch.uint8))
    sent = pinxfer.to_device(resized)
    torch.cuda.synchronize()
    assert torch.equal(sent.cpu(), resized)


@pytest.mark.parametrize("install_before_free", [False, True], ids=["plain", "install_between"])
@pytest.mark.parametrize("nbytes", [64 * KiB, 4 * MiB], ids=["fence_batch", "own_event"])
def test_free_without_record_is_fenced_on_the_current_stream(nbytes, install_before_free):
    # A small block waits in its stream's fence batch, a large one for an event of its own:
    # either way it is not reused while the copy torch did not report is queued. Installed
    # between the copy and the free, the fence is off for new blocks but not for this one
    # (it was binned at once; found by review, session 44).
    a = pinxfer.empty(nbytes, dtype=torch.uint8)
    a.fill_(9)
    ptr = a.data_ptr()
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    torch.cuda._sleep(SLEEP_CYCLES)
    dev.copy_(a, non_blocking=True)  # torch tells only its own allocator
    pending = pinxfer.memory_stats()["pending_blocks.current"]
    if install_before_free:
        pinxfer.install()
    try:
        del a
        assert pinxfer.memory_stats()["num_fenced_frees"] == 1
        assert pinxfer.memory_stats()["pending_blocks.current"] == pending + 1
        b = pinxfer.empty(nbytes, dtype=torch.uint8)
        assert b.data_ptr() != ptr
        b.fill_(1)
        torch.cuda.synchronize()
        assert bool((dev == 9).all())
    finally:
        pinxfer.uninstall()


def test_fenced_small_frees_share_one_event_per_batch():
    # Eight 16 KiB blocks (a batch closes at 8 blocks or 256 KiB) freed with no recorded use
    # while their copies wait behind a kernel: the eighth free records one event for the
    # eight. None is reused while the stream is busy (new allocations, scribbled on, leave
    # the copies intact); all come back after.
    n = 8
    dev = torch.empty(n, 16 * KiB, dtype=torch.uint8, device="cuda")
    blocks = [pinxfer.empty(16 * KiB, dtype=torch.uint8) for _ in range(n)]
    old = {b.data_ptr() for b in blocks}
    torch.cuda._sleep(SLEEP_CYCLES // 4)
    for i, b in enumerate(blocks):
        b.fill_(i + 1)
        dev[i].copy_(b, non_blocking=True)
    del b
    before = pinxfer.memory_stats()
    blocks.clear()
    after = pinxfer.memory_stats()
    assert after["num_fenced_frees"] - before["num_fenced_frees"] == n
    assert after["num_fence_markers"] - before["num_fence_markers"] == 1
    assert after["pending_blocks.current"] - before["pending_blocks.current"] == n
    fresh = [pinxfer.empty(16 * KiB, dtype=torch.uint8) for _ in range(n)]
    assert not old & {f.data_ptr() for f in fresh}, "a fenced block was reused while read"
    for f in fresh:
        f.fill_(0xEE)
    torch.cuda.synchronize()
    for i in range(n):
        assert bool((dev[i] == i + 1).all()), i
    reused = {f.data_ptr() for f in fresh}
    del f
    fresh.clear()  # a second batch, flushed at its eighth free
    torch.cuda.synchronize()
    again = pinxfer.empty(16 * KiB, dtype=torch.uint8)  # both markers are done: a bin hit
    assert again.data_ptr() in old | reused
    assert pinxfer.memory_stats()["pending_blocks.current"] == before["pending_blocks.current"]


def test_a_fence_batch_closes_at_256_KiB():
    # Four 64 KiB frees fill a batch by bytes: the fourth records its event, the fifth starts
    # the next batch.
    blocks = [pinxfer.empty(64 * KiB, dtype=torch.uint8) for _ in range(5)]
    markers = pinxfer.memory_stats()["num_fence_markers"]
    for count in range(1, 6):
        blocks.pop()
        expected = markers + (1 if count >= 4 else 0)
        assert pinxfer.memory_stats()["num_fence_markers"] == expected, count


def test_empty_cache_flushes_a_fence_batch_short_of_its_size():
    # One fenced free leaves a batch of one with no event; empty_cache records its marker,
    # waits for it and gives the segment back.
    dev = torch.empty(64 * KiB, dtype=torch.uint8, device="cuda")
    before = pinxfer.memory_stats()
    a = pinxfer.empty(64 * KiB, dtype=torch.uint8)
    a.fill_(3)
    dev.copy_(a, non_blocking=True)
    del a
    mid = pinxfer.memory_stats()
    assert mid["pending_blocks.current"] == before["pending_blocks.current"] + 1
    assert mid["num_fence_markers"] == before["num_fence_markers"]
    pinxfer.empty_cache()
    after = pinxfer.memory_stats()
    assert after["num_fence_markers"] == before["num_fence_markers"] + 1
    assert after["pending_blocks.current"] == before["pending_blocks.current"]
    assert after["reserved_bytes.current"] == before["reserved_bytes.current"]
    assert bool((dev == 3).all())


def _bytes_no_cached_block_fits() -> int:
    """A large request that must miss whatever earlier tests left cached (run one after
    another, e.g. under memcheck, a 4 MiB request found a free block and flushed nothing)."""
    cached = pinxfer.memory_stats()["cached_bytes.current"]
    return 4 * MiB + (cached + MiB - 1) // MiB * MiB


def test_a_miss_flushes_the_fence_batches():
    # A request no cached block fits gives the waiting batches their markers, so their
    # blocks come back once their copies are done rather than after more frees.
    dev = torch.empty(64 * KiB, dtype=torch.uint8, device="cuda")
    a = pinxfer.empty(64 * KiB, dtype=torch.uint8)
    dev.copy_(a, non_blocking=True)
    ptr = a.data_ptr()
    del a
    markers = pinxfer.memory_stats()["num_fence_markers"]
    big = pinxfer.empty(_bytes_no_cached_block_fits(), dtype=torch.uint8)  # a large-pool miss
    assert pinxfer.memory_stats()["num_fence_markers"] == markers + 1
    torch.cuda.synchronize()
    again = pinxfer.empty(64 * KiB, dtype=torch.uint8)
    assert again.data_ptr() == ptr  # its marker is done: back through its bin
    del big, again


def _block_fenced_on_a_side_stream():
    """A 64 KiB pool block copied to the GPU on a side stream and freed there with no recorded
    use, so it waits in that stream's fence batch: (the stream, the copy's target, the
    block's address)."""
    side = torch.cuda.Stream()
    dev = torch.empty(64 * KiB, dtype=torch.uint8, device="cuda")
    with torch.cuda.stream(side):
        a = pinxfer.empty(64 * KiB, dtype=torch.uint8)
        dev.copy_(a, non_blocking=True)
        ptr = a.data_ptr()
        del a  # no recorded use: fenced on `side`, its current stream
    return side, dev, ptr


def test_a_fence_batch_flushed_while_its_stream_captures_is_held():
    # Frees fenced on a stream that then begins a capture: an event recorded now would be a
    # node of the graph, so the flush (here: a miss on another stream) holds the batch.
    side, dev, ptr = _block_fenced_on_a_side_stream()
    before = pinxfer.memory_stats()
    miss_bytes = _bytes_no_cached_block_fits()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=side, capture_error_mode="relaxed"):
        dev.add_(1)
        with torch.cuda.stream(torch.cuda.default_stream()):
            big = pinxfer.empty(miss_bytes, dtype=torch.uint8)  # a miss: flushes the batches
    after = pinxfer.memory_stats()
    assert after["held_blocks.current"] == before["held_blocks.current"] + 1
    assert after["pending_blocks.current"] == before["pending_blocks.current"] - 1
    assert after["num_fence_markers"] == before["num_fence_markers"]
    torch.cuda.synchronize()
    again = pinxfer.empty(64 * KiB, dtype=torch.uint8)
    assert again.data_ptr() != ptr  # held: not handed out
    del big, again, g


def _capture_begun_during_a_held_record(work_on_another_thread, side, dev, capture_error_mode):
    """Runs work_on_another_thread (a free, or an allocation that flushes a fence batch) on
    a thread of its own while the pool holds every event record after its capture check
    (_hold_use_records), begins a capture on `side` once the worker's record waits there,
    and lets the record go inside the capture: the capture takes it. The worker's free runs
    without the GIL (torch releases it around a tensor's deleter), so the main thread runs
    meanwhile. Then checks that the block (or batch) is held, not handed out, and given back
    by empty_cache; returns the pool's stats from before and after the capture."""
    gc.collect()  # no pool tensor freed by the main thread while the worker's record waits
    before = pinxfer.memory_stats()
    failure = []

    def worker_body():
        try:
            work_on_another_thread()
        except BaseException as exc:  # re-raised on the main thread
            failure.append(exc)

    worker = threading.Thread(target=worker_body)
    g = torch.cuda.CUDAGraph()
    pinxfer._C._hold_use_records(True)
    try:
        worker.start()
        deadline = time.monotonic() + 10
        while pinxfer._C._use_records_waiting() == 0:
            assert time.monotonic() < deadline and worker.is_alive(), "no record reached the hold"
            time.sleep(0.001)
        with torch.cuda.graph(g, stream=side, capture_error_mode=capture_error_mode):
            dev.add_(1)
            pinxfer._C._hold_use_records(False)
            worker.join()  # its record goes into this capture
    finally:
        pinxfer._C._hold_use_records(False)
        worker.join()
    if failure:
        raise failure[0]
    after = pinxfer.memory_stats()
    g.replay()
    torch.cuda.synchronize()
    del g
    return before, after


def _check_held_then_given_back(before, after, ptr):
    assert after["held_blocks.current"] == before["held_blocks.current"] + 1, (before, after)
    again = pinxfer.empty(64 * KiB, dtype=torch.uint8)
    assert again.data_ptr() != ptr  # held: not handed out
    del again
    pinxfer.empty_cache()  # synchronizes, then gives held blocks back
    assert pinxfer.memory_stats()["held_blocks.current"] == before["held_blocks.current"]


def test_a_capture_begun_between_a_frees_check_and_its_event_record_holds_the_block():
    """A block freed on one thread while another begins a capture on the stream that read
    it: the free asked the stream (not capturing), then recorded its event, which the
    capture took. That event says nothing of the copy queued before the capture, so the
    free holds the block as a free under a capture does (found by review in session 44;
    until session 48 the block waited for the captured event, whose query fails, and was
    poisoned). In torch's default capture mode: the free's calls leave the capture valid."""
    side = torch.cuda.Stream()
    dev = torch.empty(64 * KiB, dtype=torch.uint8, device="cuda")
    a = pinxfer.empty(64 * KiB, dtype=torch.uint8)
    with torch.cuda.stream(side):
        dev.copy_(a, non_blocking=True)
        pinxfer.record_stream(a, side)  # a recorded use: the free records an event of its own
    ptr = a.data_ptr()
    last_reference = [a]
    del a
    before, after = _capture_begun_during_a_held_record(
        last_reference.clear, side, dev, capture_error_mode="global"
    )
    assert after["pending_blocks.current"] == before["pending_blocks.current"], (before, after)
    _check_held_then_given_back(before, after, ptr)


def test_a_capture_begun_between_a_fence_flush_check_and_its_marker_holds_the_batch():
    """The same race for a fence batch: its marker is recorded at a flush (here a miss on
    another thread), after the flush asked the stream; a capture begun in between took the
    marker, so the batch is held and the marker never waited for. Relaxed capture: the
    worker's miss maps a segment during the capture."""
    side, dev, ptr = _block_fenced_on_a_side_stream()
    miss_bytes = _bytes_no_cached_block_fits()
    made = []
    before, after = _capture_begun_during_a_held_record(
        lambda: made.append(pinxfer.empty(miss_bytes, dtype=torch.uint8)),
        side,
        dev,
        capture_error_mode="relaxed",
    )
    assert after["pending_blocks.current"] == before["pending_blocks.current"] - 1
    assert after["num_fence_markers"] == before["num_fence_markers"], (before, after)
    made.clear()
    _check_held_then_given_back(before, after, ptr)


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


def _pinned_then_freed_after_its_copy(nbytes: int, fill: int) -> int:
    """pin_memory of `nbytes`, sent with a copy torch reports to no one, then freed (a
    fenced free: it joins the current stream's fence batch). Returns its address."""
    pinned = pinxfer.pin_memory(torch.full((nbytes,), fill, dtype=torch.uint8))
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev.copy_(pinned, non_blocking=True)
    torch.cuda.synchronize()
    ptr = pinned.data_ptr()
    del pinned
    return ptr


# Sizes whose fenced free leaves its batch open (a batch closes at 256 KiB).
@pytest.mark.parametrize("nbytes", [64 * KiB, 200 * KiB], ids=["64K", "200K"])
def test_pin_memory_takes_its_block_back_when_the_stream_is_idle(nbytes):
    # The block waits in a batch no marker covers yet; the stream has run everything queued
    # on it, so one query proves its copy done and the next pin_memory of that size writes
    # the block it wrote last (still in the core's caches) instead of another one.
    ptr = _pinned_then_freed_after_its_copy(nbytes, 5)
    before = pinxfer.memory_stats()
    assert before["pending_blocks.current"] >= 1
    again = pinxfer.pin_memory(torch.full((nbytes,), 6, dtype=torch.uint8))
    after = pinxfer.memory_stats()
    assert again.data_ptr() == ptr
    assert after["num_idle_reclaims"] == before["num_idle_reclaims"] + 1
    assert after["pending_blocks.current"] < before["pending_blocks.current"]
    assert bool((again == 6).all())


def test_pin_memory_leaves_a_fenced_block_its_queued_copy_still_reads():
    nbytes = 64 * KiB
    first = pinxfer.pin_memory(torch.full((nbytes,), 7, dtype=torch.uint8))
    ptr = first.data_ptr()
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    torch.cuda._sleep(SLEEP_CYCLES // 4)
    dev.copy_(first, non_blocking=True)  # queued behind the sleep; torch tells no one
    del first
    before = pinxfer.memory_stats()
    second = pinxfer.pin_memory(torch.full((nbytes,), 9, dtype=torch.uint8))
    assert second.data_ptr() != ptr, "a fenced block was taken back while its copy is queued"
    assert pinxfer.memory_stats()["num_idle_reclaims"] == before["num_idle_reclaims"]
    torch.cuda.synchronize()
    assert bool((dev == 7).all())
    assert bool((second == 9).all())


def test_idle_reclaim_asks_only_the_current_stream():
    # A block fenced on a side stream is in that stream's FIFO: a pin_memory on the default
    # stream does not query for it (it comes back through its marker, as before).
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        ptr = _pinned_then_freed_after_its_copy(64 * KiB, 1)
    before = pinxfer.memory_stats()
    again = pinxfer.pin_memory(torch.full((64 * KiB,), 2, dtype=torch.uint8))
    assert again.data_ptr() != ptr
    assert pinxfer.memory_stats()["num_idle_reclaims"] == before["num_idle_reclaims"]


def test_empty_does_not_query_the_stream():
    # pinxfer.empty's caller may not write the block at once: nothing to gain from the query.
    dev = torch.empty(64 * KiB, dtype=torch.uint8, device="cuda")
    a = pinxfer.empty(64 * KiB, dtype=torch.uint8)
    dev.copy_(a, non_blocking=True)
    torch.cuda.synchronize()
    ptr = a.data_ptr()
    del a
    before = pinxfer.memory_stats()
    b = pinxfer.empty(64 * KiB, dtype=torch.uint8)
    assert b.data_ptr() != ptr
    assert pinxfer.memory_stats()["num_idle_reclaims"] == before["num_idle_reclaims"]


def test_idle_reclaim_during_another_streams_global_capture_keeps_the_graph():
    # torch captures in its default (global) mode on a side stream; this thread then asks
    # the default stream whether it is idle. The query runs in relaxed mode, so it neither
    # fails nor invalidates the capture, and the graph replays.
    ptr = _pinned_then_freed_after_its_copy(64 * KiB, 3)
    side = torch.cuda.Stream()
    dev = torch.zeros(16, device="cuda")
    graph = torch.cuda.CUDAGraph()
    before = pinxfer.memory_stats()
    with torch.cuda.graph(graph, stream=side):
        dev.add_(1)
        with torch.cuda.stream(torch.cuda.default_stream()):
            again = pinxfer.pin_memory(torch.full((64 * KiB,), 4, dtype=torch.uint8))
    assert again.data_ptr() == ptr
    assert pinxfer.memory_stats()["num_idle_reclaims"] == before["num_idle_reclaims"] + 1
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    assert bool((dev == 2).all())
    assert bool((again == 4).all())
    del graph


def test_idle_reclaim_off_waits_for_the_marker():
    code = """
        import torch, pinxfer
        n = 64 << 10
        p = pinxfer.pin_memory(torch.full((n,), 5, dtype=torch.uint8))
        dev = torch.empty(n, dtype=torch.uint8, device="cuda")
        dev.copy_(p, non_blocking=True)
        torch.cuda.synchronize()
        ptr = p.data_ptr()
        del p
        again = pinxfer.pin_memory(torch.full((n,), 6, dtype=torch.uint8))
        assert again.data_ptr() != ptr
        assert pinxfer.memory_stats()["num_idle_reclaims"] == 0
        print("ok")
    """
    env = dict(os.environ, PINXFER_IDLE_RECLAIM="off")
    proc = fresh.run(textwrap.dedent(code), env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


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


def test_a_pool_tensor_goes_to_the_pool_of_its_current_devices_node():
    # The node of the current device, whichever it is (each device's node is read from
    # sysfs; a host where all sit on one node answers without asking which is current).
    for index in range(torch.cuda.device_count()):
        node = pinxfer._ops.numa_node_for_device(index)
        with torch.cuda.device(index):
            before = pinxfer.memory_stats(numa_node=node)["num_allocs"]
            t = pinxfer.empty(4096, dtype=torch.uint8)
            assert pinxfer.memory_stats(numa_node=node)["num_allocs"] == before + 1, (index, node)
            del t


def test_memory_is_placed_on_the_gpu_numa_node():
    t = pinxfer.empty(16 * MiB, dtype=torch.uint8, numa_node=0)
    nodes = set(torch.ops.pinxfer.page_nodes(t))
    assert nodes == {0}, nodes
