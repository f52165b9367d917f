"""One mode of the stress: ``plain`` (pinxfer as a library) or ``install`` (after
``pinxfer.install()``, ``uninstall()`` at the end): its threads, their merged counts, the
end-state contract, the mode's verdict."""

from __future__ import annotations

import gc
import time
import traceback
from dataclasses import dataclass

import torch

import pinxfer
from tests.stress import ops
from tests.stress.contract import check_after_mode, failures_of
from tests.stress.env import Env
from tests.stress.report import mode_report
from tests.stress.stats import Stats, log
from tests.stress.worker import Gate, Shared, Worker

MODES = ("plain", "install")


@dataclass
class ModeArgs:
    threads: int
    seconds: float
    seed: int
    large_frac: float
    medium_frac: float
    min_transfers: int


def run_mode(env: Env, mode: str, args: ModeArgs, mode_index: int) -> dict:
    """Runs ``mode`` for ``args.seconds`` with ``args.threads`` threads; returns its report
    (report.mode_report)."""
    installed = False
    before = pinxfer.memory_stats()
    workers = []
    total = Stats()
    wall = 0.0
    fatal = None
    skipped: dict[str, str] = {}
    table: list[ops.Op] = []
    try:
        if mode == "install":
            pinxfer.install()
            installed = True
            if not pinxfer.is_installed():
                raise RuntimeError("pinxfer.install() returned but is_installed() is False")
        table, skipped = ops.plan(env, installed)
        shared = Shared(args.threads, args.seconds)
        gate = Gate()
        for i in range(args.threads):
            seed = (args.seed * 1_000_003 + mode_index * 10_007 + i) & 0x7FFFFFFF
            workers.append(
                Worker(
                    i,
                    env,
                    mode,
                    installed,
                    seed,
                    shared,
                    gate,
                    table,
                    args.large_frac,
                    args.medium_frac,
                )
            )
        for w in workers:
            w.thread.start()
        for w in workers:
            w.thread.join()
        wall = time.monotonic() - shared.t0 if shared.t0 else 0.0
        if env.cuda:
            torch.cuda.synchronize(env.device)
    except Exception:
        fatal = traceback.format_exc()
        log(f"[{mode}] FATAL:\n{fatal}")
    finally:
        for w in workers:
            total.merge(w.rec.stats)
        del workers
        gc.collect()
        if installed:
            pinxfer.uninstall()
    leftover, pool = check_after_mode(env, installed, before, total)
    if env.cuda:
        torch.cuda.synchronize(env.device)
    released = pinxfer.empty_cache()
    failures = failures_of(total, fatal, args.min_transfers)
    return mode_report(
        total,
        failures=failures,
        wall=wall,
        threads=args.threads,
        installed=installed,
        table=table,
        skipped=skipped,
        leftover=leftover,
        pool=pool,
        released=released,
        fatal=fatal,
    )
