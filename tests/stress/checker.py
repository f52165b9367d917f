"""The byte checker: outputs compared with their expected values as raw bytes, on the device.

Each check concatenates the bytes of its outputs and of their expected values (uint8 views:
bool, NaN payloads and -0.0 compare exactly) and leaves a 4-number summary on the device
(bad bytes, first bad index, got, expected), queued on the current stream; the summaries are
fetched every RESOLVE_EVERY checks (one host sync), so checks do not serialise the threads.
torch only: the checker never asks pinxfer, which it checks.
"""

from __future__ import annotations

import bisect
import random

import torch

from tests.stress.env import Env
from tests.stress.sources import Leaf
from tests.stress.stats import Recorder, meta_dict
from tests.stress.tensors import as_bytes

RESOLVE_EVERY = 32  # checks between two fetches of their summaries


class Checker:
    def __init__(self, env: Env, rec: Recorder, rng: random.Random):
        self.env = env
        self.rec = rec
        self.rng = rng  # picks the byte an injected fault corrupts
        self.pending: list[tuple] = []

    def check_leaves(
        self,
        op: str,
        gots: list,
        leaves: list[Leaf],
        extra: dict | None = None,
        contiguous: bool = True,
    ) -> None:
        self.check(
            op,
            gots,
            [lf.exp for lf in leaves],
            [lf.meta for lf in leaves],
            extra,
            contiguous,
            exp_bytes=[lf.exp_b for lf in leaves],
        )

    def check(
        self,
        op: str,
        gots: list,
        exps: list,
        metas: list,
        extra: dict | None = None,
        contiguous: bool = True,
        transfers: int | None = None,
        exp_bytes: list | None = None,
    ) -> None:
        """Queues a bytewise comparison of outputs against expected values on the current
        stream. Wrong type, device, dtype or shape (and, where the env is strict and
        ``contiguous``, a non-contiguous result) is a contract violation. ``transfers``:
        how many transfers the check covers (default: one per output)."""
        env, st = self.env, self.rec.stats
        g_parts, e_parts, part_meta, bounds = [], [], [], [0]
        for i, (g, e, m) in enumerate(zip(gots, exps, metas)):
            if not isinstance(g, torch.Tensor):
                self.rec.contract(op, f"got a {type(g).__name__}, expected a tensor", m)
                continue
            if g.device != e.device or g.dtype != e.dtype or tuple(g.shape) != tuple(e.shape):
                self.rec.contract(
                    op,
                    f"got {g.device} {g.dtype} {tuple(g.shape)}, expected "
                    f"{e.device} {e.dtype} {tuple(e.shape)}",
                    m,
                )
                continue
            if env.strict and contiguous and not g.is_contiguous():
                self.rec.contract(op, f"result not contiguous: stride {g.stride()}", m)
            if e.numel() == 0:
                continue
            gb = as_bytes(g)
            eb = exp_bytes[i] if exp_bytes is not None else as_bytes(e)
            g_parts.append(gb)
            e_parts.append(eb)
            part_meta.append(m)
            bounds.append(bounds[-1] + gb.numel())
        n = len(gots) if transfers is None else transfers
        st.transfers += n
        st.ops[op]["transfers"] += n
        total = bounds[-1]
        st.bytes_checked += total
        st.ops[op]["bytes_checked"] += total
        if total == 0:
            return
        G = g_parts[0] if len(g_parts) == 1 else torch.cat(g_parts)
        E = e_parts[0] if len(e_parts) == 1 else torch.cat(e_parts)
        if env.inject > 0 and self.rng.random() < env.inject:
            G = G.clone()  # a simulated corruption: exactly one byte differs
            G.narrow(0, self.rng.randrange(total), 1).bitwise_xor_(0x5A)
            st.injected += 1
        ne = G != E
        idx = env.first_true(ne).view(1)
        summary = torch.cat(
            [ne.sum().view(1), idx, G.gather(0, idx).long(), E.gather(0, idx).long()]
        )
        self.pending.append((summary, op, part_meta, bounds, extra or {}))
        if len(self.pending) >= RESOLVE_EVERY:
            self.resolve()

    def resolve(self) -> None:
        """Fetches the pending summaries (one sync of the current stream) and counts."""
        if not self.pending:
            return
        pend, self.pending = self.pending, []
        values = torch.stack([p[0] for p in pend]).cpu().tolist()
        for (_, op, metas, bounds, extra), (bad, idx, got, exp) in zip(pend, values):
            if bad == 0:
                continue
            leaf = bisect.bisect_right(bounds, idx) - 1
            self.rec.mismatch(
                op,
                {
                    "bad_bytes": bad,
                    "tensors_in_check": len(metas),
                    "tensor": leaf,
                    "first_bad_byte": idx - bounds[leaf],
                    "got": got,
                    "expected": exp,
                    "leaf": meta_dict(metas[leaf]),
                    **extra,
                },
            )
