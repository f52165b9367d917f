"""pinxfer.pin_memory, pin_ and unpin_: semantics of Tensor.pin_memory(), batches,
errors, thread safety, real NUMA placement and real page locking.

On CPU, torch's own Tensor.pin_memory() cannot run (it needs CUDA), so results
are compared with the source and with `torch_layout_pin`, which is torch's
at::_pin_memory algorithm (storage of computeStorageNbytes(sizes, strides),
set_, copy_) on ordinary memory. GPU tests compare with t.pin_memory() itself.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import mmap
import os
import platform
import subprocess
import sys
import textwrap
import threading
from typing import NamedTuple

import pytest
import torch

import pinxfer
from pinxfer.pin import inplace_lock_kind, is_pinned

from .conftest import HAS_CUDA, MLOCK_IS_REAL, requires_cuda, vm_locked_kib

ops = torch.ops.pinxfer

DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex32,
    torch.complex64,
    torch.complex128,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.float8_e4m3fnuz,
    torch.float8_e5m2fnuz,
]
if hasattr(torch, "float8_e8m0fnu"):
    DTYPES.append(torch.float8_e8m0fnu)


def random_tensor(shape, dtype, seed=0) -> torch.Tensor:
    """Random bit patterns (NaN payloads, denormals, negative zero included); bool
    gets valid 0/1 bytes."""
    g = torch.Generator().manual_seed(seed)
    numel = 1
    for d in shape:
        numel *= d
    itemsize = torch.empty((), dtype=dtype).element_size()
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g, dtype=torch.uint8).bool()
    raw = torch.randint(0, 256, (numel * itemsize,), generator=g, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's element bytes in logical order (bit-exact comparison)."""
    c = t.contiguous()
    return c.reshape(-1).view(torch.uint8) if c.numel() else torch.empty(0, dtype=torch.uint8)


def torch_layout_pin(t: torch.Tensor) -> torch.Tensor:
    """What at::_pin_memory builds, on ordinary memory."""
    from torch._prims_common import compute_required_storage_length

    nbytes = compute_required_storage_length(t.shape, t.stride(), 0) * t.element_size()
    out = torch.empty(0, dtype=t.dtype).set_(torch.UntypedStorage(nbytes), 0, t.shape, t.stride())
    out.copy_(t)
    return out


def assert_same_as_torch(out: torch.Tensor, src: torch.Tensor) -> None:
    ref = torch_layout_pin(src)
    assert out.shape == src.shape
    assert out.dtype == src.dtype
    assert out.stride() == ref.stride()
    assert out.storage_offset() == 0
    assert out.untyped_storage().nbytes() == ref.untyped_storage().nbytes()
    assert torch.equal(as_bytes(out), as_bytes(src))
    assert out.device.type == "cpu"


@pytest.fixture(autouse=True)
def _fresh(fresh_pool):
    return


# ---- values, sizes, strides ----


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(7, 5), (3, 1 << 18)], ids=["small", "multi_chunk"])
def test_every_dtype_bit_exact(dtype, shape):
    t = random_tensor(shape, dtype, seed=1)
    out = pinxfer.pin_memory(t, numa_node=0)
    assert out is not t
    assert pinxfer.is_pool_tensor(out)
    assert_same_as_torch(out, t)
    assert out.data_ptr() != t.data_ptr()
    assert not is_pinned(t)  # the source stays pageable


# dtypes torch's own copy_ has no kernel for (sub-byte placeholders) or that came late
# (shell dtypes): pinxfer copies their bytes (pin_memory_cpu.cpp, torch_copy_covers).
BYTE_ONLY_DTYPES = [
    getattr(torch, name)
    for name in (
        "uint1",
        "uint4",
        "uint7",
        "int1",
        "int4",
        "int7",
        "bits8",
        "bits16",
        "float4_e2m1fn_x2",
    )
    if hasattr(torch, name)
]


@pytest.mark.parametrize("dtype", BYTE_ONLY_DTYPES, ids=str)
@pytest.mark.parametrize("nbytes", [36, 3 << 18], ids=["small", "multi_chunk"])
def test_dtypes_without_a_torch_copy_kernel_are_copied_bit_exact(dtype, nbytes):
    raw = random_tensor((nbytes,), torch.uint8, seed=4)
    src = raw.view(dtype)
    out = pinxfer.pin_memory(src, numa_node=0)
    assert out.dtype == dtype and out.shape == src.shape and out.stride() == src.stride()
    assert torch.equal(out.view(torch.uint8), raw)
    assert pinxfer.is_pool_tensor(out)


@pytest.mark.parametrize(
    "dtype",
    [torch.float32, torch.bfloat16, torch.complex64, torch.uint64, torch.bool, torch.float8_e5m2],
    ids=str,
)
def test_views_keep_their_strides(dtype):
    base = random_tensor((64, 48, 6), dtype, seed=2)
    views = {
        "transpose": base.transpose(0, 1),
        "step_slice": base[::3, 1::2],
        "narrow_offset": base[5:9],  # storage offset 5*48*6 -> 0
        "permute": base.permute(2, 0, 1),
        "channels_last": random_tensor((2, 3, 8, 8), dtype).contiguous(
            memory_format=torch.channels_last
        ),
        "size_one_odd_stride": base[:, :1, :].transpose(0, 1),
        "column": base[:, 3, 2],
    }
    for name, v in views.items():
        out = pinxfer.pin_memory(v, numa_node=0)
        assert_same_as_torch(out, v), name


def test_overlapping_views_become_contiguous():
    # torch's pin_memory raises here ("more than one element of the written-to
    # tensor refers to a single memory location"); pinxfer returns a contiguous copy.
    base = torch.arange(12, dtype=torch.float32)
    for v in (base[:3].expand(4, 3), base[:1].expand(5), base[:4].view(2, 2).expand(3, 2, 2)):
        out = pinxfer.pin_memory(v, numa_node=0)
        assert out.is_contiguous()
        assert out.shape == v.shape and torch.equal(out, v)
    # Overlap torch cannot prove (has_internal_overlap: "too hard") is copied as
    # torch copies it: strides kept, and the span copy gives every element.
    v = base.as_strided((4, 4), (2, 1))
    out = pinxfer.pin_memory(v, numa_node=0)
    assert out.stride() == (2, 1) and torch.equal(out, v)
    big = torch.randn(1, 1 << 16).expand(64, 1 << 16)  # multi-chunk element-wise copy
    out = pinxfer.pin_memory(big, numa_node=0)
    assert out.is_contiguous() and torch.equal(out, big)


def test_element_wise_copies_on_the_workers_run_in_the_callers_modes():
    """The chunks of an element-wise copy (overlapping views, conj/neg) run on the pool's
    workers with the caller's thread-local state and below autograd: under inference_mode a
    worker's chunk copy into the inference output raised, and under no_grad the workers
    recorded autograd history on the result, racing each other (found by review, session
    44). Large enough to be split: 64 rows of 256 KiB, two threads."""
    with torch.inference_mode():
        big = torch.randn(1, 1 << 16).expand(64, 1 << 16)
        out = pinxfer.pin_memory(big, numa_node=0, num_threads=2)
        assert out.is_inference() and torch.equal(out, big)
        z = torch.randn(64, 1 << 15, dtype=torch.complex64).conj()
        out = pinxfer.pin_memory(z, numa_node=0, num_threads=2)
        assert torch.equal(out, z.resolve_conj())
    leaf = torch.randn(1, 1 << 16, requires_grad=True)
    with torch.no_grad():
        for _ in range(20):
            out = pinxfer.pin_memory(leaf.expand(64, 1 << 16), numa_node=0, num_threads=2)
            assert not out.requires_grad and out.grad_fn is None


def test_pin_of_pool_memory_reached_through_another_storage_is_refused():
    """torch.from_numpy(p.numpy()) of a pool tensor is another storage over the pool's
    pages: pin_ then unpin_ unlocked them under the pool's live blocks (found by review,
    session 44)."""
    p = pinxfer.pin_memory(torch.randn(1 << 18), numa_node=0)
    alias = torch.from_numpy(p.numpy())
    with pytest.raises(RuntimeError, match="lies in pinxfer's pinned pool"):
        pinxfer.pin_(alias)
    assert pinxfer.is_pinned(p)


def test_pin_memory_under_vmap_takes_the_operators_path():
    """A functorch wrapper reads as a plain CPU tensor but has no storage: the fast path
    refused it ('expected a tensor with storage'); it goes to the operator (session 44)."""
    x = torch.randn(3, 4)
    out = torch.func.vmap(pinxfer.pin_memory)(x)
    assert torch.equal(out, x)


def test_conj_and_neg_views_are_resolved():
    z = random_tensor((300, 7), torch.complex64, seed=3).conj()
    assert z.is_conj()
    out = pinxfer.pin_memory(z, numa_node=0)
    assert not out.is_conj()
    assert torch.equal(as_bytes(out), as_bytes(z.resolve_conj()))
    n = torch._neg_view(torch.randn(1000, 50))
    out = pinxfer.pin_memory(n, numa_node=0)
    assert not out.is_neg() and torch.equal(out, n)


@pytest.mark.parametrize("shape", [(0,), (0, 3), (3, 0), (2, 0, 4), ()])
def test_zero_size_and_scalar(shape):
    t = torch.zeros(shape) if shape != () else torch.tensor(2.5)
    out = pinxfer.pin_memory(t, numa_node=0)
    assert_same_as_torch(out, t)
    empty_view = torch.randn(4, 5)[:, 5:]
    assert_same_as_torch(pinxfer.pin_memory(empty_view), empty_view)


def test_pinned_inputs_come_back_as_the_same_object():
    t = torch.randn(100)
    p = pinxfer.pin_memory(t)
    assert pinxfer.pin_memory(p) is p
    assert pinxfer.pin_memory(p[10:20]) is not None
    e = pinxfer.empty(5, 5)
    assert pinxfer.pin_memory(e) is e
    assert pinxfer.pin_memory({"e": e})["e"] is e


def test_result_is_locked_and_bound_to_node0():
    t = random_tensor((1 << 20,), torch.float32, seed=4)  # 4 MiB: under `ulimit -l` here
    out = pinxfer.pin_memory(t, numa_node=0)
    assert torch.equal(as_bytes(out), as_bytes(t))
    assert pinxfer.lock_kind(out) == ("cuda_registered" if HAS_CUDA else "mlocked")
    nodes = ops.page_nodes(out)
    assert len(nodes) >= (4 << 20) // os.sysconf("SC_PAGE_SIZE")
    assert set(nodes) == {0}
    mode, mask = get_mempolicy(out.data_ptr())
    assert mode == MPOL_PREFERRED  # on node 0 while it has memory, never an OOM kill
    assert mask & 1


def test_requires_grad_stays_differentiable():
    t = torch.randn(10, requires_grad=True)
    out = pinxfer.pin_memory(t)
    assert out.requires_grad and out.grad_fn is not None
    (out * 3).sum().backward()
    assert torch.equal(t.grad, torch.full((10,), 3.0))


# ---- batches ----


class Pair(NamedTuple):
    a: torch.Tensor
    b: object


@dataclasses.dataclass
class Sample:
    x: torch.Tensor
    label: int
    extra: list = dataclasses.field(default_factory=list)
    cache: object = dataclasses.field(default=None, init=False)


@dataclasses.dataclass(frozen=True)
class FrozenSample:
    x: torch.Tensor
    name: str

    def __post_init__(self):
        if not isinstance(self.name, str):
            raise TypeError("name must be str")


class OwnPin:
    def __init__(self, t):
        self.t = t
        self.calls = 0

    def pin_memory(self):
        self.calls += 1
        return OwnPin(pinxfer.pin_memory(self.t))


def assert_pinned_copy(out, src):
    assert pinxfer.is_pool_tensor(out), type(out)
    assert torch.equal(out, src)


def test_nested_batch_types_kept():
    ts = [torch.randn(4, 3) for _ in range(10)]
    dd = collections.defaultdict(list, {"k": ts[2]})
    own = OwnPin(ts[6])
    batch = {
        "dict": {"a": ts[0], "n": 3},
        "ordered": collections.OrderedDict([("z", ts[1]), ("a", "text")]),
        "default": dd,
        "pair": Pair(ts[3], None),
        "tuple": (ts[4], 1.5),
        "list": [ts[5], b"bytes"],
        "own": own,
        "sample": Sample(ts[7], label=4, extra=[ts[8]]),
        "frozen": FrozenSample(ts[9], "f"),
        "deep": {"l1": [({"l3": ts[0].t()},)]},
    }
    out = pinxfer.pin_memory(batch, numa_node=0)
    assert type(out) is dict and list(out) == list(batch)
    assert_pinned_copy(out["dict"]["a"], ts[0]) and out["dict"]["n"] == 3
    assert type(out["ordered"]) is collections.OrderedDict and list(out["ordered"]) == ["z", "a"]
    assert_pinned_copy(out["ordered"]["z"], ts[1])
    assert type(out["default"]) is collections.defaultdict
    assert out["default"].default_factory is list
    assert_pinned_copy(out["default"]["k"], ts[2])
    assert type(out["pair"]) is Pair and out["pair"].b is None
    assert_pinned_copy(out["pair"].a, ts[3])
    assert type(out["tuple"]) is tuple and out["tuple"][1] == 1.5
    assert_pinned_copy(out["tuple"][0], ts[4])
    assert type(out["list"]) is list and out["list"][1] == b"bytes"
    assert_pinned_copy(out["list"][0], ts[5])
    assert own.calls == 1 and isinstance(out["own"], OwnPin)
    assert_pinned_copy(out["own"].t, ts[6])
    s = out["sample"]
    assert type(s) is Sample and s.label == 4
    assert_pinned_copy(s.x, ts[7])
    assert_pinned_copy(s.extra[0], ts[8])
    assert batch["sample"].x is ts[7]  # the input batch is not modified
    f = out["frozen"]
    assert type(f) is FrozenSample and f.name == "f"
    assert_pinned_copy(f.x, ts[9])
    deep = out["deep"]["l1"][0][0]["l3"]
    assert_pinned_copy(deep, ts[0].t())
    assert deep.stride() == ts[0].t().stride()


def test_leaves_untouched():
    leaves = [3, 2.5, "s", None, b"b", object(), torch.float32]
    out = pinxfer.pin_memory(leaves)
    assert all(a is b for a, b in zip(out, leaves))
    assert pinxfer.pin_memory("str") == "str"


# ---- errors ----


def test_errors_say_what_arrived():
    with pytest.raises(RuntimeError, match="expected a CPU tensor, got a tensor on meta"):
        pinxfer.pin_memory(torch.empty(3, device="meta"))
    # The op itself takes dense tensors only; pinxfer.pin_memory hands the rest to torch
    # (test_other_layouts_behave_as_torch_pin_memory).
    with pytest.raises(RuntimeError, match=r"expected a dense .strided. CPU tensor, got layout"):
        ops.pin_memory(torch.randn(4, 4).to_sparse())
    with pytest.raises(RuntimeError, match="expected a dense"):
        ops.pin_memory(torch.randn(4, 4).to_sparse_csr())
    with pytest.raises(ValueError, match="num_threads"):
        pinxfer.pin_memory(torch.randn(3), num_threads=-1)
    with pytest.raises(ValueError, match="numa_node"):
        pinxfer.pin_memory(torch.randn(3), numa_node=-2)
    with pytest.raises(ValueError, match="not both"):
        pinxfer.pin_memory(torch.randn(3), device=0, numa_node=0)
    with pytest.raises(ValueError, match="must be a CUDA device"):
        pinxfer.pin_memory(torch.randn(3), device="cpu")


def test_errors_deep_inside_a_batch_name_the_path():
    batch = {"x": [torch.randn(2), 1, torch.empty(2, device="meta")]}
    with pytest.raises(RuntimeError, match=r"cannot pin batch\['x'\]\[2\]: expected a CPU"):
        pinxfer.pin_memory(batch)
    with pytest.raises(RuntimeError, match=r"batch\.a\[0\]\['s'\]"):
        pinxfer.pin_memory(Pair([{"s": torch.empty(3, device="meta")}], None))
    with pytest.raises(RuntimeError, match=r"batch\[1\]\.x"):
        pinxfer.pin_memory((1, Sample(torch.empty(1, device="meta"), 0)))


# ---- layouts pinxfer hands to torch: sparse, nested, quantized ----


def _sparse_source() -> torch.Tensor:
    d = torch.randn(6, 8, generator=torch.Generator().manual_seed(11))
    d[d.abs() < 0.7] = 0
    return d


_OTHER_LAYOUTS = {
    "sparse_coo": lambda: _sparse_source().to_sparse(),
    "sparse_coo_uncoalesced": lambda: torch.sparse_coo_tensor(
        torch.tensor([[0, 0, 2], [1, 1, 3]]),
        torch.tensor([1.0, 2.0, 3.0]),
        (4, 5),
        check_invariants=True,
    ),
    "sparse_csr": lambda: _sparse_source().to_sparse_csr(),
    "sparse_csc": lambda: _sparse_source().to_sparse_csc(),
    "sparse_bsr": lambda: _sparse_source().to_sparse_bsr((2, 2)),
    "sparse_bsc": lambda: _sparse_source().to_sparse_bsc((2, 4)),
    "nested_strided": lambda: torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(5, 3)]),
    "nested_jagged": lambda: torch.nested.nested_tensor(
        [torch.randn(2, 3), torch.randn(5, 3)], layout=torch.jagged
    ),
    "quantized": lambda: torch.quantize_per_tensor(torch.randn(10), 0.1, 3, torch.quint8),
}


def _outcome(fn):
    try:
        return "ok", fn()
    except Exception as err:
        return "raised", err


def _components(t: torch.Tensor) -> list:
    """Plain tensors that carry t's values and structure, for exact comparison."""
    if t.layout == torch.sparse_coo:
        return [t._indices(), t._values(), torch.tensor(t.shape)]
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        return [t.crow_indices(), t.col_indices(), t.values(), torch.tensor(t.shape)]
    if t.layout in (torch.sparse_csc, torch.sparse_bsc):
        return [t.ccol_indices(), t.row_indices(), t.values(), torch.tensor(t.shape)]
    if t.is_nested:
        return list(t.unbind())
    if t.is_quantized:
        return [t.int_repr(), torch.tensor(t.q_scale()), torch.tensor(t.q_zero_point())]
    return [t]


def _assert_same_tensor(a: torch.Tensor, b: torch.Tensor) -> None:
    assert type(a) is type(b)
    assert a.layout == b.layout and a.is_nested == b.is_nested and a.dtype == b.dtype
    assert a.is_quantized == b.is_quantized
    ca, cb = _components(a), _components(b)
    assert len(ca) == len(cb)
    for x, y in zip(ca, cb):
        assert x.shape == y.shape and x.dtype == y.dtype and torch.equal(x, y)


@pytest.mark.filterwarnings("ignore:.*(beta|prototype|deprecated).*:UserWarning")
@pytest.mark.parametrize("name", list(_OTHER_LAYOUTS))
def test_other_layouts_behave_as_torch_pin_memory(name):
    """Tensors pinxfer does not pin itself go to Tensor.pin_memory(): the same
    result where torch pins them (CUDA), torch's error type where it refuses (here,
    without CUDA), said in pinxfer's words with torch's message kept.
    pinxfer.is_pinned agrees with Tensor.is_pinned()."""
    t = _OTHER_LAYOUTS[name]()
    theirs = _outcome(lambda: t.pin_memory())
    ours = _outcome(lambda: pinxfer.pin_memory(t))
    assert ours[0] == theirs[0], (ours, theirs)
    if ours[0] == "raised":
        assert type(ours[1]) is type(theirs[1])
        if HAS_CUDA:
            # torch refused for a reason of its own (a quantized tensor cannot be pinned at
            # all): its error, unchanged.
            assert str(ours[1]) == str(theirs[1])
        else:
            # Without CUDA torch talks of drivers; pinxfer says which tensor needed what.
            assert str(theirs[1]) in str(ours[1]) and "needs a usable CUDA device" in str(ours[1])
        # Inside a batch: the same type, with the path added.
        with pytest.raises(type(theirs[1]), match=r"cannot pin batch\['x'\]"):
            pinxfer.pin_memory({"x": t, "y": torch.randn(3)})
    else:
        _assert_same_tensor(ours[1], theirs[1])
        _assert_same_tensor(ours[1], t)
        if t.layout == torch.sparse_coo:
            assert ours[1].is_coalesced() == theirs[1].is_coalesced()
        assert ours[1].is_pinned() and is_pinned(ours[1])
        assert pinxfer.pin_memory(ours[1]) is ours[1]  # pinned: the same object, as torch
    assert is_pinned(t) == t.is_pinned() == False  # noqa: E712
    assert pinxfer.is_pinned is is_pinned


@pytest.mark.gpu
@requires_cuda
@pytest.mark.filterwarnings("ignore:.*(beta|prototype|deprecated).*:UserWarning")
@pytest.mark.parametrize("name", list(_OTHER_LAYOUTS))
def test_gpu_other_layouts_are_pinned(name):
    """With CUDA: every layout pins (values, indices, layout, shape, nesting kept),
    is_pinned() is True, alone and inside a batch, and the pinned tensor copies to
    the GPU intact."""
    t = _OTHER_LAYOUTS[name]()
    if name == "quantized":
        theirs = _outcome(lambda: t.pin_memory())
        if theirs[0] == "raised":  # torch itself does not pin quantized tensors here
            with pytest.raises(type(theirs[1])):
                pinxfer.pin_memory(t)
            return
    out = pinxfer.pin_memory(t)
    _assert_same_tensor(out, t)
    assert out.is_pinned() and is_pinned(out) and not is_pinned(t)
    assert pinxfer.pin_memory(out) is out
    batch = pinxfer.pin_memory({"x": t, "n": 3})
    _assert_same_tensor(batch["x"], t)
    assert batch["x"].is_pinned() and batch["n"] == 3
    if t.layout != torch.jagged and not t.is_quantized:
        back = out.to("cuda", non_blocking=True).cpu()
        if t.is_nested:
            assert all(torch.equal(x, y) for x, y in zip(back.unbind(), t.unbind()))
        else:
            assert back.layout == t.layout and torch.equal(back.to_dense(), t.to_dense())


def test_import_and_queries_do_not_initialise_cuda():
    """import pinxfer, its queries, and pinning where pinxfer does not use CUDA
    (PINXFER_DISABLE_CUDA=1; on a machine without a GPU also without it) leave
    torch's CUDA state alone."""
    code = textwrap.dedent("""
        import torch, pinxfer
        states = [torch.cuda.is_initialized()]
        pinxfer.build_info(); pinxfer.memory_stats(); pinxfer.get_max_pinned_bytes()
        pinxfer.is_pinned(torch.randn(3))
        states.append(torch.cuda.is_initialized())
        a = pinxfer.empty(1000)
        p = pinxfer.pin_memory({"x": torch.randn(100)})["x"]
        states.append(torch.cuda.is_initialized())
        print(states, pinxfer.lock_kind(a), pinxfer.lock_kind(p), pinxfer.is_pinned(p))
    """)
    # Without a GPU both runs would take the same path: one is enough there.
    for env in ({"PINXFER_DISABLE_CUDA": "1"}, {}) if HAS_CUDA else ({},):
        out = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            env=dict(os.environ, **env),
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        states, kind_a, kind_p, pinned = out.stdout.strip().rsplit(" ", 3)
        if env or not HAS_CUDA:
            assert states == "[False, False, False]", (env, out.stdout)
            # mlocked, or pageable where the machine's memlock limit refuses.
            assert kind_a == kind_p and kind_a in ("mlocked", "pageable"), out.stdout
            assert pinned == str(kind_a == "mlocked")
        else:  # pinning with CUDA initialises torch's CUDA state, as torch's own pin does
            assert states == "[False, False, True]", out.stdout
            assert kind_a == kind_p == "cuda_registered" and pinned == "True"


def test_pin_memory_after_idle_gaps_wakes_its_helpers_ahead_and_copies_every_byte():
    """After an idle gap pin_memory wakes the copy helpers it will use before its pool
    allocation (ThreadPool::wake_ahead, as to_device's pipeline does), so they rise while
    it allocates. Gaps of 3 ms (longer than the pool's longest spin, so each call finds its
    workers asleep), four copy threads and the pool's road (torch's team off), the helpers
    woken ahead in one call and at the offer in the next, the source rewritten before each:
    every byte must be the source's, and no call may hang on a helper counted as rising."""
    code = textwrap.dedent("""
        import time, torch, pinxfer
        gen = torch.Generator().manual_seed(5)
        src = torch.empty(4 << 20, dtype=torch.uint8)  # 4 chunks of 1 MiB: 3 helpers
        for i in range(16):
            pinxfer._C._set_wake_ahead(i % 2 == 0)
            src.random_(0, 256, generator=gen)
            time.sleep(0.003)
            out = pinxfer.pin_memory(src)
            assert out.data_ptr() != src.data_ptr() and torch.equal(out, src), i
        pinxfer._C._set_wake_ahead(True)
        print("OK")
    """)
    env = dict(os.environ, PINXFER_NUM_THREADS="4", PINXFER_TORCH_TEAM="off")
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "OK", out.stdout


def test_pin_memory_with_the_most_copy_threads_from_two_threads_copies_every_byte():
    """The pool's wake-up lists (ThreadPool::post, wake_ahead, wake_relayed; 128 workers on
    the caller's stack since session 45, 16 before): as many copy threads as this machine
    allows (PINXFER_NUM_THREADS' maximum: 16, or the CPUs where there are more), 32 pieces a
    call, after gaps (the helpers asleep: woken ahead, relayed, at the offer) and back to
    back, from two Python threads at once: every byte must be the source's, and no call may
    hang."""
    code = textwrap.dedent("""
        import threading, time, torch, pinxfer
        def run(seed, errors):
            try:
                gen = torch.Generator().manual_seed(seed)
                src = torch.empty(32 << 20, dtype=torch.uint8)
                for i in range(12):
                    pinxfer._C._set_wake_ahead(i % 3 != 2)
                    src.random_(0, 256, generator=gen)
                    if i % 2:
                        time.sleep(0.003)
                    out = pinxfer.pin_memory(src)
                    assert torch.equal(out, src), (seed, i)
            except BaseException as e:
                errors.append(e)
        errors = []
        threads = [threading.Thread(target=run, args=(s, errors)) for s in (1, 2)]
        for t in threads: t.start()
        for t in threads: t.join()
        pinxfer._C._set_wake_ahead(True)
        assert not errors, errors
        print("OK")
    """)
    most_threads = max(16, len(os.sched_getaffinity(0)))  # thread_budget's max_copy_threads
    env = dict(os.environ, PINXFER_NUM_THREADS=str(most_threads), PINXFER_TORCH_TEAM="off")
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "OK", out.stdout


_FIRST_THING = {
    "pin_memory": "t = pinxfer.pin_memory(torch.randn(1000))",
    "pin_memory_batch": "t = pinxfer.pin_memory({'a': [torch.randn(10, 10).t()]})['a'][0]",
    "empty": "t = pinxfer.empty(1000)",
    "empty_large": "t = pinxfer.empty(16 << 20, dtype=torch.uint8)",
    "pin_": "t = pinxfer.pin_(torch.randn(1 << 16))",
    "pin_memory_in_thread": (
        "import threading\n"
        "box = []\n"
        "th = threading.Thread(target=lambda: box.append(pinxfer.pin_memory(torch.randn(1000))))\n"
        "th.start(); th.join()\n"
        "t = box[0]"
    ),
}


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("first", list(_FIRST_THING))
def test_gpu_is_pinned_in_a_fresh_process(first):
    """In a fresh process where nothing used CUDA yet, the first pinxfer call that
    pins leaves torch in the state torch's own pinning leaves it in: is_pinned()
    is True at once (torch's isPinnedPtr answers False before torch initialised
    CUDA), and torch.cuda.is_initialized() is True, as after x.pin_memory()."""
    code = textwrap.dedent("""
        import torch, pinxfer
        assert not torch.cuda.is_initialized()
        {first}
        ours = [t.is_pinned(), pinxfer.is_pinned(t), torch.cuda.is_initialized()]
        ref = torch.randn(10).pin_memory()
        print(ours, [ref.is_pinned(), torch.cuda.is_initialized()])
    """).format(first=_FIRST_THING[first])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[True, True, True] [True, True]", out.stdout


def test_is_pinned_is_exported():
    assert "is_pinned" in pinxfer.__all__ and pinxfer.is_pinned is is_pinned
    assert pinxfer.is_pinned.__doc__
    assert not is_pinned(torch.randn(3)) and not is_pinned(torch.empty(3, device="meta"))
    e = pinxfer.empty(10)
    assert is_pinned(e) == (pinxfer.lock_kind(e) != "pageable")
    assert is_pinned(e[3:]) == is_pinned(e)  # a view of a pool block
    with open(os.path.join(os.path.dirname(__file__), "..", "README.md")) as f:
        assert "| `is_pinned(t)` |" in f.read()


# ---- threads ----


def test_concurrent_callers_get_correct_results():
    tensors = [
        random_tensor((1 << 18,) if i % 2 else (513, 77), torch.float32, seed=i) for i in range(8)
    ]
    errors = []
    barrier = threading.Barrier(8)

    def work(i):
        try:
            barrier.wait()
            for _ in range(10):
                src = (
                    tensors[i] if _ % 2 else tensors[i].t() if tensors[i].dim() == 2 else tensors[i]
                )
                out = pinxfer.pin_memory(src, numa_node=0)
                assert torch.equal(as_bytes(out), as_bytes(src))
                assert out.stride() == src.stride()
        except Exception as err:
            errors.append(err)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors


def test_background_thread_with_one_torch_thread():
    """As the DataLoader's pin thread: torch.set_num_threads(1), then pin a batch."""
    result = {}
    before = torch.get_num_threads()

    def work():
        torch.set_num_threads(1)
        batch = {"img": random_tensor((16, 3, 64, 64), torch.uint8), "y": torch.arange(16)}
        result["src"] = batch
        result["out"] = pinxfer.pin_memory(batch, numa_node=0, num_threads=2)

    th = threading.Thread(target=work)
    th.start()
    th.join()
    torch.set_num_threads(before)
    for k in ("img", "y"):
        assert_pinned_copy(result["out"][k], result["src"][k])


# ---- pin_ / unpin_ ----


def locked_kib_in(start: int, end: int) -> int:
    """Sum of 'Locked:' over the mappings inside [start, end), from /proc/self/smaps
    (mlock splits a mapping into locked and unlocked parts)."""
    inside = False
    total = 0
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo < end and start < hi
                if inside:
                    assert start <= lo and hi <= end, "mapping extends past the range"
            elif inside and head == "Locked:":
                total += int(line.split()[1])
    return total


@pytest.mark.skipif(HAS_CUDA, reason="the mlock path runs only where CUDA is not usable")
def test_pin_inplace_mlock_path():
    t = torch.randn(1 << 18)  # 1 MiB
    t.view(-1)[0] = 1.0
    before = vm_locked_kib()
    assert pinxfer.pin_(t) is t
    assert inplace_lock_kind(t) == "mlocked"
    assert vm_locked_kib() - before >= 1024 or not MLOCK_IS_REAL  # ASan/TSan: mlock is a no-op
    assert is_pinned(t) and is_pinned(t[5:])
    assert pinxfer.pin_memory(t) is t  # already pinned: same object
    with pytest.raises(RuntimeError, match=r"already pinned by pinxfer.pin_"):
        pinxfer.pin_(t)
    with pytest.raises(RuntimeError, match=r"already pinned by pinxfer.pin_"):
        pinxfer.pin_(t[100:200])  # another view of the same storage
    with pytest.raises(RuntimeError, match="not resizable"):
        t.view(t.shape).resize_(1 << 20)  # would free the locked memory under mlock
    assert pinxfer.unpin_(t[3:]) is not None  # any view of the storage works
    assert inplace_lock_kind(t) is None
    assert vm_locked_kib() - before < 1024
    with pytest.raises(RuntimeError, match=r"not pinned by pinxfer.pin_"):
        pinxfer.unpin_(t)
    t.resize_(1 << 19)  # resizable again


@pytest.mark.skipif(HAS_CUDA, reason="the mlock path runs only where CUDA is not usable")
def test_unpin_keeps_pages_shared_with_another_pinned_tensor():
    page = mmap.PAGESIZE
    # Three pages between two PROT_NONE guard pages, so that the kernel never
    # merges them with a neighbouring (maybe locked) mapping.
    buf = mmap.mmap(-1, 5 * page)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    libc = ctypes.CDLL(None, use_errno=True)
    for guard in (base, base + 4 * page):
        assert libc.mprotect(ctypes.c_void_p(guard), ctypes.c_size_t(page), 0) == 0
    addr = base + page
    # a covers page 0 and the start of page 1; b the rest of page 1 and page 2.
    a = torch.frombuffer(buf, dtype=torch.uint8, count=page + 100, offset=page)
    b = torch.frombuffer(buf, dtype=torch.uint8, count=2 * page - 200, offset=2 * page + 200)
    # Under ASan/TSan mlock is a no-op (MLOCK_IS_REAL): the calls still run, the
    # kernel's page counts are not checked.
    pinxfer.pin_(a)
    pinxfer.pin_(b)
    assert not MLOCK_IS_REAL or locked_kib_in(addr, addr + 3 * page) == 3 * page // 1024
    pinxfer.unpin_(a)
    # page 1 stays locked for b
    assert not MLOCK_IS_REAL or locked_kib_in(addr, addr + 3 * page) == 2 * page // 1024
    pinxfer.unpin_(b)
    assert not MLOCK_IS_REAL or locked_kib_in(addr, addr + 3 * page) == 0
    del a, b


def test_pin_inplace_refusals():
    with pytest.raises(RuntimeError, match="storage is empty"):
        pinxfer.pin_(torch.empty(0))
    # Checked in Python (pinxfer/_check.py) before the operator, which checks again.
    with pytest.raises(ValueError, match="expected a tensor with memory, got a meta tensor"):
        pinxfer.pin_(torch.empty(3, device="meta"))
    with pytest.raises(ValueError, match=r"expected a dense .strided. tensor, got layout"):
        pinxfer.pin_(torch.randn(3, 3).to_sparse())
    with pytest.raises(RuntimeError, match="expected a CPU tensor, got a tensor on meta"):
        torch.ops.pinxfer.pin_(torch.empty(3, device="meta"))
    with pytest.raises(RuntimeError, match="expected a dense CPU tensor"):
        torch.ops.pinxfer.pin_(torch.randn(3, 3).to_sparse())
    with pytest.raises(RuntimeError, match="already lives in pinxfer's pinned pool"):
        pinxfer.pin_(pinxfer.empty(16))
    with pytest.raises(RuntimeError, match="lives in pinxfer's pinned pool"):
        pinxfer.unpin_(pinxfer.empty(16))
    with pytest.raises(RuntimeError, match=r"not pinned by pinxfer.pin_"):
        pinxfer.unpin_(torch.randn(10))


def test_pin_inplace_parameter_requiring_grad():
    p = torch.nn.Parameter(torch.randn(64, 64))
    pinxfer.pin_(p)
    try:
        assert inplace_lock_kind(p) is not None
    finally:
        pinxfer.unpin_(p)
    assert inplace_lock_kind(p) is None


# ---- GPU ----


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_equals_torch_pin_memory(dtype):
    base = random_tensor((96, 40), dtype, seed=5)
    for src in (base, base.t(), base[::3, 1::2], base[7:20]):
        ours = pinxfer.pin_memory(src)
        theirs = src.pin_memory()
        assert ours.is_pinned() and theirs.is_pinned()
        assert ours.shape == theirs.shape and ours.stride() == theirs.stride()
        assert ours.storage_offset() == theirs.storage_offset() == 0
        assert ours.untyped_storage().nbytes() == theirs.untyped_storage().nbytes()
        assert torch.equal(as_bytes(ours), as_bytes(theirs))
        assert pinxfer.lock_kind(ours) == "cuda_registered"
        assert pinxfer.pin_memory(theirs) is theirs  # torch-pinned: same object


@pytest.mark.gpu
@requires_cuda
def test_gpu_round_trip_random_data():
    t = random_tensor((64 << 20,), torch.uint8, seed=6)
    p = pinxfer.pin_memory(t, device=0)
    assert p.is_pinned()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        d = p.to("cuda:0", non_blocking=True)
        back = pinxfer.pin_memory(torch.empty_like(t))
        back.copy_(d, non_blocking=True)
    pinxfer.record_stream(p, stream)
    stream.synchronize()
    assert torch.equal(back, t)
    assert pinxfer.pin_memory(t, device="cuda:0").is_pinned()
    assert pinxfer.pin_memory(t, device=torch.device("cuda", 0)).is_pinned()


@pytest.mark.gpu
@requires_cuda
def test_gpu_pin_inplace():
    t = random_tensor((8 << 20,), torch.uint8, seed=7)
    assert not t.is_pinned()
    pinxfer.pin_(t)
    assert t.is_pinned() and t[100:].is_pinned()
    assert inplace_lock_kind(t) == "cuda_registered"
    assert pinxfer.pin_memory(t) is t
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        d = t.to("cuda", non_blocking=True)
    stream.synchronize()
    assert torch.equal(d.cpu(), t)
    with pytest.raises(RuntimeError, match=r"already pinned by pinxfer.pin_"):
        pinxfer.pin_(t)
    pinxfer.unpin_(t)
    assert not t.is_pinned()
    assert inplace_lock_kind(t) is None


@pytest.mark.gpu
@requires_cuda
def test_gpu_share_memory_of_a_pinned_tensor_unregisters_it_and_a_queued_copy_reads_it_whole():
    """share_memory_() swaps the storage's memory and frees the old. pin_'s deleter
    unregisters the old memory first (cudaHostUnregister, which waits for the copy queued
    behind a sleep), so the copy reads the bytes it was given and nothing stays registered."""
    t = random_tensor((64 << 20,), torch.uint8, seed=11)
    expected = t.clone()
    registrations = pinxfer._C._inplace_registrations()
    pinxfer.pin_(t)
    old_address = t.data_ptr()
    out = torch.empty(t.shape, dtype=t.dtype, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)  # tens of ms: the copy is still queued at the swap
        out.copy_(t, non_blocking=True)
    t.share_memory_()
    assert t.data_ptr() != old_address and t.is_shared() and not t.is_pinned()
    assert pinxfer._C._inplace_registrations() == registrations
    stream.synchronize()
    assert torch.equal(out.cpu(), expected) and torch.equal(t, expected)
    pinxfer.pin_(t)  # the shared memory registers from scratch
    assert t.is_pinned()
    pinxfer.unpin_(t)


@pytest.mark.gpu
@requires_cuda
def test_gpu_a_failed_unregister_keeps_the_memory_until_a_later_sweep():
    """An unregister that fails (injected) never frees the memory it names: neither pin_'s
    deleter (share_memory_ swapped the storage) nor the sweep (every tensor gone). Each
    warns once and keeps the registration; the next empty_cache() unpins and frees it."""
    registrations = pinxfer._C._inplace_registrations()
    swapped = random_tensor((4 << 20,), torch.uint8, seed=12)
    expected = swapped.clone()
    orphan = random_tensor((4 << 20,), torch.uint8, seed=13)
    pinxfer.pin_(swapped)
    pinxfer.pin_(orphan)
    assert pinxfer._C._inject_host_unregister_failures(1) == 0
    with pytest.warns(UserWarning, match="undoing the pin of the old memory failed"):
        swapped.share_memory_()
    assert torch.equal(swapped, expected) and not swapped.is_pinned()
    assert pinxfer._C._inplace_registrations() == registrations + 2  # kept, still registered
    pinxfer.empty_cache()  # the kept memory goes; `orphan` lives on
    assert pinxfer._C._inplace_registrations() == registrations + 1
    del orphan
    assert pinxfer._C._inject_host_unregister_failures(1) == 0
    with pytest.warns(UserWarning, match="stays registered and allocated"):
        pinxfer.empty_cache()
    assert pinxfer._C._inplace_registrations() == registrations + 1
    pinxfer.empty_cache()
    assert pinxfer._C._inplace_registrations() == registrations
    assert pinxfer._C._inject_host_unregister_failures(0) == 0


@pytest.mark.gpu
@requires_cuda
def test_gpu_pin_inplace_refuses_torch_pinned_memory():
    t = torch.randn(1 << 16).pin_memory()
    with pytest.raises(RuntimeError, match="already page-locked for CUDA"):
        pinxfer.pin_(t)
    with pytest.raises(RuntimeError, match=r"not by pinxfer.pin_"):
        pinxfer.unpin_(t)


@pytest.mark.gpu
@requires_cuda
def test_gpu_cuda_input_refused():
    with pytest.raises(RuntimeError, match="expected a CPU tensor, got a tensor on cuda"):
        pinxfer.pin_memory({"x": torch.randn(3, device="cuda")})
    with pytest.raises(RuntimeError, match="expected a CPU tensor, got a tensor on cuda"):
        ops.pin_memory(torch.randn(3, device="cuda"))


# ---- helpers: get_mempolicy(2) through libc ----

MPOL_PREFERRED = 1
MPOL_F_ADDR = 2
_SYS_GET_MEMPOLICY = {"x86_64": 239, "aarch64": 236}


def get_mempolicy(address: int) -> tuple[int, int]:
    nr = _SYS_GET_MEMPOLICY.get(platform.machine())
    if nr is None:
        pytest.skip(f"get_mempolicy syscall number unknown on {platform.machine()}")
    libc = ctypes.CDLL(None, use_errno=True)
    mode = ctypes.c_int(-1)
    mask = (ctypes.c_ulong * 16)()
    rc = libc.syscall(
        ctypes.c_long(nr),
        ctypes.byref(mode),
        mask,
        ctypes.c_ulong(16 * 64),
        ctypes.c_void_p(address),
        ctypes.c_ulong(MPOL_F_ADDR),
    )
    assert rc == 0, os.strerror(ctypes.get_errno())
    # The mode may carry flags (MPOL_F_STATIC_NODES...) in its high bits.
    return mode.value & 0xFF, mask[0]


def test_pin_call_trace_is_recorded_only_while_tracing():
    """_C._last_pin_call_trace (benchmarks/diag_pin_copy.py): the steps of this thread's last
    pin_memory copy, recorded while _trace_team_regions(True), left alone after."""
    native = pinxfer._C
    x = torch.randn(1 << 18)  # 1 MiB
    native._trace_team_regions(True)
    try:
        y = pinxfer.pin_memory(x)
        trace = native._last_pin_call_trace()
    finally:
        native._trace_team_regions(False)
    assert torch.equal(y, x)
    steps = ("checks_us", "setup_us", "alloc_us", "copy_us")
    assert all(trace[s] >= 0 for s in (*steps, "pinned_check_us")), trace
    assert trace["copy_us"] > 0
    assert sum(trace[s] for s in steps) <= trace["total_us"] * 1.001 + 0.01, trace
    assert isinstance(trace["on_team"], bool)
    pinxfer.pin_memory(torch.randn(1 << 18))
    assert native._last_pin_call_trace() == trace


# ---- resize_: pool tensors resize as torch's pinned tensors do (their storage's allocator) ----


def _pool_counts(node: int) -> tuple[int, int, int]:
    s = pinxfer.memory_stats(node)
    return s["num_allocs"], s["num_frees"], s["active_blocks.current"]


@pytest.mark.parametrize("make", ["empty", "pin_memory"])
@pytest.mark.parametrize("node", [-1, 0])
def test_resize_grows_from_the_same_nodes_pool_and_frees_the_old_block(make, node):
    if node != -1 and node not in pinxfer.numa_nodes():  # -1: the unbound pool, always there
        pytest.skip(f"no NUMA node {node} here")
    values = torch.arange(1000, dtype=torch.float64)
    if make == "empty":
        t = pinxfer.empty(1000, dtype=torch.float64, numa_node=node)
        t.copy_(values)
    else:
        t = pinxfer.pin_memory(values, numa_node=node)
    kind = pinxfer.lock_kind(t)
    allocs, frees, active = _pool_counts(node)
    old = t.data_ptr()
    t.resize_(1 << 18)  # 2 MiB: a new block
    assert t.data_ptr() != old and t.numel() == 1 << 18
    assert torch.equal(t[:1000], values)  # the old bytes, copied as torch's resize_ copies
    assert pinxfer.is_pool_tensor(t) and pinxfer.lock_kind(t) == kind
    assert _pool_counts(node) == (allocs + 1, frees + 1, active)  # the old block went back
    t.resize_(10)  # shrinking keeps the block, as torch does
    assert torch.equal(t, values[:10]) and pinxfer.is_pool_tensor(t)
    storage = t.untyped_storage()
    storage.resize_(1 << 22)
    assert storage.nbytes() == 1 << 22 and pinxfer.is_pool_tensor(t)
    assert torch.equal(t, values[:10])


def test_resize_from_many_threads_keeps_every_byte():
    """Real threads resizing their own pool tensors at once: each keeps its bytes, and the
    pool ends with the blocks it started with."""
    node = -1
    _, _, active = _pool_counts(node)
    errors: list[str] = []

    def work(seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        t = pinxfer.pin_memory(torch.randint(0, 255, (4096,), dtype=torch.uint8, generator=g),
                               numa_node=node)  # fmt: skip
        want = t.clone()
        for step in range(40):
            n = int(torch.randint(4096, 1 << 20, (1,), generator=g))
            t.resize_(n)
            if not torch.equal(t[:4096], want):
                errors.append(f"thread {seed} step {step}: bytes changed")
                return
            t.resize_(4096)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    assert _pool_counts(node)[2] == active
