"""``pinxfer.prefetch`` over lists of batches: depth 1-4, consumed with for / with / next(),
passes left early (``break``) then closed, deleted or collected; the consumer writes into
every batch it got after checking it. On a GPU the default transfer (to_device); on the CPU
the producer thread pins each batch (``transfer=pinxfer.pin_memory``)."""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING

import torch

import pinxfer
from tests.stress.batches import get_path, structure_diff
from tests.stress.tensors import MiB, flat_bytes

if TYPE_CHECKING:
    from tests.stress.worker import Worker


def prefetch(w: Worker) -> None:
    env, rng = w.env, w.rng
    n = rng.randint(1, 8)
    depth = rng.randint(1, 4)
    batches = []
    for _ in range(n):
        if rng.random() < 0.5:
            leaf = w.sources.make_leaf(cap=32 * MiB)
            batches.append((leaf.src, [((), leaf)]))
        else:
            batches.append(w.sources.make_batch(max_leaves=4, leaf_cap=16 * MiB, allow_gpu=False))
    break_at = rng.randrange(n) if rng.random() < 0.3 else None
    how = rng.choice(["for", "with", "next"])
    # gc.collect() costs ~0.2 s with torch loaded: rarely
    finish = rng.choices(["close", "del", "gc"], [0.495, 0.495, 0.01])[0]
    if env.cuda:
        kw = w.sources.chunk_kwargs(32 * MiB) if rng.random() < 0.3 else {}
        pf = pinxfer.prefetch([b[0] for b in batches], device=env.device, depth=depth, **kw)
    else:
        kw = {"transfer": "pin_memory"}
        pf = pinxfer.prefetch(
            [b[0] for b in batches], device="cpu", depth=depth, transfer=pinxfer.pin_memory
        )
    extra = {"depth": depth, "batches": n, "break_at": break_at, "how": how, **kw}
    if how == "with":
        with pf:
            got = _consume(w, iter(pf), batches, break_at, extra)
    elif how == "for":
        got = _consume(w, pf, batches, break_at, extra)
    else:
        got = _consume(w, _next_iter(pf), batches, break_at, extra)
    if break_at is None and got != n:
        w.rec.contract("prefetch", f"the pass yielded {got} batches, the source has {n}")
    for _, leaves in batches:
        for _, leaf in leaves:
            w.rec.moved("prefetch", leaf.nbytes)
    if finish == "close":
        pf.close()
        del pf
    elif finish == "del":
        del pf
    else:
        del pf
        gc.collect()


def _consume(w: Worker, iterable, batches: list, break_at: int | None, extra: dict) -> int:
    i = 0
    for out in iterable:
        if i >= len(batches):
            w.rec.contract("prefetch", "the pass yielded more batches than the source has")
            break
        obj, leaves = batches[i]
        diff = structure_diff(obj, out, gpu_identity=False)
        if diff:
            w.rec.contract("prefetch", f"batch {i}: {diff}")
        else:
            gots = [get_path(out, p) for p, _ in leaves]
            w.checker.check_leaves(
                "prefetch",
                gots,
                [lf for _, lf in leaves],
                {**extra, "index": i},
                contiguous=w.env.strict,
            )
            # The consumer owns the batch: write into it (after the check, same stream).
            for g in gots:
                if isinstance(g, torch.Tensor) and g.numel() and g.is_contiguous():
                    fb = flat_bytes(g)
                    if fb is None or g.dtype == torch.bool or w.rng.random() < 0.5:
                        g.zero_()
                    else:
                        fb.add_(1)
        del out
        i += 1
        if break_at is not None and i > break_at:
            break
    return i


def _next_iter(pf):
    """Drives a Prefetcher with next() (its __next__ starts a pass) instead of for."""
    while True:
        try:
            yield next(pf)
        except StopIteration:
            return
