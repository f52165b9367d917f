"""Settings (csrc/runtime/settings.h), the split of the copy-thread budget among
the NUMA nodes' pools, and the transfer layer's chunk planning.

Settings are read from the environment once per process, so every check of an
environment variable runs in a fresh Python process. The derivations (copy
threads from CPUs, a node pool's share of them, cgroup quota) take their inputs
as arguments and are checked against hand-computed answers and fake cgroup trees.
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch

import pinxfer
from pinxfer import _ops
from tests import fresh
from tests.conftest import run_child

native = pinxfer._C
REPO = str(Path(__file__).resolve().parent.parent)
MiB = 1 << 20
PINXFER_VARS = [
    "PINXFER_SYSFS_ROOT",
    "PINXFER_DISABLE_CUDA",
    "PINXFER_NUMA_NODE",
    "PINXFER_MAX_PINNED_BYTES",
    "PINXFER_NUM_THREADS",
    "PINXFER_SPIN_US",
    "PINXFER_STAGE_COPY",
    "PINXFER_CACHED_TAIL",
    "PINXFER_TORCH_TEAM",
    "PINXFER_TEAM_PROBE",
    "PINXFER_IDLE_RECLAIM",
    "PINXFER_SENDER_LANDING",
    "PINXFER_SENDER_WORKERS",
    "PINXFER_SENDER_OUTPUTS",
    "PINXFER_H2D_READ",
    "LOCAL_WORLD_SIZE",  # torchrun's, read by the same table
    "OMP_WAIT_POLICY",  # libgomp's, read (never set) by the same table
    "GOMP_SPINCOUNT",
]


def run_fresh(code: str, **env: str) -> subprocess.CompletedProcess:
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("PINXFER_") and k != "LOCAL_WORLD_SIZE"
    }
    return fresh.run(textwrap.dedent(code), env={**base, **env}, cwd=REPO)


# ---- copy threads from what the process has ----


@pytest.mark.parametrize(
    ("affinity", "online", "quota", "ranks", "expected"),
    [
        (1, 1, 0.0, 1, 1),
        (2, 2, 0.0, 1, 2),  # below 4 CPUs none is kept back
        (4, 4, 0.0, 1, 3),
        (16, 16, 0.0, 1, 12),  # the 16-CPU H100/H200 hosts
        (32, 32, 0.0, 1, 16),  # capped: memory bandwidth, not threads, limits
        (32, 32, 0.0, 2, 12),  # two torchrun ranks on an unpartitioned host: 16 CPUs each
        (32, 32, 0.0, 8, 3),  # eight ranks: 4 CPUs each
        (8, 32, 0.0, 4, 6),  # the launcher bound this rank to 8 CPUs: not divided again
        (16, 16, 4.0, 1, 3),  # cgroup quota of 4 CPUs
        (16, 16, 2.5, 1, 3),  # a fractional quota rounds up
        (16, 16, 64.0, 1, 12),  # a quota above the affinity changes nothing
        (3, 64, 0.0, 8, 3),
    ],
)
def test_copy_threads_follow_the_process_cpus(affinity, online, quota, ranks, expected):
    threads, why = native.copy_threads_for(affinity, online, quota, ranks)
    assert threads == expected, why
    assert f"{threads} copy threads" in why
    if quota and quota < affinity:
        assert "cgroup quota" in why
    if ranks > 1 and affinity >= online:
        assert f"LOCAL_WORLD_SIZE={ranks}" in why


def test_copy_threads_reject_nonsense():
    with pytest.raises(ValueError, match="expected affinity_cpus"):
        native.copy_threads_for(0, 4, 0.0, 1)


# ---- one copy-thread budget per process, split among the NUMA nodes' pools ----


def cpus(lo: int, hi: int) -> list[int]:
    return list(range(lo, hi))


@pytest.mark.parametrize(
    ("budget", "node", "affinity", "from_env", "expected"),
    [
        # One node holding every allowed CPU: the whole budget on them, as before the split.
        (12, cpus(0, 16), cpus(0, 16), False, (12, cpus(0, 16))),
        (2, [0, 1], [0, 1], False, (2, [0, 1])),
        (1, [0], [0], False, (1, [0])),
        # Node -1 (no CPUs): unbound, the whole budget, as before.
        (12, [], cpus(0, 16), False, (12, [])),
        (5, [], cpus(0, 4), True, (5, [])),
        # Two nodes of 16 CPUs: half the budget each, bound to their own CPUs.
        (16, cpus(0, 16), cpus(0, 32), False, (8, cpus(0, 16))),
        (16, cpus(16, 32), cpus(0, 32), False, (8, cpus(16, 32))),
        # Unequal nodes (3 + 5 CPUs, budget 6 derived from 8): 2.25 -> 2 and 3.75 -> 4.
        (6, cpus(0, 3), cpus(0, 8), False, (2, cpus(0, 3))),
        (6, cpus(3, 8), cpus(0, 8), False, (4, cpus(3, 8))),
        # Shares round to the nearest, halves up (12 * 3/8 = 4.5 -> 5), and are at least 1.
        (12, cpus(0, 3), cpus(0, 8), True, (5, cpus(0, 3))),
        (2, [0], cpus(0, 16), False, (1, [0])),
        # Affinity restricted to part of a node (taskset -c 0-3 on a 2 x 16-CPU host, budget 3):
        # bound to those 4 CPUs only, with the whole budget; the other node has none of them.
        (3, cpus(0, 16), cpus(0, 4), False, (3, cpus(0, 4))),
        # Restricted to part of each node: each pool gets its allowed CPUs and half the budget.
        (6, cpus(0, 16), cpus(0, 4) + cpus(16, 20), False, (3, cpus(0, 4))),
        (6, cpus(16, 32), cpus(0, 4) + cpus(16, 20), False, (3, cpus(16, 20))),
        # A node with no allowed CPU: no binding (the workers run where the process may),
        # and the pool's CPUs are all of the process's, so it counts the whole budget.
        (3, cpus(16, 32), cpus(0, 4), False, (3, [])),
        # A derived budget is at most the pool's CPUs; PINXFER_NUM_THREADS is the whole
        # process's total, split the same way and not capped.
        (8, [0, 1], cpus(0, 4), False, (2, [0, 1])),
        (8, [0, 1], cpus(0, 4), True, (4, [0, 1])),
        (6, [0], [0, 1], True, (3, [0])),
        (3, [1], [0, 1], True, (2, [1])),  # 1.5 rounds up: 2 + 2 for the two nodes
        (40, cpus(0, 16), cpus(0, 64), True, (10, cpus(0, 16))),
        # Unknown affinity (empty): the node's CPUs are taken as allowed, as before the split.
        (12, cpus(0, 8), [], False, (8, cpus(0, 8))),
        (12, [], [], False, (12, [])),
        # Unsorted, repeated ids are sets.
        (4, [3, 1, 2, 1], [2, 3, 1, 0, 0], False, (3, [1, 2, 3])),
    ],
)
def test_node_pool_plan(budget, node, affinity, from_env, expected):
    assert _ops._node_pool_plan(budget, node, affinity, from_env) == expected


@pytest.mark.parametrize("num_nodes", [1, 2, 4, 8])
@pytest.mark.parametrize(("budget", "from_env"), [(16, False), (12, False), (3, True), (48, True)])
def test_node_pools_share_one_budget(num_nodes, budget, from_env):
    """A process driving GPUs on every node of a 32-CPU host runs its budget once in all,
    not once per node (issue 11): equal nodes give equal shares summing to the budget,
    to within the rounding of each share."""
    per_node = 32 // num_nodes
    shares = [
        _ops._node_pool_plan(budget, cpus(n * per_node, (n + 1) * per_node), cpus(0, 32), from_env)
        for n in range(num_nodes)
    ]
    threads = [t for t, _ in shares]
    assert [c for _, c in shares] == [
        cpus(n * per_node, (n + 1) * per_node) for n in range(num_nodes)
    ]
    assert len(set(threads)) == 1 and min(threads) >= 1
    exact = budget / num_nodes
    assert abs(threads[0] - exact) <= 0.5 or threads[0] == 1
    if budget % num_nodes == 0:
        assert sum(threads) == budget


def test_node_pool_plan_rejects_nonsense():
    with pytest.raises(ValueError, match="expected 1 <= budget"):
        _ops._node_pool_plan(0, [0], [0], False)
    with pytest.raises(ValueError, match="expected CPU ids"):
        _ops._node_pool_plan(4, [-1], [0], False)


def _cgroup_v2(root: Path, path: str, cpu_max: dict[str, str]) -> str:
    for rel, text in cpu_max.items():
        d = root / rel.lstrip("/")
        d.mkdir(parents=True, exist_ok=True)
        (d / "cpu.max").write_text(text + "\n")
    return f"0::{path}\n"


def test_cgroup_v2_quota_is_the_smallest_on_the_path(tmp_path):
    self_cgroup = _cgroup_v2(
        tmp_path,
        "/kubepods/pod1/ctr",
        {
            "/": "max 100000",
            "/kubepods": "800000 100000",  # 8 CPUs for all pods
            "/kubepods/pod1": "250000 100000",  # 2.5 CPUs for this pod
            "/kubepods/pod1/ctr": "max 100000",
        },
    )
    assert native.cgroup_quota_cpus(str(tmp_path), self_cgroup) == pytest.approx(2.5)


def test_cgroup_v2_without_quota_or_files_is_zero(tmp_path):
    assert (
        native.cgroup_quota_cpus(str(tmp_path), _cgroup_v2(tmp_path, "/", {"/": "max 100000"})) == 0
    )
    assert native.cgroup_quota_cpus(str(tmp_path / "missing"), "0::/a/b\n") == 0
    assert native.cgroup_quota_cpus(str(tmp_path), "garbage\n") == 0


def test_cgroup_v1_cpu_controller(tmp_path):
    d = tmp_path / "cpu,cpuacct" / "docker" / "abc"
    d.mkdir(parents=True)
    (d / "cpu.cfs_quota_us").write_text("300000\n")
    (d / "cpu.cfs_period_us").write_text("100000\n")
    self_cgroup = "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n"
    assert native.cgroup_quota_cpus(str(tmp_path), self_cgroup) == pytest.approx(3.0)
    (d / "cpu.cfs_quota_us").write_text("-1\n")  # v1's "no quota"
    assert native.cgroup_quota_cpus(str(tmp_path), self_cgroup) == 0


def test_cgroup_cpuset_is_the_containers_share_of_the_host(tmp_path):
    """A container's cpuset stands for the machine when the ranks inside it decide whether
    their launcher divided the CPUs (16 of a 128-CPU host shared by 8 ranks read as divided
    already: 12 copy threads each, 96 on 16 CPUs; found by review, session 43)."""
    d = tmp_path / "kubepods" / "pod1"
    d.mkdir(parents=True)
    (d / "cpuset.cpus.effective").write_text("0-7,64-71\n")
    assert native.cgroup_cpuset_cpus(str(tmp_path), "0::/kubepods/pod1\n") == 16
    assert native.cgroup_cpuset_cpus(str(tmp_path), "0::/elsewhere\n") == 0
    v1 = tmp_path / "cpuset" / "docker" / "abc"
    v1.mkdir(parents=True)
    (v1 / "cpuset.cpus").write_text("2-5\n")
    self_v1 = "12:memory:/docker/abc\n3:cpuset:/docker/abc\n"
    assert native.cgroup_cpuset_cpus(str(tmp_path), self_v1) == 4
    assert native.cgroup_cpuset_cpus(str(tmp_path), "garbage\n") == 0
    # A container that sees only its own cgroup, mounted at the root, while /proc/self/cgroup
    # names the host's path: the nearest readable ancestor counts, as for the quota (the
    # leaf alone read nothing; found by review, session 44).
    own = tmp_path / "container"
    (own / "cpuset").mkdir(parents=True)
    (own / "cpuset" / "cpuset.cpus").write_text("0-1\n")
    assert native.cgroup_cpuset_cpus(str(own), "3:cpuset:/docker/abc\n") == 2
    (own / "cpuset.cpus.effective").write_text("0-3\n")
    assert native.cgroup_cpuset_cpus(str(own), "0::/kubepods/pod1/abc\n") == 4
    # Those 16 CPUs shared by 8 unbound ranks: divided, 2 CPUs each (below 4 none kept back).
    threads, why = native.copy_threads_for(16, 16, 0.0, 8)
    assert threads == 2 and "shared by LOCAL_WORLD_SIZE=8" in why


# ---- the settings object ----


def test_settings_list_every_variable_with_its_source():
    out = run_fresh(
        """
        import torch, pinxfer
        names, values, sources, _docs = zip(*pinxfer._C.settings())
        for n, v, s in zip(names, values, sources):
            print(n, "|", v, "|", s)
    """,
        PINXFER_SPIN_US="7",
        PINXFER_MAX_PINNED_BYTES="1GiB",
    )
    assert out.returncode == 0, out.stderr
    rows = {line.split(" | ")[0]: line.split(" | ")[1:] for line in out.stdout.splitlines()}
    assert sorted(rows) == sorted(PINXFER_VARS)
    assert rows["PINXFER_SPIN_US"] == ["7", "env"]
    assert rows["PINXFER_MAX_PINNED_BYTES"] == [str(1 << 30), "env"]
    assert rows["PINXFER_NUM_THREADS"][1] == "derived"
    assert "copy threads" in rows["PINXFER_NUM_THREADS"][0]
    assert rows["PINXFER_STAGE_COPY"] == ["auto", "default"]
    assert rows["PINXFER_TEAM_PROBE"] == ["proc", "default"]
    assert rows["PINXFER_SENDER_LANDING"] == ["auto", "default"]
    assert rows["PINXFER_SENDER_WORKERS"] == ["2", "default"]
    assert rows["PINXFER_SENDER_OUTPUTS"] == ["auto", "default"]
    assert rows["PINXFER_H2D_READ"] == ["auto", "default"]


def test_spin_is_adaptive_unless_set():
    """Unset, PINXFER_SPIN_US is a floor: idle copy threads spin for an eighth of the pool's
    last job when that is longer (capped), so a producer's gaps between long jobs find them
    awake; set, it is exact."""
    out = run_fresh("""
        import torch, pinxfer
        names, values, sources, _docs = zip(*pinxfer._C.settings())
        row = dict(zip(names, zip(values, sources)))["PINXFER_SPIN_US"]
        print("ROW", row[0], "|", row[1])
    """)
    assert out.returncode == 0, out.stderr
    value, source = out.stdout.split("ROW ", 1)[1].strip().split(" | ")
    assert source == "default"
    assert value.startswith("100, or an eighth of the pool's last job"), value
    assert "at most 1000" in value


@pytest.mark.parametrize(
    ("policy", "spincount", "read_as"),
    [
        ("  PASSIVE\n", None, ("passive", None)),  # libgomp skips the blanks, ignores the case
        ("Active", " 1000 ", ("active", "1000")),
        (None, " \t", (None, "")),  # blanks only: no word, libgomp's default spin
    ],
)
def test_libgomps_words_are_read_as_libgomp_reads_them(policy, spincount, read_as):
    """libgomp reads OMP_WAIT_POLICY and GOMP_SPINCOUNT past blanks around the word and in
    any case. pinxfer read " passive" as another word, so it assumed torch's team spins
    after each region (the spin window) when the team in fact slept at once."""
    env = {k: v for k, v in (("OMP_WAIT_POLICY", policy), ("GOMP_SPINCOUNT", spincount)) if v}
    out = run_fresh(
        """
        import torch, pinxfer
        names, values, sources, _docs = zip(*pinxfer._C.settings())
        rows = dict(zip(names, zip(values, sources)))
        for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
            value, source = rows[name]
            print("ROW", name, repr(value if source == "env" else None))
    """,
        **env,
    )
    assert out.returncode == 0, out.stderr
    got = dict(line.split()[1:] for line in out.stdout.splitlines() if line.startswith("ROW "))
    assert got == {"OMP_WAIT_POLICY": repr(read_as[0]), "GOMP_SPINCOUNT": repr(read_as[1])}


def test_settings_are_read_once():
    out = run_fresh(
        """
        import os, torch, pinxfer
        first = pinxfer._C.settings()
        os.environ["PINXFER_SPIN_US"] = "999"
        os.environ["PINXFER_STAGE_COPY"] = "bogus"
        assert pinxfer._C.settings() == first
        assert pinxfer._C.get_max_pinned_bytes() == 3 << 20
        print("ok")
    """,
        PINXFER_MAX_PINNED_BYTES="3MiB",
    )
    assert out.returncode == 0 and "ok" in out.stdout, out.stdout + out.stderr


@pytest.mark.parametrize(
    ("text", "ranks"),
    [("4", "4"), (" 4\n", "4"), ("4x", "1"), ("0x8", "1"), ("-4294967288", "1"), ("", "1")],
)
def test_local_world_size_is_read_whole_or_means_one(text, ranks):
    """torchrun's variable, not ours to reject: a value that is not a whole number of ranks
    means 1 ("4x" read as 4 and "0x8" as 0 until session 44's review)."""
    code = """
        import pinxfer
        names, values, _, _ = zip(*pinxfer._C.settings())
        print("RANKS", dict(zip(names, values))["LOCAL_WORLD_SIZE"])
    """
    out = run_fresh(code, LOCAL_WORLD_SIZE=text)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"RANKS {ranks}" in out.stdout, out.stdout


# A child's reading, after `import os, torch, pinxfer`: pinxfer's PINXFER_NUM_THREADS setting
# (threads) and the CPU count of each of its copy threads' masks (masks), after a pin that
# starts them. The OpenMP binding tests below share it.
_COPY_THREAD_CPUS = textwrap.dedent("""
        names, values, _, _ = zip(*pinxfer._C.settings())
        threads = dict(zip(names, values))["PINXFER_NUM_THREADS"]
        pinxfer.pin_memory(torch.randn(4 << 20), numa_node=0, num_threads=2)
        masks = set()
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/status") as f:
                lines = dict(l.split(":", 1) for l in f.read().splitlines() if ":" in l)
            if lines["Name"].strip() == "pinxfer-copy":
                masks.add(len(pinxfer._ops.parse_cpulist(lines["Cpus_allowed_list"])))
""")


def _torch_openmp_is_libgomp() -> bool:
    """Whether torch's OpenMP runtime is libgomp here, as pinxfer found it: pinxfer then asks it
    whether it bound the main thread (csrc/runtime/libgomp.h); elsewhere it reads the OpenMP
    variables itself."""
    return bool(native._libgomp_path())


@pytest.mark.parametrize("places", ["unset", "listed"])
def test_an_openmp_binding_of_the_main_thread_is_not_the_processs_cpus(places):
    """OMP_PROC_BIND makes libgomp bind the initial thread to one place as torch loads it:
    pinxfer read that one CPU as the process's, ran one copy thread, and its workers
    inherited the caller's core (found by review, session 44). It now reads the process's
    cpuset (or the online CPUs), and binds its workers there. A real interpreter: the
    binding happens when libgomp loads, which the fresh-process zygote did without it.
    Places listed in OMP_PLACES are some of the process's CPUs, picked for torch's team: the
    copy threads keep the cpuset there too (a first form of session 50's places rule squeezed
    them into the listed places, found by review)."""
    env = {"OMP_PROC_BIND": "true", "OMP_PLACES": None, "GOMP_CPU_AFFINITY": None}
    if places == "listed":
        if not _torch_openmp_is_libgomp():
            pytest.skip("torch's OpenMP is not libgomp here: pinxfer reads the variables itself")
        env["OMP_PLACES"] = f"{{{min(os.sched_getaffinity(0))}}}"
    code = (
        textwrap.dedent("""
            import os, torch, pinxfer
            bound = len(os.sched_getaffinity(0))
        """)
        + _COPY_THREAD_CPUS
        + 'print("RESULT", bound, os.cpu_count(), min(masks), threads)\n'
    )
    out = run_child(code, env={**env, "PINXFER_NUM_THREADS": None})
    assert out.returncode == 0, out.stdout + out.stderr
    bound, cpus, worker_cpus, threads = out.stdout.split("RESULT ", 1)[1].split(" ", 3)
    if int(bound) >= int(cpus) or int(cpus) < 2:
        pytest.skip(f"libgomp did not bind the main thread here ({bound} of {cpus} CPUs)")
    assert "OpenMP's binding" in threads, threads
    assert int(worker_cpus) > int(bound), (worker_cpus, bound)


def test_an_openmp_binding_keeps_the_copy_threads_in_the_mask_the_process_started_with():
    """libgomp makes its places from the mask the process had when it loaded: narrowed first
    (here to one CPU, as `taskset` does) and then bound by OMP_PROC_BIND, the process's CPUs
    are that mask, the union of libgomp's places, not the cpuset, which pinxfer took until
    session 50 (found by review)."""
    if not _torch_openmp_is_libgomp():
        pytest.skip("torch's OpenMP is not libgomp here: pinxfer reads the variables itself")
    code = (
        textwrap.dedent("""
            import os
            os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
            import torch, pinxfer
        """)
        + _COPY_THREAD_CPUS
        + 'print("RESULT", max(masks, default=0), threads)  # 0: no copy threads but this one\n'
    )
    env = {"OMP_PROC_BIND": "true", "OMP_PLACES": None, "GOMP_CPU_AFFINITY": None}
    out = run_child(code, env={**env, "PINXFER_NUM_THREADS": None})
    assert out.returncode == 0, out.stdout + out.stderr
    worker_cpus, threads = out.stdout.split("RESULT ", 1)[1].split(" ", 1)
    assert "OpenMP's binding" not in threads, threads
    assert int(worker_cpus) <= 1, worker_cpus


@pytest.mark.parametrize("decoy_scope", ["local", "global"])
def test_pinxfer_uses_the_libgomp_torch_calls_when_another_was_loaded_first(tmp_path, decoy_scope):
    """A package that bundles its own libgomp under another soname (wheels' libgomp-<hash>.so.1,
    scikit-learn's among them), imported before torch, puts a second OpenMP runtime in the
    process ahead of torch's. pinxfer took the first library named libgomp for torch's (until
    session 51): its host copies would have run on a team torch does not use, and torch's
    binding been read from the other runtime. Loaded RTLD_LOCAL (as Python loads extensions)
    the other copy is not torch's; loaded RTLD_GLOBAL it is in the global scope, which the
    linker searches first for torch's calls too: then it is the runtime torch calls. The decoy
    is torch's own libgomp copied under another soname, so that the loader keeps both."""
    if not _torch_openmp_is_libgomp():
        pytest.skip("torch's OpenMP is not libgomp here")
    source = native._libgomp_path()
    image = Path(source).read_bytes()
    # The soname, NUL-terminated in the dynamic string table, one letter of it changed
    # ("libgomp.so.1" -> "libgomq.so.1": the same length, so nothing else in the file moves).
    soname = re.search(rb"libgomp[\w.-]*?\.so(\.\d+)*\x00", image)
    if soname is None:
        pytest.skip(f"no libgomp soname found in {source}")
    patched = soname.group(0).replace(b"libgomp", b"libgomq", 1)
    decoy = tmp_path / "libgomp-decoy.so.1"
    decoy.write_bytes(image.replace(soname.group(0), patched))
    mode = "ctypes.RTLD_GLOBAL" if decoy_scope == "global" else "ctypes.RTLD_LOCAL"
    code = f"""
        import ctypes, os
        decoy = ctypes.CDLL({str(decoy)!r}, mode={mode})  # before torch, as an import would
        import torch, pinxfer
        loaded = set()
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split(maxsplit=5)[-1].strip()
                if "libgomp" in os.path.basename(path):
                    loaded.add(os.path.realpath(path))
        # Which runtime torch calls, asked of torch: a thread count set in the decoy's runtime
        # is torch's (at::get_num_threads is omp_get_max_threads) only if it calls the decoy.
        threads = torch.get_num_threads()
        decoy.omp_set_num_threads(threads + 1)
        torch_calls_decoy = torch.get_num_threads() == threads + 1
        used = os.path.realpath(pinxfer._C._libgomp_path())
        print("RESULT", torch_calls_decoy, used, *sorted(loaded))
    """
    out = run_child(code)
    if "failed to map segment" in out.stderr:
        pytest.skip(f"{tmp_path} does not allow loading a library from it (noexec)")
    assert out.returncode == 0, out.stdout + out.stderr
    torch_calls_decoy, used, *loaded = out.stdout.split("RESULT ", 1)[1].split()
    decoy_path = str(decoy.resolve())
    assert decoy_path in loaded and len(loaded) == 2, loaded  # two runtimes, the decoy one
    torchs = (
        decoy_path if torch_calls_decoy == "True" else next(p for p in loaded if p != decoy_path)
    )
    assert torch_calls_decoy == str(decoy_scope == "global")  # the linker's order, as seen
    assert used == torchs


def test_openmp_settings_that_bind_nothing_leave_a_narrowed_mask_the_processs():
    """OMP_PLACES of blanks alone, or of words libgomp does not know, and an OMP_PROC_BIND it
    does not know are invalid to libgomp, which then binds nothing, and so is any OMP_PLACES or
    GOMP_CPU_AFFINITY under OMP_PROC_BIND=false: a mask the process narrowed itself (here to one
    CPU, before torch loads) is its own, not OpenMP's binding, and pinxfer's copy threads keep
    to it. pinxfer used to take any non-empty OMP_PLACES, and any value with
    OMP_PROC_BIND=false, for a binding and spread its copy threads over the whole cpuset (found
    by review, sessions 46 and 47); until session 50 it read the variables itself and took the
    unparsable ones for a binding (it now asks libgomp, csrc/runtime/libgomp.h)."""
    code = (
        textwrap.dedent("""
            import os
            os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
            import torch, pinxfer
        """)
        + _COPY_THREAD_CPUS
        + 'print("RESULT", max(masks, default=0), threads)  # 0: no copy threads but this one\n'
    )
    unset = {"OMP_PROC_BIND": None, "OMP_PLACES": None, "GOMP_CPU_AFFINITY": None}
    cases = [
        {"OMP_PLACES": " \t "},
        {"OMP_PROC_BIND": " False", "OMP_PLACES": "cores"},
        {"OMP_PROC_BIND": "false", "GOMP_CPU_AFFINITY": "0"},
    ]
    if _torch_openmp_is_libgomp():  # values only libgomp's own parser tells from a binding
        cases += [
            {"OMP_PLACES": "cores-please"},
            {"OMP_PLACES": "{0},{1}x"},
            {"OMP_PROC_BIND": "tightly"},
        ]
    for env in cases:
        out = run_child(code, env={**unset, **env, "PINXFER_NUM_THREADS": None})
        assert out.returncode == 0, (env, out.stdout + out.stderr)
        worker_cpus, threads = out.stdout.split("RESULT ", 1)[1].split(" ", 1)
        assert "OpenMP's binding" not in threads, (env, threads)
        assert int(worker_cpus) <= 1, (env, worker_cpus)


def test_derived_threads_follow_local_world_size_and_affinity():
    code = """
        import os, torch, pinxfer
        names, values, _, _ = zip(*pinxfer._C.settings())
        print(dict(zip(names, values))["PINXFER_NUM_THREADS"])
    """
    alone = run_fresh(code)
    shared = run_fresh(code, LOCAL_WORLD_SIZE="2")
    assert alone.returncode == 0 and shared.returncode == 0, alone.stderr + shared.stderr
    cpus = len(os.sched_getaffinity(0))
    expected_alone, _ = native.copy_threads_for(cpus, os.cpu_count(), 0.0, 1)
    assert alone.stdout.startswith(f"{expected_alone} (")
    if cpus >= os.cpu_count() and cpus >= 2:
        assert "LOCAL_WORLD_SIZE=2" in shared.stdout


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        ("PINXFER_NUM_THREADS", "many", "an integer from 1 to"),
        ("PINXFER_NUM_THREADS", "0", "an integer from 1 to"),
        # Issue 27: values past int were truncated (4294967297 -> 1 thread).
        ("PINXFER_NUM_THREADS", "4294967297", "an integer from 1 to"),
        ("PINXFER_NUM_THREADS", "100000", "an integer from 1 to"),
        ("PINXFER_SPIN_US", "-5", "an integer from 0 to 1000000"),
        ("PINXFER_SPIN_US", "4294967396", "an integer from 0 to 1000000"),
        ("PINXFER_MAX_PINNED_BYTES", "lots", "a byte size"),
        # Issue 27: a fraction of a byte silently meant "no cap".
        ("PINXFER_MAX_PINNED_BYTES", "0.5", "a byte size"),
        ("PINXFER_MAX_PINNED_BYTES", "1.5", "a byte size"),
        ("PINXFER_STAGE_COPY", "fast", "expected 'auto', 'nt'"),
        ("PINXFER_TORCH_TEAM", "on", "expected 'auto' \\(on torch's team"),
        ("PINXFER_TEAM_PROBE", "stat", "expected 'proc' \\(the default: read one member"),
        ("PINXFER_IDLE_RECLAIM", "on", "expected 'auto' \\(one stream query"),
        ("PINXFER_SENDER_LANDING", "host", "expected 'auto' \\(the default: a host function"),
        ("PINXFER_SENDER_WORKERS", "0", "an integer from 1 to 4"),
        ("PINXFER_SENDER_OUTPUTS", "caller", "expected 'worker' \\(the sender's worker"),
        ("PINXFER_SENDER_WORKERS", "two", "an integer from 1 to 4"),
        ("PINXFER_H2D_READ", "dma", "expected 'auto' \\(the default: a kernel reads them"),
        ("PINXFER_DISABLE_CUDA", "yes", "1 \\(never touch CUDA\\) or 0"),
        ("PINXFER_NUMA_NODE", "first", "an integer from 0 to"),
        # Issue 27: 2^32 was read as node 0 while settings() showed 4294967296.
        ("PINXFER_NUMA_NODE", "4294967296", "an integer from 0 to"),
        ("PINXFER_NUMA_NODE", "-5", "an integer from 0 to"),
        # Session 43: a mistyped root read as "no NUMA nodes", every pool unbound.
        ("PINXFER_SYSFS_ROOT", "/no/such/sysfs", "a sysfs tree"),
    ],
)
def test_malformed_variable_is_a_clear_error_at_every_call(name, value, expected):
    out = run_fresh(
        """
        import torch, pinxfer
        for _ in range(2):
            try:
                pinxfer._C.settings()
            except ValueError as e:
                print("ERROR", e)
            else:
                print("NO ERROR")
    """,
        **{name: value},
    )
    assert out.returncode == 0, out.stderr
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith(("ERROR", "NO ERROR"))]
    assert len(lines) == 2 and all(ln.startswith("ERROR") for ln in lines), out.stdout
    import re

    assert name in lines[0] and f"'{value}'" in lines[0] and re.search(expected, lines[0])
    assert "unset it" in lines[0]


def test_cuda_unusable_reason_is_one_answer():
    out = run_fresh(
        """
        import torch, pinxfer
        print(pinxfer._C.cuda_unusable_reason())
    """,
        PINXFER_DISABLE_CUDA="1",
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "PINXFER_DISABLE_CUDA=1 is set"
    reason = native.cuda_unusable_reason()
    assert (reason is None) == pinxfer.build_info().cuda_usable


# ---- chunk planning (transfer/chunk_plan.h) ----


@pytest.mark.parametrize(
    ("staging", "cached_tail", "nbytes", "expected"),
    [
        ("auto", -1, 4096, "nt"),  # a page: the copy is short, the DMA's read of it is not
        ("auto", -1, 4097, "movsb"),
        ("auto", -1, 256 << 10, "movsb"),
        ("nt", -1, 256 << 10, "nt"),  # the op's argument decides
        ("movsb", -1, 4096, "movsb"),
        ("auto", 0, 4096, "movsb"),  # a cached tail given: the pipeline's rule
        ("auto", 16 << 20, 256 << 10, "nt"),
    ],
)
def test_the_small_roads_stores_follow_its_rule_and_the_callers_choices(
    staging, cached_tail, nbytes, expected
):
    """The caller's copy of a small pageable to_device (<= 256 KiB) stages with cached stores
    above a page under "auto" (session 50: its source is cold in a loop); the op's staging
    argument and a cached tail keep their meaning."""
    if os.environ.get("PINXFER_STAGE_COPY") or os.environ.get("PINXFER_CACHED_TAIL"):
        pytest.skip("this process's PINXFER_STAGE_COPY / PINXFER_CACHED_TAIL decide 'auto'")
    assert native._small_copy_kind(staging, cached_tail, nbytes) == expected


@pytest.mark.parametrize("kind", ["nt", "movsb"])
@pytest.mark.parametrize("placed", [None, "dram", "cache"])
@pytest.mark.parametrize(
    ("nbytes", "dst_offset", "src_offset"),
    [(100, 0, 0), (4096 + 17, 3, 5), ((1 << 20) + 129, 31, 0), (8192, 0, 63)],
)
def test_a_staging_copy_writes_every_byte_whatever_the_stores_and_alignment(
    kind, placed, nbytes, dst_offset, src_offset
):
    """transfer::stage_copy, timed alone by the diagnostic _stage_copy_ns: each kind of stores
    copies every byte, at any alignment of either side (the nontemporal loop aligns the
    destination with a memcpy head and copies the tail apart), and writes nothing past the end;
    placing either side's lines first (_place_cache_lines) changes no byte."""
    src = torch.randint(0, 256, (nbytes + src_offset,), dtype=torch.uint8)[src_offset:]
    dst_whole = torch.zeros(nbytes + dst_offset + 64, dtype=torch.uint8)
    dst = dst_whole[dst_offset : dst_offset + nbytes]
    expected = src.clone()
    if placed is not None:
        native._place_cache_lines(src, placed)
        native._place_cache_lines(dst, placed)
    ns = native._stage_copy_ns(dst, src, kind)
    assert ns > 0
    assert torch.equal(dst, expected) and torch.equal(src, expected)
    assert not dst_whole[:dst_offset].any() and not dst_whole[dst_offset + nbytes :].any()


def test_a_timed_staging_copy_refuses_what_it_cannot_copy():
    """The staging diagnostics say what they expected: contiguous CPU tensors, of equal bytes
    and apart for a copy, and a kind of stores ('auto' is a policy, not a kind)."""
    a, b = torch.zeros(64, dtype=torch.uint8), torch.zeros(32, dtype=torch.uint8)
    with pytest.raises(ValueError, match="same bytes, got 64 and 32"):
        native._stage_copy_ns(a, b, "nt")
    with pytest.raises(ValueError, match="expected kind 'nt' or 'movsb', got 'auto'"):
        native._stage_copy_ns(a, a.clone(), "auto")
    with pytest.raises(ValueError, match="expected dst and src not to overlap"):
        native._stage_copy_ns(a[:32], a[16:48], "movsb")
    strided = torch.zeros(64, dtype=torch.uint8)[::2]
    with pytest.raises(ValueError, match="expected src contiguous"):
        native._stage_copy_ns(b, strided, "nt")
    with pytest.raises(ValueError, match="expected tensor contiguous"):
        native._place_cache_lines(strided, "dram")
    with pytest.raises(ValueError, match=r"expected where 'dram' .* or 'cache'"):
        native._place_cache_lines(a, "l3")
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="expected dst on the CPU"):
            native._stage_copy_ns(a.cuda(), a, "nt")


@pytest.mark.parametrize(
    ("env", "expected"),
    [({"PINXFER_STAGE_COPY": "nt"}, "nt"), ({"PINXFER_CACHED_TAIL": "16MiB"}, "nt"), ({}, "movsb")],
)
def test_the_small_roads_stores_follow_the_environment(env, expected):
    """PINXFER_STAGE_COPY and PINXFER_CACHED_TAIL, read once a process, override "auto" there
    as in the pipeline."""
    code = 'import pinxfer; print("KIND", pinxfer._C._small_copy_kind("auto", -1, 256 << 10))'
    out = run_fresh(code, **env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"KIND {expected}" in out.stdout, out.stdout


@pytest.mark.parametrize(
    "nbytes",
    [
        1,
        4095,
        4096,
        256 << 10,
        (256 << 10) + 1,
        3 * MiB + 7,
        40 * MiB + 3,
        64 * MiB,
        1 << 30,
        (1 << 30) + 12345,
    ],
)
@pytest.mark.parametrize(
    ("chunk_bytes", "num_buffers"), [(16 * MiB, 4), (4096, 1), (70_001, 3), (5 * MiB + 13, 2)]
)
@pytest.mark.parametrize("threads", [1, 3, 12])
def test_chunk_plan_covers_every_byte_once(nbytes, chunk_bytes, num_buffers, threads):
    bounds, flat, ring, slot_bytes, used_threads = native._chunk_plan(
        nbytes, chunk_bytes, num_buffers, threads
    )
    assert bounds[0] == 0 and bounds[-1] == nbytes
    assert all(a < b for a, b in itertools.pairwise(bounds))
    assert all(b % 4096 == 0 for b in bounds[1:-1])
    pieces = [tuple(flat[i : i + 3]) for i in range(0, len(flat), 3)]
    # Pieces are in chunk order, each inside its chunk, and tile the tensor exactly.
    pos = 0
    for chunk, begin, end in pieces:
        assert begin == pos and begin < end
        assert bounds[chunk] <= begin and end <= bounds[chunk + 1]
        pos = end
    assert pos == nbytes
    assert [c for c, _, _ in pieces] == sorted(c for c, _, _ in pieces)
    chunks = len(bounds) - 1
    if nbytes <= 256 << 10:
        assert chunks == 1 and len(pieces) == 1 and used_threads == 1
    if ring:
        assert ring == num_buffers and chunks > num_buffers
        assert slot_bytes == max(b - a for a, b in itertools.pairwise(bounds))
    else:
        assert slot_bytes == 0
        assert nbytes <= chunk_bytes * num_buffers or chunks <= num_buffers
    assert 1 <= used_threads <= max(1, min(threads, len(pieces)))


def test_chunk_plan_ramps_up_and_down():
    bounds, *_ = native._chunk_plan(1 << 30, 16 * MiB, 4, 12)
    sizes = [b - a for a, b in itertools.pairwise(bounds)]
    assert sizes[0] == sizes[-1] == 256 << 10
    assert max(sizes) == 16 * MiB
    assert sizes[:4] == [256 << 10, 512 << 10, 1 * MiB, 2 * MiB]


def test_chunk_plan_rejects_bad_arguments():
    with pytest.raises(ValueError, match="chunk_bytes >= 4096"):
        native._chunk_plan(MiB, 1000, 4, 1)


# ---- idle copy threads ----


def test_idle_copy_threads_use_no_cpu():
    """After a threaded copy the workers spin for PINXFER_SPIN_US, then sleep: over one
    second of idle the whole process uses a few milliseconds of CPU, not the seconds that
    workers spinning on (or polling) would burn. Checked in a fresh process whose copy
    threads are forced to 2, so the pool has a worker even on a 1-CPU runner."""
    out = run_fresh(
        """
        import resource, time, torch, pinxfer
        def cpu():
            r = resource.getrusage(resource.RUSAGE_SELF)
            return r.ru_utime + r.ru_stime
        x = torch.randn(16 << 20)
        for _ in range(3):
            assert torch.equal(pinxfer.pin_memory(x), x)  # threaded copies wake the workers
        c0 = cpu()
        time.sleep(1.0)
        print("IDLE_CPU", cpu() - c0)
    """,
        PINXFER_NUM_THREADS="2",
    )
    assert out.returncode == 0, out.stderr
    idle = float(out.stdout.split("IDLE_CPU", 1)[1].split()[0])
    # A worker that never sleeps would use ~1 s here; the spin before sleeping is 100 us.
    assert idle < 0.25, f"idle copy threads used {idle:.3f} s of CPU in 1 s"
