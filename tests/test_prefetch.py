"""pinxfer.prefetch's thread/queue machinery, on the CPU (device="cpu" or a custom transfer).

The CUDA half (streams, events, record_stream) is in tests/test_transfer_gpu.py.
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import importlib
import threading
import time

import pytest
import torch

import pinxfer
from pinxfer import cuda_unavailable_reason

from .conftest import HAS_CUDA

prefetch_mod = importlib.import_module("pinxfer.prefetch")  # pinxfer.prefetch is the function


def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("pinxfer-prefetch-")]


def _wait_no_threads(timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _prefetch_threads():
            return True
        time.sleep(0.01)
    return not _prefetch_threads()


@pytest.fixture(autouse=True)
def _no_leftover_threads():
    assert _wait_no_threads(), "a previous test left a prefetch thread running"
    yield
    gc.collect()
    assert _wait_no_threads(), f"prefetch threads left running: {_prefetch_threads()}"


def test_order_and_values_cpu():
    batches = [torch.full((4,), i) for i in range(20)]
    out = list(pinxfer.prefetch(batches, device="cpu", depth=3))
    assert len(out) == 20
    for i, b in enumerate(out):
        assert b is batches[i]  # device="cpu": yielded unchanged


def test_identity_transfer_runs_in_background_thread():
    seen = []

    def transfer(batch):
        seen.append(threading.current_thread().name)
        return batch * 2

    out = list(pinxfer.prefetch(range(5), device="cpu", transfer=transfer))
    assert out == [0, 2, 4, 6, 8]
    assert all(name.startswith("pinxfer-prefetch-") for name in seen)


def test_depth_bounds_batches_in_flight():
    pulled = []

    def source():
        for i in range(10):
            pulled.append(i)
            yield i

    pf = pinxfer.prefetch(source(), device="cpu", depth=2)
    it = iter(pf)
    assert next(it) == 0
    time.sleep(0.2)  # give the producer every chance to run ahead
    # one handed out + at most depth fetched ahead
    assert len(pulled) <= 1 + 2
    assert next(it) == 1
    time.sleep(0.2)
    assert len(pulled) <= 2 + 2
    assert list(it) == list(range(2, 10))


class Boom(RuntimeError):
    pass


def test_source_exception_raised_at_its_step():
    def source():
        yield 0
        yield 1
        yield 2
        raise Boom("source failed at 3")

    got = []
    with pytest.raises(Boom, match="source failed at 3") as info:
        got.extend(pinxfer.prefetch(source(), device="cpu", depth=4))
    assert got == [0, 1, 2]
    notes = getattr(info.value, "__notes__", [])
    if notes:  # Python >= 3.11
        assert "batch 3" in notes[0]


def test_exception_in_first_batch_and_then_stop():
    def source():
        raise Boom("at once")
        yield  # pragma: no cover

    pf = pinxfer.prefetch(source(), device="cpu")
    it = iter(pf)
    with pytest.raises(Boom):
        next(it)
    with pytest.raises(StopIteration):
        next(it)


def test_transfer_exception_raised_at_its_step():
    def transfer(b):
        if b == 2:
            raise ValueError("bad batch 2")
        return b

    got = []
    with pytest.raises(ValueError, match="bad batch 2"):
        got.extend(pinxfer.prefetch(range(5), device="cpu", transfer=transfer))
    assert got == [0, 1]


@pytest.mark.parametrize("producer", ["caller", "thread"])
def test_a_stop_iteration_in_transfer_is_an_error_not_the_end(producer):
    """Raised from next(), a StopIteration ends a for loop: the batches left were dropped
    without a word (found by review, session 44). It comes as a RuntimeError, as PEP 479
    makes it in a generator."""

    def transfer(b):
        if b == 2:
            next(iter([]))
        return b

    got = []
    with pytest.raises(RuntimeError, match="StopIteration") as info:
        got.extend(pinxfer.prefetch(range(5), device="cpu", transfer=transfer, producer=producer))
    assert got == [0, 1]
    assert isinstance(info.value.__cause__, StopIteration)


def test_early_break_stops_thread_while_prefetcher_still_referenced():
    closed = threading.Event()

    def source():
        try:
            for i in range(1000):
                yield torch.full((1024,), i)
        finally:
            closed.set()

    pf = pinxfer.prefetch(source(), device="cpu", depth=2)
    for i, b in enumerate(pf):
        assert int(b[0]) == i
        if i == 3:
            break
    gc.collect()  # not needed on CPython (refcounting), harmless elsewhere
    assert _wait_no_threads()
    assert closed.wait(5), "the source generator was not closed"
    del pf


def test_close_stops_thread_and_next_raises_stop():
    pf = pinxfer.prefetch(iter(range(100)), device="cpu")
    assert next(pf) == 0
    assert len(_prefetch_threads()) == 1
    pf.close()
    assert not _prefetch_threads()
    pf.close()  # idempotent


def test_context_manager_closes():
    with pinxfer.prefetch(range(100), device="cpu") as pf:
        it = iter(pf)
        assert next(it) == 0
        assert _prefetch_threads()
    assert _wait_no_threads()


def test_gc_of_unreferenced_prefetcher_stops_thread():
    pf = pinxfer.prefetch(range(1000), device="cpu")
    it = iter(pf)
    next(it)
    assert _prefetch_threads()
    del it, pf
    gc.collect()
    assert _wait_no_threads()


def test_gc_with_reference_cycle_stops_thread():
    pf = pinxfer.prefetch(range(1000), device="cpu")
    next(pf)
    holder = {"pf": pf}
    holder["self"] = holder  # a cycle: only the cycle collector frees it
    del pf, holder
    gc.collect()
    assert _wait_no_threads()


def test_blocked_producer_is_released_by_close():
    # The producer waits for a free slot (consumer is not reading).
    pf = pinxfer.prefetch(range(1000), device="cpu", depth=1)
    next(pf)
    time.sleep(0.1)
    t0 = time.monotonic()
    pf.close()
    assert time.monotonic() - t0 < 2.0
    assert not _prefetch_threads()


def test_queued_batches_are_freed_on_close():
    freed = []

    class Tracked:
        def __init__(self, i):
            self.i = i

        def __del__(self):
            freed.append(self.i)

    pf = pinxfer.prefetch((Tracked(i) for i in range(10)), device="cpu", depth=3)
    first = next(pf)
    time.sleep(0.2)  # let the producer fill its slots
    pf.close()
    gc.collect()
    assert set(freed) >= {1, 2}, freed  # batches queued ahead were dropped
    assert first.i == 0


Point = collections.namedtuple("Point", ["x", "y"])


@dataclasses.dataclass
class Sample:
    image: torch.Tensor
    label: int
    meta: dict


def test_nested_structures_and_non_tensor_fields_pass_through():
    batch = {
        "a": torch.arange(3),
        "list": [torch.ones(2), "text", 7, None],
        "tuple": (torch.zeros(1), 2.5),
        "nt": Point(torch.ones(1), "y"),
        "dc": Sample(torch.ones(2, 2), 3, {"k": torch.arange(2)}),
        "od": collections.OrderedDict(z=torch.ones(1)),
    }
    seen_types = []

    def transfer(b):
        return pinxfer._batch.map_tensors(b, lambda t: (seen_types.append(t.dtype), t + 1)[1])

    (out,) = list(pinxfer.prefetch([batch], device="cpu", transfer=transfer))
    assert torch.equal(out["a"], torch.arange(3) + 1)
    assert out["list"][1:] == ["text", 7, None]
    assert isinstance(out["nt"], Point) and out["nt"].y == "y"
    assert isinstance(out["dc"], Sample) and out["dc"].label == 3
    assert torch.equal(out["dc"].meta["k"], torch.arange(2) + 1)
    assert isinstance(out["od"], collections.OrderedDict)
    assert isinstance(out["tuple"], tuple) and out["tuple"][1] == 2.5
    assert len(seen_types) == 7
    # the input batch is not modified
    assert torch.equal(batch["a"], torch.arange(3))


def test_len_follows_source():
    assert len(pinxfer.prefetch([1, 2, 3], device="cpu")) == 3
    assert (
        len(
            pinxfer.prefetch(
                torch.utils.data.DataLoader(list(range(10)), batch_size=4), device="cpu"
            )
        )
        == 3
    )
    with pytest.raises(TypeError, match="has no len"):
        len(pinxfer.prefetch(iter([1, 2]), device="cpu"))


def test_reiteration_is_a_new_pass():
    pf = pinxfer.prefetch([1, 2, 3], device="cpu")
    assert list(pf) == [1, 2, 3]
    assert list(pf) == [1, 2, 3]  # a list source: a second epoch


def test_dataloader_source_cpu():
    ds = torch.utils.data.TensorDataset(torch.arange(40).float().view(20, 2), torch.arange(20))
    loader = torch.utils.data.DataLoader(ds, batch_size=4)
    out = list(pinxfer.prefetch(loader, device="cpu"))
    assert len(out) == 5
    assert torch.equal(torch.cat([b[1] for b in out]), torch.arange(20))


def test_bad_depth():
    with pytest.raises(ValueError, match="depth"):
        pinxfer.prefetch([1], device="cpu", depth=0)


@pytest.mark.skipif(HAS_CUDA, reason="behaviour without CUDA")
def test_without_cuda_default_device_is_cpu_and_cuda_request_raises():
    pf = pinxfer.prefetch([torch.ones(1)])
    assert pf.device == torch.device("cpu")
    assert torch.equal(next(pf), torch.ones(1))
    pf.close()
    with pytest.raises(RuntimeError, match="device='cpu'"):
        pinxfer.prefetch([1], device="cuda")
    assert cuda_unavailable_reason() is not None


@pytest.mark.skipif(HAS_CUDA, reason="behaviour without CUDA")
def test_transfers_raise_clearly_without_cuda():
    with pytest.raises(RuntimeError, match="expected a usable CUDA device"):
        pinxfer.to_device(torch.ones(3))
    with pytest.raises(RuntimeError, match="expected a usable CUDA device"):
        pinxfer.to_device({"x": torch.ones(3)}, "cuda:0")
    with pytest.raises(RuntimeError, match="expected a usable CUDA device"):
        pinxfer.to_host(torch.ones(3))


def test_to_device_cpu_target_passes_structure():
    batch = {"x": torch.ones(2), "n": 1}
    out = pinxfer.to_device(batch, "cpu")
    assert torch.equal(out["x"], batch["x"]) and out["n"] == 1


def test_map_tensors_and_tensors_in_agree():
    batch = [
        torch.ones(1),
        {"b": torch.zeros(2), "a": (torch.ones(3),)},
        Sample(torch.ones(4), 1, {}),
    ]
    found = pinxfer._batch.tensors_in(batch)
    assert [t.numel() for t in found] == [1, 2, 3, 4]
    order = []
    pinxfer._batch.map_tensors(batch, lambda t: order.append(t.numel()))
    assert order == [1, 2, 3, 4]


# ---- the caller's road (producer="caller"): the consumer's thread sends one batch ahead ----


def test_producer_defaults_and_bad_value():
    # A CPU pass and a caller's transfer keep the thread; "auto" is only for a GPU pass.
    assert pinxfer.prefetch([1], device="cpu").producer == "thread"
    assert pinxfer.prefetch([1], device="cpu", producer="caller").producer == "caller"
    with pytest.raises(ValueError, match="producer must be one of 'auto', 'caller', 'thread'"):
        pinxfer.prefetch([1], device="cpu", producer="inline")


def test_caller_road_order_values_and_no_thread():
    batches = [{"x": torch.full((5,), i), "i": i} for i in range(7)]
    got = []
    for b in pinxfer.prefetch(batches, device="cpu", producer="caller"):
        assert not _prefetch_threads()  # sent in this thread
        got.append((b["i"], b["x"].tolist()))
    assert got == [(i, [i] * 5) for i in range(7)]


def test_caller_road_runs_one_batch_ahead():
    # The source is asked for batch i+1 when batch i is handed out: its copy overlaps the
    # consumer's step on batch i. No further.
    fetched = []

    def source():
        for i in range(5):
            fetched.append(i)
            yield i

    for i, b in enumerate(pinxfer.prefetch(source(), device="cpu", producer="caller")):
        assert b == i
        assert fetched[-1] == min(i + 1, 4)


def test_caller_road_errors_at_their_step_and_closes_the_source():
    closed = threading.Event()

    def source():
        try:
            yield from range(3)
            raise KeyError("source broke")
        finally:
            closed.set()

    seen = []
    with pytest.raises(KeyError, match="source broke") as info:
        seen.extend(pinxfer.prefetch(source(), device="cpu", producer="caller"))
    assert seen == [0, 1, 2]
    assert any("at batch 3" in n for n in getattr(info.value, "__notes__", [])) or not hasattr(
        info.value, "add_note"
    )
    assert closed.is_set()

    def transfer(b):
        if b == 2:
            raise ValueError("transfer broke")
        return b

    seen = []
    with pytest.raises(ValueError, match="transfer broke"):
        seen.extend(pinxfer.prefetch(range(5), device="cpu", transfer=transfer, producer="caller"))
    assert seen == [0, 1]


def test_caller_road_early_break_and_close():
    closed = threading.Event()

    def source():
        try:
            yield from range(1000)
        finally:
            closed.set()

    pf = pinxfer.prefetch(source(), device="cpu", producer="caller")
    for i, b in enumerate(pf):
        assert b == i
        if i == 3:
            break
    assert closed.wait(5), "the source generator was not closed"
    pf = pinxfer.prefetch(iter(range(10)), device="cpu", producer="caller")
    assert next(pf) == 0
    pf.close()
    pf.close()  # idempotent
    assert list(pinxfer.prefetch([1, 2], device="cpu", producer="caller")) == [1, 2]


def test_caller_road_keyboard_interrupt_is_not_deferred():
    # In the consumer's thread an interrupt while sending the next batch is raised now,
    # not held back until the consumer asks for that batch.
    def transfer(b):
        if b == 1:
            raise KeyboardInterrupt
        return b

    it = iter(pinxfer.prefetch(range(5), device="cpu", transfer=transfer, producer="caller"))
    with pytest.raises(KeyboardInterrupt):
        next(it)  # hands out batch 0 after sending batch 1 ahead


# ---- the sender road's steady step, its Python alone ----


class _RecordingSender:
    """BatchSender's calls made at once on the CPU, each recorded: the steady step's Python
    (which call it makes for which batch, in what order) without a GPU. The sends themselves,
    and every byte, are tests/test_transfer_gpu.py's (the sender road's tests)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def submit_batch_if_plain(self, batch, chunk_bytes: int, num_buffers: int):
        # As the binding: a dict or list of two tensors or more, nothing else.
        whole = type(batch) in (dict, list) and len(batch) >= 2
        self.calls.append("whole" if whole else "declined")
        return ("whole", batch) if whole else None

    def submit(self, leaves, chunk_bytes: int, num_buffers: int):
        self.calls.append("leaves")
        return ("leaves", list(leaves))

    def take_batch(self, ticket):
        assert ticket[0] == "whole"
        return ticket[1]

    def take(self, ticket):
        assert ticket[0] == "leaves"
        return ticket[1]

    def settle(self, ticket) -> None:
        self.calls.append("settle")


class _RefusingSender(_RecordingSender):
    """A sender whose submit of the batch with ``i == refused`` raises, as the binding does
    when it cannot take a batch (e.g. the device out of memory for its outputs)."""

    def __init__(self, refused: int) -> None:
        super().__init__()
        self.refused = refused

    def submit_batch_if_plain(self, batch, chunk_bytes: int, num_buffers: int):
        if type(batch) is dict and int(batch["i"]) == self.refused:
            raise RuntimeError("sender refused the batch")
        return super().submit_batch_if_plain(batch, chunk_bytes, num_buffers)


def _sender_pass(source, sender: _RecordingSender):
    """A caller's-road pass over ``source`` whose sender is ``sender``, as next() leaves it
    after the pass's first batch (handed out; the second at the sender), and that batch."""
    to = prefetch_mod.Delivery(torch.device("cuda", 0), None, 1 << 20, 4)
    p = prefetch_mod._CallerPass(iter(prefetch_mod.StagedSource(source)), to, 2, False)
    p.sender = sender
    first = next(p.leases).batch
    second = next(p.leases).batch
    ticket = sender.submit_batch_if_plain(second, to.chunk_bytes, to.num_buffers)
    sent = prefetch_mod._Sent(second, prefetch_mod._TAKEN_APART_IN_C, ticket, 1)
    p.ahead = (prefetch_mod._SENT, sent, None)
    p.step = 2
    return p, first


def _steps(p) -> list:
    """Every batch the pass hands out after its first, by its steady steps."""
    out = []
    while True:
        try:
            out.append(p._next_locked())
        except StopIteration:
            return out


@pytest.mark.skipif(
    not hasattr(pinxfer._C, "BatchSender"), reason="a build without CUDA has no sender road"
)
def test_sender_steady_step_reads_the_source_and_falls_back_once_a_batch_is_declined():
    """The steady step reads a StagedSource's own iterator and submits each batch whole; the
    first batch the binding declines (here a bare tensor) goes through _send_lease, its leaves
    sent apart, and so does every later batch of the pass (asked once each, not twice). Every
    batch comes out in order, rebuilt as it went in."""
    source = [{"i": torch.tensor(i), "x": torch.full((3,), float(i))} for i in range(5)]
    source += [torch.full((2,), 5.0), [torch.tensor(6), torch.ones(2)], torch.full((2,), 7.0)]
    source += [{"i": torch.tensor(8), "x": torch.full((3,), 8.0)}]
    sender = _RecordingSender()
    p, first = _sender_pass(source, sender)
    got = [first, *_steps(p)]
    # Batch 1 submitted before the steady steps, 2-4 by them; 5 declined there and asked
    # again by _submit, which sends its leaves; 6-8 through _send_lease, asked once each.
    assert sender.calls == (
        ["whole"] * 4 + ["declined", "declined", "leaves", "whole", "declined", "leaves", "whole"]
    ), sender.calls
    assert len(got) == len(source)
    for g, want in zip(got, source):
        if isinstance(want, torch.Tensor):
            assert torch.equal(g, want)
        elif isinstance(want, dict):
            assert g.keys() == want.keys() and all(torch.equal(g[k], want[k]) for k in want)
        else:
            assert type(g) is list and all(torch.equal(a, b) for a, b in zip(g, want))
    assert p.finished


@pytest.mark.skipif(
    not hasattr(pinxfer._C, "BatchSender"), reason="a build without CUDA has no sender road"
)
def test_sender_steady_step_source_errors_arrive_after_the_batches_before_them():
    """A source that raises mid-pass, read directly by the steady step: the batches before the
    error come out, then the error once, with the batch's number in its note. A
    KeyboardInterrupt in the source is raised at once, and the batch being taken is settled
    (the sender drops it or lets its copies end), never left at the sender."""

    def breaking(k: int, err: BaseException):
        for i in range(k):
            yield {"i": torch.tensor(i), "x": torch.ones(2)}
        raise err

    sender = _RecordingSender()
    p, first = _sender_pass(breaking(5, KeyError("source broke")), sender)
    got = [first] + [p._next_locked() for _ in range(4)]
    assert [int(b["i"]) for b in got] == [0, 1, 2, 3, 4]
    with pytest.raises(KeyError, match="source broke") as raised:
        p._next_locked()
    assert any("at batch 5" in note for note in getattr(raised.value, "__notes__", []))
    assert "settle" not in sender.calls

    sender = _RecordingSender()
    p, _ = _sender_pass(breaking(3, KeyboardInterrupt()), sender)
    assert int(p._next_locked()["i"]) == 1
    with pytest.raises(KeyboardInterrupt):
        p._next_locked()
    assert sender.calls[-1] == "settle"


@pytest.mark.skipif(
    not hasattr(pinxfer._C, "BatchSender"), reason="a build without CUDA has no sender road"
)
@pytest.mark.parametrize("refused", [3, 6], ids=["steady_step", "send_lease"])
def test_a_batch_the_sender_refuses_raises_at_its_own_step_after_the_batch_before_it(refused):
    """A submit that raises (found by review, session 42: it was raised a step early, in
    place of the ready batch before it, which was dropped). Now every batch before the
    refused one comes out, then its error, named by its batch number, which ends the pass.
    Refused by the steady step (batch 3) or by _send_lease (batch 6, after a bare tensor
    made the pass leave the steady step's fast case)."""
    source = [{"i": torch.tensor(i), "x": torch.full((3,), float(i))} for i in range(5)]
    source.insert(5, torch.full((2,), 5.0))  # declined whole: the pass leaves the fast case
    source += [{"i": torch.tensor(i), "x": torch.full((3,), float(i))} for i in range(6, 9)]
    sender = _RefusingSender(refused)
    p, first = _sender_pass(source, sender)
    got = [first]
    for _ in range(1, refused):
        got.append(p._next_locked())
    assert [int(b["i"]) if type(b) is dict else 5 for b in got] == list(range(refused))
    with pytest.raises(RuntimeError, match="sender refused the batch") as raised:
        p._next_locked()
    assert any(f"batch {refused}" in note for note in getattr(raised.value, "__notes__", []))
    assert p.finished  # an error ends the pass, as a source's or a transfer's does


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"transfer": 3}, TypeError, "transfer must be a callable"),
        ({"chunk_bytes": 100}, ValueError, "chunk_bytes"),
        ({"num_buffers": 0}, ValueError, "num_buffers"),
        ({"chunk_bytes": "big"}, TypeError, "chunk_bytes"),
    ],
)
def test_bad_arguments_are_refused_when_the_prefetcher_is_made(kwargs, error, match):
    """Not at the first batch of a GPU pass (and never on a CPU one); found by review,
    session 44."""
    with pytest.raises(error, match=match):
        pinxfer.prefetch(range(3), device="cpu", **kwargs)
