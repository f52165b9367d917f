"""The randomized stress (tests/stress/) under pytest: each mode runs for
PINXFER_STRESS_SECONDS (default 5) in a fresh child process (``pinxfer.install()`` swaps
torch's host allocator for the whole process, and a crash must fail the run, not take
pytest with it). On a GPU every operation runs; without one the CPU part does (the report
says which were skipped and why). A mode fails on any bad byte, error or contract
violation; every operation of weight >= MIN_WEIGHT must have run and checked bytes.

Deselected by default (a soak-like run); CI runs it: ``python3 -m pytest -q -m stress
tests``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import pinxfer
from tests.conftest import HAS_CUDA

pytestmark = pytest.mark.stress

REPO = Path(__file__).resolve().parents[2]
SECONDS = float(os.environ.get("PINXFER_STRESS_SECONDS", "5"))
MIN_WEIGHT = 4  # rarer operations (maintenance, graph) may miss a short run
# Fewest checked tensors per mode: a floor that catches a run that did next to nothing (the
# CPU part checks ~600 tensors/s on 2 shared cores; a GPU thousands).
MIN_TRANSFERS = max(10, int(SECONDS * (200 if HAS_CUDA else 20)))


def run_stress(
    tmp_path: Path, *args: str, seconds: float = SECONDS
) -> tuple[subprocess.CompletedProcess, dict]:
    """The stress's command line in a child; returns it and its JSON report."""
    out = tmp_path / "stress.json"
    cmd = [
        sys.executable,
        "-X",
        "faulthandler",
        "-m",
        "tests.stress",
        "--seconds",
        str(seconds),
        "--json",
        str(out),
        *args,
    ]
    if not HAS_CUDA:
        cmd.append("--cpu")
    # The child's own watchdog dumps stacks and exits first (modes x (seconds + 90) + 120).
    proc = subprocess.run(
        cmd, cwd=REPO, capture_output=True, text=True, timeout=2 * (seconds + 90) + 240
    )
    report = json.loads(out.read_text()) if out.exists() else {}
    return proc, report


def _tail(proc: subprocess.CompletedProcess) -> str:
    return (
        f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}\n"
        f"--- stderr\n{proc.stderr[-6000:]}"
    )


@pytest.mark.parametrize("mode", ["plain", "install"])
def test_stress_mode_has_no_bad_byte(tmp_path, mode):
    if mode == "install" and not pinxfer.build_info().with_cuda:
        pytest.skip("pinxfer built without CUDA: install() has no CUDA host allocator to replace")
    proc, report = run_stress(tmp_path, "--mode", mode, "--min-transfers", str(MIN_TRANSFERS))
    print(proc.stdout)  # the summary line and the per-operation table (pytest -s, or -rP)
    assert proc.returncode == 0, _tail(proc)  # a crash (signal) or a failed mode
    assert report.get("complete") and report["ok"], _tail(proc)
    r = report["modes"][mode]
    assert (r["bad_bytes"], r["errors"], r["contract_errors"]) == (0, 0, 0), _tail(proc)
    assert r["installed"] == (mode == "install")
    assert not r["leftover_prefetch_threads"]
    for name, op in r["op_table"].items():
        if op["weight"] < MIN_WEIGHT:
            continue
        done = r["ops"].get(name, {})
        assert done.get("calls", 0) > 0, f"{name} never ran: {r['ops']}"
        if op["checks_bytes"]:
            assert done.get("transfers", 0) > 0 and done.get("bytes_checked", 0) > 0, (
                f"{name} checked nothing: {done}"
            )
    if HAS_CUDA:
        assert not r["skipped_ops"], r["skipped_ops"]
    else:
        assert {"pin_memory", "pool_hold", "prefetch"} <= set(r["op_table"])


def test_injected_faults_fail_the_run_and_are_all_counted(tmp_path):
    """The run's checker can fail: one corrupted byte in 5% of the checks."""
    proc, report = run_stress(
        tmp_path,
        "--mode",
        "plain",
        "--min-transfers",
        "1",
        "--inject-faults",
        "0.05",
        seconds=min(SECONDS, 3.0),
    )
    assert proc.returncode == 1, _tail(proc)
    assert "STRESS FAILED" in proc.stdout
    r = report["modes"]["plain"]
    assert r["injected_bytes"] > 0 and r["bad_bytes"] == r["injected_bytes"], _tail(proc)
    assert not r["ok"] and any("bad bytes" in f for f in r["failures"])
    assert report["checker_ok"] and r["errors"] == 0 and r["contract_errors"] == 0
