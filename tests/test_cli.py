"""The pinxfer command (bench, doctor) and the examples.

CPU tests run the real commands as subprocesses and read doctor's report from
fixture sysfs/proc trees. GPU tests (``gpu`` marker) run bench, doctor and
every example on the device.
"""

from __future__ import annotations

import importlib.util
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pinxfer
from pinxfer.cli import bench as _bench
from pinxfer.cli import doctor as _doctor
from pinxfer.topology import parse_cpulist

HAS_CUDA = pinxfer.cuda_unavailable_reason() is None

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ["train_loop.py", "dataloader_workers.py", "lightning_hook.py", "ddp_torchrun.py"]
RESULT_KEYS = {"section", "op", "impl", "bytes", "seconds", "gbps"}
RATIO_KEYS = {"section", "op", "bytes", "torch_seconds", "pinxfer_seconds", "speedup"}


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    for name in _doctor.env_vars():
        env.pop(name, None)
    env.update(extra)
    return env


def _run(
    args: list[str], timeout: float = 300, preexec_fn=None, **env: str
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env=_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=preexec_fn,
    )


def _check_bench_json(data: dict) -> None:
    assert set(data) == {"device", "torch", "pinxfer", "date", "results", "ratios", "skipped"}
    assert data["torch"] == torch.__version__ and data["pinxfer"] == pinxfer.__version__
    assert data["date"][:4].isdigit() and "T" in data["date"]
    for r in data["results"]:
        assert RESULT_KEYS <= set(r) <= RESULT_KEYS | {"note"}
        assert r["impl"] in ("torch", "pinxfer", "ideal")
        assert r["seconds"] > 0 and r["bytes"] > 0
        assert r["gbps"] == pytest.approx(r["bytes"] / r["seconds"] / 1e9)
    for q in data["ratios"]:
        assert set(q) == RATIO_KEYS
        assert q["speedup"] == pytest.approx(q["torch_seconds"] / q["pinxfer_seconds"])
    for s in data["skipped"]:
        assert set(s) == {"section", "reason"} and s["reason"]


def test_library_import_leaves_the_command_line_out():
    # The command line is a package of its own: the library never pulls it in.
    proc = _run(
        [
            "-c",
            "import sys, pinxfer; "
            "print(sorted(m for m in sys.modules if m.startswith('pinxfer.cli')))",
        ]
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


# ---------------------------------------------------------------- bench (CPU)


def test_bench_runs_and_writes_documented_json(tmp_path):
    out = tmp_path / "bench.json"
    proc = _run(["-m", "pinxfer", "bench", "--sizes", "1MiB,4MiB", "--json", str(out)])
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    _check_bench_json(data)

    # Host-side pinning always runs; each size has cold and warm pinxfer rows.
    pins = {
        (r["op"], r["bytes"])
        for r in data["results"]
        if r["section"] == "pin" and r["impl"] == "pinxfer"
    }
    assert pins == {(op, n) for op in ("pin_cold", "pin_warm") for n in (1 << 20, 4 << 20)}

    assert "pin 1.0 MiB" in proc.stderr  # the progress bar (tqdm or the text fallback)

    # The table: a header naming both implementations, and one row per measured point.
    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("section"))
    assert "torch GB/s" in lines[header] and "pinxfer GB/s" in lines[header]
    assert set(lines[header + 1]) <= {"-", " "}
    # torch and pinxfer share a line; the prefetch "ideal" figure has its own.
    rows = {(r["section"], r["op"], r["bytes"], r["impl"] == "ideal") for r in data["results"]}
    sections = ("pin ", "copy ", "to_device ", "prefetch ")
    assert sum(1 for line in lines[header + 2 :] if line.startswith(sections)) == len(rows)

    if not HAS_CUDA:
        assert data["device"] is None
        skipped = {s["section"]: s["reason"] for s in data["skipped"]}
        assert {"copy", "to_device", "prefetch"} <= set(skipped)
        assert "CUDA" in skipped["copy"]
        assert "skipped:" in proc.stdout and "copy:" in proc.stdout
        assert all(r["section"] == "pin" for r in data["results"])


def test_bench_json_to_stdout_keeps_table_on_stderr():
    proc = _run(
        [
            "-m",
            "pinxfer",
            "bench",
            "--sizes",
            "1MiB",
            "--sections",
            "pin",
            "--json",
            "-",
            "--no-progress",
        ]
    )
    assert proc.returncode == 0, proc.stderr
    _check_bench_json(json.loads(proc.stdout))
    assert "section" in proc.stderr


def test_bench_rejects_bad_arguments():
    proc = _run(["-m", "pinxfer", "bench", "--sizes", "12 parsecs"])
    assert proc.returncode == 2 and "byte size" in proc.stderr
    proc = _run(["-m", "pinxfer", "bench", "--sections", "pin,warp"])
    assert proc.returncode == 2 and "copy,pin,to_device,prefetch" in proc.stderr


@pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is not None, reason="matplotlib installed"
)
def test_bench_plot_without_matplotlib_says_how_to_fix(tmp_path):
    proc = _run(["-m", "pinxfer", "bench", "--sizes", "1MiB", "--plot", str(tmp_path / "p.png")])
    assert proc.returncode == 2
    assert "matplotlib" in proc.stderr and "pip install" in proc.stderr
    assert not (tmp_path / "p.png").exists()


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="needs matplotlib")
def test_bench_plot_writes_png(tmp_path):
    png = tmp_path / "p.png"
    proc = _run(["-m", "pinxfer", "bench", "--sizes", "1MiB,4MiB", "--plot", str(png)])
    assert proc.returncode == 0, proc.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _fake_report() -> dict:
    return {
        "device": "Fake GPU",
        "torch": "x",
        "pinxfer": "y",
        "date": "2026-01-01T00:00:00+00:00",
        "results": [
            {
                "section": "to_device",
                "op": "h2d",
                "impl": "torch",
                "bytes": 1 << 30,
                "seconds": 0.1,
                "gbps": 10.7,
            },
            {
                "section": "to_device",
                "op": "h2d",
                "impl": "pinxfer",
                "bytes": 1 << 30,
                "seconds": 0.02,
                "gbps": 53.7,
            },
            {
                "section": "copy",
                "op": "h2d_pinned",
                "impl": "torch",
                "bytes": 1 << 20,
                "seconds": 2e-5,
                "gbps": 52.4,
            },
        ],
        "ratios": [],
        "skipped": [{"section": "prefetch", "reason": "because"}],
    }


def test_render_aligns_columns_and_pairs_implementations():
    text = _bench.render(_fake_report())
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("section"))
    table = lines[header : header + 4]
    assert len({len(line) for line in table[:2]}) == 1  # header and rule equally wide
    row = next(line for line in table if line.startswith("to_device"))
    assert row.endswith("5.00x")
    assert "pinned H2D limit measured: 52.4 GB/s" in text
    assert "prefetch: because" in text


def test_bench_from_json_rerenders_without_measuring(tmp_path):
    saved = tmp_path / "device.json"
    saved.write_text(json.dumps(_fake_report()))
    args = ["-m", "pinxfer", "bench", "--from-json", str(saved)]
    if importlib.util.find_spec("matplotlib") is not None:
        args += ["--plot", str(tmp_path / "p.png")]
    proc = _run(args)
    assert proc.returncode == 0, proc.stderr
    assert "device: Fake GPU" in proc.stdout and "5.00x" in proc.stdout
    assert proc.stderr == ""  # nothing measured: no progress bar
    if "--plot" in args:
        assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


# ---------------------------------------------------------------- doctor (CPU, fixture trees)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def _sysfs(
    root: Path,
    *,
    cur: str = "16.0 GT/s PCIe",
    mx: str = "32.0 GT/s PCIe",
    cur_w: int = 16,
    max_w: int = 16,
    thp: str = "always madvise [never]",
    gpu_node: int = 1,
) -> Path:
    """A two-node machine: CPUs 1000-1003 on node 0, 1004-1007 on node 1 (numbers no
    real test host has, so the affinity check is deterministic), one NVIDIA GPU on
    node 1 and an Intel NIC that doctor must ignore."""
    _write(root / "devices/system/node/node0/cpulist", "1000-1003")
    _write(root / "devices/system/node/node1/cpulist", "1004-1007")
    gpu = root / "bus/pci/devices/0000:41:00.0"
    for name, value in {
        "vendor": "0x10de",
        "class": "0x030200",
        "numa_node": str(gpu_node),
        "current_link_speed": cur,
        "max_link_speed": mx,
        "current_link_width": str(cur_w),
        "max_link_width": str(max_w),
    }.items():
        _write(gpu / name, value)
    nic = root / "bus/pci/devices/0000:01:00.0"
    for name, value in {"vendor": "0x8086", "class": "0x020000", "numa_node": "0"}.items():
        _write(nic / name, value)
    _write(root / "kernel/mm/transparent_hugepage/enabled", thp)
    _write(root / "kernel/mm/transparent_hugepage/defrag", "always defer [madvise] never")
    return root


def _proc(root: Path, cap_eff: str = "0000000000000000") -> Path:
    _write(
        root / "meminfo",
        "MemTotal:       131072000 kB\nHugePages_Total:      16\n"
        "HugePages_Free:        8\nHugepagesize:       2048 kB",
    )
    _write(root / "self/status", f"Name:\tpython\nCapEff:\t{cap_eff}")
    return root


def _codes(report: dict) -> set[str]:
    return {w["code"] for w in report["warnings"]}


def test_doctor_reads_fixture_tree_and_warns(tmp_path):
    sysfs, proc = _sysfs(tmp_path / "sys"), _proc(tmp_path / "proc")
    report = _doctor.collect(str(sysfs), str(proc), affinity={1000, 1001})
    (gpu,) = report["gpus"]
    assert gpu["pci_bus_id"] == "0000:41:00.0" and gpu["index"] == 0
    assert gpu["numa_node"] == 1 and gpu["cpus"] == [1004, 1005, 1006, 1007]
    assert gpu["pcie"] == {
        "current_gen": 4,
        "current_width": 16,
        "max_gen": 5,
        "max_width": 16,
        "current_speed_gts": 16.0,
        "max_speed_gts": 32.0,
        "under_load": False,
    }
    assert gpu["source"] == "sysfs"
    assert report["thp"] == {"enabled": "never", "defrag": "madvise"}
    assert report["hugepages"] == {"total": 16, "free": 8, "size_bytes": 2 << 20}
    assert report["process"]["cap_ipc_lock"] is False
    assert {"pcie_below_max", "thp_never", "affinity_far_from_gpu"} <= _codes(report)
    far = next(w for w in report["warnings"] if w["code"] == "affinity_far_from_gpu")
    assert "numactl --cpunodebind=1" in far["message"]
    text = _doctor.render(report)
    assert "0000:41:00.0" in text and "Gen4 (16 GT/s) x16" in text and "Gen5 (32 GT/s) x16" in text


def test_doctor_healthy_fixture_has_no_topology_warnings(tmp_path):
    sysfs = _sysfs(tmp_path / "sys", cur="32.0 GT/s PCIe", thp="always [madvise] never")
    report = _doctor.collect(str(sysfs), str(_proc(tmp_path / "proc")), affinity={1004, 1005})
    assert not _codes(report) & {"pcie_below_max", "thp_never", "affinity_far_from_gpu"}


def test_doctor_narrow_link_and_upstream_port_cap(tmp_path):
    report = _doctor.collect(
        str(_sysfs(tmp_path / "a", cur="32.0 GT/s", cur_w=8)),
        str(_proc(tmp_path / "p")),
        affinity={1004},
    )
    (w,) = [w for w in report["warnings"] if w["code"] == "pcie_below_max"]
    assert "x8" in w["message"] and "lanes" in w["message"]

    # As on a real machine: bus/pci/devices/<id> links to the device under its
    # upstream port. A Gen5 GPU behind a Gen4 port at Gen4 is as fast as it gets.
    root = _sysfs(tmp_path / "b")
    port = root / "devices/pci0000:40/0000:40:01.0"
    _write(port / "max_link_speed", "16.0 GT/s PCIe")
    _write(port / "max_link_width", "16")
    link = root / "bus/pci/devices/0000:41:00.0"
    link.rename(port / "0000:41:00.0")
    link.symlink_to(port / "0000:41:00.0")
    report = _doctor.collect(str(root), str(_proc(tmp_path / "p")), affinity={1004})
    assert report["gpus"][0]["pcie"]["max_gen"] == 4
    assert "pcie_below_max" not in _codes(report)


def test_doctor_cli_json_and_memlock_warnings(tmp_path):
    sysfs, proc = _sysfs(tmp_path / "sys"), _proc(tmp_path / "proc")
    out = tmp_path / "doctor.json"
    soft = 64 << 10
    hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]

    def low_memlock() -> None:  # lowering one's own soft limit needs no privilege
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (soft, hard))

    args = ["-m", "pinxfer", "doctor", "--sysfs-root", str(sysfs), "--proc-root", str(proc)]
    proc_run = _run([*args, "--json", str(out)], preexec_fn=low_memlock)
    assert proc_run.returncode == 0, proc_run.stderr
    assert "0000:41:00.0" in proc_run.stdout and "warnings" in proc_run.stdout
    data = json.loads(out.read_text())
    assert set(data) == {
        "pinxfer",
        "torch",
        "sysfs_root",
        "proc_root",
        "gpus",
        "process",
        "memlock",
        "thp",
        "hugepages",
        "settings",
        "warnings",
    }
    assert set(data["gpus"][0]) == {
        "index",
        "name",
        "pci_bus_id",
        "numa_node",
        "cpus",
        "pcie",
        "source",
    }
    assert data["memlock"]["soft"] == soft
    assert set(data["settings"]) == {"env", "values", "max_pinned_bytes", "build_info", "installed"}
    assert (
        set(data["settings"]["env"]) == set(_doctor.env_vars()) == set(data["settings"]["values"])
    )
    assert data["settings"]["values"]["PINXFER_NUM_THREADS"]["source"] == "derived"
    assert set(data["settings"]["build_info"]) == {"with_cuda", "cuda_version", "cuda_usable"}
    assert "memlock_low" in _codes(data)  # no cap, no CAP_IPC_LOCK in the fixture, 64 KiB

    # With a cap the warning names the cap; JSON alone on stdout with a bare --json.
    proc_run = _run([*args, "--json"], preexec_fn=low_memlock, PINXFER_MAX_PINNED_BYTES="1GiB")
    assert proc_run.returncode == 0, proc_run.stderr
    data = json.loads(proc_run.stdout)
    assert data["settings"]["max_pinned_bytes"] == 1 << 30
    assert data["settings"]["env"]["PINXFER_MAX_PINNED_BYTES"] == "1GiB"
    row = data["settings"]["values"]["PINXFER_MAX_PINNED_BYTES"]
    assert (row["value"], row["source"]) == (str(1 << 30), "env")
    assert "cap" in row["doc"]
    assert "memlock_below_cap" in _codes(data)

    # CAP_IPC_LOCK (bit 14) exempts the process from the limit.
    _proc(proc, cap_eff=f"{1 << 14:016x}")
    data = json.loads(_run([*args, "--json"], preexec_fn=low_memlock).stdout)
    assert data["process"]["cap_ipc_lock"] is True
    assert not _codes(data) & {"memlock_low", "memlock_below_cap"}


def test_doctor_runs_on_this_machine():
    proc = _run(["-m", "pinxfer", "doctor"])
    assert proc.returncode == 0, proc.stderr
    assert "memlock limit" in proc.stdout and "PINXFER_MAX_PINNED_BYTES" in proc.stdout


def test_parse_cpulist_and_compact():
    # doctor reads node CPU lists with pinxfer's parser (the op) and writes them with _compact.
    assert parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert _doctor._compact([0, 1, 2, 3, 8, 10, 11]) == "0-3,8,10-11"


# ---------------------------------------------------------------- examples (CPU)


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_help(name):
    proc = _run([f"examples/{name}", "--help"], timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "--steps" in proc.stdout


@pytest.mark.skipif(HAS_CUDA, reason="the no-CUDA path")
@pytest.mark.parametrize("name", EXAMPLES)
def test_example_without_cuda_exits_cleanly(name):
    proc = _run([f"examples/{name}", "--steps", "3"], timeout=120)
    # 77: the examples' documented "skipped" status (examples/README.md).
    assert proc.returncode == 77, (proc.returncode, proc.stdout, proc.stderr)
    assert "needs a CUDA device" in proc.stdout or "Lightning not installed" in proc.stdout
    assert "skipping (exit 77" in proc.stdout


# ---------------------------------------------------------------- GPU (device)


@pytest.mark.gpu
def test_gpu_bench_reports_gpu_sections(tmp_path):
    out = tmp_path / "bench.json"
    proc = _run(
        [
            "-m",
            "pinxfer",
            "bench",
            "--sizes",
            "1MiB,16MiB",
            "--prefetch-steps",
            "4",
            "--json",
            str(out),
        ]
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    _check_bench_json(data)
    assert data["device"] == torch.cuda.get_device_name()
    got = {(r["section"], r["op"], r["impl"]) for r in data["results"]}
    for key in [
        ("copy", "h2d_pageable", "torch"),
        ("copy", "h2d_pinned", "torch"),
        ("copy", "h2d_pinned", "pinxfer"),
        ("copy", "d2h_pinned", "pinxfer"),
        ("pin", "pin_cold", "torch"),
        ("pin", "pin_warm", "torch"),
        ("pin", "pin_cold", "pinxfer"),
        ("to_device", "h2d", "torch"),
    ]:
        assert key in got, key
    skipped = {s["section"] for s in data["skipped"]}
    assert "copy" not in skipped
    if hasattr(pinxfer, "to_device"):
        assert ("to_device", "h2d", "pinxfer") in got
    if hasattr(pinxfer, "prefetch"):
        assert {("prefetch", "loop", i) for i in ("torch", "pinxfer", "ideal")} <= got
    assert any(q["section"] == "copy" for q in data["ratios"])
    assert "pinned H2D limit measured" in proc.stdout


@pytest.mark.gpu
def test_gpu_doctor_lists_every_gpu():
    proc = _run(["-m", "pinxfer", "doctor", "--json"])
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    visible = [g for g in data["gpus"] if g["index"] is not None]
    assert [g["index"] for g in visible] == list(range(torch.cuda.device_count()))
    for g in visible:
        assert g["name"] == torch.cuda.get_device_name(g["index"])
        p = torch.cuda.get_device_properties(g["index"])
        assert g["pci_bus_id"].endswith(f"{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0")
        assert {"current_gen", "max_gen", "current_width", "max_width"} <= set(g["pcie"]), g
        assert g["pcie"]["under_load"] is True  # links read while the GPU copied


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("name", "extra"),
    [
        ("train_loop.py", []),
        ("dataloader_workers.py", []),
        ("dataloader_workers.py", ["--no-slots"]),
        ("lightning_hook.py", []),
    ],
)
def test_gpu_example_runs(name, extra):
    proc = _run([f"examples/{name}", "--steps", "3", *extra], timeout=180)
    if proc.returncode == 77 and "Lightning not installed" in proc.stdout:
        pytest.skip("Lightning is not installed here (the example exited 77, its skip status)")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().splitlines()[-1].startswith(name[:-3] + ":")


@pytest.mark.gpu
def test_gpu_example_ddp_under_torchrun():
    proc = _run(
        [
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=1",
            "examples/ddp_torchrun.py",
            "--steps",
            "3",
        ],
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ddp_torchrun: world 1, 3 steps" in proc.stdout
