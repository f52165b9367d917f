"""Fresh Python processes for tests, without paying ``import torch`` in each one.

Many tests need a process of their own: pinxfer reads its environment once per process
(csrc/runtime/settings.h), so each malformed ``PINXFER_*`` value, each ``LOCAL_WORLD_SIZE``
and each fault needs a new one. Started with ``python -c``, each such child spends about
1.2 s of its 1.3 s importing torch, and the README's test command runs dozens of them.

:func:`run` gives the same thing faster: one *zygote* process imports torch once and
``fork()``s a child per request. The child replaces its environment and working directory
with the caller's, redirects its output to files, and runs the code as ``__main__``. It is
a real process (its own pid, page-locked memory, threads, exit status, signals), and it
imports pinxfer itself, so pinxfer's extension, its ``pthread_atfork`` handlers and its
settings start fresh there exactly as in ``python -c``. The zygote never imports pinxfer
and never initialises CUDA: a fork of it is not a "forked child" to pinxfer or to torch,
and CUDA initialises in the child as in any new process. What the zygote did before the
fork (``import torch``) does not depend on the variables a test sets.

Use :func:`run` where a test needs a new interpreter with some environment; tests about
interpreter start-up itself (``import pinxfer`` does not initialise CUDA, the command
line stays unimported, a build refused before it is loaded) keep starting ``python``.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time

# The zygote: reads one JSON request per line, forks a child for it, answers the child's
# pid, then its exit code (negative: the signal that killed it).
_ZYGOTE = r"""
import json, os, sys, traceback
import torch  # the cost every fresh process would pay; nothing here reads the environment

requests, answers = sys.stdin, sys.stdout
for line in requests:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
                f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                os.dup2(f, fd)
                os.close(f)
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.close(null)
            os.environ.clear()
            os.environ.update(req["env"])
            os.chdir(req["cwd"])  # sys.path[0] is "", as in `python -c`: the new directory
            sys.argv = ["-c"]
            code = 0
            try:
                exec(compile(req["code"], "<string>", "exec"), {"__name__": "__main__"})
            except SystemExit as stop:
                if stop.code is None or isinstance(stop.code, int):
                    code = stop.code or 0
                else:
                    print(stop.code, file=sys.stderr)
                    code = 1
            except BaseException:
                traceback.print_exc()
                code = 1
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)
    answers.write(json.dumps({"pid": pid}) + "\n")
    answers.flush()
    _, status = os.waitpid(pid, 0)
    answers.write(json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n")
    answers.flush()
"""

_lock = threading.Lock()
_zygote: subprocess.Popen | None = None
_pending = b""  # answer bytes read from the zygote and not yet taken (a partial line)


def _start() -> subprocess.Popen:
    global _zygote, _pending
    if _zygote is None or _zygote.poll() is not None:
        # Its own environment matters only for `import torch`; each child gets the caller's.
        env = {k: v for k, v in os.environ.items() if not k.startswith("PINXFER_")}
        _zygote = subprocess.Popen(
            [sys.executable, "-c", _ZYGOTE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
        )
        _pending = b""
        atexit.register(_stop, _zygote)
    return _zygote


def _stop(zygote: subprocess.Popen) -> None:
    if zygote.poll() is None:
        zygote.stdin.close()
        try:
            zygote.wait(timeout=10)
        except subprocess.TimeoutExpired:
            zygote.kill()


def _answer(zygote: subprocess.Popen, timeout: float | None) -> dict:
    """The zygote's next answer line, or TimeoutError after ``timeout`` seconds. Read with
    select() in the caller's thread: no reader thread outlives a test (the fuzz suite
    checks that none does), and a timed-out wait leaves no read behind."""
    global _pending
    deadline = None if timeout is None else time.monotonic() + timeout
    fd = zygote.stdout.fileno()
    while b"\n" not in _pending:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not select.select([fd], [], [], left)[0]:
            raise TimeoutError
        chunk = os.read(fd, 65536)
        if not chunk:
            raise RuntimeError(f"the test zygote died (exit {zygote.poll()})")
        _pending += chunk
    line, _pending = _pending.split(b"\n", 1)
    return json.loads(line)


def run(
    code: str, *, env: dict[str, str], cwd: str, timeout: float | None = None
) -> subprocess.CompletedProcess:
    """Runs ``code`` as ``python -c code`` would in a new process with exactly ``env`` and
    working directory ``cwd``; returns its exit code and text output.

    Raises subprocess.TimeoutExpired (the child killed) when it runs past ``timeout``."""
    with _lock, tempfile.TemporaryDirectory(prefix="pinxfer-fresh-") as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        zygote = _start()
        request = {"code": code, "env": dict(env), "cwd": str(cwd), "stdout": out, "stderr": err}
        zygote.stdin.write(json.dumps(request).encode() + b"\n")
        zygote.stdin.flush()
        pid = _answer(zygote, 60)["pid"]
        try:
            rc = _answer(zygote, timeout)["rc"]
        except TimeoutError:
            os.kill(pid, signal.SIGKILL)
            _answer(zygote, 60)  # the zygote reaps it
            with open(out) as o, open(err) as e:
                raise subprocess.TimeoutExpired(
                    ["python", "-c", code], timeout, output=o.read(), stderr=e.read()
                ) from None
        with open(out) as o, open(err) as e:
            return subprocess.CompletedProcess(["python", "-c", code], rc, o.read(), e.read())
