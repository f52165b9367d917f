"""Issue 27, native side: impossible sizes, out-of-range integers, storage-level
questions on views, orphaned pin_ registrations, failure paths that used to hang.

Each finding of the issue has a test named after what must now happen. Cases that
could crash or hang the interpreter run in a child process with a timeout, so a
regression fails its test and not the run.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import pinxfer
from pinxfer.pin import inplace_lock_kind
from tests.conftest import MLOCK_IS_REAL, SANITIZER, vm_locked_kib

ROOT = str(Path(__file__).resolve().parent.parent)
INT64_MAX = (1 << 63) - 1


def run_child(code: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh interpreter from the checkout; a hang fails the test."""
    full_env = dict(os.environ, **env)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def task_count() -> int:
    return len(os.listdir("/proc/self/task"))


# ---- sizes: every byte count is overflow-checked before anything is allocated ----


@pytest.mark.parametrize(
    ("numel", "dtype"),
    [
        (2**62, torch.float32),  # numel * 4 wrapped to 0: a 0-byte storage, shape 2^62
        (2**61, torch.float64),
        (INT64_MAX, torch.float32),  # wrapped to -4: aliased a live block
        (INT64_MAX, torch.uint8),  # fits int64, but rounding to 64 KiB overflowed
    ],
)
def test_impossible_size_is_a_value_error_naming_the_limit(fresh_pool, numel, dtype):
    with pytest.raises(ValueError, match=r"2\^63 - 1") as info:
        pinxfer.empty(numel, dtype=dtype)
    assert str(numel) in str(info.value)
    with pytest.raises(ValueError, match=r"2\^63 - 1"):
        torch.ops.pinxfer.empty([numel], dtype, None)


def test_product_of_sizes_overflowing_is_refused(fresh_pool):
    with pytest.raises(ValueError, match="more elements than pinxfer can handle"):
        pinxfer.empty([2**40, 2**40], dtype=torch.uint8)
    # Even with a 0 among them: torch's own element count overflows there too.
    with pytest.raises(ValueError, match="more elements than pinxfer can handle"):
        pinxfer.empty([2**40, 2**40, 0], dtype=torch.float32)
    assert pinxfer.empty([2**20, 0], dtype=torch.float32).shape == (2**20, 0)


def test_bad_size_never_aliases_a_live_block(fresh_pool):
    """The issue's reproducer: after a refused impossible size, two live tensors
    never share memory and the counters stay exact."""
    b = pinxfer.empty(4 << 20, dtype=torch.uint8)
    del b
    with pytest.raises(ValueError, match="2\\^63 - 1"):
        pinxfer.empty(INT64_MAX)
    v = pinxfer.empty(4 << 20, dtype=torch.uint8)
    w = pinxfer.empty(4 << 20, dtype=torch.uint8)
    assert v.data_ptr() != w.data_ptr()
    assert v.untyped_storage().nbytes() == 4 << 20
    v.fill_(1)
    w.fill_(2)
    assert int(v.sum()) == 4 << 20
    stats = pinxfer.memory_stats()
    assert stats["requested_bytes.current"] == 8 << 20
    del v, w
    assert pinxfer.memory_stats()["requested_bytes.current"] == 0


def test_a_size_whose_sum_with_the_pinned_bytes_passes_int64_is_out_of_memory(fresh_pool):
    """A size under 2^63 - 1 whose sum with what is pinned is over it: the cap's count
    overflowed (undefined; in practice it went negative, so the cap let maps through) until
    session 44. Now an OutOfMemoryError that says so, and the counts stay exact."""
    held = pinxfer.empty(4 << 20, dtype=torch.uint8)
    reserved = pinxfer.memory_stats()["reserved_bytes.current"]
    with pytest.raises(torch.OutOfMemoryError, match=r"2\^63 - 1"):
        pinxfer.empty(INT64_MAX - (1 << 20) + 1, dtype=torch.uint8)
    assert pinxfer.memory_stats()["reserved_bytes.current"] == reserved
    again = pinxfer.empty(4 << 20, dtype=torch.uint8)
    assert again.data_ptr() != held.data_ptr()


def test_a_request_above_the_cap_alone_gives_back_no_cache(fresh_pool):
    """No relief can make room for a request larger than the cap: it raises at once and
    leaves the cache mapped (relief unmapped every pool's cache first)."""
    pinxfer.set_max_pinned_bytes(16 << 20)
    cached = pinxfer.empty(4 << 20, dtype=torch.uint8)
    del cached
    unmaps = pinxfer.memory_stats()["num_segment_unmaps"]
    with pytest.raises(torch.OutOfMemoryError, match="cap is 16777216"):
        pinxfer.empty(32 << 20, dtype=torch.uint8)
    assert pinxfer.memory_stats()["num_segment_unmaps"] == unmaps
    assert pinxfer.memory_stats()["reserved_bytes.current"] > 0


def test_quantized_dtype_is_refused_by_empty():
    with pytest.raises(ValueError, match="quantized dtype"):
        pinxfer.empty(3, dtype=torch.qint8)
    with pytest.raises(ValueError, match="quantized dtype"):
        torch.ops.pinxfer.empty([3], torch.qint8, None)


# ---- integers in range, or a clear error (the argument and its variable alike) ----


@pytest.mark.parametrize("node", [2**32, 2**31, -5, 100000])
def test_numa_node_out_of_range_is_refused(node):
    with pytest.raises(ValueError, match="numa_node must be"):
        pinxfer.empty(16, numa_node=node)
    with pytest.raises(ValueError, match="numa_node must be"):
        pinxfer.pin_memory(torch.randn(4), numa_node=node)
    # The operators check too (the Python edge is not the only way in).
    with pytest.raises(ValueError, match="numa_node must be -1"):
        torch.ops.pinxfer.empty([16], torch.float32, node)
    with pytest.raises(ValueError, match="numa_node must be -1"):
        torch.ops.pinxfer.pin_memory(torch.randn(4), node, 0)


def test_no_thread_pool_for_nodes_that_do_not_exist():
    """200 calls with numa_node=2..201 left 200 permanent threads behind."""
    pinxfer.pin_memory(torch.randn(1 << 20))  # the real node's pool exists already
    before = task_count()
    for node in range(2, 202):
        with pytest.raises(ValueError, match="numa_node"):
            pinxfer.pin_memory(torch.randn(1 << 20), numa_node=node)
    pinxfer.empty_cache()
    assert task_count() <= before


def test_num_threads_above_the_cap_is_refused():
    with pytest.raises((ValueError, RuntimeError), match="num_threads"):
        pinxfer.pin_memory(torch.randn(4), num_threads=2**40)


def test_settings_report_the_number_in_force():
    """settings() shows what the process uses, never the text it could not read."""
    out = run_child(
        """
        import torch
        import pinxfer
        names, values, sources, _docs = zip(*pinxfer._C.settings())
        print(dict(zip(names, values))["PINXFER_NUM_THREADS"])
        print(dict(zip(names, values))["PINXFER_SPIN_US"])
    """,
        PINXFER_NUM_THREADS="2",
        PINXFER_SPIN_US="0007",
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["2", "7"]


# ---- storage-level questions on views: no hidden copies ----


def _neg_view(t: torch.Tensor) -> torch.Tensor:
    return torch._neg_view(t)


@pytest.mark.parametrize("make_view", [torch.conj, _neg_view], ids=["conj", "neg"])
def test_pin_of_a_conj_or_neg_view_pins_the_real_storage(make_view):
    base = torch.randn(1 << 20, dtype=torch.complex64)
    view = make_view(base)
    assert view.is_conj() or view.is_neg()
    locked_before = vm_locked_kib()
    pinxfer.pin_(view)
    try:
        assert pinxfer.is_pinned(view) and pinxfer.is_pinned(base)
        if MLOCK_IS_REAL and not torch.cuda.is_available():
            assert vm_locked_kib() - locked_before >= (8 << 20) // 1024 - 8
    finally:
        pinxfer.unpin_(view)
    assert not pinxfer.is_pinned(base)
    if MLOCK_IS_REAL:
        assert vm_locked_kib() <= locked_before + 8


def test_pool_queries_agree_on_a_conj_view(fresh_pool):
    t = pinxfer.empty(1024, dtype=torch.complex64)
    c = t.conj()
    assert pinxfer.is_pinned(c)
    assert torch.ops.pinxfer.is_pool_tensor(c)
    assert torch.ops.pinxfer.lock_kind(c) == torch.ops.pinxfer.lock_kind(t)


def test_pin_then_set_leaves_nothing_locked():
    """pin_ then t.set_(other) left 4 MiB locked with no handle to unpin it."""
    t = torch.randn(1 << 20)
    locked_before = vm_locked_kib()
    pinxfer.pin_(t)
    t.set_(torch.randn(16))
    assert not pinxfer.is_pinned(t)
    gc.collect()
    pinxfer.empty_cache()  # unpins registrations nobody can reach any more
    if MLOCK_IS_REAL:
        assert vm_locked_kib() <= locked_before + 8
    # The memory may be pinned again from scratch.
    u = torch.randn(1 << 20)
    pinxfer.pin_(u)
    pinxfer.unpin_(u)


def test_pin_unpin_of_shared_memory_tensor_is_clean():
    """Was: 'allocator_ INTERNAL ASSERT FAILED ... please report a bug to PyTorch'."""
    t = torch.randn(1 << 16).share_memory_()
    pinxfer.pin_(t)
    assert pinxfer.is_pinned(t)
    # torch still sees it shared, so share_memory_() leaves the memory (and the pin) as is.
    address = t.data_ptr()
    assert t.is_shared() and t.share_memory_().data_ptr() == address
    assert pinxfer.is_pinned(t)
    pinxfer.unpin_(t)
    assert not pinxfer.is_pinned(t)
    assert t.is_shared()


def test_share_memory_of_a_pinned_tensor_ends_the_pin_and_keeps_the_bytes():
    """share_memory_() swaps a storage's memory whatever its resizable flag and frees the
    old: the freed range stayed registered (CUDA) or in the registry, which kept naming
    it (found by review, session 42). Now the old memory is unpinned before it is freed,
    the tensor keeps its bytes in shared memory, unpinned, and may be pinned again."""
    t = torch.randn(1 << 20)  # 4 MiB
    expected = t.clone()
    registrations = pinxfer._C._inplace_registrations()
    locked_before = vm_locked_kib()
    pinxfer.pin_(t)
    assert pinxfer._C._inplace_registrations() == registrations + 1
    t.share_memory_()
    assert t.is_shared() and torch.equal(t, expected)
    assert not pinxfer.is_pinned(t) and inplace_lock_kind(t) is None
    assert pinxfer._C._inplace_registrations() == registrations
    if MLOCK_IS_REAL:
        assert vm_locked_kib() <= locked_before + 8
    with pytest.raises(RuntimeError, match=r"not pinned by pinxfer.pin_"):
        pinxfer.unpin_(t)
    pinxfer.pin_(t)  # the shared memory, from scratch
    assert pinxfer.is_pinned(t) and torch.equal(t, expected)
    pinxfer.unpin_(t)
    assert t.is_shared() and pinxfer._C._inplace_registrations() == registrations


def test_pin_of_a_lazy_clone_copies_it_first():
    """A lazy clone shares its source's memory until written. pin_ registers the clone's
    own memory, so writes through the pinned clone never reach the source."""
    source = torch.arange(1 << 18, dtype=torch.float32)
    clone = torch._lazy_clone(source)
    pinxfer.pin_(clone)
    assert clone.data_ptr() != source.data_ptr()
    clone.fill_(-1.0)
    assert torch.equal(source, torch.arange(1 << 18, dtype=torch.float32))
    assert pinxfer.is_pinned(clone) and not pinxfer.is_pinned(source)
    pinxfer.unpin_(clone)


def test_a_forked_child_may_share_a_tensor_its_parent_pinned():
    """DataLoader's forked workers send tensors with share_memory_(). In the child nothing
    is locked and the pin_ registry starts empty (the parent's may have been half-changed by
    another thread at the fork): unpin_ refuses, the swap frees the child's copy through
    pin_'s deleter, and the child may pin its copy; the parent's pin is untouched."""
    out = run_child(
        """
        import os
        import torch
        import pinxfer
        t = torch.randn(1 << 20)
        pinxfer.pin_(t)
        pid = os.fork()
        if pid == 0:
            # The child's registry starts empty: nothing is pinned here.
            ok = not pinxfer.is_pinned(t) and pinxfer._C._inplace_registrations() == 0
            try:
                pinxfer.unpin_(t)
                ok = False
            except RuntimeError as err:
                ok = ok and "not pinned by pinxfer.pin_" in str(err)
            t.share_memory_()
            ok = ok and t.is_shared() and not pinxfer.is_pinned(t)
            pinxfer.pin_(t)  # the child's own pin of its shared copy
            ok = ok and pinxfer.is_pinned(t) and pinxfer._C._inplace_registrations() == 1
            pinxfer.unpin_(t)
            os._exit(0 if ok else 3)
        _, status = os.waitpid(pid, 0)
        print("CHILD", os.waitstatus_to_exitcode(status))
        assert pinxfer.is_pinned(t) and pinxfer._C._inplace_registrations() == 1
        pinxfer.unpin_(t)
        print("PARENT OK")
    """,
        PINXFER_DISABLE_CUDA="1",
    )
    assert out.returncode == 0, out.stderr
    assert "CHILD 0" in out.stdout and "PARENT OK" in out.stdout, out.stdout + out.stderr


def test_pin_of_quantized_tensor_is_refused():
    q = torch.quantize_per_tensor(torch.randn(64), 0.1, 0, torch.qint8)
    with pytest.raises(ValueError, match="quantized"):
        pinxfer.pin_(q)  # the Python edge
    with pytest.raises(RuntimeError, match="quantized tensors are not supported"):
        torch.ops.pinxfer.pin_(q)  # the operator


def test_forked_child_sees_parent_pool_tensor_unpinned():
    """In a forked child the parent's blocks are neither mlocked nor registered:
    is_pinned, is_pool_tensor and VmLck agree there."""
    out = run_child(
        """
        import os
        import torch
        import pinxfer
        t = pinxfer.empty(4 << 20, dtype=torch.uint8)
        assert pinxfer.is_pinned(t)
        pid = os.fork()
        if pid == 0:
            ok = not pinxfer.is_pinned(t) and not torch.ops.pinxfer.is_pool_tensor(t)
            os._exit(0 if ok else 3)
        _, status = os.waitpid(pid, 0)
        print("CHILD", os.waitstatus_to_exitcode(status))
    """,
        PINXFER_DISABLE_CUDA="1",
    )
    assert out.returncode == 0, out.stderr
    assert "CHILD 0" in out.stdout, out.stdout + out.stderr


# ---- failure paths never hang ----


@pytest.mark.skipif(
    SANITIZER is not None,
    reason="an address-space limit leaves no room for a sanitizer's shadow memory",
)
def test_thread_creation_failing_part_way_is_an_error_not_a_hang():
    """PINXFER_NUM_THREADS=2000 under `ulimit -v` hung in pthread_cond_destroy: the
    pool's constructor unwound while its started threads waited. Now the started
    threads are joined and the call raises."""
    out = run_child(
        """
        import resource
        import torch
        import pinxfer
        src = torch.randn(8 << 20)
        # Room for a few 8 MiB thread stacks, not for sixteen.
        vm = int(open("/proc/self/statm").read().split()[0]) * 4096
        resource.setrlimit(resource.RLIMIT_AS, (vm + (160 << 20), resource.RLIM_INFINITY))
        try:
            pinxfer.pin_memory(src)
        except RuntimeError as e:
            print("ERROR", "could not start copy thread" in str(e))
        else:
            print("NO ERROR")
    """,
        timeout=60,
        PINXFER_NUM_THREADS="16",
        PINXFER_DISABLE_CUDA="1",
    )
    assert out.returncode == 0, out.stderr
    # Either the limit left room for every thread, or the call failed cleanly.
    assert "ERROR True" in out.stdout or "NO ERROR" in out.stdout, out.stdout + out.stderr


def test_sysfs_fifo_never_blocks(tmp_path):
    """A FIFO where sysfs has a file made topology() block forever."""
    d = tmp_path / "bus" / "pci" / "devices" / "0000:1b:00.0"
    d.mkdir(parents=True)
    os.mkfifo(d / "numa_node")
    node = tmp_path / "devices" / "system" / "node" / "node0"
    node.mkdir(parents=True)
    os.mkfifo(node / "cpulist")
    out = run_child(
        f"""
        import torch
        import pinxfer
        print(pinxfer._C.pci_numa_node("0000:1b:00.0", {str(tmp_path)!r}))
        print(pinxfer._C.node_cpus(0, {str(tmp_path)!r}))
    """,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["-1", "[]"], out.stdout


def test_huge_node_directory_is_not_a_node(tmp_path):
    """numa_nodes(root) with a node99999999999 directory raised IndexError: stoi."""
    base = tmp_path / "devices" / "system" / "node"
    for name in ("node0", "node1", "node99999999999"):
        (base / name).mkdir(parents=True)
    assert list(pinxfer._C.online_nodes(str(tmp_path))) == [0, 1]
