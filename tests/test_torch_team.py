"""Host copies on torch's awake intra-op team (csrc/runtime/torch_team.h).

Right after a torch parallel CPU op, the main thread's OpenMP team spins for milliseconds;
pinxfer then runs its host copies on that team instead of waking its own copy threads.
These tests run in a fresh interpreter (the team that is probed is its main thread's, and
a test runner may run tests on another thread), with torch on at least two threads, and
check the probe itself, that copies really take the team's road, and every byte.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

import pinxfer

from .conftest import SANITIZER, requires_cuda

pytestmark = pytest.mark.skipif(
    SANITIZER == "thread", reason="the team's road is off under TSan (libgomp is not instrumented)"
)
# pinxfer learns a team only once it sees two of its other members spinning, so a team of
# three or more threads; libgomp spins only briefly when its team has more threads than the
# process has CPUs, so that team needs four CPUs to be seen.
TEAM_THREADS = 4
needs_cpus = pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < TEAM_THREADS,
    reason=f"a team of {TEAM_THREADS} threads needs {TEAM_THREADS} CPUs (the GPU machines have 16)",
)

_PRELUDE = """
import json, threading, time
import torch, pinxfer

torch.set_num_threads(max(4, torch.get_num_threads()))
state = pinxfer._C._torch_team_state
WAKE = torch.ones(1 << 22)  # 16 MiB: an add on it is one of torch's parallel ops

def wake_team():
    WAKE.add_(1)

def awake_after_op(tries=20):
    # Whether the probe sees the team awake right after one of torch's ops, in a few tries
    # (on a loaded machine a team member may not run at the moment it is read).
    for _ in range(tries):
        wake_team()
        if state()[1]:
            return True
        time.sleep(0.01)
    return False

def random_bytes(nbytes, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
"""


def _run(body: str, **env: str) -> dict:
    code = _PRELUDE + textwrap.dedent(body)
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@needs_cpus
@pytest.mark.parametrize("probe", ["proc", "clock"])
def test_probe_tells_a_spinning_team_from_a_sleeping_one(probe):
    """Both ways of reading a member (PINXFER_TEAM_PROBE): its /proc state, or whether its
    thread CPU clock runs."""
    got = _run(
        """
        first = awake_after_op()
        threads = state()[0]
        time.sleep(1.0)  # libgomp's spin is milliseconds
        awake_after_idle = state()[1]
        again = awake_after_op()
        other = []
        t = threading.Thread(target=lambda: other.append(state()))
        t.start(); t.join()
        torch.set_num_threads(1)
        awake_one_thread = state()[1]
        print(json.dumps(dict(threads=threads, want=torch.get_num_threads(),
              after_op=first, after_idle=awake_after_idle, again=again,
              other=list(other[0][:2]), one_thread=awake_one_thread)))
        """,
        PINXFER_TEAM_PROBE=probe,
    )
    assert got["threads"] >= TEAM_THREADS  # the team was learned, its size torch's
    assert got["after_op"] and got["again"], got
    assert not got["after_idle"], got
    assert got["other"] == [0, False]  # only the main thread's team is probed
    assert not got["one_thread"]


def test_a_running_thread_is_told_from_a_waiting_one_by_its_cpu_clock():
    """PINXFER_TEAM_PROBE=clock's question, asked of real threads (two CPUs suffice): a
    thread waiting on a condition variable is never seen running, a spinning one is (the
    self-test keeps it off the asking thread's CPU and asks for up to two seconds until it
    has seen it run once: a spinner sharing the asker's CPU is never on it while asked), and
    a thread that has ended has no clock."""
    spinner, sleeper, gone = pinxfer._C._thread_running_self_test(100_000)
    assert sleeper == 0
    assert spinner > 0
    assert gone == -1


def test_the_road_can_be_turned_off():
    """PINXFER_TORCH_TEAM=off: a spinning team is never used (nor probed)."""
    got = _run(
        """
        before = state()[2]
        wake_team()
        awake = state()[1]
        y = pinxfer.pin_memory(torch.ones(4 << 20))
        print(json.dumps(dict(awake=awake, copies=state()[2] - before)))
        """,
        PINXFER_TORCH_TEAM="off",
    )
    assert got == {"awake": False, "copies": 0}


@needs_cpus
def test_pin_memory_of_at_most_256_kib_is_the_callers_alone():
    """Up to 256 KiB the caller copies, with no probe, even right after a torch op: the
    team's road costs more there than the half of the copy it would take (pin_memory_cpu.cpp,
    parallel_memcpy). A larger copy right after a torch op does take the team."""
    got = _run(
        """
        small_copies, large_copies, small_ok = [], [], True
        for n in (256 << 10, (256 << 10) - 4, 200 << 10):
            for attempt in range(20):
                if not awake_after_op():
                    continue
                x = random_bytes(n, attempt)
                before = state()[2]
                y = pinxfer.pin_memory(x)
                small_copies.append(state()[2] - before)
                small_ok = small_ok and torch.equal(y, x)
                break
        for attempt in range(20):
            if not awake_after_op():
                continue
            before = state()[2]
            pinxfer.pin_memory(torch.ones(1 << 20))  # 4 MiB of float32
            large_copies.append(state()[2] - before)
            if large_copies[-1]:
                break
        print(json.dumps(dict(small=small_copies, large=large_copies, ok=small_ok)))
        """
    )
    assert got["small"] == [0, 0, 0], got
    assert got["ok"]
    assert got["large"] and got["large"][-1] == 1, got


@needs_cpus
def test_pin_memory_on_the_team_copies_contiguous_strided_and_grad_tensors():
    """Right after a torch op, a contiguous tensor is copied by torch's copy_ on the team and a
    strided view by the byte-span copy (pin_memory_cpu.cpp, copy_plain): values, sizes and
    strides as the source's, a tensor that requires grad included."""
    got = _run(
        """
        x = torch.randn(1024, 1024)  # 4 MiB
        w = torch.randn(1024, 1024, requires_grad=True)
        v = torch.randn(2048, 1024)[::2]  # every other row: a strided view
        ok, on_team = [], []
        for src in (x, w, v):
            # Retried: a busy host can put the team to sleep between the op and the copy.
            for attempt in range(20):
                awake_after_op()
                before = state()[2]
                out = pinxfer.pin_memory(src)
                went = state()[2] - before
                ok.append(torch.equal(out, src.detach()) and out.stride() == src.stride()
                          and pinxfer.is_pinned(out))
                if went:
                    break
            on_team.append(went)
        print(json.dumps(dict(ok=all(ok), on_team=on_team)))
        """
    )
    assert got["ok"], got
    assert got["on_team"] == [1, 1, 1], got


@needs_cpus
def test_pin_memory_on_the_team_of_dtypes_torchs_copy_does_not_copy():
    """Sub-byte placeholder dtypes (torch.uint4, torch.int3, ...) and shell dtypes have no
    case in torch's copy kernel ("copy_kernel not implemented"): on an awake team they take
    the byte-span copy, on the team, and come back bit for bit (torch_copy_covers)."""
    got = _run(
        """
        names = ["uint1", "uint4", "uint7", "int1", "int3", "int7", "bits8", "bits16",
                 "float4_e2m1fn_x2", "float8_e8m0fnu", "float32"]
        results = {}
        for name in names:
            dtype = getattr(torch, name, None)
            if dtype is None:
                continue
            raw = random_bytes(1 << 20, 3)  # 1 MiB: over the caller-alone bound
            src = raw.view(dtype)
            for attempt in range(20):
                awake_after_op()
                before = state()[2]
                try:
                    out = pinxfer.pin_memory(src)
                except RuntimeError as e:
                    results[name] = str(e)[:200]
                    break
                went = state()[2] - before
                same = out.dtype == dtype and torch.equal(out.view(torch.uint8), raw)
                results[name] = dict(on_team=went, same=same)
                if went:
                    break
        print(json.dumps(results))
        """
    )
    assert got["float32"] == {"on_team": 1, "same": True}, got
    for name, result in got.items():
        assert result == {"on_team": 1, "same": True}, (name, got)


@pytest.mark.parametrize(
    ("policy", "spincount", "threads", "cpus", "window"),
    [
        ("", "", 16, 16, 100),  # libgomp's default: 300000 spins after a region
        ("active", "", 16, 16, 100),
        ("passive", "", 16, 16, 0),  # the team sleeps at once
        ("", "1000", 16, 16, 0),  # set: not second-guessed
        ("", "infinite", 16, 16, 0),
        ("", "", 17, 16, 0),  # more threads than CPUs: libgomp spins 100 times only
    ],
)
def test_team_spin_window_follows_libgomps_spin(policy, spincount, threads, cpus, window):
    import pinxfer

    assert pinxfer._C._team_spin_window_us(policy, spincount, threads, cpus) == window


_BACK_TO_BACK = """
        x = torch.randn(1 << 20)  # 4 MiB: a copy on the team
        _, _, copies, _, reads, window = state()
        for round in range(10):  # rounds: a loaded host may deschedule us past every window
            for attempt in range(20):
                awake_after_op()
                before_copies = state()[2]
                pinxfer.pin_memory(x)
                if state()[2] > before_copies:
                    break
            round_window = state()[5]
            for _ in range(50):
                pinxfer.pin_memory(x)  # right after the last one's region
            if state()[5] > round_window:
                break
        after = state()
        print(json.dumps(dict(copies=after[2] - copies, reads=after[4] - reads,
                              window=after[5] - window, rounds=round + 1)))
        """


@needs_cpus
def test_back_to_back_copies_on_the_team_skip_the_proc_read():
    """Right after a region of its own the team spins (libgomp's default): pin_memory calls
    back to back run on it, their probes answered by the spin window without reading a
    member's state from /proc. On a quiet host every one of them is; on a loaded one (the
    suite's other workers) this thread can be descheduled past the window between two calls,
    and that call reads /proc, as it should: so at least one of 50, not all, in up to ten
    rounds of 50 (with -n 16 on 16 CPUs one round of 50 has had none in the window)."""
    got = _run(_BACK_TO_BACK)
    assert got["copies"] >= 1, got
    assert got["window"] >= 1, got


@needs_cpus
@pytest.mark.parametrize(
    "env",
    [{"OMP_WAIT_POLICY": "passive"}, {"OMP_WAIT_POLICY": " Passive\n"}, {"GOMP_SPINCOUNT": "1000"}],
)
def test_a_team_that_may_sleep_at_once_is_read_at_every_probe(env):
    """OMP_WAIT_POLICY=passive (the team sleeps after each region) or a GOMP_SPINCOUNT set:
    no probe is answered by the spin window, every one reads /proc (and a sleeping team is
    never used)."""
    got = _run(_BACK_TO_BACK, **env)
    assert got["window"] == 0, got
    assert got["reads"] >= 50 or got["copies"] == 0, got


@needs_cpus
def test_pin_memory_after_a_gap_reads_the_teams_state_once():
    """After a gap (the team asleep, the pool's helpers woken ahead) a pin_memory call asks
    whether torch's team is awake once, before its allocation, and its copy takes that
    answer: one /proc read a call, contiguous or strided. The copy used to ask again."""
    got = _run(
        """
        learned = awake_after_op()
        sources = {"contiguous": torch.randn(1 << 20),
                   "strided": torch.randn(2048, 1024)[:, ::2]}
        reads, exact = {}, True
        for name, x in sources.items():
            before = state()[4]  # state() reads once itself, before its counters
            for _ in range(4):
                time.sleep(0.05)  # libgomp's spin and the pool's wake-ahead gap are shorter
                y = pinxfer.pin_memory(x)
                exact = exact and torch.equal(y, x) and pinxfer.is_pinned(y)
            reads[name] = state()[4] - before - 1  # less the second state()'s own read
        print(json.dumps(dict(learned=learned, reads=reads, exact=exact)))
        """
    )
    assert got["learned"], got  # a team not learned is never read, which would prove nothing
    assert got["exact"], got
    assert got["reads"] == {"contiguous": 4, "strided": 4}, got


@needs_cpus
def test_pin_memory_on_the_team_keeps_every_byte():
    """pin_memory right after a torch parallel op (its copy then runs on the team), over
    sizes and layouts, each result checked byte for byte against the source, and the
    source overwritten afterwards (the copy was finished when pin_memory returned)."""
    got = _run(
        """
        import random
        rng = random.Random(7)
        before = state()[2]
        bad = []
        for i in range(40):
            n = rng.choice([300 << 10, 1 << 20, 3 << 20, 8 << 20]) + rng.randrange(0, 4096)
            x = random_bytes(n, i)
            want = x.clone()
            wake_team()
            y = pinxfer.pin_memory(x)
            x.fill_(0x5A)
            if not (pinxfer.is_pinned(y) and torch.equal(y, want)):
                bad.append(n)
        # The element-wise road (a conjugate view) on the team too.
        z = torch.randn(1 << 20, dtype=torch.complex64)
        wake_team()
        zc = pinxfer.pin_memory(z.conj())
        conj_ok = torch.equal(zc, z.conj().resolve_conj())
        print(json.dumps(dict(bad=bad, copies=state()[2] - before, conj_ok=conj_ok)))
        """
    )
    assert got["bad"] == []
    assert got["conj_ok"]
    assert got["copies"] >= 20, got  # most of them ran on the team (a slow CI core may miss some)


@requires_cuda
@pytest.mark.gpu
@needs_cpus
def test_to_device_on_the_team_keeps_every_byte():
    """to_device right after a torch parallel op: one block (1 MiB - 64 MiB), the ring
    (larger) and a packed batch of small tensors; the source is overwritten as soon as
    to_device returns and every byte is checked."""
    got = _run(
        """
        import random
        rng = random.Random(11)
        trace = pinxfer._C._last_single_block_trace
        before = state()[2]
        bad, single_on_team, singles = [], 0, 0
        sizes = [(1 << 20) + 5, 3 << 20, 8 << 20, (40 << 20) + 4097, 100 << 20]
        for i in range(30):
            n = rng.choice(sizes)
            x = random_bytes(n, i)
            want = x.clone()
            wake_team()
            y = pinxfer.to_device(x)
            if n <= 64 << 20:
                singles += 1
                single_on_team += trace()["on_torch_team"]
            x.fill_(0xA5)
            if not torch.equal(y.cpu(), want):
                bad.append(n)
        xs = [random_bytes(rng.randrange(1, 200 << 10), 100 + k) for k in range(12)]
        wants = [t.clone() for t in xs]
        wake_team()
        ys = pinxfer.to_device(xs)
        for t in xs:
            t.fill_(0)
        batch_ok = all(torch.equal(a.cpu(), b) for a, b in zip(ys, wants))
        print(json.dumps(dict(bad=bad, singles=singles, single_on_team=single_on_team,
                              copies=state()[2] - before, batch_ok=batch_ok)))
        """
    )
    assert got["bad"] == [] and got["batch_ok"]
    assert got["single_on_team"] >= got["singles"] // 2, got
    assert got["copies"] >= 15, got
