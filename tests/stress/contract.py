"""What must hold once a mode's threads are done, beside the bytes: torch's allocator back
after uninstall, no prefetch thread left, no CUDA event error in the pool; what fails a mode;
and the watchdog that turns a hang into stacks and exit status 1."""

from __future__ import annotations

import faulthandler
import gc
import threading
import time

import pinxfer
from tests.stress.env import Env
from tests.stress.stats import Stats

# Pool counters reported as their change over the mode, and levels reported as they are.
POOL_KEYS = [
    "num_allocs",
    "num_frees",
    "num_cache_hits",
    "num_cache_misses",
    "num_segment_maps",
    "num_segment_unmaps",
    "num_ooms",
    "num_event_waits",
    "num_fenced_frees",
    "num_fence_markers",
    "num_idle_reclaims",
    "num_event_errors",
]
POOL_CURRENT = [
    "reserved_bytes.current",
    "reserved_bytes.peak",
    "active_blocks.current",
    "pending_blocks.current",
    "segments.current",
]
PREFETCH_THREAD_PREFIX = "pinxfer-prefetch-"  # pinxfer/prefetch.py names its producers so


def prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(PREFETCH_THREAD_PREFIX)]


def _violation(total: Stats, op: str, what: str) -> None:
    total.contract_errors += 1
    total.contract_samples.append({"op": op, "what": what})


def check_after_mode(env: Env, installed: bool, before: dict, total: Stats) -> tuple[list, dict]:
    """Checks the end state of a mode (violations go into ``total``); returns the prefetch
    threads left over and the pool's counters (changes since ``before``, levels now)."""
    if installed and pinxfer.is_installed():
        _violation(total, "uninstall", "still installed")
    deadline = time.monotonic() + 10
    while prefetch_threads() and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    leftover = [t.name for t in prefetch_threads()]
    if leftover:
        _violation(total, "prefetch", f"threads left: {leftover}")
    after = pinxfer.memory_stats()
    pool = {k: after.get(k, 0) - before.get(k, 0) for k in POOL_KEYS}
    pool.update({k: after.get(k, 0) for k in POOL_CURRENT})
    if env.cuda and pool["num_event_errors"] > 0:
        _violation(total, "pool", f"{pool['num_event_errors']} CUDA event errors in the pool")
    return leftover, pool


def failures_of(total: Stats, fatal: str | None, min_transfers: int) -> list[str]:
    """Why a mode fails (empty: it passed)."""
    failures = []
    if fatal:
        failures.append("fatal error")
    if total.bad_bytes:
        failures.append(f"{total.bad_bytes} bad bytes in {total.bad_checks} checks")
    if total.errors:
        failures.append(f"{total.errors} errors")
    if total.contract_errors:
        failures.append(f"{total.contract_errors} contract violations")
    if total.transfers < min_transfers:
        failures.append(f"{total.transfers} transfers < --min-transfers {min_transfers}")
    return failures


def start_watchdog(seconds: float) -> None:
    """After ``seconds``, every thread's stack goes to stderr and the process exits 1."""
    faulthandler.enable()
    faulthandler.dump_traceback_later(seconds, exit=True)


def stop_watchdog() -> None:
    faulthandler.cancel_dump_traceback_later()
