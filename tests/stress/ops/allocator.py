"""The pool as an allocator and as torch's host allocator: blocks kept alive across other
operations, pinned tensors freed while a copy still reads or writes them (a block handed out
too early is overwritten, or overwrites), torch's pinned paths once installed, the cache's
maintenance calls."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

import pinxfer
from tests.stress.sources import DENSE_LAYOUTS, Leaf
from tests.stress.tensors import DTYPES, MiB, elsize

if TYPE_CHECKING:
    from tests.stress.worker import Worker

HELD_BLOCKS = 4  # pool blocks a thread keeps alive across its other operations
ITEM_DTYPES = [torch.int64, torch.int32, torch.int16, torch.uint8, torch.bool]


def pool_hold(w: Worker) -> None:
    """A pool block filled from R stays alive while the thread goes on allocating, freeing,
    copying; when it is freed (at random, or at the end: release_held) its bytes are
    checked. Two live blocks sharing memory, or a late copy landing in a block handed out
    again too early, show up as bad bytes."""
    leaf = w.sources.make_leaf(mems=("pool",), layouts=DENSE_LAYOUTS, cap=16 * MiB)
    if leaf.nbytes and not pinxfer.is_pool_tensor(leaf.base):
        w.rec.contract("pool_hold", "pinxfer.empty did not return a pool tensor", leaf.meta)
    w.held_blocks.append(leaf)
    w.rec.moved("pool_hold", leaf.nbytes)
    while len(w.held_blocks) > HELD_BLOCKS:
        _check_and_free(w, w.held_blocks.pop(w.rng.randrange(len(w.held_blocks))))


def _check_and_free(w: Worker, leaf: Leaf) -> None:
    got = w.env.h2d_trusted(leaf.base)
    leaf.drop_source()
    w.checker.check_leaves("pool_hold", [got], [leaf])


def release_held(w: Worker) -> None:
    """At the end of a thread's run: the blocks still held are checked and freed."""
    while w.held_blocks:
        _check_and_free(w, w.held_blocks.pop())


def _side_h2d(w: Worker, op: str, mem: str, record: bool) -> None:
    """A pinned host tensor copied on the side stream and freed at once; a new block of
    the same size is scribbled at once; the copy must still deliver the old bytes."""
    env = w.env
    leaf = w.sources.make_leaf(mems=(mem,), layouts=DENSE_LAYOUTS)
    t = leaf.base
    if mem == "torch_pinned" and w.installed and t.numel() and not pinxfer.is_pool_tensor(t):
        w.rec.contract(op, "torch.empty(pin_memory=True) did not come from the pool", leaf.meta)
    leaf.drop_source()
    shape, dtype = tuple(t.shape), t.dtype
    cur = env.current_stream()
    with env.stream_ctx(w.side):
        if w.rng.random() < 0.3:
            env.sleep(w.rng.randint(10_000, 1_000_000))  # the copy starts late
        d = t.to(env.device, non_blocking=True)
        if record:
            pinxfer.record_stream(t, w.side)
    del t
    junk = w.sources.alloc(mem, shape, dtype)
    w.sources.scribble(junk)
    env.wait_stream(cur, w.side)
    d.record_stream(cur)
    w.rec.moved(op, leaf.nbytes)
    w.checker.check_leaves(op, [d], [leaf], {"recorded": record})
    del junk


def pool_side_h2d(w: Worker) -> None:
    # Without install, torch tells only its own allocator about the copy: record_stream
    # is required (README, Limitations). Installed, torch reports it to the pool.
    record = (not w.installed) or w.rng.random() < 0.5
    _side_h2d(w, "pool_side_h2d", "pool", record)


def torch_pinned_side_h2d(w: Worker) -> None:
    _side_h2d(w, "torch_pinned_side_h2d", "torch_pinned", record=False)


def _d2h_free(w: Worker, op: str, mem: str, policy: str) -> None:
    """D2H copy_(non_blocking=True) into a pinned tensor freed at once. A new tensor of
    the same size, filled on the host, is read back twice (before and after the first
    copy is certainly done): a block handed out too early would be overwritten."""
    env, rng = w.env, w.rng
    dtype = rng.choice(DTYPES)
    es = elsize(dtype)
    numel = max(1, w.sources.sample_nbytes(16 * MiB) // es)
    g_off, g_bytes, _ = w.sources.r_slice(dtype, numel * es)
    g = g_bytes.view(dtype)
    h = w.sources.alloc(mem, (numel,), dtype)
    use_side = rng.random() < 0.5
    # policy "needed": record_stream where the docs require it (a side stream without
    # install; on the current stream the pool's fence at free covers the copy);
    # "optional": installed, torch reports copy_ to the pool; "never": torch's tensors.
    if policy == "needed":
        record = use_side or rng.random() < 0.5
    elif policy == "optional":
        record = rng.random() < 0.5
    else:
        record = False
    stream = w.side if use_side else env.current_stream()
    with env.stream_ctx(stream):
        if rng.random() < 0.5:
            env.sleep(rng.randint(10_000, 1_000_000))  # the copy lands late
        h.copy_(g, non_blocking=True)
        if record:
            pinxfer.record_stream(h, stream)
    del h
    leaf = w.sources.make_leaf(mems=(mem,), dtype=dtype, shape=(numel,))
    d1 = env.h2d_trusted(leaf.base)
    env.sync(stream)
    d2 = env.h2d_trusted(leaf.base)
    w.rec.moved(op, numel * es)
    w.checker.check_leaves(
        op,
        [d1, d2],
        [leaf, leaf],
        {"side_stream": use_side, "recorded": record, "d2h_r_offset": g_off},
    )


def pool_d2h_free(w: Worker) -> None:
    _d2h_free(w, "pool_d2h_free", "pool", "optional" if w.installed else "needed")


def torch_pinned_d2h_free(w: Worker) -> None:
    _d2h_free(w, "torch_pinned_d2h_free", "torch_pinned", "never")


def item(w: Worker) -> None:
    """``.item()`` of GPU scalars: torch's D2H scalar read through its pinned allocator."""
    rng = w.rng
    k = rng.randint(1, 8)
    vals, exps = [], []
    for _ in range(k):
        dtype = rng.choice(ITEM_DTYPES)
        _, g_bytes, _ = w.sources.r_slice(dtype, elsize(dtype))
        g = g_bytes.view(dtype)[0]
        vals.append(int(g.item()))
        exps.append(g.to(torch.int64))
    got = torch.tensor(vals, dtype=torch.int64, device=w.env.device)
    exp = torch.stack(exps)
    w.rec.moved("item", k * 8)
    w.checker.check("item", [got], [exp], [{"scalars": k}], transfers=k)


def copy_nb_del(w: Worker) -> None:
    """H2D ``copy_(non_blocking=True)`` from torch-pinned memory, the source deleted at once
    and a new block of its size scribbled: the installed pool must hold it for the copy."""
    env = w.env
    leaf = w.sources.make_leaf(mems=("torch_pinned",), layouts=DENSE_LAYOUTS)
    t = leaf.base
    leaf.drop_source()
    if w.rng.random() < 0.3:
        env.sleep(w.rng.randint(10_000, 1_000_000))
    d = torch.empty(tuple(t.shape), dtype=t.dtype, device=env.device)
    d.copy_(t, non_blocking=True)
    shape, dtype = tuple(t.shape), t.dtype
    del t
    junk = env.torch_pinned_empty(shape, dtype)
    w.sources.scribble(junk)
    w.rec.moved("copy_nb_del", leaf.nbytes)
    w.checker.check_leaves("copy_nb_del", [d], [leaf])
    del junk


def maintenance(w: Worker) -> None:
    """memory_stats (a snapshot with its keys), empty_cache, reset_peak_memory_stats, while
    the other threads allocate and copy."""
    r = w.rng.random()
    stats = pinxfer.memory_stats()
    if "num_allocs" not in stats:
        w.rec.contract("maintenance", "memory_stats() has no num_allocs")
    if r < 0.3:
        pinxfer.empty_cache()
    elif r < 0.4:
        pinxfer.reset_peak_memory_stats()
