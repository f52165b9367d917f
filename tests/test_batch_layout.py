"""plain_batch / rebuilt_batch (pinxfer/_plain.py): the fast way to_device's eager batch
path, prefetch's sender and pin_memory of a batch find a batch's tensors and put results
back. Whatever way it takes (flat, one level deep, the walker), it must find exactly
``tensors_in(obj)`` and rebuild exactly what ``map_tensors`` builds. CPU only, except the
pin_memory test's pinning (real page-locked memory, as the README tests pin)."""

from __future__ import annotations

import collections
import random
from typing import Any

import pytest
import torch

from pinxfer import _C
from pinxfer._batch import map_tensors, tensors_in
from pinxfer._plain import plain_batch, rebuilt_batch

Pair = collections.namedtuple("Pair", ["a", "b"])


def t(n: int = 4) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32)


def assert_same_structure(got: Any, want: Any) -> None:
    """Same container types, keys and order; the same tensor objects; equal other leaves."""
    assert type(got) is type(want)
    if isinstance(want, torch.Tensor):
        assert got is want
    elif isinstance(want, dict):
        assert list(got) == list(want)
        for k in want:
            assert_same_structure(got[k], want[k])
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want)
        for a, b in zip(got, want):
            assert_same_structure(a, b)
    else:
        assert got == want


def check_against_walker(batch: Any, min_leaves: int = 1) -> Any:
    """plain_batch's leaves are tensors_in's, and rebuilt_batch builds map_tensors' batch
    (results: fresh tensors, so a result in a wrong place shows). Returns the layout."""
    plain = plain_batch(batch, min_leaves=min_leaves)
    walked = tensors_in(batch)
    if plain is None:
        return None
    leaves, layout = plain
    assert len(leaves) == len(walked) and all(a is b for a, b in zip(leaves, walked))
    results = [x.clone() for x in leaves]
    it = iter(results)
    assert_same_structure(
        rebuilt_batch(batch, layout, results), map_tensors(batch, lambda _x: next(it))
    )
    return layout


LAYOUT_CASES = [
    ({"x": t(), "y": t(2)}, True),
    ([t(), t()], True),
    ((t(), t(3)), True),
    ({"x": t(), "meta": [t(1), t(1)]}, (-1, 2)),  # bench_loop's batch
    ({"x": t(), "pair": (t(1), t(2))}, (-1, 2)),
    ([t(), [t(), t()], (t(),)], (-1, 2, 1)),
    ({"x": t(), "none": []}, (-1, 0)),
    ({"x": t(), "empty": ()}, (-1, 0)),
    ({"x": t(), "name": "a"}, False),  # a value that is not a tensor
    ({"x": t(), "ids": [t(), 3]}, False),  # a list with a non-tensor item
    ({"x": t(), "deep": [[t()]]}, False),  # two levels down
    ({"x": t(), "pair": Pair(t(), t())}, False),  # a namedtuple value
    (collections.OrderedDict(x=t(), y=[t()]), False),  # not exactly a dict
    (Pair(t(), [t()]), False),
    ({"nested": {"a": t(), "b": t()}}, False),
]


@pytest.mark.parametrize(("batch", "layout"), LAYOUT_CASES)
def test_layout_and_results_agree_with_the_walker(batch, layout):
    assert check_against_walker(batch) == layout


def test_batches_that_are_not_plain_are_refused_whatever_the_layout():
    grad = t().requires_grad_()
    for batch in ({"x": t(), "meta": [grad]}, {"x": grad, "y": t()}, [t(), [t(), grad]]):
        assert plain_batch(batch, min_leaves=1) is None
    # Fewer tensors than asked for.
    assert plain_batch({"x": t(), "meta": []}, min_leaves=2) is None
    assert plain_batch({"x": t(), "meta": [t()]}, min_leaves=2) is not None


@pytest.mark.parametrize(
    "batch",
    [
        {"x": t(), "y": t(2)},
        {"x": t(), "meta": [t(1), t(1)], "pair": (t(3),)},
        [t(), [t(), t()]],
        {"x": t(), "name": "a", "deep": [[t()]]},  # the walker's
    ],
)
def test_pin_memory_of_a_batch_pins_every_tensor_in_its_place(batch):
    """pin_memory of a flat or one-level batch takes plain_batch's way (no walker); every
    tensor comes back pinned, equal, in map_tensors' structure, and an already pinned
    tensor comes back as itself, as Tensor.pin_memory() does."""
    import pinxfer

    already = pinxfer.pin_memory(t(5))
    if isinstance(batch, dict):
        batch = {**batch, "pinned": already}
    out = pinxfer.pin_memory(batch)
    it = iter(tensors_in(out))
    want_structure = map_tensors(batch, lambda _x: next(it))
    assert_same_structure(out, want_structure)
    for got, src in zip(tensors_in(out), tensors_in(batch)):
        assert pinxfer.is_pinned(got) and torch.equal(got, src)
        assert (got is src) == (src is already)


def test_pin_memory_asks_an_object_with_its_own_pin_memory_inside_a_batch():
    """A value with its own pin_memory() is not a tensor: the batch takes the walker,
    which asks the object to pin itself, as before the plain_batch way existed."""
    import pinxfer

    class OwnPin:
        def pin_memory(self):
            return "pinned by itself"

    out = pinxfer.pin_memory({"x": t(), "own": OwnPin(), "meta": [t()]})
    assert out["own"] == "pinned by itself" and pinxfer.is_pinned(out["x"])


def test_without_walk_only_flat_and_one_level_batches_are_taken():
    for batch in ({"x": t(), "y": t()}, {"x": t(), "meta": [t()]}):
        assert plain_batch(batch, min_leaves=1, walk=False) is not None
    for batch in ({"x": t(), "deep": [[t()]]}, Pair(t(), t()), {"x": t(), "name": "a"}):
        assert plain_batch(batch, min_leaves=1, walk=False) is None
        assert plain_batch(batch, min_leaves=1) is not None


def test_pin_memory_of_a_plain_batch_that_fails_names_the_tensor(fresh_pool):
    """When the one C++ call for a plain batch raises (here: the pinned cap), the tensors
    are pinned one by one for an error that names the failing one's place; the batch's
    one call is not repeated on the way (one OOM there, one for the tensor)."""
    import pinxfer

    MiB = 1 << 20
    pinxfer.set_max_pinned_bytes(4 * MiB)
    batch = {"x": t(), "meta": [t(), torch.empty(8 * MiB, dtype=torch.uint8)]}
    with pytest.raises(torch.OutOfMemoryError, match=r"cannot pin batch\['meta'\]\[1\]"):
        pinxfer.pin_memory(batch)
    assert pinxfer.memory_stats()["num_ooms"] == 2


def check_one_call_batch(batch: Any) -> None:
    """_C._rebuilt_plain_batch walks and rebuilds a batch as to_device's one-call batch path
    does (to_device_batch_if_plain, csrc/python/plain_calls.cpp): it must take exactly the
    batches plain_batch takes without the walker (two tensors or more), and rebuild each
    one as rebuilt_batch does, every result in its tensor's place."""
    got = _C._rebuilt_plain_batch(batch)
    plain = plain_batch(batch, walk=False)
    if plain is None:
        assert got is None, batch
        return
    assert got is not None, batch
    leaves, layout = plain
    want = rebuilt_batch(batch, layout, leaves)
    got_leaves, want_leaves = tensors_in(got), tensors_in(want)
    # Same containers, keys and order; each result a new tensor equal to its own source.
    it = iter(want_leaves)
    assert_same_structure(map_tensors(got, lambda _x: next(it)), want)
    assert len(got_leaves) == len(want_leaves)
    for a, b in zip(got_leaves, want_leaves):
        assert a is not b and torch.equal(a, b)


@pytest.mark.parametrize(("batch", "layout"), LAYOUT_CASES)
def test_one_call_batch_takes_and_rebuilds_what_plain_batch_does(batch, layout):
    check_one_call_batch(batch)


def test_one_call_batch_refuses_what_plain_batch_refuses():
    grad = t().requires_grad_()

    class Sub(torch.Tensor):
        pass

    for batch in (
        {"x": t(), "meta": [grad]},
        {"x": grad, "y": t()},
        [t(), [t(), grad]],
        [t(), t().as_subclass(Sub)],
        {"x": t(), "meta": []},  # one tensor
        {"x": t()},
        [],
        {},
        t(),
        "text",
        {"x": t(), "y": torch.empty(2, device="meta")},
    ):
        assert _C._rebuilt_plain_batch(batch) is None, batch
        check_one_call_batch(batch)


def test_one_call_batch_agrees_with_plain_batch_on_random_batches():
    """Random flat, one-level and deeper batches of tensors, lists, tuples and other leaves."""
    rng = random.Random(7)

    def leaf():
        r = rng.random()
        if r < 0.93:
            return t(rng.randint(0, 5))
        return rng.choice(["a", 3, None, t().requires_grad_()])

    def value(depth: int):
        r = rng.random()
        if r < 0.5 or depth > 1:
            return leaf()
        kind = rng.choice([list, list, tuple, tuple, dict, Pair])
        n = 2 if kind is Pair else rng.randint(0, 4)
        items = [value(depth + 1) for _ in range(n)]
        if kind is dict:
            return {f"k{rng.randint(0, 99)}": v for v in items}
        return kind(*items) if kind is Pair else kind(items)

    taken = 0
    for _ in range(400):
        top = rng.choice([dict, list, tuple])
        values = [value(1) for _ in range(rng.randint(0, 5))]
        batch = {f"v{i}": v for i, v in enumerate(values)} if top is dict else top(values)
        check_one_call_batch(batch)
        taken += _C._rebuilt_plain_batch(batch) is not None
    assert 40 < taken < 360, taken  # both answers were exercised
