"""benchmarks/bench_loop.py --self-test: its statistics, verdicts and table on the CPU."""

from __future__ import annotations

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
