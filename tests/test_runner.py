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
