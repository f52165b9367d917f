"""Topology: GPU -> NUMA node -> CPUs, read from fake sysfs trees and the real one.

Each fixture tree is checked through the Python API (pinxfer.topology /
numa_nodes) and through the C++ ops the pools and thread pools use.
"""

from __future__ import annotations

import json
import os
import random
import textwrap
from pathlib import Path

import pytest
import torch

import pinxfer
from pinxfer.topology import GpuTopology, parse_cpulist

from .conftest import requires_cuda, run_child

native = pinxfer._C


def make_tree(
    root: Path, nodes: dict[int, str | None], gpus: dict[str, str | None] | None = None
) -> str:
    """A sysfs tree: nodes {n: cpulist text or None (file missing)}, PCI devices
    {bus id: numa_node text or None (file missing)}. Also the non-node entries a
    real /sys/devices/system/node holds, which must be ignored."""
    node_dir = root / "devices" / "system" / "node"
    node_dir.mkdir(parents=True, exist_ok=True)
    for name in ("possible", "online", "has_cpu", "has_memory"):
        (node_dir / name).write_text("0\n")
    (node_dir / "power").mkdir(exist_ok=True)
    for n, cpulist in nodes.items():
        d = node_dir / f"node{n}"
        d.mkdir()
        if cpulist is not None:
            (d / "cpulist").write_text(cpulist + "\n")
    for bus_id, numa in (gpus or {}).items():
        d = root / "bus" / "pci" / "devices" / bus_id
        d.mkdir(parents=True)
        if numa is not None:
            (d / "numa_node").write_text(numa + "\n")
    return str(root)


def reference_cpulist(text: str) -> list[int]:
    """An independent parser to check the C++ one against."""
    out = set()
    for item in text.strip().split(","):
        if not item:
            continue
        lo, _, hi = item.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return sorted(out)


# ---- parse_cpulist ----


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", [0]),
        ("0-3", [0, 1, 2, 3]),
        ("0-3,8,10-11", [0, 1, 2, 3, 8, 10, 11]),
        ("0-1,64-65\n", [0, 1, 64, 65]),
        ("", []),
        ("\n", []),
        ("3,1,2,1", [1, 2, 3]),
        (" 0-3, 8 ,10 - 11\n", [0, 1, 2, 3, 8, 10, 11]),  # blanks around items and ids
    ],
)
def test_parse_cpulist(text, expected):
    assert parse_cpulist(text) == expected
    assert list(native.parse_cpulist(text)) == expected


def test_parse_cpulist_matches_reference_on_random_lists():
    rng = random.Random(3)
    for _ in range(200):
        items = []
        for _ in range(rng.randint(1, 6)):
            lo = rng.randint(0, 255)
            items.append(f"{lo}-{lo + rng.randint(0, 31)}" if rng.random() < 0.5 else str(lo))
        text = ",".join(items)
        assert parse_cpulist(text) == reference_cpulist(text), text


@pytest.mark.parametrize(
    "text",
    # "0 1" and "1 0-3": blanks inside an item were dropped, reading CPU 1 and 10-3 (found by
    # review, session 44).
    ["a", "0-", "-3", "3-1", "0-3,x", "1.5", "0--2", "0,,3", ",1", "0-999999999", "0 1", "1 0-3"],
)
def test_parse_cpulist_malformed_raises_value_error(text):
    with pytest.raises(ValueError, match="malformed CPU list"):
        parse_cpulist(text)


# ---- fixture trees ----


def test_two_nodes_gpus_on_different_nodes(tmp_path):
    root = make_tree(
        tmp_path, {0: "0-7,16-23", 1: "8-15,24-31"}, {"0000:1b:00.0": "0", "0000:9a:00.0": "1"}
    )
    assert pinxfer.numa_nodes(root) == {
        0: list(range(8)) + list(range(16, 24)),
        1: list(range(8, 16)) + list(range(24, 32)),
    }
    topo = pinxfer.topology(root, pci_bus_ids=["0000:1b:00.0", "0000:9a:00.0"])
    assert topo == [
        GpuTopology(0, "0000:1b:00.0", 0, tuple(range(8)) + tuple(range(16, 24))),
        GpuTopology(1, "0000:9a:00.0", 1, tuple(range(8, 16)) + tuple(range(24, 32))),
    ]
    # The C++ paths placement uses give the same answers.
    assert list(native.online_nodes(root)) == [0, 1]
    assert native.pci_numa_node("0000:9a:00.0", root) == 1
    assert list(native.node_cpus(1, root)) == list(topo[1].cpus)


def test_cuda_style_bus_ids_resolve(tmp_path):
    # CUDA reports an 8-digit domain and upper-case hex; sysfs uses 4 digits, lower case.
    root = make_tree(tmp_path, {0: "0-3", 1: "4-7"}, {"0000:9a:00.0": "1"})
    assert native.pci_numa_node("00000000:9A:00.0", root) == 1
    assert pinxfer.topology(root, pci_bus_ids=["00000000:9A:00.0"])[0].numa_node == 1


def test_four_nodes(tmp_path):
    nodes = {n: f"{4 * n}-{4 * n + 3},{16 + 4 * n}-{16 + 4 * n + 3}" for n in range(4)}
    gpus = {f"0000:{0x10 * (g + 1):02x}:00.0": str(g // 2 * 2 + 1) for g in range(4)}
    root = make_tree(tmp_path, nodes, gpus)
    got = pinxfer.numa_nodes(root)
    assert sorted(got) == [0, 1, 2, 3]
    for n in range(4):
        assert got[n] == reference_cpulist(nodes[n])
    topo = pinxfer.topology(root, pci_bus_ids=list(gpus))
    assert [g.numa_node for g in topo] == [1, 1, 3, 3]
    assert topo[2].cpus == tuple(reference_cpulist(nodes[3]))
    assert [g.index for g in topo] == [0, 1, 2, 3]


def test_numa_node_minus_one_means_no_binding(tmp_path):
    root = make_tree(tmp_path, {0: "0-15"}, {"0000:1b:00.0": "-1"})
    (g,) = pinxfer.topology(root, pci_bus_ids=["0000:1b:00.0"])
    assert g.numa_node == -1 and g.cpus == ()
    assert native.pci_numa_node("0000:1b:00.0", root) == -1
    assert list(native.node_cpus(-1, root)) == []


def test_missing_files(tmp_path):
    root = make_tree(tmp_path, {0: "0-3", 1: None}, {"0000:1b:00.0": None, "0000:2b:00.0": "1"})
    # numa_node file missing, device missing entirely: unknown.
    assert native.pci_numa_node("0000:1b:00.0", root) == -1
    assert native.pci_numa_node("0000:ff:00.0", root) == -1
    # Node present but its cpulist missing: no CPUs (threads are left unbound).
    assert pinxfer.numa_nodes(root) == {0: [0, 1, 2, 3], 1: []}
    topo = pinxfer.topology(root, pci_bus_ids=["0000:1b:00.0", "0000:2b:00.0"])
    assert [(g.numa_node, g.cpus) for g in topo] == [(-1, ()), (1, ())]
    # No node directory at all.
    empty = tmp_path / "empty"
    empty.mkdir()
    assert pinxfer.numa_nodes(str(empty)) == {}
    assert list(native.node_cpus(0, str(empty))) == []


def test_malformed_numa_node_reads_unknown(tmp_path):
    root = make_tree(tmp_path, {0: "0-3"}, {"0000:1b:00.0": "banana"})
    assert native.pci_numa_node("0000:1b:00.0", root) == -1


def test_malformed_cpulist_names_the_file(tmp_path):
    root = make_tree(tmp_path, {0: "0-3", 1: "4-x"}, {"0000:1b:00.0": "1"})
    with pytest.raises(ValueError, match=r"node1/cpulist"):
        pinxfer.numa_nodes(root)
    with pytest.raises(ValueError, match=r"malformed CPU list '4-x'"):
        pinxfer.topology(root, pci_bus_ids=["0000:1b:00.0"])
    with pytest.raises(ValueError, match="malformed CPU list"):
        native.node_cpus(1, root)


def test_env_sysfs_root_is_the_cpp_default(tmp_path):
    # Settings are read once per process (runtime/settings.h), so each root is
    # checked in a fresh process.
    root = make_tree(tmp_path, {0: "0-1", 5: "2-3"})
    code = (
        "import torch, pinxfer; native = pinxfer._C; "
        "print(repr(native.sysfs_root()), pinxfer.numa_nodes())"
    )
    for root_setting, expected in (
        (root, f"{root!r} {{0: [0, 1], 5: [2, 3]}}"),
        (None, "'/sys'"),
    ):
        out = run_child(code, env={"PINXFER_SYSFS_ROOT": root_setting})
        assert out.returncode == 0, out.stdout + out.stderr
        assert out.stdout.startswith(expected), out.stdout


# ---- the real machine ----


def test_real_machine_has_node0_with_our_cpus():
    nodes = pinxfer.numa_nodes("/sys")
    assert 0 in nodes
    all_cpus = set().union(*map(set, nodes.values()))
    assert set(os.sched_getaffinity(0)) <= all_cpus


def test_topology_lists_visible_gpus():
    topo = pinxfer.topology()
    assert len(topo) == int(native.cuda_device_count())
    if not pinxfer.build_info().cuda_usable:
        assert topo == []


# A fresh process that starts the copy-thread pool of node 0, then of node 1, and prints
# the CPUs each new worker thread may run on (its Cpus_allowed_list). pin_memory to a
# node starts that node's pool; on a host without that real node the pool memory's
# mbind fails with one warning and the memory is placed by the default policy, which
# this test does not look at.
_POOL_WORKERS = textwrap.dedent("""
    import json, os, torch, pinxfer
    from pinxfer.topology import parse_cpulist

    def threads():
        out = {}
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/status") as f:
                    out[tid] = next(l.split()[1] for l in f if l.startswith("Cpus_allowed_list:"))
            except FileNotFoundError:
                pass  # a thread that just exited
        return out

    t = torch.randn(4 << 20)  # 16 MiB: a threaded copy
    assert torch.equal(t, t.clone())  # torch's own intra-op threads start here, not below
    workers = {}
    for node in (0, 1):
        before = threads()
        pinned = pinxfer.pin_memory(t, numa_node=node)
        workers[node] = [parse_cpulist(cpus) for tid, cpus in threads().items()
                         if tid not in before]
        assert torch.equal(pinned, t)
    print("WORKERS", json.dumps(workers))
""")


def _pool_workers(
    root: str, total_threads: int, affinity: list[int] | None = None
) -> dict[int, list[list[int]]]:
    env = {
        "PINXFER_SYSFS_ROOT": root,
        "PINXFER_NUM_THREADS": str(total_threads),
        "PINXFER_DISABLE_CUDA": "1",
        # The copies must run on the node pools' workers under test: with torch's intra-op
        # team still spinning from the clone below, 'auto' may copy on that team instead and
        # start no worker (once on a loaded 16-core GPU host, 2026-11-27).
        "PINXFER_TORCH_TEAM": "off",
        "PINXFER_NUMA_NODE": None,
    }
    preexec = None if affinity is None else (lambda: os.sched_setaffinity(0, affinity))
    out = run_child(_POOL_WORKERS, env=env, preexec_fn=preexec)
    assert out.returncode == 0, out.stdout + out.stderr
    workers = out.stdout.split("WORKERS", 1)[1].strip().splitlines()[0]
    return {int(node): w for node, w in json.loads(workers).items()}


def _two_node_tree(tmp_path) -> tuple[str, list[int], list[int]]:
    """A fixture tree that splits this process's CPUs into nodes 0 and 1 (on a 2-CPU
    host: node0 = {0}, node1 = {1})."""
    mine = sorted(os.sched_getaffinity(0))
    if len(mine) < 2:
        pytest.skip("needs 2 CPUs in the affinity mask to make two nodes")
    node0, node1 = mine[: len(mine) // 2], mine[len(mine) // 2 :]
    root = make_tree(tmp_path, {0: ",".join(map(str, node0)), 1: ",".join(map(str, node1))})
    return root, node0, node1


def test_node_pools_split_one_budget_on_their_cpus(tmp_path):
    """Two nodes over this process's CPUs, PINXFER_NUM_THREADS=6 for the whole process:
    each node's pool runs its share (3 of 6 where the nodes are equal; the pool counts
    the caller, so 2 workers), each worker bound to exactly its node's CPUs. Before
    issue 11 each pool ran the whole 6."""
    root, node0, node1 = _two_node_tree(tmp_path)
    mine = node0 + node1
    workers = _pool_workers(root, 6)
    for node, cpus in ((0, node0), (1, node1)):
        threads, bound = pinxfer._ops._node_pool_plan(6, cpus, mine, True)
        assert bound == cpus
        assert workers[node] == [cpus] * (threads - 1), workers
    if len(node0) == len(node1):
        assert len(workers[0]) == len(workers[1]) == 2


def test_node_pool_stays_on_the_process_cpus(tmp_path):
    """The process may run on node 0's CPUs only (as under taskset): node 0's pool runs
    the whole budget there, and node 1's pool, whose CPUs the process may not use, is
    not bound to them: its workers stay on the process's CPUs. Before issue 11 they
    were moved onto node 1's CPUs."""
    root, node0, _node1 = _two_node_tree(tmp_path)
    workers = _pool_workers(root, 4, affinity=node0)
    assert workers[0] == [node0] * 3, workers
    assert workers[1] == [node0] * 3, workers


# ---- GPU ----


@pytest.mark.gpu
@requires_cuda
def test_topology_matches_torch_bus_ids():
    topo = pinxfer.topology()
    assert len(topo) == torch.cuda.device_count()
    for g in topo:
        props = torch.cuda.get_device_properties(g.index)
        domain, bus, dev_fn = g.pci_bus_id.lower().split(":")
        assert int(domain, 16) == props.pci_domain_id
        assert int(bus, 16) == props.pci_bus_id
        assert int(dev_fn.split(".")[0], 16) == props.pci_device_id
        assert g.numa_node == native.pci_numa_node(g.pci_bus_id, "/sys")
        if g.numa_node >= 0:
            assert list(g.cpus) == list(native.node_cpus(g.numa_node, "/sys"))


def test_node_and_device_numbers_out_of_int_range_are_refused(tmp_path):
    """2**32 was cast to 0: node_cpus answered node 0's CPUs for it."""
    root = make_tree(tmp_path, {0: "0-1"})
    with pytest.raises(ValueError, match="out of range"):
        native.node_cpus(2**32, root)
    with pytest.raises(ValueError, match="out of range"):
        native.numa_node_for_device(2**32)


@pytest.mark.gpu
@requires_cuda
def test_a_gpu_on_a_node_the_machine_does_not_have_is_unbound(tmp_path):
    """A VM's firmware may give a GPU any numa_node. One that is not a node of the machine
    is read as -1 (unbound), with one warning, instead of a pool built for it (found by
    review, session 43)."""
    bus_id = native.cuda_pci_bus_id(0).lower()
    domain, _, rest = bus_id.partition(":")
    bus_id = f"{domain[-4:]}:{rest}"  # sysfs's 4-digit domain (CUDA reports 8)
    root = make_tree(tmp_path, {0: "0-1"}, {bus_id: "7"})
    code = textwrap.dedent("""
        import warnings, torch, pinxfer
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            node = pinxfer._C.numa_node_for_device(0)
            t = pinxfer.empty(1 << 20, dtype=torch.uint8)
        print("NODE", node, sum("does not have" in str(w.message) for w in caught))
    """)
    out = run_child(code, env={"PINXFER_SYSFS_ROOT": root, "PINXFER_NUMA_NODE": None})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "NODE -1 1" in out.stdout, out.stdout + out.stderr
