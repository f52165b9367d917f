"""The README's test command fails on a crash: under pytest-xdist (-n) a test that kills its
worker process is reported as failed ("worker 'gwN' crashed while running ...") and the
run's exit status is non-zero; the runner does not absorb it."""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_a_crashing_test_fails_the_run_under_xdist(tmp_path):
    (tmp_path / "test_crash.py").write_text(
        "import os\n\ndef test_before():\n    pass\n\n"
        "def test_crash():\n    os.abort()\n\ndef test_after():\n    pass\n"
    )
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider",
         "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path), str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 1, run.stdout + run.stderr
    assert "crashed while running" in run.stdout and "test_crash" in run.stdout, run.stdout


def test_gpu_check_refuses_a_word_that_names_no_step(tmp_path):
    """A mistyped step alone used to run every step under a pytest -k that selected almost
    nothing (about ten minutes of device time); it is refused before anything runs."""
    run = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "tset"],
        capture_output=True, text=True, timeout=60,
        env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path)},
    )  # fmt: skip
    assert run.returncode == 2, run.stdout + run.stderr
    assert "'tset' names no step" in run.stderr and "'test tset'" in run.stderr, run.stderr
    assert "steps:" not in run.stdout, run.stdout  # refused before the steps were announced
