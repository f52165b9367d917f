"""Shared test helpers.

GPU tests carry ``@pytest.mark.gpu`` and are skipped cleanly where no CUDA device
is usable (CI); they run on the device machine through scripts/gpu_check.sh.
"""
from __future__ import annotations

import pytest
import torch

import pinxfer

HAS_CUDA = torch.cuda.is_available() and pinxfer.build_info().cuda_usable

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


@pytest.fixture
def fresh_pool():
    """Each test starts from an empty cache and zeroed counters, and leaves no cap."""
    pinxfer.set_max_pinned_bytes(0)
    pinxfer.empty_cache()
    pinxfer.reset_accumulated_memory_stats()
    pinxfer.reset_peak_memory_stats()
    yield
    pinxfer.set_max_pinned_bytes(0)
    pinxfer.empty_cache()
