"""torch.compile(fullgraph=True) of code that calls pinxfer.empty and pinxfer.pin_memory (CPU:
the ops run their real kernels, so the results are real pool tensors; the GPU side of compile,
to_device, is in test_graphs_gpu.py), and the calls that are never traced (to_host, prefetch,
iterating a Prefetcher, transfer.copy_stream, record_stream, pin_, unpin_, the state calls:
_check.never_traced), compiled as in
eager. Traced, pin_memory always copies: a graph cannot branch on whether its input is pinned
when it runs (csrc/README.md, "pinxfer's own calls under capture")."""

from __future__ import annotations

import importlib
import os
import pickle
import textwrap
import threading
from pathlib import Path

import pytest
import torch

import pinxfer
from pinxfer._batch import tensors_in
from tests import fresh
from tests.graph_count import CountingBackend

REPO = str(Path(__file__).resolve().parent.parent)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def compiled(fn, backend: str = "aot_eager"):
    return torch.compile(fn, fullgraph=True, backend=backend)


def test_empty_traces_in_a_fresh_process():
    """The first pinxfer call of a process can be a traced one: empty used to read the build
    (a pybind call dynamo cannot trace) before it asked whether it was being traced."""
    code = """
        import torch, pinxfer
        from pinxfer import _ops
        assert not _ops.torch_cuda_ready  # nothing has pinned yet in this process
        f = torch.compile(lambda: pinxfer.empty(4, 4, dtype=torch.int32), fullgraph=True,
                          backend="aot_eager")
        out = f()
        assert out.shape == (4, 4) and out.dtype == torch.int32, out
        assert pinxfer.is_pool_tensor(out)
        print("ok")
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("PINXFER_")}
    run = fresh.run(textwrap.dedent(code), env=env, cwd=REPO, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout + run.stderr


def test_pin_memory_of_a_tensor_traces_and_copies_every_time():
    f = compiled(lambda t: pinxfer.pin_memory(t))
    x = torch.randn(1000)
    out = f(x)
    assert torch.equal(out, x) and pinxfer.is_pool_tensor(out) and pinxfer.is_pinned(out)
    # An already-pinned input gives a new copy (eager gives the input itself).
    pinned = pinxfer.pin_memory(x)
    assert pinxfer.pin_memory(pinned) is pinned
    again = f(pinned)
    assert again.data_ptr() != pinned.data_ptr() and torch.equal(again, x)


def test_pin_memory_of_a_batch_traces():
    f = compiled(lambda b: pinxfer.pin_memory(b))
    batch = {"x": torch.randn(3, 5), "meta": [torch.arange(7), torch.tensor(2.5)]}
    out = f(batch)
    assert set(out) == {"x", "meta"} and len(out["meta"]) == 2
    for got, want in ((out["x"], batch["x"]), *zip(out["meta"], batch["meta"])):
        assert torch.equal(got, want) and pinxfer.is_pool_tensor(got)


def test_pin_memory_traced_passes_the_gradient_through():
    x = torch.randn(8, requires_grad=True)
    f = compiled(lambda t: (pinxfer.pin_memory(t) * 3).sum())
    f(x).backward()
    assert torch.equal(x.grad, torch.full((8,), 3.0))


def test_empty_and_pin_memory_compile_with_inductor():
    """Inductor runs the ops as fallback kernels: the results are pool memory."""

    def fn(t):
        out = pinxfer.empty(*t.shape, dtype=t.dtype)
        out.copy_(t)
        return out, pinxfer.pin_memory(t)

    x = torch.randn(4, 6)
    empty_out, pinned_out = compiled(fn, backend="inductor")(x)
    assert torch.equal(empty_out, x) and torch.equal(pinned_out, x)
    assert pinxfer.is_pool_tensor(pinned_out)


def _outcome(fn, *args):
    """fn(*args)'s result, or the message of the exception it raised."""
    try:
        return fn(*args)
    except Exception as exc:  # compared between eager and compiled runs
        return f"{type(exc).__name__}: {exc}"


def test_to_host_under_compile_breaks_the_graph_at_the_call():
    """to_host is never traced (its handle waits on an event a graph cannot hold): compiled
    without fullgraph, the graph breaks at the call, the code before it stays compiled and
    the call itself runs as in eager: on a machine without a GPU it raises eager's error
    (before session 48 the traced call skipped the CUDA check and returned a handle there),
    with one the CPU tensor passes through and the code after it is a second graph (the GPU
    copy is checked in tests/test_transfer_gpu.py). Not the whole function run uncompiled,
    as when to_host raised while traced (0 graphs).

    The code after the call adds ``x``: dynamo skips a resume frame whose locals hold no tensor
    (torch 2.11 and 2.14: "no tensor-related objects found in frame"; the handle hides its
    tensor), and then runs ``.cos()`` uncompiled (1 graph; the GPU run of session 56 found it)."""
    backend = CountingBackend()

    def fn(x):
        y = x.exp()
        handle = pinxfer.to_host(y)
        return handle.wait().cos() + x

    x = torch.arange(6.0)
    eager = _outcome(fn, x)
    traced = _outcome(torch.compile(fn, backend=backend), x)
    if isinstance(eager, str):
        assert traced == eager
        assert len(backend.graphs) == 1, backend.graphs  # x.exp(), compiled and run before the call
    else:
        assert torch.equal(traced, eager)
        assert len(backend.graphs) == 2, backend.graphs
        assert "cos" in backend.graphs[1].code, backend.graphs[1].code  # the code after the call


def test_a_host_transfers_wait_and_ready_break_the_graph():
    """HostTransfer.wait and ready are never traced (they wait on and query CUDA events, whose
    query dynamo would answer once, while tracing: tests/test_transfer_gpu.py shows it). A
    handle with no copies in flight (a CPU result) stands in for one here: the graph breaks at
    each call, the code around it stays compiled (2 graphs a function), and the call returns
    what it returns in eager."""
    from pinxfer.transfer import HostTransfer

    for method in ("wait", "ready"):
        backend = CountingBackend()

        def fn(x, handle, method=method):
            y = x.exp()
            got = getattr(handle, method)()
            return y.cos(), got

        x = torch.arange(6.0)
        handle = HostTransfer(torch.ones(3), [])
        y, got = torch.compile(fn, backend=backend)(x, handle)
        assert torch.equal(y, x.exp().cos())
        assert got is True if method == "ready" else torch.equal(got, torch.ones(3))
        assert len(backend.graphs) == 2, (method, backend.graphs)


def test_import_pinxfer_does_not_import_dynamo():
    """never_traced calls through torch._dynamo.disable only once something else imported
    dynamo: importing it costs about 1.6 s."""
    code = "import sys, pinxfer; print('torch._dynamo' in sys.modules)"
    run = fresh.run(code, env=dict(os.environ), cwd=REPO, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "False", run.stdout + run.stderr


def test_to_host_under_fullgraph_compile_says_it_cannot_be_traced():
    f = compiled(lambda x: pinxfer.to_host(x * 2), backend="eager")
    with pytest.raises(Exception, match=r"to_host") as raised:
        f(torch.arange(6.0))
    # The reason, where this torch prints it (torch._dynamo reads _torchdynamo_disable_msg).
    if "reason: None" not in str(raised.value):
        assert "pinxfer.to_host cannot be traced by torch.compile" in str(raised.value)


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda x: pinxfer.prefetch([x], device="cuda"), id="prefetch"),
        pytest.param(lambda x: pinxfer.transfer.copy_stream(), id="copy_stream"),
        pytest.param(lambda x: pinxfer.record_stream(pinxfer.empty(4)), id="record_stream"),
    ],
)
def test_calls_that_make_threads_or_streams_are_never_traced(call):
    """prefetch, copy_stream and record_stream are never traced either (never_traced):
    compiled, each ends as in eager. Traced, their CUDA check trusted an op that is not
    there: on a machine without a GPU dynamo failed inside torch (InternalTorchDynamoError,
    or torch's "no NVIDIA driver") where eager raises pinxfer's message (found by review,
    session 48)."""
    x = torch.arange(6.0)
    eager = _outcome(call, x)
    traced = _outcome(torch.compile(call, backend="eager"), x)
    if isinstance(eager, str):
        assert traced == eager
    else:
        assert type(traced) is type(eager)


def test_pin_and_unpin_break_the_graph_and_act_on_the_tensor_they_get():
    """pin_ and unpin_ lock and unlock the memory of the tensor they get, when they run, so
    they are never traced: compiled, the graph breaks at each call and the tensor made by the
    graph before the call is the one pinned, then unpinned (real page-locked memory: mlock
    here, cudaHostRegister with a GPU). Traced, both failed in dynamo's fake-tensor pass
    ("expected a CPU tensor, got a tensor on meta"), a message about pinxfer's op rather
    than about compile (found in session 49)."""
    pin_backend, unpin_backend = CountingBackend(), CountingBackend()

    def pin_step(x):
        t = x + 1
        pinxfer.pin_(t)
        return t, t * 2

    def unpin_step(t):
        u = t * 3
        pinxfer.unpin_(t)
        return u + 1

    x = torch.arange(4096.0)
    t = None
    try:
        t, doubled = torch.compile(pin_step, backend=pin_backend)(x)
        assert pinxfer.is_pinned(t)
        assert torch.equal(doubled, (x + 1) * 2)
        assert len(pin_backend.graphs) == 2, pin_backend.graphs
        out = torch.compile(unpin_step, backend=unpin_backend)(t)
        assert not pinxfer.is_pinned(t)
        assert torch.equal(out, (x + 1) * 3 + 1)
        assert len(unpin_backend.graphs) == 2, unpin_backend.graphs
    finally:
        if t is not None and pinxfer.is_pinned(t):
            pinxfer.unpin_(t)


@pytest.mark.parametrize("name", ["pin_", "unpin_"])
def test_pin_and_unpin_under_fullgraph_compile_say_they_cannot_be_traced(name):
    call = getattr(pinxfer, name)
    f = compiled(lambda x: call(x + 1), backend="eager")
    with pytest.raises(Exception, match=name) as raised:
        f(torch.arange(6.0))
    if "reason: None" not in str(raised.value):
        assert f"pinxfer.{name} cannot be traced by torch.compile" in str(raised.value)


def _batches() -> list[dict[str, torch.Tensor]]:
    return [{"x": torch.full((4,), float(i))} for i in range(3)]


def _loop_over(prefetcher):
    total = torch.zeros(())
    for batch in prefetcher:
        total = total + batch["x"].sum()
    return total.cos()


def _one_step(prefetcher):
    return next(prefetcher)["x"].exp()


@pytest.mark.parametrize("fn", [_loop_over, _one_step], ids=["for", "next"])
def test_a_prefetcher_iterated_under_compile_runs_as_in_eager(fn, monkeypatch):
    """Prefetcher.__iter__ and __next__ are never traced (never_traced): a pass runs a
    producer thread or CUDA streams, outside any graph. Compiled without fullgraph, a loop over
    a Prefetcher and a next() on one give eager's batches (on a machine without a GPU a CPU
    pass: its producer thread hands the batches over as they are), and nothing a step calls
    is traced: the loop's generator runs outside the call to __iter__, and dynamo compiled
    each function it called, each on its own, until the step's gate was never traced too
    (found in session 54: `_refuse_under_capture`, `_hand_over`, `profiling`). A function
    dynamo traces sees torch.compiler.is_compiling() True."""
    prefetch_module = importlib.import_module("pinxfer.prefetch")  # pinxfer.prefetch: the function
    gate = prefetch_module._refuse_under_capture
    compiling: list[bool] = []

    def watched_gate(device):
        compiling.append(torch.compiler.is_compiling())
        return gate(device)

    eager = fn(pinxfer.prefetch(_batches()))
    monkeypatch.setattr(prefetch_module, "_refuse_under_capture", watched_gate)
    traced = torch.compile(fn, backend="eager")(pinxfer.prefetch(_batches()))
    assert torch.equal(traced, eager)
    assert compiling and not any(compiling), compiling


@pytest.mark.parametrize(
    ("fn", "method"), [(_loop_over, "__iter__"), (_one_step, "__next__")], ids=["for", "next"]
)
def test_a_prefetcher_under_fullgraph_compile_says_it_cannot_be_iterated(fn, method):
    """Before session 54 dynamo traced into the pass and failed on what it met first there
    (a queue.SimpleQueue's constructor), naming nothing of pinxfer's."""
    f = compiled(fn, backend="eager")
    with pytest.raises(Exception, match=rf"Prefetcher\.{method}") as raised:
        f(pinxfer.prefetch(_batches()))
    if "reason: None" not in str(raised.value):
        assert f"pinxfer.Prefetcher.{method} cannot be traced by torch.compile" in str(raised.value)


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda x: pinxfer.to_device({"a": x * 2}), id="batch"),
        pytest.param(lambda x: pinxfer.to_device(x * 2, "cuda"), id="to_cuda_without_index"),
        pytest.param(lambda x: pinxfer.to_device([x * 2], torch.device("cuda")), id="list"),
    ],
)
def test_to_device_resolving_the_current_gpu_under_compile_ends_as_in_eager(call):
    """Where to_device resolves the current GPU (no device given for a batch, or "cuda"
    without an index), compiled without fullgraph it ends as in eager. On a machine without
    a GPU, tracing called torch.cuda.current_device() and failed inside dynamo
    (InternalTorchDynamoError, torch's "Found no NVIDIA driver") where eager raises pinxfer's
    message (found in session 54); fullgraph=True then fails carrying that message."""
    x = torch.arange(6.0)
    eager = _outcome(call, x)
    traced = _outcome(torch.compile(call, backend="eager"), x)
    if isinstance(eager, str):
        assert traced == eager
        assert "pinxfer.to_device: expected a usable CUDA device" in eager
        torch._dynamo.reset()
        with pytest.raises(Exception, match=r"pinxfer\.to_device: expected a usable CUDA device"):
            compiled(call, backend="eager")(x)
    else:
        assert all(
            torch.equal(a, b) for a, b in zip(tensors_in(traced), tensors_in(eager), strict=True)
        )


_topology = importlib.import_module("pinxfer.topology")  # pinxfer.topology: the function
_STATE_CALLS = {
    "memory_stats": lambda: pinxfer.memory_stats(),
    "reset_peak_memory_stats": lambda: pinxfer.reset_peak_memory_stats(),
    "reset_accumulated_memory_stats": lambda: pinxfer.reset_accumulated_memory_stats(),
    "empty_cache": lambda: pinxfer.empty_cache(),
    "get_max_pinned_bytes": lambda: pinxfer.get_max_pinned_bytes(),
    "set_max_pinned_bytes": lambda: pinxfer.set_max_pinned_bytes(0),
    "install": lambda: pinxfer.install(),
    "uninstall": lambda: pinxfer.uninstall(),
    "is_installed": lambda: pinxfer.is_installed(),
    "numa_nodes": lambda: pinxfer.numa_nodes(),
    "topology": lambda: pinxfer.topology(),
    "topology.node_cpus": lambda: _topology.node_cpus(0),
}


@pytest.mark.parametrize("name", sorted(_STATE_CALLS))
def test_state_calls_under_fullgraph_compile_say_they_cannot_be_traced(name):
    """The calls that read or change the process's pools, torch's allocator or sysfs act when
    they run, so they are never traced (never_traced). Until session 55 each failed under
    fullgraph with dynamo's "Attempted to call function marked as skipped" and its advice to
    wrap a C extension in a custom operator, and warned so without fullgraph. A failed
    fullgraph trace runs nothing (install is not called here)."""
    call = _STATE_CALLS[name]

    def step(x):
        call()
        return x + 1

    with pytest.raises(Exception, match=name.replace(".", r"\.")) as raised:
        compiled(step, backend="eager")(torch.arange(6.0))
    if "reason: None" not in str(raised.value):
        assert f"pinxfer.{name} cannot be traced by torch.compile" in str(raised.value)


def test_the_cap_set_and_read_in_a_compiled_function_acts_when_it_runs():
    """Without fullgraph the graph breaks at each state call and the call runs for real at
    every call of the compiled function: the cap it sets is the pool's afterwards, and the
    cap it reads is the one in force then, not one put in the graph at trace time."""
    before = pinxfer.get_max_pinned_bytes()

    def step(x, limit):
        pinxfer.set_max_pinned_bytes(limit)
        read = pinxfer.get_max_pinned_bytes()
        return x + 1, read

    f = torch.compile(step, backend="eager")
    try:
        for limit in (1 << 40, 3 << 40):
            out, read = f(torch.zeros(2), limit)
            assert torch.equal(out, torch.ones(2))
            assert read == limit == pinxfer.get_max_pinned_bytes()
    finally:
        pinxfer.set_max_pinned_bytes(before)


def test_build_info_and_the_cuda_reason_trace_as_their_answer():
    """build_info and cuda_unavailable_reason answer the same for the whole process, so dynamo
    calls them while it traces and a fullgraph function may branch on them, as on
    torch.cuda.is_available()."""

    def step(x):
        usable = pinxfer.cuda_unavailable_reason() is None
        built = pinxfer.build_info()
        return x + (1 if usable else 2) + (10 if built.cuda_usable else 20)

    x = torch.zeros(2)
    assert torch.equal(compiled(step, backend="eager")(x), step(x))


def _compile_while_a_thread_runs(work) -> None:
    """Compiles and runs a small function whose backend runs ``work`` on another thread and
    joins it: the backend runs inside the compile, so ``work`` runs while it is under way."""

    def backend(gm, example_inputs):
        thread = threading.Thread(target=work)
        thread.start()
        thread.join()
        return gm.forward

    out = torch.compile(lambda x: x.sin() + 1, backend=backend)(torch.zeros(2))
    assert torch.equal(out, torch.ones(2))


def test_a_state_call_in_another_thread_runs_while_a_compile_is_under_way():
    """torch 2.14 holds torch.compiler.is_compiling() True in every thread for the whole of
    a compile, and never_traced raised its message when it read True: a monitoring thread's
    memory_stats failed while the main thread compiled (found by review, session 55). The
    backend runs inside the compile, so the thread's calls are made while it is under way."""
    outcomes: list[str] = []

    def other_thread_calls() -> None:
        for call in (pinxfer.memory_stats, pinxfer.get_max_pinned_bytes, pinxfer.numa_nodes):
            try:
                call()
                outcomes.append("ok")
            except Exception as exc:
                outcomes.append(f"{call.__name__}: {exc}")

    _compile_while_a_thread_runs(other_thread_calls)
    assert outcomes == ["ok"] * 3, outcomes


def test_a_state_call_in_a_function_exported_non_strict_runs():
    """Non-strict torch.export runs the function's Python for real (is_compiling() True):
    a state call there runs, as in eager, rather than raising never_traced's message."""

    class Logged(torch.nn.Module):
        def forward(self, x):
            pinxfer.memory_stats()
            return x + 1

    exported = torch.export.export(Logged(), (torch.zeros(2),), strict=False)
    assert torch.equal(exported.module()(torch.zeros(2)), torch.ones(2))


@pytest.mark.parametrize("strict", [False, True], ids=["non_strict", "strict"])
def test_pin_memory_and_empty_export(strict):
    """Exported, pin_memory and empty are their ops in the graph. Non-strict export runs the
    Python for real under its fake-tensor mode: the traced road is chosen there by that mode
    (eager() and the fast calls see it), not by is_compiling()."""

    class Pins(torch.nn.Module):
        def forward(self, x):
            return pinxfer.pin_memory(x * 2) + 1, pinxfer.empty(4).shape[0]

    exported = torch.export.export(Pins(), (torch.zeros(3),), strict=strict)
    out, n = exported.module()(torch.ones(3))
    assert torch.equal(out, torch.full((3,), 3.0)) and n == 4
    # The graph holds the copy and nothing of eager's road: non-strict, eager's pinned check
    # ran on the fake tensor and left three query ops in it (found by review, session 55).
    code = exported.graph_module.code
    assert "pin_memory" in code
    assert not any(q in code for q in ("is_pinned", "is_pool_tensor", "inplace_lock_kind")), code


@pytest.mark.parametrize("strict", [False, True], ids=["non_strict", "strict"])
def test_to_device_to_a_named_gpu_exports_as_torch_to_does(strict):
    """Exported, to_device to an explicit GPU ends as torch's x.to("cuda:0") does: both export
    or both fail. Non-strict, the CUDA check ran on the fake tensors' real Python and refused
    on a machine without a GPU where torch's own export succeeds (found by review, session 55)."""

    class ToCuda(torch.nn.Module):
        def __init__(self, send):
            super().__init__()
            self.send = send

        def forward(self, x):
            return self.send(x * 2)

    def exports(send) -> bool:
        torch._dynamo.reset()
        try:
            torch.export.export(ToCuda(send), (torch.zeros(3),), strict=strict)
        except Exception:
            return False
        return True

    assert exports(lambda x: pinxfer.to_device(x, "cuda:0")) == exports(lambda x: x.to("cuda:0"))


def test_a_traced_answer_does_not_take_a_users_global_name():
    """dynamo keeps a constant-result call's answer in the compiled function's module globals
    under the marked function's name, and reads it there when the graph returns it: marked
    as build_info itself, a user's global named build_info, set after the compile, was
    returned instead (found by review, session 55). The marked bodies have private names."""
    namespace = {"pinxfer": pinxfer}
    exec(  # a module of the user's, whose globals dynamo writes to
        "def step(x):\n    return x + 1, pinxfer.build_info()\n", namespace
    )
    f = compiled(namespace["step"], backend="eager")
    assert f(torch.zeros(1))[1] == pinxfer.build_info()
    namespace["build_info"] = "the user's own"
    assert f(torch.zeros(1))[1] == pinxfer.build_info()


@pytest.mark.parametrize("name", sorted(set(pinxfer.__all__) | {"topology.node_cpus"}))
def test_public_functions_pickle_as_themselves(name):
    """A wrapped public function keeps the wrapped one's module and name (functools.wraps),
    so pickle looked for it in pinxfer._ops and found another object there: DataLoader
    worker_init_fn, spawn and ProcessPoolExecutor failed (found by review, session 55)."""
    obj = _topology.node_cpus if name == "topology.node_cpus" else getattr(pinxfer, name)
    if callable(obj):
        assert pickle.loads(pickle.dumps(obj)) is obj


def test_eager_calls_in_another_thread_take_their_eager_road_while_a_compile_is_under_way():
    """pinxfer's Python chose its traced road (pin_memory always copying, no fast call) by
    torch.compiler.is_compiling(), which torch 2.14 holds True in every thread for the whole of
    a compile: a data thread's pin_memory of a pinned tensor returned a copy, not the tensor,
    while the main thread compiled (found in session 55). The road is chosen by _ops.traced():
    dynamo tracing the call, or a tracing mode in this thread; otherwise as in eager."""
    pinned = pinxfer.empty(1024)
    seen: list[bool] = []

    def other_thread_pins() -> None:
        seen.append(pinxfer.pin_memory(pinned) is pinned)
        seen.append(pinxfer.pin_memory([pinned])[0] is pinned)

    assert pinxfer.pin_memory(pinned) is pinned
    _compile_while_a_thread_runs(other_thread_pins)
    assert seen == [True, True]
