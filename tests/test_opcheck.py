"""``torch.library.opcheck`` on every operator declared in csrc/module.cpp.

opcheck runs an operator under its schema checker, through autograd, with fake
tensors (the fakes in pinxfer/_ops.py) and through AOT dispatch, on copies of the
arguments. Where one of those checks cannot apply to an operator, its case
names the checks it runs and says why. Operators that need a CUDA device are
``gpu``-marked and skip cleanly without one (tests/conftest.py).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import pinxfer

ops = torch.ops.pinxfer

MODULE_CPP = Path(__file__).resolve().parent.parent / "csrc" / "module.cpp"

ALL = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
# AOT dispatch compares tensor outputs and cannot carry strings through a graph.
NO_AOT = ("test_schema", "test_autograd_registration", "test_faketensor")
# The schema checker and AOT dispatch run the op on *copies* of its tensors: a copy
# is never a pool block nor pinned by pin_, and a fake tensor has no memory to ask about.
AUTOGRAD_ONLY = ("test_autograd_registration",)


def _pool_tensor() -> torch.Tensor:
    return pinxfer.empty(4, 4)


# op name -> (args factory, kwargs, checks)
CPU_CASES = {
    # Not AOT dispatch: empty's values are uninitialised, so two runs differ.
    "empty": (lambda: ([2, 3], torch.float32), {"numa_node": None}, NO_AOT),
    "is_pool_tensor": (lambda: (_pool_tensor(),), {}, ALL),
    "lock_kind": (lambda: (_pool_tensor(),), {}, AUTOGRAD_ONLY),
    # The page count of a fake tensor has no answer (it has no pages), so no fake and
    # no fake-tensor check; the schema checker's copy has pages of its own to report.
    "page_nodes": (lambda: (_pool_tensor(),), {}, ("test_schema", "test_autograd_registration")),
    "inplace_lock_kind": (lambda: (torch.randn(4),), {}, ALL),
}


def _cuda() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _stream_triple() -> tuple[int, int, int]:
    s = torch.cuda.current_stream()
    return s.stream_id, s.device_index, s.device_type


GPU_CASES = {
    "record_stream": (lambda: (_pool_tensor(), *_stream_triple()), {}, AUTOGRAD_ONLY),
    "to_device": (lambda: (torch.randn(1000), _cuda(), 1 << 20, 2), {}, ALL),
    "to_device_packed": (
        lambda: ([torch.randn(3), torch.arange(5), torch.randn(2, 3).t()], _cuda()),
        {},
        ALL,
    ),
}
# Cases with their own tests below: pin_memory (several layouts), pin_ and unpin_ (they
# change the memory of their argument).
OWN_TESTS = {"pin_memory", "pin_", "unpin_"}


def _declared_schemas() -> dict[str, str]:
    """name -> schema of every m.def in csrc/module.cpp (a schema may be split over
    several adjacent string literals)."""
    text = MODULE_CPP.read_text()
    schemas = {}
    for call in re.findall(r"m\.def\(((?:\s*\"(?:[^\"\\]|\\.)*\")+)\s*\)", text):
        schema = "".join(re.findall(r'"((?:[^"\\]|\\.)*)"', call))
        schemas[schema.split("(", 1)[0]] = schema
    return schemas


def test_every_declared_op_has_an_opcheck_case():
    covered = set(CPU_CASES) | set(GPU_CASES) | OWN_TESTS
    assert set(_declared_schemas()) == covered


def test_the_operator_namespace_holds_tensor_ops_only():
    """torch.ops.pinxfer is for what the dispatcher can act on: every op takes or returns a
    tensor. Utilities, queries and test hooks are functions of pinxfer._C."""
    schemas = _declared_schemas()
    assert len(schemas) >= 11, schemas
    for name, schema in schemas.items():
        assert "Tensor" in schema, f"{name} takes and returns no tensor: {schema}"
        assert not hasattr(pinxfer._C, name) or name in FAST_CALLS, name
    for name in ("settings", "memory_stats", "parse_cpulist", "_chunk_plan", "install"):
        assert not hasattr(ops, name), name
        assert callable(getattr(pinxfer._C, name)), name


# The eager fast calls of pinxfer._C reach an operator's own kernel (pinxfer/_ops.py).
FAST_CALLS = {"empty", "pin_memory", "to_device"}


def _opcheck(name: str, case) -> None:
    make_args, kwargs, checks = case
    torch.library.opcheck(getattr(ops, name).default, make_args(), kwargs, test_utils=checks)


@pytest.mark.parametrize("name", sorted(CPU_CASES))
def test_opcheck(name):
    _opcheck(name, CPU_CASES[name])


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(GPU_CASES))
def test_gpu_opcheck(name):
    _opcheck(name, GPU_CASES[name])


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(5, 4),
        lambda: torch.randn(5, 4).t(),
        lambda: torch.randn(20)[::3],
        lambda: torch.arange(3.0).expand(4, 3),
        lambda: torch.empty(0, 3),
    ],
    ids=["contiguous", "transpose", "step", "expanded", "empty"],
)
def test_opcheck_pin_memory(make):
    torch.library.opcheck(ops.pin_memory.default, (make(),), {"numa_node": 0})


def test_opcheck_pin_and_unpin_():
    # The schema, fake-tensor and AOT checks run the op on copies of the tensor: pin_
    # would keep its copies alive and locked with no unpin_ to reach them, and unpin_
    # refuses copies that pin_ never pinned. They have no fake (pinxfer/_ops.py says why),
    # so the autograd check is the one that applies.
    unpinned, pinned = torch.randn(16), pinxfer.pin_(torch.randn(16))
    try:
        torch.library.opcheck(ops.pin_.default, (unpinned,), {}, test_utils=AUTOGRAD_ONLY)
        torch.library.opcheck(ops.unpin_.default, (pinned,), {}, test_utils=AUTOGRAD_ONLY)
    finally:
        # The autograd check may run the op on the tensor itself: undo whatever it left.
        for t in (unpinned, pinned):
            if pinxfer.pin.inplace_lock_kind(t) is not None:
                pinxfer.unpin_(t)
