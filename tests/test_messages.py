"""What users read where pinxfer meets torch's conventions: the no-GPU reason, torch's own
wording when a device tensor is pinned, and the containers torch's DataLoader pinning
turns into lists."""

from __future__ import annotations

import ctypes
import os

import pytest
import torch
from torch.utils.data._utils.pin_memory import pin_memory as torch_loader_pin

import pinxfer

from .conftest import HAS_CUDA


def _driver_present() -> bool:
    if os.path.exists("/proc/driver/nvidia/version"):
        return True
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


@pytest.mark.skipif(not pinxfer.build_info().with_cuda, reason="the CPU-only variant")
@pytest.mark.skipif(_driver_present(), reason="an NVIDIA driver is installed here")
def test_no_driver_is_not_called_an_old_driver():
    """With no driver at all the CUDA runtime still answers cudaErrorInsufficientDriver;
    the reason must not send the user to upgrade a driver they do not have."""
    reason = pinxfer.cuda_unavailable_reason()
    assert reason is not None
    assert reason.startswith("no NVIDIA driver or GPU on this machine"), reason
    assert "too old" not in reason


def test_pinning_a_device_tensor_carries_torchs_words():
    """torch's message comes after pinxfer's explanation, word for word, so code matching
    torch's error still matches. A meta tensor stands for any non-CPU tensor here (the GPU
    test below does it with a CUDA tensor)."""
    t = torch.empty(4, device="meta")
    with pytest.raises(RuntimeError) as torch_err:
        t.pin_memory()
    with pytest.raises(RuntimeError) as ours:
        pinxfer.pin_memory(t)
    text = str(ours.value)
    assert text.startswith("pinxfer.pin_memory: expected a CPU tensor, got a tensor on meta")
    assert text.endswith(str(torch_err.value).strip())
    assert "only dense CPU tensors can be pinned" in text


def test_device_tensor_in_a_batch_names_its_place_and_torchs_words():
    with pytest.raises(RuntimeError) as ours:
        pinxfer.pin_memory({"x": [torch.zeros(2), torch.empty(2, device="meta")]})
    text = str(ours.value)
    assert "batch['x'][1]" in text
    assert "only dense CPU tensors can be pinned" in text


@pytest.mark.gpu
def test_pinning_a_cuda_tensor_carries_torchs_words():
    t = torch.ones(4, device="cuda")
    with pytest.raises(RuntimeError) as ours:
        pinxfer.pin_memory(t)
    assert str(ours.value).endswith(
        "cannot pin 'torch.cuda.FloatTensor' only dense CPU tensors can be pinned"
    )


def test_range_and_other_sequences_come_back_as_torch_returns_them():
    """torch's DataLoader pinning rebuilds a non-tuple Sequence as type(seq)(items), and a
    range (whose constructor refuses a list) as a list."""
    import collections.abc

    class Frozen(collections.abc.Sequence):  # immutable, built from a list
        def __init__(self, items):
            self.items = list(items)

        def __getitem__(self, i):
            return self.items[i]

        def __len__(self):
            return len(self.items)

    batch = {
        "ids": range(3),
        "frozen": Frozen([1, 2]),
        "name": "abc",
        "raw": b"xy",
        "tup": (1, range(2)),
    }
    ours = pinxfer.pin_memory(batch)
    theirs = torch_loader_pin(batch)  # no tensors inside: runs without CUDA
    assert ours["ids"] == theirs["ids"] == [0, 1, 2]
    assert type(ours["ids"]) is type(theirs["ids"]) is list
    assert type(ours["frozen"]) is type(theirs["frozen"]) is Frozen
    assert ours["frozen"].items == [1, 2]
    assert ours["name"] == "abc" and ours["raw"] == b"xy"
    assert ours["tup"] == theirs["tup"] == (1, [0, 1])


def test_range_beside_tensors_in_a_batch():
    x = torch.arange(6.0)
    out = pinxfer.pin_memory([x, range(2)])
    assert type(out) is list and out[1] == [0, 1]
    assert torch.equal(out[0], x)
    if HAS_CUDA:
        assert out[0].is_pinned()


@pytest.mark.parametrize("flag", [True, False])
def test_a_bool_is_not_a_device(flag):
    """to_device(x, True) went to cuda:1 (True is an int to Python): a bool is refused with a
    TypeError naming what a device may be (review, session 43)."""
    with pytest.raises(TypeError, match=r"expected a device .* got bool"):
        pinxfer.to_device(torch.ones(4), flag)
