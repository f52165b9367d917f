"""Topology: GPU -> NUMA node -> CPUs, read from fake sysfs trees and the real one.

Each fixture tree is checked through the Python API (pinxfer.topology /
numa_nodes) and through the C++ ops the pools and thread pools use.
"""
from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Optional

import pytest
import torch

import pinxfer
from pinxfer.topology import GpuTopology, parse_cpulist

from .conftest import requires_cuda

ops = torch.ops.pinxfer


def make_tree(root: Path, nodes: dict[int, Optional[str]],
              gpus: dict[str, Optional[str]] = None) -> str:
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

@pytest.mark.parametrize("text,expected", [
    ("0", [0]),
    ("0-3", [0, 1, 2, 3]),
    ("0-3,8,10-11", [0, 1, 2, 3, 8, 10, 11]),
    ("0-1,64-65\n", [0, 1, 64, 65]),
    ("", []),
    ("\n", []),
    ("3,1,2,1", [1, 2, 3]),
])
def test_parse_cpulist(text, expected):
    assert parse_cpulist(text) == expected
    assert list(ops.parse_cpulist(text)) == expected


def test_parse_cpulist_matches_reference_on_random_lists():
    rng = random.Random(3)
    for _ in range(200):
        items = []
        for _ in range(rng.randint(1, 6)):
            lo = rng.randint(0, 255)
            items.append(f"{lo}-{lo + rng.randint(0, 31)}" if rng.random() < 0.5 else str(lo))
        text = ",".join(items)
        assert parse_cpulist(text) == reference_cpulist(text), text


@pytest.mark.parametrize("text", ["a", "0-", "-3", "3-1", "0-3,x", "1.5", "0--2"])
def test_parse_cpulist_malformed_raises_value_error(text):
    with pytest.raises(ValueError, match="malformed CPU list"):
        parse_cpulist(text)


# ---- fixture trees ----

def test_two_nodes_gpus_on_different_nodes(tmp_path):
    root = make_tree(tmp_path, {0: "0-7,16-23", 1: "8-15,24-31"},
                     {"0000:1b:00.0": "0", "0000:9a:00.0": "1"})
    assert pinxfer.numa_nodes(root) == {0: list(range(0, 8)) + list(range(16, 24)),
                                        1: list(range(8, 16)) + list(range(24, 32))}
    topo = pinxfer.topology(root, pci_bus_ids=["0000:1b:00.0", "0000:9a:00.0"])
    assert topo == [
        GpuTopology(0, "0000:1b:00.0", 0, tuple(range(0, 8)) + tuple(range(16, 24))),
        GpuTopology(1, "0000:9a:00.0", 1, tuple(range(8, 16)) + tuple(range(24, 32))),
    ]
    # The C++ paths placement uses give the same answers.
    assert list(ops.online_nodes(root)) == [0, 1]
    assert ops.pci_numa_node("0000:9a:00.0", root) == 1
    assert list(ops.node_cpus(1, root)) == list(topo[1].cpus)


def test_cuda_style_bus_ids_resolve(tmp_path):
    # CUDA reports an 8-digit domain and upper-case hex; sysfs uses 4 digits, lower case.
    root = make_tree(tmp_path, {0: "0-3", 1: "4-7"}, {"0000:9a:00.0": "1"})
    assert ops.pci_numa_node("00000000:9A:00.0", root) == 1
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
    assert ops.pci_numa_node("0000:1b:00.0", root) == -1
    assert list(ops.node_cpus(-1, root)) == []


def test_missing_files(tmp_path):
    root = make_tree(tmp_path, {0: "0-3", 1: None},
                     {"0000:1b:00.0": None, "0000:2b:00.0": "1"})
    # numa_node file missing, device missing entirely: unknown.
    assert ops.pci_numa_node("0000:1b:00.0", root) == -1
    assert ops.pci_numa_node("0000:ff:00.0", root) == -1
    # Node present but its cpulist missing: no CPUs (threads are left unbound).
    assert pinxfer.numa_nodes(root) == {0: [0, 1, 2, 3], 1: []}
    topo = pinxfer.topology(root, pci_bus_ids=["0000:1b:00.0", "0000:2b:00.0"])
    assert [(g.numa_node, g.cpus) for g in topo] == [(-1, ()), (1, ())]
    # No node directory at all.
    empty = tmp_path / "empty"
    empty.mkdir()
    assert pinxfer.numa_nodes(str(empty)) == {}
    assert list(ops.node_cpus(0, str(empty))) == []


def test_malformed_numa_node_reads_unknown(tmp_path):
    root = make_tree(tmp_path, {0: "0-3"}, {"0000:1b:00.0": "banana"})
    assert ops.pci_numa_node("0000:1b:00.0", root) == -1


def test_malformed_cpulist_names_the_file(tmp_path):
    root = make_tree(tmp_path, {0: "0-3", 1: "4-x"}, {"0000:1b:00.0": "1"})
    with pytest.raises(ValueError, match=r"node1/cpulist"):
        pinxfer.numa_nodes(root)
    with pytest.raises(ValueError, match=r"malformed CPU list '4-x'"):
        pinxfer.topology(root, pci_bus_ids=["0000:1b:00.0"])
    with pytest.raises(ValueError):
        ops.node_cpus(1, root)


def test_env_sysfs_root_is_the_cpp_default(tmp_path):
    # Settings are read once per process (runtime/settings.h), so each root is
    # checked in a fresh process.
    root = make_tree(tmp_path, {0: "0-1", 5: "2-3"})
    code = ("import torch, pinxfer; ops = torch.ops.pinxfer; "
            "print(repr(ops.sysfs_root()), pinxfer.numa_nodes())")
    repo = str(Path(__file__).resolve().parent.parent)
    env = {k: v for k, v in os.environ.items() if k != "PINXFER_SYSFS_ROOT"}
    for extra, expected in (({"PINXFER_SYSFS_ROOT": root}, f"{root!r} {{0: [0, 1], 5: [2, 3]}}"),
                            ({}, "'/sys'")):
        out = subprocess.run([sys.executable, "-c", code], env={**env, **extra}, cwd=repo,
                             capture_output=True, text=True)
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
    assert len(topo) == int(ops.cuda_device_count())
    if not pinxfer.build_info().cuda_usable:
        assert topo == []


def test_copy_workers_are_bound_to_the_node_cpus(tmp_path):
    """A fixture tree that gives node 0 only CPU 0: the node-0 thread pool's
    workers must run with affinity {0}. Checked in a fresh process, whose
    pools are built under that tree."""
    root = make_tree(tmp_path, {0: "0"})
    code = textwrap.dedent("""
        import os, torch, pinxfer
        t = torch.randn(4 << 20)
        p = pinxfer.pin_memory(t, numa_node=0)
        assert torch.equal(p, t)
        me = os.getpid()
        bound = []
        for tid in os.listdir(f"/proc/{me}/task"):
            with open(f"/proc/{me}/task/{tid}/status") as f:
                for line in f:
                    if line.startswith("Cpus_allowed_list:"):
                        bound.append(line.split()[1])
        print("AFFINITIES", bound)
        assert "0" in bound, bound
    """)
    env = dict(os.environ, PINXFER_SYSFS_ROOT=root, PINXFER_NUM_THREADS="3",
               PINXFER_DISABLE_CUDA="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         cwd=str(Path(__file__).resolve().parent.parent))
    assert out.returncode == 0, out.stdout + out.stderr
    # Two workers bound to CPU 0 (the pool of 3 counts the caller, which stays free).
    affinities = eval(out.stdout.split("AFFINITIES", 1)[1].strip().splitlines()[0])
    assert affinities.count("0") >= 2


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
        assert g.numa_node == ops.pci_numa_node(g.pci_bus_id, "/sys")
        if g.numa_node >= 0:
            assert list(g.cpus) == list(ops.node_cpus(g.numa_node, "/sys"))
