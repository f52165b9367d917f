"""tests/fresh.py gives the tests that need a new process what ``python -c`` gives: its own
pid, exactly the environment asked for, pinxfer's settings and fork state read fresh, exit
codes and signals, and a hang cut off at its timeout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests import fresh

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(code: str, timeout: float | None = 60, **env: str) -> subprocess.CompletedProcess:
    return fresh.run(
        textwrap.dedent(code),
        env={"PATH": os.environ.get("PATH", ""), **env},
        cwd=REPO,
        timeout=timeout,
    )


def test_a_new_process_with_exactly_the_environment_asked_for():
    proc = _run(
        """
        import json, os, sys
        print(json.dumps([os.getpid(), os.getppid(), sorted(os.environ), sys.argv, os.getcwd()]))
        """,
        ONLY_THIS="1",
    )
    assert proc.returncode == 0, proc.stderr
    pid, ppid, names, argv, cwd = json.loads(proc.stdout)
    assert os.getpid() not in (pid, ppid)
    assert names == ["ONLY_THIS", "PATH"]
    assert argv == ["-c"]
    assert cwd == REPO


def test_pinxfer_starts_fresh_there():
    """pinxfer is imported in the child, so its settings come from the child's environment
    and it is not a forked child of a CUDA process (the zygote never imports it)."""
    code = """
        import pinxfer
        rows = {s.name: s for s in pinxfer._ops.settings()}
        print(rows["PINXFER_SPIN_US"].value, rows["PINXFER_SPIN_US"].source)
        print(pinxfer._ops.cuda_unusable_reason())
        """
    seven = _run(code, PINXFER_SPIN_US="7")
    unset = _run(code)
    assert seven.returncode == 0 and unset.returncode == 0, seven.stderr + unset.stderr
    assert seven.stdout.splitlines()[0] == "7 env"
    assert unset.stdout.splitlines()[0].endswith("default")
    assert "forked child" not in seven.stdout + unset.stdout


def test_exit_codes_errors_and_signals():
    assert _run("raise SystemExit(77)").returncode == 77
    assert _run("import sys; sys.exit('why')").returncode == 1
    failed = _run("raise KeyError('lost')")
    assert failed.returncode == 1 and "KeyError: 'lost'" in failed.stderr
    killed = _run("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    assert killed.returncode == -11
    printed = _run("import sys; print('out'); print('err', file=sys.stderr)")
    assert (printed.stdout, printed.stderr) == ("out\n", "err\n")


def test_a_hang_is_cut_off_and_the_next_run_works():
    with pytest.raises(subprocess.TimeoutExpired) as hung:
        _run("import time; print('started', flush=True); time.sleep(60)", timeout=2)
    assert "started" in hung.value.output
    assert _run("print(6 * 7)").stdout == "42\n"


def test_the_same_code_under_python_c_agrees():
    code = "import pinxfer, torch; print(pinxfer.build_info().with_cuda, torch.__version__)"
    ours = _run(code)
    env = {"PATH": os.environ.get("PATH", "")}
    theirs = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True
    )
    assert (ours.returncode, ours.stdout) == (theirs.returncode, theirs.stdout), ours.stderr
