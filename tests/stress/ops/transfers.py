"""Transfers through pinxfer's copy paths: ``to_device`` of one tensor and of nested batches,
``to_host(...).wait()``. Every result checked byte for byte on the device."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

import pinxfer
from tests.stress.batches import get_path, structure_diff
from tests.stress.tensors import MiB

if TYPE_CHECKING:
    from tests.stress.worker import Worker


def to_device(w: Worker) -> None:
    """One tensor: pageable, pool-pinned or torch-pinned; any layout; sizes 1 B - 64 MiB;
    sometimes small chunks (ring mode) and non_blocking=False."""
    leaf = w.sources.make_leaf()
    nb = w.rng.random() < 0.8
    kw = w.sources.chunk_kwargs(leaf.nbytes)
    out = pinxfer.to_device(leaf.src, w.env.device, non_blocking=nb, **kw)
    w.sources.after_send(leaf, nb)
    w.rec.moved("to_device", leaf.nbytes)
    w.checker.check_leaves("to_device", [out], [leaf], {"non_blocking": nb, **kw})


def to_device_batch(w: Worker) -> None:
    """A nested batch (dict / list / tuple / namedtuple, non-tensor leaves, a tensor already
    on the device that must come back as it is, a few leaves that require grad)."""
    obj, leaves = w.sources.make_batch(
        max_leaves=w.rng.randint(2, 12), leaf_cap=16 * MiB, allow_gpu=True, grad=True
    )
    nb = w.rng.random() < 0.85
    kw = w.sources.chunk_kwargs(max(leaf.nbytes for _, leaf in leaves))
    out = pinxfer.to_device(obj, w.env.device, non_blocking=nb, **kw)
    diff = structure_diff(obj, out, gpu_identity=True)
    del obj
    for _, leaf in leaves:
        w.sources.after_send(leaf, nb)
        w.rec.moved("to_device_batch", leaf.nbytes)
    if diff:
        w.rec.contract("to_device_batch", diff)
        return
    gots = [get_path(out, p) for p, _ in leaves]
    w.checker.check_leaves(
        "to_device_batch", gots, [lf for _, lf in leaves], {"non_blocking": nb, **kw}
    )


def to_host(w: Worker) -> None:
    """GPU tensors and batches (views, temporaries freed at once) to pinned host memory;
    waited for, or sometimes dropped unwaited (its block must not be reused before the
    copy). The host results go back to the device with torch's synchronous copy."""
    env, rng = w.env, w.rng
    k = 1 if rng.random() < 0.7 else rng.randint(2, 4)
    gs, exps, metas = [], [], []
    for _ in range(k):
        g, exp, meta = w.sources.device_tensor(cap=32 * MiB if k == 1 else 8 * MiB)
        gs.append(g)
        exps.append(exp)
        metas.append(meta)
    if k == 1:
        obj = gs[0]
    else:
        obj = rng.choice([list, tuple, lambda v: {f"k{i}": x for i, x in enumerate(v)}])(gs)
    h = pinxfer.to_host(obj)
    del obj, gs  # temporaries are freed while their copies are queued (stream-ordered)
    nbytes = sum(m["nbytes"] for m in metas)
    w.rec.moved("to_host", nbytes)
    if rng.random() < 0.08:
        del h  # dropped unwaited: its pinned block must not be reused before the copy
        w.rec.stats.ops["to_host_dropped"]["calls"] += 1
        return
    res = h.wait() if rng.random() < 0.5 else h.tensor
    if not h.ready():
        w.rec.contract("to_host", "ready() is False after wait()")
    outs = [res] if k == 1 else (list(res.values()) if isinstance(res, dict) else list(res))
    backs, kept_exps, kept_metas = [], [], []
    for t, e, m in zip(outs, exps, metas):
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            w.rec.contract("to_host", f"result is not a CPU tensor: {type(t).__name__}", m)
            continue
        if not t.is_contiguous():
            w.rec.contract("to_host", f"host result not contiguous: {t.stride()}", m)
        if t.numel() and not (t.is_pinned() and pinxfer.is_pool_tensor(t)):
            w.rec.contract("to_host", "host result is not a pinned pool tensor", m)
        backs.append(env.h2d_trusted(t))
        kept_exps.append(e)
        kept_metas.append(m)
    del res, outs, h
    w.checker.check("to_host", backs, kept_exps, kept_metas)
