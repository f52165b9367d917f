"""benchmarks/bench_loop.py --self-test: its statistics, verdicts and table on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_loop_self_test():
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "bench_loop.py"), "--self-test"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "bench_loop self-test OK" in proc.stdout
    assert "== loop table" in proc.stdout


def _loop_run(xp: float, verdict: str = "MISS") -> dict:
    """A bench_loop result of one row (to_device, 8 MiB back to back) and a torch row."""
    return {
        "rows": [
            {
                "size": "8MiB",
                "bytes": 8 << 20,
                "pattern": "b2b",
                "way": "to_device",
                "ratio_torch": {"median": 2 * xp, "min": 2 * xp},
                "ratio_pinned": {"median": xp, "min": xp},
                "verdict": verdict,
            },
            {"size": "8MiB", "bytes": 8 << 20, "pattern": "b2b", "way": "torch_to"},
        ],
        "small_rows": [],
    }


def _compare_loop(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "compare_loop.py"), *argv],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_compare_loop_counts_the_rounds_a_change_moved_a_row(tmp_path):
    """benchmarks/compare_loop.py over rounds of before/after runs: per cell the medians
    of the rounds and in how many the after run was higher; a combined session file gives
    the same table; an odd number of runs is refused."""
    runs = [_loop_run(0.70), _loop_run(0.74), _loop_run(0.72), _loop_run(0.71, "PASS")]
    paths = []
    for i, run in enumerate(runs):
        paths.append(str(tmp_path / f"run{i}.json"))
        with open(paths[-1], "w") as f:
            json.dump(run, f)
    proc = _compare_loop(paths)
    assert proc.returncode == 0, proc.stderr
    row = next(line for line in proc.stdout.splitlines() if line.startswith("| 8MiB | b2b"))
    # xt: before 1.40 and 1.44 -> median 1.42; after 1.48 and 1.42 -> 1.45; higher in round 1 only
    assert "| 1.42→1.45 1/2 | 0.71→0.72 1/2 |" in row
    assert "rows meeting every target: 0 -> 0, 0 -> 1 of 1" in proc.stdout
    assert "cells higher after in every round: 0; lower in every round: 0 (of 2)" in proc.stdout

    session = {
        "runs": {"old": {"r1": runs[0], "r2": runs[2]}, "new": {"r1": runs[1], "r2": runs[3]}}
    }
    with open(tmp_path / "session.json", "w") as f:
        json.dump(session, f)
    proc2 = _compare_loop(
        ["--session", str(tmp_path / "session.json"), "--before", "old", "--after", "new"]
    )
    assert proc2.returncode == 0, proc2.stderr
    assert proc2.stdout == proc.stdout

    odd = _compare_loop(paths[:3])
    assert odd.returncode != 0 and "even number of files" in odd.stderr
    missing = _compare_loop(
        ["--session", str(tmp_path / "session.json"), "--before", "old", "--after", "x"]
    )
    assert missing.returncode != 0 and "no variant 'x'" in missing.stderr
