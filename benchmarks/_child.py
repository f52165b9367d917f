"""A benchmark run again in a child process, and its result read back.

Settings that pinxfer or torch read once per process (PINXFER_NUM_THREADS, PINXFER_SPIN_US,
PINXFER_TORCH_TEAM, PYTORCH_CUDA_ALLOC_CONF) can only be varied by starting a new process.
The scripts that do (diag_latency, diag_many_small, diag_midsize, diag_prefetch,
sweep_chunking, sweep_to_device, bench_allocator) run themselves with a child flag; the
child prints its result as JSON on its last line of standard output.

A child that fails fails its parent: a crash is a failed run, never a row left out.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any


def _tail(text: str | bytes | None, chars: int = 3000) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return (text or "")[-chars:]


def run_child(
    script: str, args: list[str], env: dict[str, str] | None = None, timeout: float = 300
) -> Any:
    """Runs ``python script *args`` with this process's environment updated by ``env`` and
    returns the JSON value on the last line of its standard output.

    Raises:
        SystemExit: the child exited with a failure status, ran past ``timeout`` seconds, or
            printed no JSON last; the message names the child and ends with its output.
    """
    cmd = [sys.executable, os.path.abspath(script), *args]
    what = " ".join([*(f"{k}={v}" for k, v in (env or {}).items()), *cmd[1:]])
    try:
        proc = subprocess.run(
            cmd,
            env={**os.environ, **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as e:
        raise SystemExit(
            f"child {what}: no result within {timeout} s\n{_tail(e.stdout)}\n{_tail(e.stderr)}"
        ) from None
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise SystemExit(
            f"child {what}: exit status {proc.returncode}\n{_tail(proc.stdout)}\n"
            f"{_tail(proc.stderr)}"
        )
    try:
        return json.loads(lines[-1])
    except json.JSONDecodeError:
        raise SystemExit(
            f"child {what}: its last line is not JSON: {lines[-1][:500]!r}\n{_tail(proc.stderr)}"
        ) from None
