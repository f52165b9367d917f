"""Shared test helpers.

GPU tests carry ``@pytest.mark.gpu`` and are skipped cleanly where no CUDA device
is usable (CI); they run on the device machine through scripts/gpu_check.sh.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import pinxfer

# Why no GPU test can run here, in pinxfer's words: "no NVIDIA driver or GPU on this
# machine" is told apart from a driver that is too old (csrc/runtime/cuda_runtime.cpp).
NO_CUDA_REASON = pinxfer.cuda_unavailable_reason()
HAS_CUDA = NO_CUDA_REASON is None

requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason=f"needs a CUDA device: {NO_CUDA_REASON}")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(pytest.mark.skip(reason=f"GPU test: {NO_CUDA_REASON}"))
    # PINXFER_TEST_SHUFFLE=SEED runs the tests in a shuffled order (the flake hunt of
    # issue 24: a test that passes only after another one has run is found this way); the
    # seed is printed in the header so a failing order can be replayed.
    seed = os.environ.get("PINXFER_TEST_SHUFFLE")
    if seed:
        import random

        random.Random(seed).shuffle(items)


def pytest_report_header(config):
    seed = os.environ.get("PINXFER_TEST_SHUFFLE")
    return f"pinxfer: tests shuffled with seed {seed!r}" if seed else None


@contextlib.contextmanager
def gc_paused():
    """No garbage collection inside: no object an earlier test left in a reference cycle (a
    pool tensor, whose free is fenced; a Prefetcher, whose shutdown may wait) is freed in the
    window a test counts or times."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@contextlib.contextmanager
def checkout_setup_lock():
    """Held while a test runs setup.py (or pip's build hooks, which run it) in the checkout:
    setup.py writes pinxfer.egg-info/ there, and two pytest-xdist workers writing it at once
    failed one of them (H100, `-n 12`: test_install's hooks fixture against test_packaging's
    sdist). An flock on a file in the checkout's ignored build/ directory, so every worker
    of every run in this checkout takes the same lock."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    os.makedirs(os.path.join(root, "build"), exist_ok=True)
    with open(os.path.join(root, "build", ".setup-py.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def benchmark_module(name: str):
    """benchmarks/<name>.py imported as a module (the benchmarks are scripts, not a package):
    for tests of a diag's readers and reports, which run only after a device run's GPU work."""
    import importlib
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def vm_locked_kib() -> int:
    """This process's mlocked memory (VmLck in /proc/self/status), in KiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmLck:"):
                return int(line.split()[1])
    raise AssertionError("no VmLck in /proc/self/status")


def _sanitizer_runtime() -> str | None:
    """'address' or 'thread' when a sanitizer runtime is loaded (scripts/sanitize.sh)."""
    with open("/proc/self/maps") as f:
        maps = f.read()
    for lib, name in (("libtsan.so", "thread"), ("libasan.so", "address")):
        if lib in maps:
            return name
    return None


SANITIZER = _sanitizer_runtime()


def _mlock_is_real() -> bool:
    """False where mlock() locks nothing: the ASan and TSan runtimes intercept
    mlock/munlock and return 0 without calling the kernel, so VmLck and smaps'
    "Locked:" stay 0. Tests then skip those kernel-side checks (the rest runs)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    page = 4096
    addr = libc.mmap(None, page, 3, 0x22, -1, 0)  # PROT_READ|WRITE, MAP_PRIVATE|ANONYMOUS
    try:
        before = vm_locked_kib()
        if libc.mlock(ctypes.c_void_p(addr), ctypes.c_size_t(page)) != 0:
            return True  # a real refusal (memlock limit): the kernel is asked
        real = vm_locked_kib() > before
        libc.munlock(ctypes.c_void_p(addr), ctypes.c_size_t(page))
        return real
    finally:
        libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(page))


MLOCK_IS_REAL = _mlock_is_real()


@pytest.fixture
def fresh_pool():
    """Each test starts from an empty cache and zeroed counters, and leaves no cap.
    gc first: pool tensors that earlier tests left in reference cycles are freed
    before the cache is emptied."""
    gc.collect()
    pinxfer.set_max_pinned_bytes(0)
    pinxfer.empty_cache()
    pinxfer.reset_accumulated_memory_stats()
    pinxfer.reset_peak_memory_stats()
    yield
    pinxfer.set_max_pinned_bytes(0)
    pinxfer.empty_cache()


_LEAK_REPORT = os.environ.get("PINXFER_TEST_LEAK_REPORT")


@pytest.fixture(autouse=True)
def _report_pool_growth(request):
    """With PINXFER_TEST_LEAK_REPORT=FILE, appends a line to FILE for every test after
    which the pool holds more bytes for live tensors than before it (after gc): the
    way to find which test left pinned tensors alive."""
    if not _LEAK_REPORT:
        yield
        return
    gc.collect()
    before = pinxfer.memory_stats()["allocated_bytes.current"]
    yield
    gc.collect()
    if HAS_CUDA:
        torch.cuda.synchronize()
    after = pinxfer.memory_stats()["allocated_bytes.current"]
    if after != before:
        with open(_LEAK_REPORT, "a") as f:
            f.write(
                f"{request.node.nodeid}: allocated_bytes {before} -> {after} "
                f"({after - before:+d})\n"
            )


# Source text for child scripts (no braces: callers may str.format() around it).
# drop_cap_ipc_lock() removes CAP_IPC_LOCK (effective and permitted) from the child,
# so RLIMIT_MEMLOCK applies to it even when the tests run as root; it returns
# "dropped", "not held", "unknown" (capget failed) or why capset refused.
DROP_CAP_IPC_LOCK = """
import ctypes

def drop_cap_ipc_lock():
    CAP_IPC_LOCK = 14
    libc = ctypes.CDLL(None, use_errno=True)
    class Hdr(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                    ("inheritable", ctypes.c_uint32)]
    hdr, data = Hdr(0x20080522, 0), (Data * 2)()
    if libc.capget(ctypes.byref(hdr), data) != 0:
        return "unknown"
    if not data[0].effective & (1 << CAP_IPC_LOCK):
        return "not held"
    data[0].effective &= ~(1 << CAP_IPC_LOCK)
    data[0].permitted &= ~(1 << CAP_IPC_LOCK)
    if libc.capset(ctypes.byref(hdr), data) == 0:
        return "dropped"
    return "capset refused: errno %d" % ctypes.get_errno()
"""


_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child_env(env=None) -> dict:
    """The environment of a child interpreter that imports this checkout's pinxfer: this
    process's, with `env` on top (a None value removes that variable)."""
    full_env = dict(os.environ)
    for name, value in (env or {}).items():
        if value is None:
            full_env.pop(name, None)
        else:
            full_env[name] = value
    full_env["PYTHONPATH"] = _REPO + os.pathsep + full_env.get("PYTHONPATH", "")
    return full_env


def run_child(
    code: str, *, env=None, prefix=(), timeout=120, preexec_fn=None
) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh interpreter from the repository root (so it imports
    this checkout's pinxfer); a hang fails through the timeout."""
    return subprocess.run(
        [*prefix, sys.executable, "-c", textwrap.dedent(code)],
        cwd=_REPO,
        env=child_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=preexec_fn,
    )


def start_child(code: str, *, env=None) -> subprocess.Popen:
    """`code` started in a fresh interpreter as run_child runs it, without waiting for it
    (several at once); its output is read with communicate()."""
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=_REPO,
        env=child_env(env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def thread_states(pid: int) -> str:
    """One line per thread of process `pid` from /proc: its id, name, scheduler state and
    wait channel, and the system call it is in (a hung child's threads, for a failure)."""
    lines = []
    for tid in sorted(os.listdir(f"/proc/{pid}/task"), key=int):
        base = f"/proc/{pid}/task/{tid}"
        fields = []
        for name in ("comm", "wchan", "syscall"):
            try:
                with open(f"{base}/{name}") as f:
                    fields.append(f.read().strip())
            except OSError:
                fields.append("?")
        try:
            with open(f"{base}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            state = "?"
        comm, wchan, syscall = fields
        lines.append(f"{tid} {comm} state={state} wchan={wchan} syscall={syscall[:60]}")
    return "\n".join(lines)


def last_json(out: subprocess.CompletedProcess) -> dict:
    assert out.returncode == 0, f"child failed ({out.returncode}):\n{out.stdout}\n{out.stderr}"
    return json.loads(out.stdout.strip().splitlines()[-1])
