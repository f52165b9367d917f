"""The stress's own parts, on the CPU and quick (in the README's test command): the checker
finds a corrupted byte (and says where), counts injected faults, tells shape errors from
bad bytes; the batch walker sees structural differences; every layout's expected bytes are
its source's; an operation's check catches a block corrupted behind its back; the op table
says what runs without a GPU."""

from __future__ import annotations

import random

import pytest
import torch

from tests.stress import ops
from tests.stress.batches import Pair, structure_diff
from tests.stress.checker import Checker
from tests.stress.env import Env
from tests.stress.ops import allocator
from tests.stress.sources import LAYOUTS
from tests.stress.stats import Recorder
from tests.stress.tensors import KiB, MiB, as_bytes, flat_bytes
from tests.stress.worker import Gate, Shared, Worker

CPU = torch.device("cpu")


def checker(inject: float = 0.0) -> tuple[Checker, Env]:
    env = Env(CPU, inject=inject, max_bytes=MiB)
    return Checker(env, Recorder("plain", 0), random.Random(0)), env


def cpu_worker(table: list | None = None) -> Worker:
    env = Env(CPU, max_bytes=MiB)
    w = Worker(
        0,
        env,
        "plain",
        False,
        1,
        Shared(1, 0),
        Gate(),
        table if table is not None else ops.plan(env, installed=False)[0],
        0.0,
        0.0,
    )
    w.setup()
    return w


def values() -> list[torch.Tensor]:
    """int32, bool and float32 with a NaN and a -0.0 (which == would call equal to +0.0)."""
    return [
        torch.arange(10, dtype=torch.int32),
        torch.tensor([True, False, True]),
        torch.tensor([float("nan"), -0.0, 1.0], dtype=torch.float32),
    ]


def test_equal_values_have_no_bad_byte():
    chk, _ = checker()
    exp = values()
    chk.check("direct", [t.clone() for t in exp], exp, [{}, {}, {}])
    chk.resolve()
    st = chk.rec.stats
    assert (st.bad_bytes, st.contract_errors, st.transfers) == (0, 0, 3)
    assert st.bytes_checked == 40 + 3 + 12 == st.ops["direct"]["bytes_checked"]


@pytest.mark.parametrize("argmax_u8", [True, False], ids=["uint8_argmax", "int32_argmax"])
def test_a_flipped_byte_is_found_and_located(argmax_u8):
    chk, env = checker()
    env.argmax_u8 = argmax_u8
    exp = values()
    got = [t.clone() for t in exp]
    flat_bytes(got[1])[1] = 7  # a bool byte that is not 0/1: one bad byte
    flat_bytes(got[2])[7] ^= 0x80  # -0.0 -> +0.0, its sign byte
    chk.check("direct", got, exp, [{"n": "a"}, {"n": "b"}, {"n": "c"}], {"why": "test"})
    chk.resolve()
    st = chk.rec.stats
    assert (st.bad_bytes, st.bad_checks) == (2, 1)
    assert st.ops["direct"]["bad_bytes"] == 2
    m = st.mismatches[0]
    assert (m["tensor"], m["first_bad_byte"], m["got"], m["expected"]) == (1, 1, 7, 0)
    assert m["leaf"] == {"n": "b"} and m["why"] == "test" and m["tensors_in_check"] == 3


def test_a_wrong_shape_is_a_contract_violation_not_bytes():
    chk, _ = checker()
    a = torch.arange(10, dtype=torch.int32)
    chk.check("direct", [a.view(2, 5)], [a], [{"n": "shape"}])
    chk.check("direct", [a.to(torch.int64)], [a], [{"n": "dtype"}])
    chk.check("direct", [[1, 2]], [a], [{"n": "type"}])
    chk.resolve()
    st = chk.rec.stats
    assert st.contract_errors == 3 and st.bad_bytes == 0
    assert [s["leaf"]["n"] for s in st.contract_samples] == ["shape", "dtype", "type"]


def test_every_injected_fault_is_counted():
    chk, _ = checker(inject=1.0)
    for n in (1, 7, 4096, 65537):
        exp = torch.randint(0, 256, (n,), dtype=torch.uint8)
        chk.check("direct", [exp.clone()], [exp], [{"n": n}])
    chk.resolve()
    st = chk.rec.stats
    assert st.injected == 4 and st.bad_bytes == 4 and st.bad_checks == 4
    assert all(m["got"] != m["expected"] for m in st.mismatches)


def test_structure_diff_sees_what_differs():
    t = torch.zeros(2)
    src = {"a": [t, 3, "x"], "b": Pair(t, None)}
    assert structure_diff(src, {"a": [t.clone(), 3, "x"], "b": Pair(t, None)}, False) is None
    differs = {
        "key order": {"b": Pair(t, None), "a": [t, 3, "x"]},
        "length": {"a": [t, 3], "b": Pair(t, None)},
        "leaf": {"a": [t, 4, "x"], "b": Pair(t, None)},
        "container": {"a": (t, 3, "x"), "b": Pair(t, None)},
        "namedtuple": {"a": [t, 3, "x"], "b": (t, None)},
        "tensor lost": {"a": [3, 3, "x"], "b": Pair(t, None)},
    }
    for what, out in differs.items():
        assert structure_diff(src, out, False) is not None, what


def test_every_layout_expects_its_sources_bytes():
    w = cpu_worker()
    for layout in LAYOUTS:
        for _ in range(20):
            leaf = w.sources.make_leaf(layouts=[layout], cap=64 * KiB)
            assert torch.equal(as_bytes(leaf.src), as_bytes(leaf.exp)), leaf.meta
            assert torch.equal(as_bytes(leaf.exp), leaf.exp_b), leaf.meta


def test_a_pool_block_corrupted_while_held_fails_its_check():
    """What pool_hold exists to catch: a block's bytes changed by someone else while it is
    alive (here by hand) are counted when it is freed."""
    w = cpu_worker()
    for _ in range(allocator.HELD_BLOCKS):
        allocator.pool_hold(w)
    victim = next(leaf for leaf in w.held_blocks if leaf.nbytes)
    flat_bytes(victim.base)[victim.nbytes // 2] ^= 0xFF
    allocator.release_held(w)
    w.checker.resolve()
    st = w.rec.stats
    assert st.bad_bytes == 1 and st.errors == 0 and st.contract_errors == 0
    assert st.ops["pool_hold"]["bytes_checked"] >= victim.nbytes
    assert st.mismatches[0]["op"] == "pool_hold"


def test_without_a_gpu_the_cpu_operations_run_and_the_others_say_why_not():
    env = Env(CPU)
    for installed in (False, True):
        runnable, skipped = ops.plan(env, installed)
        names = {op.name for op in runnable}
        assert {"pin_memory", "pool_hold", "prefetch", "maintenance"} <= names
        assert all(not op.needs_cuda for op in runnable)
        assert skipped.get("to_device") == "needs a CUDA device"
        assert ("torch_pin_memory" in skipped) == installed  # install-only: not in plain


@pytest.mark.parametrize("name", ["pin_memory", "pool_hold", "pin_inplace", "prefetch"])
def test_each_cpu_operation_checks_bytes(name):
    runnable, skipped = ops.plan(Env(CPU), installed=False)
    table = [op for op in runnable if op.name == name]
    if not table:
        pytest.skip(f"{name}: {skipped[name]}")
    w = cpu_worker(table)
    for _ in range(20):
        table[0].run(w)
    for op in table:
        if op.finish:
            op.finish(w)
    w.checker.resolve()
    st = w.rec.stats
    assert st.errors == 0 and st.contract_errors == 0 and st.bad_bytes == 0, st.contract_samples
    assert st.ops[name]["transfers"] > 0 and st.ops[name]["bytes_checked"] > 0
