"""Faults the pool must survive without crashing, leaking or sharing memory: a
tiny memlock limit, cudaHostRegister refusing, the cap hit by many threads at
once, fork() while other threads allocate, and KeyboardInterrupt inside a
prefetch loop. Each ends in a clear error or in the documented fallback.

Child processes are used where the fault is process-wide (rlimits,
capabilities, one-time warnings, fork); every child has a timeout, so a
deadlock fails the test instead of hanging it.
"""

from __future__ import annotations

import gc
import os
import random
import shutil
import signal
import threading
import time

import pytest
import torch

import pinxfer

from .conftest import DROP_CAP_IPC_LOCK, HAS_CUDA, last_json, run_child

MiB = 1 << 20
KiB = 1 << 10
native = pinxfer._C


def stats():
    return pinxfer.memory_stats()


# ---- B1: a small memlock limit, without CAP_IPC_LOCK ----

# Drops CAP_IPC_LOCK from the child's effective and permitted sets (capset(2)),
# sets RLIMIT_MEMLOCK itself when prlimit(1) is not there, then allocates and
# reports lock kinds, warnings, VmLck and the pool's stats as JSON.
_MEMLOCK_CHILD = (
    DROP_CAP_IPC_LOCK
    + """
import json, resource, sys, warnings

LIMIT = {limit}
if not {have_prlimit}:
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (LIMIT, LIMIT))

caps = drop_cap_ipc_lock()

def vmlck():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmLck:"):
                return int(line.split()[1])

import torch, pinxfer
base = vmlck()
keys = ("reserved_bytes.current", "reserved_bytes.mlocked", "reserved_bytes.pageable",
        "reserved_bytes.cuda_registered", "allocated_bytes.current", "segments.current")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    a = pinxfer.empty(1 << 20, dtype=torch.uint8)    # a small 2 MiB segment
    pad = pinxfer.empty(1 << 20, dtype=torch.uint8)  # fills it
    b = pinxfer.empty(4 << 20, dtype=torch.uint8)    # a large segment: 32 MiB, the least
    c = pinxfer.empty(1000, dtype=torch.uint8)       # a second small segment
for t, v in ((a, 1), (b, 2), (c, 3)):
    t.fill_(v)
data_ok = bool((a == 1).all()) and bool((b == 2).all()) and bool((c == 3).all())
s = pinxfer.memory_stats()
out = dict(caps=caps, rlimit=resource.getrlimit(resource.RLIMIT_MEMLOCK), base=base,
           locked=vmlck() - base, kinds=[pinxfer.lock_kind(t) for t in (a, b, c)],
           pinned=[pinxfer.is_pinned(t) for t in (a, b, c)], data_ok=data_ok,
           warnings=[str(w.message) for w in caught], stats={{k: s[k] for k in keys}})
del a, b, c, t, pad
out["released"] = pinxfer.empty_cache()
s = pinxfer.memory_stats()
out["after"] = {{k: s[k] for k in keys}}
out["locked_after"] = vmlck() - base
print(json.dumps(out))
"""
)


def _memlock_child(limit: int) -> tuple[dict, str]:
    have_prlimit = shutil.which("prlimit") is not None
    prefix = ("prlimit", f"--memlock={limit}:{limit}") if have_prlimit else ()
    # PINXFER_DISABLE_CUDA: the mlock path is the one the memlock limit governs
    # (cudaHostRegister is not counted against it), also on a GPU machine.
    out = run_child(
        _MEMLOCK_CHILD.format(limit=limit, have_prlimit=have_prlimit),
        env={"PINXFER_DISABLE_CUDA": "1"},
        prefix=prefix,
    )
    res = last_json(out)
    assert res["rlimit"] == [limit, limit]
    if res["caps"].startswith("capset refused"):
        pytest.skip(
            f"cannot drop CAP_IPC_LOCK here ({res['caps']}), so the memlock limit "
            "does not apply to this process"
        )
    assert res["caps"] in ("dropped", "not held"), res["caps"]
    return res, out.stderr


def _n_mlock_warnings(res: dict, stderr: str) -> int:
    # TORCH_WARN reaches Python as a UserWarning, or stderr if no handler is set.
    return sum("mlock of" in w for w in res["warnings"]) + stderr.count("mlock of")


def _assert_stats_add_up(s: dict) -> None:
    assert s["reserved_bytes.current"] == (
        s["reserved_bytes.mlocked"]
        + s["reserved_bytes.pageable"]
        + s["reserved_bytes.cuda_registered"]
    )


def test_memlock_limit_64k_every_segment_falls_back_to_pageable():
    """prlimit --memlock=64KiB, no CAP_IPC_LOCK: no segment can be mlocked. Every
    allocation still works (pageable memory), one warning says why and what to
    do, nothing is locked, the stats account every byte as pageable, and
    empty_cache() gives everything back."""
    res, stderr = _memlock_child(64 * KiB)
    assert res["kinds"] == ["pageable"] * 3
    assert res["data_ok"]
    assert res["pinned"] == [False] * 3  # pinxfer.is_pinned does not claim pageable memory
    assert _n_mlock_warnings(res, stderr) == 1, (res["warnings"], stderr)
    assert "ulimit -l" in " ".join(res["warnings"]) + stderr
    assert res["locked"] == 0  # VmLck did not move
    s = res["stats"]
    _assert_stats_add_up(s)
    assert s["reserved_bytes.current"] == s["reserved_bytes.pageable"] == 36 * MiB
    assert s["reserved_bytes.mlocked"] == s["reserved_bytes.cuda_registered"] == 0
    assert res["released"] == 36 * MiB
    assert res["after"]["reserved_bytes.current"] == res["after"]["reserved_bytes.pageable"] == 0
    assert res["locked_after"] == 0


def test_memlock_limit_6m_locks_what_fits():
    """A 6 MiB limit: the two 2 MiB small segments are mlocked, the 32 MiB large one
    between them is refused and stays pageable. VmLck and the stats agree byte for
    byte, and return to the baseline after empty_cache()."""
    res, stderr = _memlock_child(6 * MiB)
    if res["base"] != 0:
        pytest.skip(f"the child already has {res['base']} KiB locked; the 6 MiB budget is not ours")
    assert res["kinds"] == ["mlocked", "pageable", "mlocked"]
    assert res["pinned"] == [True, False, True]
    assert res["data_ok"]
    assert _n_mlock_warnings(res, stderr) == 1, (res["warnings"], stderr)
    s = res["stats"]
    _assert_stats_add_up(s)
    assert s["reserved_bytes.mlocked"] == 4 * MiB and s["reserved_bytes.pageable"] == 32 * MiB
    assert res["locked"] * KiB == s["reserved_bytes.mlocked"]  # VmLck == what the pool says
    assert res["released"] == 36 * MiB
    assert res["after"]["reserved_bytes.current"] == 0
    assert res["locked_after"] == 0


# ---- B2: cudaHostRegister failing (test-only fault injection) ----


@pytest.mark.parametrize(
    "hook", ["_inject_host_register_failures", "_inject_host_unregister_failures"]
)
def test_inject_host_register_failures_op_contract(hook):
    """The test-only ops: each sets its own count, returns what was pending, refuses n < 0."""
    inject = getattr(native, hook)
    assert inject(0) == 0
    assert inject(3) == 0
    assert inject(5) == 3
    assert inject(0) == 5
    with pytest.raises(RuntimeError, match=rf"{hook}: n must be >= 0"):
        inject(-1)
    assert inject(0) == 0


def test_injected_register_failures_untouched_where_cuda_is_not_used():
    """Where pinxfer does not use CUDA (here PINXFER_DISABLE_CUDA=1, so also on a
    GPU machine) no cudaHostRegister is attempted: injected failures are not
    consumed and segments are mlocked as usual, without a register warning."""
    out = run_child(
        """
        import json, warnings, torch, pinxfer
        native = pinxfer._C
        native._inject_host_register_failures(3)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            a = pinxfer.empty(4 << 20, dtype=torch.uint8)
            b = pinxfer.empty(100, dtype=torch.uint8)
        print(json.dumps(dict(kinds=[pinxfer.lock_kind(a), pinxfer.lock_kind(b)],
                              left=native._inject_host_register_failures(0),
                              warnings=[str(w.message) for w in caught],
                              cuda_init=torch.cuda.is_initialized())))
    """,
        env={"PINXFER_DISABLE_CUDA": "1"},
    )
    res = last_json(out)
    assert res["left"] == 3
    assert (
        not any("cudaHostRegister" in w for w in res["warnings"])
        and "cudaHostRegister" not in out.stderr
    )
    assert res["cuda_init"] is False
    # mlocked unless this machine's memlock limit refuses (then: pageable, one warning).
    assert res["kinds"][0] in ("mlocked", "pageable") and res["kinds"][1] == res["kinds"][0]


@pytest.mark.gpu
def test_gpu_unregister_failure_leaves_the_segment_mapped():
    """A segment whose cudaHostUnregister fails (CUDA refuses it, for one, while another thread
    captures a graph in global mode) is not unmapped: CUDA still maps its addresses to its
    pages, and a later mmap at those addresses would be read through that registration. It
    stays mapped, page-locked and readable, with one warning; it leaves the pool, and the next
    segment is unmapped as usual. (Found by review in session 42: it was unmapped anyway.)"""
    out = run_child("""
        import ctypes, json, warnings, torch, pinxfer
        native = pinxfer._C
        def mapped(ptr):
            with open("/proc/self/maps") as f:
                for line in f:
                    lo, hi = (int(v, 16) for v in line.split()[0].split("-"))
                    if lo <= ptr < hi:
                        return True
            return False
        a = pinxfer.empty(32 << 20, dtype=torch.uint8)  # a whole large segment
        kind = pinxfer.lock_kind(a)
        a.fill_(9)
        ptr = a.data_ptr()
        del a
        torch.cuda.synchronize()
        assert native._inject_host_unregister_failures(1) == 0
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            released = pinxfer.empty_cache()
        left = native._inject_host_unregister_failures(0)
        kept = mapped(ptr) and ctypes.string_at(ptr, 1 << 16) == bytes([9]) * (1 << 16)
        b = pinxfer.empty(32 << 20, dtype=torch.uint8)
        ptr_b = b.data_ptr()
        del b
        torch.cuda.synchronize()
        released_b = pinxfer.empty_cache()
        print(json.dumps(dict(kind=kind, released=released, left=left, kept=kept,
                              other=ptr_b != ptr, unmapped_b=not mapped(ptr_b),
                              released_b=released_b,
                              reserved=pinxfer.memory_stats()["reserved_bytes.current"],
                              warnings=[str(w.message) for w in caught])))
    """)
    res = last_json(out)
    assert res["kind"] == "cuda_registered", res
    assert res["left"] == 0 and res["kept"] and res["other"], res
    assert res["released"] >= 32 << 20 and res["released_b"] >= 32 << 20, res
    assert res["unmapped_b"] and res["reserved"] == 0, res
    said = [w for w in res["warnings"] if "cudaHostUnregister" in w] or [
        line for line in out.stderr.splitlines() if "cudaHostUnregister" in line
    ]
    assert len(said) == 1 and "stays mapped" in said[0] and "injected" in said[0], res


@pytest.mark.gpu
def test_gpu_register_failure_falls_back_to_mlock():
    """Two injected cudaHostRegister failures: the next two new segments (one
    large, one small) take the documented fallback (mlock, or pageable where the
    memlock limit refuses too), with one warning naming the CUDA error; the third
    segment is registered again. Every tensor works, including copies to and
    from the GPU, stats add up, and empty_cache() returns everything."""
    out = run_child("""
        import json, resource, warnings, torch, pinxfer
        native = pinxfer._C
        soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        try:  # as much mlock room as this process may have
            resource.setrlimit(resource.RLIMIT_MEMLOCK, (hard, hard))
        except (ValueError, OSError):
            pass
        def vmlck():
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmLck:"):
                        return int(line.split()[1])
        # Create the context and let the driver set up its staging for pageable copies
        # before the baseline: only the pool's own locking is measured against it.
        warm = torch.randint(0, 256, (6 << 20,), dtype=torch.uint8)
        assert torch.equal(warm.to("cuda").cpu(), warm)
        torch.cuda.synchronize()
        base = vmlck()
        assert native._inject_host_register_failures(2) == 0
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            a = pinxfer.empty(32 << 20, dtype=torch.uint8)  # a whole large segment: injected fault
            b = pinxfer.empty(1000, dtype=torch.uint8)      # new small segment: injected failure
            c = pinxfer.empty(6 << 20, dtype=torch.uint8)   # new large segment (32 MiB): registered
            src = torch.arange(1 << 20, dtype=torch.int32)
            d = pinxfer.pin_memory(src)                     # in c's segment: registered
        left = native._inject_host_register_failures(0)
        kinds = [pinxfer.lock_kind(t) for t in (a, b, c, d)]
        a.copy_(torch.randint(0, 256, (32 << 20,), dtype=torch.uint8))
        b.fill_(7)
        c.copy_(torch.randint(0, 256, (6 << 20,), dtype=torch.uint8))
        ok = []
        for t in (a, b, c, d):
            g = t.to("cuda", non_blocking=True)
            back = pinxfer.empty(t.numel(), dtype=t.dtype)
            back.copy_(g, non_blocking=True)
            torch.cuda.synchronize()
            ok.append(bool(torch.equal(back, t)))
        ok.append(bool(torch.equal(d, src)))
        s = pinxfer.memory_stats()
        keys = ("reserved_bytes.current", "reserved_bytes.mlocked", "reserved_bytes.pageable",
                "reserved_bytes.cuda_registered")
        res = dict(kinds=kinds, left=left, ok=ok, warnings=[str(w.message) for w in caught],
                   torch_pinned=[t.is_pinned() for t in (a, b, c, d)],
                   ours_pinned=[pinxfer.is_pinned(t) for t in (a, b, c, d)],
                   stats={k: s[k] for k in keys}, locked=vmlck() - base)
        del a, b, c, d, back, g, t
        torch.cuda.synchronize()
        res["released"] = pinxfer.empty_cache()
        s = pinxfer.memory_stats()
        res["after"] = {k: s[k] for k in keys}
        res["active_after"] = s["active_blocks.current"]
        res["locked_after"] = vmlck() - base
        print(json.dumps(res))
    """)
    res = last_json(out)
    assert res["left"] == 0
    fallback = res["kinds"][0]
    assert fallback in ("mlocked", "pageable"), res["kinds"]
    assert res["kinds"] == [fallback, fallback, "cuda_registered", "cuda_registered"]
    assert all(res["ok"]), res["ok"]
    register_warnings = [w for w in res["warnings"] if "cudaHostRegister" in w]
    register_warnings += [ln for ln in out.stderr.splitlines() if "cudaHostRegister of" in ln]
    assert len(register_warnings) == 1, (res["warnings"], out.stderr)
    assert "falling back to mlock" in register_warnings[0]
    assert (
        "cudaErrorMemoryAllocation" in register_warnings[0] and "injected" in register_warnings[0]
    )
    assert res["torch_pinned"] == [False, False, True, True]
    assert res["ours_pinned"] == [fallback == "mlocked"] * 2 + [True, True]
    s = res["stats"]
    assert s["reserved_bytes.current"] == (
        s["reserved_bytes.mlocked"]
        + s["reserved_bytes.pageable"]
        + s["reserved_bytes.cuda_registered"]
    )
    assert s["reserved_bytes." + fallback] == 32 * MiB + 2 * MiB
    assert s["reserved_bytes.cuda_registered"] >= 32 * MiB
    if fallback == "mlocked":
        assert res["locked"] * KiB >= 6 * MiB
    assert res["active_after"] == 0
    assert res["after"]["reserved_bytes.current"] == 0
    assert res["locked_after"] <= 4


# ---- B3: the cap reached by many threads at once ----


def test_cap_reached_by_many_threads(fresh_pool):
    """8 threads allocate 8-12 MiB blocks under a 32 MiB cap. Every allocation
    either succeeds with a block no other thread writes to, or raises
    torch.OutOfMemoryError with the documented message; reserved memory never
    passes the cap; nobody deadlocks; the counters agree at the end."""
    cap = 32 * MiB
    n_threads, iterations = 8, 25
    pinxfer.set_max_pinned_bytes(cap)
    pinxfer.reset_peak_memory_stats()
    ok = [0] * n_threads
    ooms = [0] * n_threads
    errors: list[str] = []
    barrier = threading.Barrier(n_threads)

    def worker(tid: int) -> None:
        rng = random.Random(tid)
        try:
            barrier.wait()
            for i in range(iterations):
                n = rng.randint(8 * MiB, 12 * MiB)
                try:
                    t = pinxfer.empty(n, dtype=torch.uint8)
                except torch.OutOfMemoryError as err:
                    msg = str(err)
                    if not (
                        "pinxfer: out of pinned memory" in msg
                        and f"the cap is {cap} bytes" in msg
                        and "empty_cache" in msg
                    ):
                        errors.append(f"thread {tid}: unexpected OOM text: {msg}")
                    ooms[tid] += 1
                    continue
                value = (tid * 29 + i) % 251 + 1
                t.fill_(value)
                time.sleep(0.001)  # others run while we hold it
                t[n // 2] = value  # touch it again, then check nobody else wrote to it
                if not bool((t == value).all()):
                    errors.append(f"thread {tid}: block overwritten by another thread")
                del t
                ok[tid] += 1
        except BaseException as err:
            errors.append(f"thread {tid}: {err!r}")

    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(n_threads)]
    for th in threads:
        th.start()
    deadline = time.monotonic() + 120
    for th in threads:
        th.join(max(0.0, deadline - time.monotonic()))
    assert not any(th.is_alive() for th in threads), "deadlock: threads still running after 120 s"
    assert not errors, errors[:3]
    s = stats()
    assert sum(ok) + sum(ooms) == n_threads * iterations
    assert sum(ok) >= n_threads  # the cap does not starve everyone
    assert s["reserved_bytes.peak"] <= cap, s["reserved_bytes.peak"]
    assert s["reserved_bytes.current"] <= cap
    assert s["num_ooms"] == sum(ooms)
    assert s["num_allocs"] == s["num_frees"] == sum(ok)
    assert s["num_cache_hits"] + s["num_cache_misses"] == sum(ok)
    assert s["active_blocks.current"] == 0 and s["requested_bytes.current"] == 0
    assert s["allocated_bytes.current"] == 0
    assert s["cached_bytes.current"] == s["reserved_bytes.current"]
    if HAS_CUDA:
        torch.cuda.synchronize()
    pinxfer.empty_cache()
    assert stats()["reserved_bytes.current"] == 0
    # The pool still serves requests up to the cap.
    t = pinxfer.empty(cap - MiB, dtype=torch.uint8)
    t.fill_(1)
    assert int(t[-1]) == 1


# ---- B4: fork() while other threads allocate ----


def _fork_child(parent_tensors: list[tuple[torch.Tensor, torch.Tensor]], w: int) -> None:
    """Body of a forked child; never returns. Exit code 0: all checks passed."""
    code = 3
    try:
        signal.alarm(30)  # a deadlock kills the child (SIGALRM) instead of hanging the test
        torch.set_num_threads(1)  # the parent's OpenMP workers do not exist here
        a = pinxfer.empty(3 * MiB, dtype=torch.uint8)
        a.fill_(9)
        b = pinxfer.empty(1000, dtype=torch.uint8)
        b.fill_(10)
        big = pinxfer.empty(9 * MiB, dtype=torch.uint8)  # first touch on a new thread pool
        big.fill_(11)
        src = torch.arange(3 << 20, dtype=torch.int32)  # 12 MiB: the child's copy threads
        p = pinxfer.pin_memory(src)
        s = pinxfer.memory_stats()
        checks = [
            bool((a == 9).all()),
            bool((b == 10).all()),
            bool((big == 11).all()),
            bool(torch.equal(p, src)),
            all(pinxfer.lock_kind(t) in ("mlocked", "pageable") for t in (a, b, big, p)),
            s["active_blocks.current"] == 4,  # the child's own pool, nothing inherited
            not pinxfer.build_info().cuda_usable,
            all(torch.equal(t, ref) for t, ref in parent_tensors),  # inherited pages readable
        ]
        del a, b, big, p
        s = pinxfer.memory_stats()
        checks.append(s["active_blocks.current"] == 0 and s["num_allocs"] == s["num_frees"] == 4)
        pinxfer.empty_cache()
        checks.append(pinxfer.memory_stats()["reserved_bytes.current"] == 0)
        code = 0 if all(checks) else 10 + checks.index(False)
    except BaseException:
        code = 4
    finally:
        try:
            os.write(w, bytes([code]))
        finally:
            os._exit(code)


def test_fork_while_threads_allocate(fresh_pool):
    """4 threads allocate and free in a loop while the main thread forks 6 times.
    Each child allocates from a pool of its own (mlocked, fresh counters), fills
    and checks its memory, uses new copy threads, and exits 0 within its alarm;
    the parent's live tensors keep their bytes and its counters stay exact."""
    keep = pinxfer.empty(4 * MiB, dtype=torch.uint8)
    keep.fill_(77)
    keep_ref = keep.clone()
    src = torch.randn(1 << 18)
    pinned = pinxfer.pin_memory(src)
    parent_tensors = [(keep, keep_ref), (pinned, src)]

    stop = threading.Event()
    errors: list[str] = []
    counts = [0] * 4

    def worker(tid: int) -> None:
        rng = random.Random(100 + tid)
        held: list[tuple[torch.Tensor, int]] = []
        try:
            while not stop.is_set():
                n = rng.choice([64, 5000, 300_000, 2 * MiB + 1, 9 * MiB])
                value = rng.randrange(1, 256)
                t = pinxfer.empty(n, dtype=torch.uint8)
                t.fill_(value)
                held.append((t, value))
                counts[tid] += 1
                if len(held) > 3:
                    old, v = held.pop(rng.randrange(len(held)))
                    if not bool((old == v).all()):
                        errors.append(f"thread {tid}: block overwritten")
        except BaseException as err:
            errors.append(f"thread {tid}: {err!r}")
        for old, v in held:
            if not bool((old == v).all()):
                errors.append(f"thread {tid}: block overwritten")

    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(4)]
    for th in threads:
        th.start()
    results = []
    try:
        for _ in range(6):
            time.sleep(0.03)
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(r)
                _fork_child(parent_tensors, w)  # never returns
            os.close(w)
            deadline = time.monotonic() + 60
            status = None
            while time.monotonic() < deadline:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    break
                time.sleep(0.01)
            else:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                status = None
            reported = os.read(r, 1)
            os.close(r)
            results.append(
                (os.waitstatus_to_exitcode(status) if status is not None else "hung", reported)
            )
    finally:
        stop.set()
        for th in threads:
            th.join(60)
    assert not any(th.is_alive() for th in threads), "allocating threads did not stop"
    assert all(code == 0 and rep == b"\x00" for code, rep in results), results
    assert not errors, errors[:3]
    assert min(counts) > 0
    assert torch.equal(keep, keep_ref) and torch.equal(pinned, src)
    s = stats()
    assert s["active_blocks.current"] == 2
    assert s["num_allocs"] - s["num_frees"] == 2
    assert s["requested_bytes.current"] == keep.nbytes + pinned.nbytes
    assert s["cached_bytes.current"] == s["reserved_bytes.current"] - s["allocated_bytes.current"]
    again = pinxfer.empty(2 * MiB, dtype=torch.uint8)  # the parent's pool still serves
    again.fill_(5)
    assert bool((again == 5).all()) and pinxfer.is_pool_tensor(again)


# ---- B5: KeyboardInterrupt inside a prefetch loop ----


def _prefetch_threads() -> list[threading.Thread]:
    return [
        t for t in threading.enumerate() if t.name.startswith("pinxfer-prefetch-") and t.is_alive()
    ]


def _wait_until(predicate, timeout: float = 10.0) -> bool:
    """Polls predicate for up to timeout seconds (a gc pass once after 1 s: refcounts
    should free everything, the collector is only a fallback)."""
    start = time.monotonic()
    collected = False
    while not predicate():
        if time.monotonic() - start > timeout:
            return False
        if not collected and time.monotonic() - start > 1.0:
            gc.collect()
            collected = True
        time.sleep(0.01)
    return True


def _endless(delay: float = 0.0):
    i = 0
    while True:
        if delay:
            time.sleep(delay)
        yield torch.full((1 << 14,), float(i))
        i += 1


def _pin(batch: torch.Tensor) -> torch.Tensor:
    return pinxfer.pin_memory(batch, numa_node=-1)  # pool blocks held by the queue


def _consume(source, how: str, stop_at: int = 5, device: str = "cpu", transfer=_pin) -> int:
    """Iterates over a prefetcher until interrupted. Returns only if it never was.
    transfer=None: prefetch's own (to_device)."""
    timer = None
    if how == "timer":
        timer = threading.Timer(0.3, signal.raise_signal, args=(signal.SIGINT,))
        timer.start()
    try:
        deadline = time.monotonic() + 20
        for i, batch in enumerate(
            pinxfer.prefetch(source, device=device, depth=3, transfer=transfer)
        ):
            assert batch.device.type == torch.device(device).type
            assert float(batch[0]) == i  # in order
            if i == stop_at and how == "raise":
                raise KeyboardInterrupt
            if i == stop_at and how == "signal":
                signal.raise_signal(signal.SIGINT)  # Python raises it at the next bytecode
            if time.monotonic() > deadline:
                return i
        return -1
    finally:
        if timer is not None:
            timer.join()


@pytest.fixture
def sigint_default():
    """KeyboardInterrupt on SIGINT, whatever handler the test runner installed.
    Python runs signal handlers in the main thread only, so the test must run there."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("SIGINT handlers run in the main thread; this test runner runs tests elsewhere")
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


@pytest.mark.parametrize("how", ["raise", "signal", "timer"])
def test_keyboard_interrupt_in_prefetch_loop(fresh_pool, sigint_default, how):
    """KeyboardInterrupt in the consumer's loop (raised by the body, by SIGINT
    from the body, or by SIGINT from a timer while the consumer waits for a
    slow source): the producer thread ends, the batches it queued (pool blocks)
    go back to the pool, and a new prefetch works. device='cpu': no CUDA needed."""
    assert not _prefetch_threads()
    base = stats()["active_blocks.current"]
    interrupted = False
    try:
        # The timer case uses a slow source, so the interrupt usually lands while
        # the consumer is blocked waiting for the next batch.
        _consume(_endless(0.01 if how == "timer" else 0.0), how)
    except KeyboardInterrupt:
        interrupted = True
    assert interrupted, "the loop was not interrupted"
    assert _wait_until(lambda: not _prefetch_threads()), _prefetch_threads()
    assert _wait_until(lambda: stats()["active_blocks.current"] == base), stats()[
        "active_blocks.current"
    ]
    # A new prefetch works.
    data = [torch.full((100,), float(i)) for i in range(7)]
    got = list(pinxfer.prefetch(data, device="cpu", transfer=_pin))
    assert len(got) == 7 and all(torch.equal(g, d) for g, d in zip(got, data))
    assert all(pinxfer.is_pool_tensor(g) for g in got)
    del got
    assert _wait_until(lambda: not _prefetch_threads())
    assert _wait_until(lambda: stats()["active_blocks.current"] == base)


@pytest.mark.gpu
@pytest.mark.parametrize("how", ["raise", "signal", "timer"])
def test_gpu_keyboard_interrupt_in_prefetch_loop(fresh_pool, sigint_default, how):
    """The same on the GPU path: batches staged by to_device on the producer's
    stream. After the interrupt the producer ends, no pool block stays active,
    and a new prefetch delivers correct data on the GPU."""
    assert not _prefetch_threads()
    base = stats()["active_blocks.current"]

    interrupted = False
    try:
        _consume(_endless(0.01 if how == "timer" else 0.0), how, device="cuda", transfer=None)
    except KeyboardInterrupt:
        interrupted = True
    assert interrupted
    assert _wait_until(lambda: not _prefetch_threads()), _prefetch_threads()
    torch.cuda.synchronize()
    assert _wait_until(lambda: stats()["active_blocks.current"] == base)
    data = [torch.randn(1 << 16) for _ in range(5)]
    got = list(pinxfer.prefetch(data, device="cuda"))
    torch.cuda.synchronize()
    assert all(g.is_cuda and torch.equal(g.cpu(), d) for g, d in zip(got, data))
    assert _wait_until(lambda: not _prefetch_threads())
