"""Shared test helpers.

GPU tests carry ``@pytest.mark.gpu`` and are skipped cleanly where no CUDA device
is usable (CI); they run on the device machine through scripts/gpu_check.sh.
"""
from __future__ import annotations

import gc
import os

import pytest
import torch

import pinxfer

HAS_CUDA = pinxfer.cuda_unavailable_reason() is None

requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(pytest.mark.skip(reason="GPU test: no CUDA device here"))


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
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
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
            f.write(f"{request.node.nodeid}: allocated_bytes {before} -> {after} ({after - before:+d})\n")
