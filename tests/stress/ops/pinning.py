"""Pinning: ``pinxfer.pin_memory`` of tensors and batches, ``pin_``/``unpin_`` of user memory,
and (installed) torch's ``Tensor.pin_memory()`` going to the pool. On a GPU the pinned
results are sent to the device and checked there; on the CPU they are checked themselves."""

from __future__ import annotations

import mmap
from typing import TYPE_CHECKING

import torch

import pinxfer
from tests.stress.batches import get_path, structure_diff
from tests.stress.env import Env
from tests.stress.tensors import MiB

if TYPE_CHECKING:
    from tests.stress.worker import Worker

# pin_ registers whole storages: a mapping of its own (pages no other tensor shares; a
# malloc'ed tensor may share a page with another thread's pin_, which CUDA refuses).
IN_PLACE_LAYOUTS = ["contig", "shaped", "scalar", "offset", "t", "step"]


def pin_memory(w: Worker) -> None:
    if w.rng.random() < 0.25:
        _pin_memory_batch(w)
    else:
        _pin_memory_tensor(w)


def _pin_memory_batch(w: Worker) -> None:
    """A nested batch of pageable and pool tensors: the structure kept, every leaf pinned,
    pool leaves returned as they are, the copies independent of their sources."""
    env = w.env
    obj, leaves = w.sources.make_batch(
        max_leaves=4, leaf_cap=16 * MiB, allow_gpu=False, mems=("pageable", "pageable", "pool")
    )
    p = pinxfer.pin_memory(obj)
    diff = structure_diff(obj, p, gpu_identity=False)
    if diff:
        w.rec.contract("pin_memory", diff)
        return
    for path, leaf in leaves:
        pt = get_path(p, path)
        if not leaf.nbytes:
            continue  # an empty tensor has no memory to pin
        if not pinxfer.is_pool_tensor(pt):
            w.rec.contract("pin_memory", "batch leaf not in the pool", leaf.meta)
        elif env.strict and not pt.is_pinned():
            w.rec.contract("pin_memory", "batch leaf not pinned", leaf.meta)
        if leaf.mem == "pool" and pt is not leaf.src:
            w.rec.contract("pin_memory", "a pinned leaf was copied", leaf.meta)
    for _, leaf in leaves:
        if leaf.mem == "pageable":
            w.sources.scribble(leaf.base)  # the pinned copy is independent of the source
        leaf.drop_source()
    out = pinxfer.to_device(p, env.device, non_blocking=True) if env.cuda else p
    del p, obj
    gots = [get_path(out, path) for path, _ in leaves]
    for _, leaf in leaves:
        w.rec.moved("pin_memory", leaf.nbytes)
    w.checker.check_leaves(
        "pin_memory", gots, [lf for _, lf in leaves], {"batch": True}, contiguous=env.cuda
    )


def _pin_memory_tensor(w: Worker) -> None:
    """One pageable tensor of any layout: dtype, shape and strides kept (torch's rule; an
    expanded view is materialised), the copy independent of its source."""
    env, rng = w.env, w.rng
    leaf = w.sources.make_leaf(mems=("pageable",))
    p = pinxfer.pin_memory(leaf.src)
    if p.dtype != leaf.src.dtype or p.shape != leaf.src.shape:
        w.rec.contract("pin_memory", f"got {p.dtype} {tuple(p.shape)}", leaf.meta)
        return
    if leaf.nbytes and not pinxfer.is_pool_tensor(p):
        w.rec.contract("pin_memory", "result not in the pool", leaf.meta)
    elif env.strict and leaf.nbytes and not p.is_pinned():
        w.rec.contract("pin_memory", "result not pinned", leaf.meta)
    if leaf.layout != "expand" and p.stride() != leaf.src.stride():
        w.rec.contract("pin_memory", f"strides {p.stride()}, source {leaf.src.stride()}", leaf.meta)
    if rng.random() < 0.5:
        w.sources.scribble(leaf.base)
    leaf.drop_source()
    if not env.cuda:
        how, out = "host", p  # the pinned copy itself, strides kept
    elif rng.random() < 0.5:
        how, out = "to_device", pinxfer.to_device(p, env.device, non_blocking=True)
    else:
        # On the current stream: without install the pool fences the free on it.
        how, out = "torch_to", p.to(env.device, non_blocking=True)
    del p
    w.rec.moved("pin_memory", leaf.nbytes)
    w.checker.check_leaves(
        "pin_memory", [out], [leaf], {"copy": how}, contiguous=how == "to_device"
    )


def pin_in_place_unavailable(env: Env) -> str | None:
    """Why pin_ cannot run here (the memlock limit, say), or None: one page pinned and
    unpinned."""
    page = torch.frombuffer(mmap.mmap(-1, 4096), dtype=torch.uint8)
    try:
        pinxfer.pin_(page)
    except RuntimeError as err:
        return f"pin_ of one page fails here: {str(err).splitlines()[0]}"
    pinxfer.unpin_(page)
    return None


def pin_inplace(w: Worker) -> None:
    """pin_ of user memory filled from R (a view of it, sometimes): pinned until unpin_, the
    bytes unchanged by both. On a GPU the pinned tensor is sent with to_device (one DMA
    from the registered pages) and the copy waited for before unpin_ (the caller's duty)."""
    env, rng = w.env, w.rng
    leaf = w.sources.make_leaf(mems=("mapped",), layouts=IN_PLACE_LAYOUTS, cap=4 * MiB)
    t = leaf.src
    pinxfer.pin_(t)
    if not pinxfer.is_pinned(t) or (env.cuda and not t.is_pinned()):
        w.rec.contract("pin_inplace", "not pinned after pin_", leaf.meta)
    gots, contiguous, extra = [], True, {}
    if env.cuda:
        blocking = rng.random() < 0.5
        gots.append(pinxfer.to_device(t, env.device, non_blocking=not blocking))
        if not blocking:
            env.sync(env.current_stream())  # the DMA has read the pages: they may go
        extra["non_blocking"] = not blocking
    pinxfer.unpin_(t)
    if pinxfer.is_pinned(t):
        w.rec.contract("pin_inplace", "still pinned after unpin_", leaf.meta)
    gots.append(env.h2d_trusted(t.contiguous()))
    leaf.drop_source()
    del t
    w.rec.moved("pin_inplace", leaf.nbytes)
    w.checker.check_leaves("pin_inplace", gots, [leaf] * len(gots), extra, contiguous=contiguous)


def torch_pin_memory(w: Worker) -> None:
    """Installed: ``Tensor.pin_memory()`` comes from the pool; copied on the side stream,
    deleted at once, a new torch-pinned block scribbled: torch reports the copy to the
    pool, which must hold the block until it is done."""
    env = w.env
    leaf = w.sources.make_leaf(
        mems=("pageable",), layouts=["contig", "shaped", "offset", "t", "step", "step2d"]
    )
    p = leaf.src.pin_memory()
    if leaf.nbytes and not (p.is_pinned() and pinxfer.is_pool_tensor(p)):
        w.rec.contract("torch_pin_memory", "Tensor.pin_memory() did not use the pool", leaf.meta)
    if w.rng.random() < 0.5:
        w.sources.scribble(leaf.base)
    leaf.drop_source()
    shape, dtype = tuple(p.shape), p.dtype
    cur = env.current_stream()
    with env.stream_ctx(w.side):
        if w.rng.random() < 0.3:
            env.sleep(w.rng.randint(10_000, 1_000_000))
        d = p.to(env.device, non_blocking=True)  # torch reports the copy to the pool
    del p
    junk = env.torch_pinned_empty(shape, dtype)
    w.sources.scribble(junk)
    env.wait_stream(cur, w.side)
    d.record_stream(cur)
    w.rec.moved("torch_pin_memory", leaf.nbytes)
    w.checker.check_leaves("torch_pin_memory", [d], [leaf], contiguous=False)
    del junk
