"""The eager fast calls (pinxfer._C, csrc/python/fast_calls.cpp) against the operators.

They reach the same kernels without the dispatcher: results must be the same as
through torch.ops, and the Python wrappers must fall back to torch.ops wherever
the dispatcher matters (autograd, subclasses, fake tensors, modes, tracing)."""

from __future__ import annotations

import collections
import dataclasses
import os
import random
import textwrap
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import pinxfer
from pinxfer import _batch, _ops
from tests import fresh

from .conftest import requires_cuda

ops = torch.ops.pinxfer
REPO = str(Path(__file__).resolve().parent.parent)


def test_fast_pin_matches_the_operator_bit_for_bit():
    g = torch.Generator().manual_seed(1)
    for x in (
        torch.randn(7, 5, generator=g),
        torch.randn(4, 6, generator=g).t(),
        torch.randint(0, 255, (100_001,), dtype=torch.uint8, generator=g)[3::2],
        torch.randn(3, generator=g).expand(4, 3),
        torch.randn(0, 3),
    ):
        via_fast = _ops.fast.pin_memory_if_plain(x, None, 0, True)
        via_op = ops.pin_memory(x, None, 0)
        assert via_fast.shape == via_op.shape and via_fast.stride() == via_op.stride()
        assert torch.equal(via_fast, via_op) and torch.equal(via_fast, x)
        assert pinxfer.is_pool_tensor(via_fast) or via_fast.numel() == 0


def test_plain_leaves_check_agrees_with_the_python_predicate():
    """_C.plain_leaves_max_bytes is plain_dense_cpu's accelerator for a batch's leaves: it
    must say "not plain" (-1) exactly where the Python predicate does, for every kind of
    leaf, and otherwise give the largest leaf's bytes."""

    class Sub(torch.Tensor):
        pass

    kinds = {
        "plain": torch.randn(3, 4),
        "transposed": torch.randn(4, 6).t(),
        "zero_dim": torch.tensor(7),
        "empty": torch.empty(0, 5),
        "uint8_large": torch.zeros(300_000, dtype=torch.uint8),
        "requires_grad": torch.randn(3, requires_grad=True),
        "parameter_no_grad": torch.nn.Parameter(torch.randn(3), requires_grad=False),
        "subclass": torch.randn(3).as_subclass(Sub),
        "sparse": torch.eye(3).to_sparse(),
        "nested": torch.nested.nested_tensor([torch.randn(2), torch.randn(3)]),
        "quantized": torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8),
        "meta": torch.empty(3, device="meta"),
        "not_a_tensor": 3,
    }
    for name, leaf in kinds.items():
        plain = isinstance(leaf, torch.Tensor) and _ops.plain_dense_cpu(leaf)
        got = _ops.fast.plain_leaves_max_bytes([kinds["plain"], leaf])
        assert (got >= 0) == plain, name
        if plain:
            assert got == max(kinds["plain"].nbytes, leaf.nbytes), name
    assert _ops.fast.plain_leaves_max_bytes([]) == 0


def test_fast_pin_returns_an_already_pinned_tensor_itself():
    t = pinxfer.empty(1000)
    assert _ops.fast.pin_memory_if_plain(t, None, 0, True) is t
    assert pinxfer.pin_memory(t) is t
    out = _ops.fast.pin_memory_many([t, torch.ones(3)], None, 0, True)
    assert out[0] is t and pinxfer.is_pool_tensor(out[1])


def test_fast_empty_matches_the_operator():
    a = _ops.fast.empty_if_eager([3, 4], torch.float64, None)
    b = ops.empty([3, 4], torch.float64, None)
    assert a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
    assert pinxfer.is_pool_tensor(a) and not a.requires_grad
    a.fill_(2.5)
    assert a.sum().item() == 30.0  # a usable tensor: storage, sizes, strides consistent
    with pytest.raises(ValueError, match="sizes must be non-negative"):
        pinxfer.empty(2, -1)


def test_fast_call_errors_are_the_operators_errors():
    # (A meta tensor sent to the op reaches its fake, not the kernel.)
    for call in (
        lambda x, n: _ops.fast.pin_memory_if_plain(x, None, n, True),
        lambda x, n: ops.pin_memory(x, None, n),
    ):
        with pytest.raises(ValueError, match="num_threads must be from 0"):
            call(torch.ones(3), -1)


def test_plain_calls_answer_none_exactly_where_the_operator_must_run():
    """pin_memory_if_plain, empty_if_eager and to_device_if_plain (METH_FASTCALL,
    csrc/python/plain_calls.cpp) make plain_dense_cpu's and eager()'s checks in C++: they
    must decline (None) every tensor the Python predicate declines and run under no mode,
    and decline nothing else."""
    from torch.overrides import TorchFunctionMode

    class Sub(torch.Tensor):
        pass

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    class Watch(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    for leaf in (
        torch.randn(3).as_subclass(Sub),
        torch.nn.Parameter(torch.randn(3), requires_grad=False),
        torch.randn(3, requires_grad=True),
        torch.eye(3).to_sparse(),
        torch.nested.nested_tensor([torch.randn(2), torch.randn(3)]),
        torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8),
        torch.empty(3, device="meta"),
        "not a tensor",
    ):
        assert not (isinstance(leaf, torch.Tensor) and _ops.plain_dense_cpu(leaf))
        assert _ops.fast.pin_memory_if_plain(leaf, None, 0, True) is None, repr(leaf)
        assert _ops.fast.pin_memory_hot(leaf) is None, repr(leaf)
    for mode in (Record, Watch):
        with mode():
            assert _ops.fast.pin_memory_if_plain(torch.ones(3), None, 0, True) is None
            assert _ops.fast.pin_memory_hot(torch.ones(3)) is None
            assert _ops.fast.empty_if_eager([3], torch.float32, None) is None
            assert _ops.fast.empty_hot((3,), torch.float32) is None
    x = torch.randn(5, 2).t()
    y = _ops.fast.pin_memory_if_plain(x, None, 0, True)
    assert y is not None and torch.equal(y, x) and y.stride() == x.stride()
    pinxfer.pin_memory(torch.ones(1))  # torch's CUDA state as pinning leaves it: the hot call open
    hot = _ops.fast.pin_memory_hot(x)
    assert hot is not None and torch.equal(hot, x) and hot.stride() == x.stride()
    assert pinxfer.is_pool_tensor(hot) and _ops.fast.pin_memory_hot(hot) is hot
    # empty_if_eager takes empty(*size)'s sizes and declines what pinxfer.empty must check
    for sizes in ((3, 4), ([3, 4],), (torch.Size([3, 4]),)):
        assert _ops.fast.empty_if_eager(sizes, None, None).shape == (3, 4)
    assert _ops.fast.empty_if_eager((2,), None, None).dtype == torch.get_default_dtype()
    for sizes in ((3, 1.0), (True,), (-1,), (2**63,), ("3",), ([3], 4), 3):
        assert _ops.fast.empty_if_eager(sizes, torch.float32, None) is None, sizes
    assert _ops.fast.empty_if_eager((3,), "float32", None) is None
    # empty_hot, open since the pin above, declines the same sizes and dtypes
    for sizes in ((3, 4), ([3, 4],), (torch.Size([3, 4]),)):
        hot = _ops.fast.empty_hot(sizes, torch.int16)
        assert hot.shape == (3, 4) and hot.dtype == torch.int16 and pinxfer.is_pool_tensor(hot)
    for sizes in ((3, 1.0), (True,), (-1,), (2**63,), ("3",), ([3], 4), 3):
        assert _ops.fast.empty_hot(sizes, torch.float32) is None, sizes
    assert _ops.fast.empty_hot((3,), "float32") is None
    with pytest.raises(TypeError, match=r"empty_hot: expected 2 arguments, got 3"):
        _ops.fast.empty_hot((3,), None, None)
    with pytest.raises(TypeError, match=r"pin_memory_if_plain: expected 4 arguments, got 1"):
        _ops.fast.pin_memory_if_plain(x)
    with pytest.raises(TypeError, match=r"pin_memory_if_plain: numa_node must be an int, got str"):
        _ops.fast.pin_memory_if_plain(x, "0", 0, True)


@pytest.mark.gpu
@requires_cuda
def test_to_device_if_plain_declines_under_the_profiler_and_modes():
    """to_device_if_plain leaves a call to the Python path while torch's profiler runs (so
    the call's record_function range is recorded) and under a mode; a plain tensor
    otherwise goes, bit for bit."""
    dev = torch.device("cuda", 0)
    x = torch.randn(1000)
    out = _ops.fast.to_device_if_plain(x, dev, 16 << 20, 4)
    assert out is not None and torch.equal(out.cpu(), x)
    grad = torch.randn(10, requires_grad=True)
    assert _ops.fast.to_device_if_plain(grad, dev, 16 << 20, 4) is None
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        assert _ops.fast.to_device_if_plain(x, dev, 16 << 20, 4) is None
        got = pinxfer.to_device(x, dev)
    assert torch.equal(got.cpu(), x)
    assert any(e.name == "pinxfer::to_device" for e in prof.events())
    with pytest.raises(TypeError, match=r"to_device_if_plain: device must be a torch\.device"):
        _ops.fast.to_device_if_plain(x, "cuda", 16 << 20, 4)


@pytest.mark.gpu
@requires_cuda
def test_call_breakdown_times_every_piece_on_a_gpu():
    """pinxfer._C._call_breakdown (diag_small_calls' native figures, each piece of a small
    call timed alone) runs its CUDA pieces where a GPU is usable, pin_memory's pinned check
    and torch's is_pinned among them, and gives each a time."""
    got = pinxfer._C._call_breakdown(50)
    for name in (
        "pool_allocate_free_64KiB",
        "is_dma_pinned_pageable",
        "pin_memory_pinned_check_pageable",
        "torch_is_pinned_pageable",
        "send_to_device_4KiB",
        "caller_staged_copy_4KiB",
        "cudaMemcpyAsync_pageable_4KiB",
    ):
        assert got.get(name, 0) > 0, (name, got)


def test_modes_and_autograd_take_the_operator():
    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    x = torch.randn(10)
    with Record():
        y = pinxfer.pin_memory(x)
        z = pinxfer.empty(4)
        pinxfer.pin_memory({"a": torch.ones(2)})
    assert torch.equal(y, x) and z.shape == (4,)
    assert "pinxfer.pin_memory.default" in seen and "pinxfer.empty.default" in seen
    assert seen.count("pinxfer.pin_memory.default") == 2  # the batch's leaf too

    w = torch.randn(5, requires_grad=True)
    p = pinxfer.pin_memory(w)
    assert p.requires_grad and p.grad_fn is not None
    p.sum().backward()
    assert torch.equal(w.grad, torch.ones(5))


def test_fake_tensors_take_the_operator():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.randn(4, 3).t())
        y = pinxfer.pin_memory(x)
        e = pinxfer.empty(5, dtype=torch.int16)
    assert y.shape == (3, 4) and y.stride() == (1, 3)
    assert e.shape == (5,) and e.dtype == torch.int16


@dataclasses.dataclass
class Sample:
    x: torch.Tensor
    meta: str = "m"


def test_batch_in_one_call_keeps_structure_and_paths():
    batch = {
        "a": [torch.arange(5), (torch.ones(2, 2), "s")],
        "b": Sample(torch.zeros(3)),
        "c": collections.OrderedDict(k=torch.full((4,), 7.0)),
        "n": 3,
    }
    out = pinxfer.pin_memory(batch)
    assert type(out["c"]) is collections.OrderedDict and out["n"] == 3
    assert isinstance(out["b"], Sample) and out["b"].meta == "m"
    for before, after in zip(_batch.tensors_in(batch), _batch.tensors_in(out)):
        assert torch.equal(before, after) and pinxfer.is_pinned(after)
    with pytest.raises(
        RuntimeError, match=r"cannot pin batch\['a'\]\[1\]\[0\]: expected a CPU tensor"
    ):
        pinxfer.pin_memory({"a": [torch.ones(1), (torch.empty(2, device="meta"),)]})


def test_walker_error_paths_cover_every_container():
    def boom(t):
        raise ValueError("no")

    for obj, path in (
        (Sample(torch.ones(1)), "batch.x"),
        ([0, {"k": torch.ones(1)}], "batch[1]['k']"),
        (collections.namedtuple("P", "u v")(1, torch.ones(1)), "batch.v"),
    ):
        with pytest.raises(ValueError, match="no") as info:
            _batch.map_tensors(obj, boom, describe=lambda e, p: ValueError(f"{p}: {e}"))
        assert str(info.value).startswith(path)


def test_pack_offsets_align_every_tensor_to_256_bytes():
    tensors = [
        torch.randn(3),
        torch.empty(0),
        torch.tensor(True),
        torch.randn(64),
        torch.randn(2, 3, dtype=torch.complex64),
    ]
    offsets, total = _ops.pack_offsets(tensors)
    assert offsets == [0, 256, 256, 512, 768]
    assert total == 1024
    assert _ops.pack_offsets([]) == ([], 0)


def test_leaf_sent_apart_is_one_rule_in_both_paths():
    """Which small leaf a batch sends apart from its pack: the C++ rule (the fast path,
    prefetch's sender) and its Python copy (the operators' path) agree on every case,
    and the cases are the ones the rule names."""
    from pinxfer.transfer import SMALL_TENSOR_BYTES as small
    from pinxfer.transfer import _leaf_sent_apart

    named = {
        # bench_loop's 256 KiB batch: 252 KiB of inputs, 4 KiB labels, two scalars.
        (258048, 4096, 8, 8): 0,
        (4096, small, 1000): 1,  # the largest need not come first
        (4096, 200 << 10, 1000): -1,  # fits in one current-stream pack
        (200 << 10, 100 << 10, small): -1,  # too large without it: one pack, helpers
        (small, small): 0,  # a tie: the first
        (small,): -1,
        (): -1,
        (small - 256, 200): -1,  # 256 KiB exactly, each leaf rounded up to 256 bytes
        (small - 256, 257): 0,
    }
    rng = random.Random(7)
    cases = list(named)
    for _ in range(2000):
        n = rng.randint(0, 6)
        cases.append(
            tuple(
                rng.choice((0, 1, 8, 255, 4096, small // 3, small - 1, small))
                if rng.random() < 0.3
                else rng.randint(0, small)
                for _ in range(n)
            )
        )
    for sizes in cases:
        want = _leaf_sent_apart(list(sizes))
        assert _ops.fast._leaf_sent_apart(list(sizes)) == want, sizes
        if sizes in named:
            assert want == named[sizes], sizes
    with pytest.raises(ValueError, match=r"expected sizes from 0 to 262144 \(a small leaf\)"):
        _ops.fast._leaf_sent_apart([small + 1])


def test_to_device_packed_fake_has_the_packed_length():
    """The fake kernel (torch.compile, opcheck) gives the buffer the real kernel returns;
    built without a GPU as a fake CUDA tensor."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    tensors = [torch.randn(3), torch.arange(70, dtype=torch.int16)]
    with FakeTensorMode(allow_non_fake_inputs=True):
        out = ops.to_device_packed(tensors, torch.device("cuda", 0))
    assert out.dtype == torch.uint8 and out.shape == (512,) and out.device.type == "cuda"


@pytest.mark.parametrize("first_call", ["pin_memory", "empty"])
def test_hot_calls_open_once_torch_cuda_is_ready_and_never_in_a_forked_child(first_call):
    """pinxfer.pin_memory(x) and pinxfer.empty(n) go straight to C++ (pin_memory_hot,
    empty_hot) only where the Python path would have done nothing more: after
    ensure_torch_cuda (the first pin or empty initialises torch's CUDA state where CUDA is
    usable; before it the hot calls decline, so that first call still does) and outside a
    forked child (where Python asks torch whether CUDA may be queried). A fresh process for
    the first, a fork of it for the second; either function's first call opens both."""
    code = f"""
        import os, torch, pinxfer
        from pinxfer import _ops
        x = torch.randn(1000)
        assert _ops.fast.pin_memory_hot(x) is None, "pin_memory_hot open before the first call"
        assert _ops.fast.empty_hot((4,), None) is None, "empty_hot open before the first call"
        first = pinxfer.pin_memory(x) if "{first_call}" == "pin_memory" else pinxfer.empty(9)
        assert _ops.torch_cuda_ready
        if _ops.build_info().cuda_usable:
            assert torch.cuda.is_initialized() and first.is_pinned()
        hot = _ops.fast.pin_memory_hot(x)
        assert hot is not None and torch.equal(hot, x) and pinxfer.is_pool_tensor(hot)
        made = _ops.fast.empty_hot((2, 3), torch.int64)
        assert made.shape == (2, 3) and made.dtype == torch.int64 and pinxfer.is_pool_tensor(made)
        pid = os.fork()
        if pid == 0:
            ok = _ops.fast.pin_memory_hot(x) is None and torch.equal(pinxfer.pin_memory(x), x)
            ok = ok and _ops.fast.empty_hot((4,), None) is None
            ok = ok and pinxfer.empty(4).shape == (4,)
            os._exit(0 if ok else 3)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, status
        print("ok")
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("PINXFER_")}
    run = fresh.run(textwrap.dedent(code), env=env, cwd=REPO, timeout=120)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout + run.stderr


@pytest.mark.skipif(
    not hasattr(pinxfer._C, "BatchSender"), reason="a build without CUDA has no batch sender"
)
def test_sender_fast_methods_are_method_descriptors_of_the_class():
    """BatchSender.submit_batch_if_plain and take_batch are METH_FASTCALL method descriptors
    added to the pybind11 class (transfer_bindings.cpp): reached on a sender as its other
    methods are, and refusing any other object as ``self`` before they read it (no CUDA
    needed to check that; the GPU tests call them on a real sender)."""
    cls = pinxfer._C.BatchSender
    for name in ("submit_batch_if_plain", "take_batch"):
        method = cls.__dict__[name]
        assert type(method).__name__ == "method_descriptor", type(method)
        assert method.__doc__.startswith(f"{name}(")
        with pytest.raises(TypeError, match="BatchSender"):
            method(object(), None)
