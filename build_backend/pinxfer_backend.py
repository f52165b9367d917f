"""pinxfer's PEP 517 build backend: setuptools' own (``setuptools.build_meta``), run so that
the extension compiles against the torch already installed where pip installs pinxfer.

Why a backend of our own (pyproject.toml names it with ``backend-path``)
------------------------------------------------------------------------
``pinxfer._C`` links against torch's C++ ABI and overrides ``at::HostAllocator``, whose
virtuals change between torch releases: it must be compiled against the very torch that will
import it. Plain ``pip install .`` builds in an isolated environment that holds only the
``[build-system] requires``, so setup.py cannot ``import torch``. The ways out, and why not:

* ``requires = ["torch"]``: pip downloads a second torch (gigabytes) into the isolated
  environment, the newest one, not necessarily the installed version or CUDA variant, so the
  extension can be built for another torch than the one that runs it; with no package index
  (the GPU machines have no network) it cannot install anything and fails.
* a build constraint pinned to the installed torch: the user must write it, and pip still
  installs a copy of torch into the isolated environment (no index: no copy).
* building at first import (``torch.utils.cpp_extension.load``): a 5-minute stall at the first
  ``import pinxfer`` in every new environment, a compiler needed wherever it runs, and a build
  directory shared by every rank and worker that needs versioning and locking.
* ``--no-build-isolation``: works, but is not what users type, and failed with "No module
  named 'torch'" and no hint when they did not.

So ``requires = []`` and this backend asks the interpreter pip runs (``sys.executable``, the
target environment's python; ``PINXFER_TORCH_PYTHON`` names another) for its ``sys.path``
with pip's isolation undone, and appends those entries to its own: setup.py then imports the
installed torch, and setuptools from the isolated environment if pip put one there, else the
installed one. Nothing is downloaded when the target environment has setuptools >= 70.1 (or
>= 64 with ``wheel``), which it has wherever a recent torch is (torch 2.14 requires
setuptools >= 77.0.3; older ones require setuptools on Python >= 3.12), so ``pip install .``
works offline; ``get_requires_for_build_*`` asks for setuptools only where it is missing or
too old (and that needs an index). Without torch there, every hook fails in
seconds with one message saying what to run. With ``--no-build-isolation`` torch is already
importable and nothing is probed; pip then installs no build requirements either, so the hooks
that make a wheel check that the setuptools they import can (an old one fails otherwise with
setuptools' "invalid command 'bdist_wheel'").

What pip's build isolation hides from the probe: its default isolation runs this backend in
the target interpreter with ``PYTHONPATH`` replaced by a directory whose ``sitecustomize.py``
drops site-packages (and ``PYTHONNOUSERSITE=1``); the probe unsets both, but the user's own
``PYTHONPATH`` is gone, so a torch reached only through it (``module load pytorch`` on a
cluster) is not found: the message then says to use ``--no-build-isolation``. Build tools that
run the backend in a virtual environment of their own (``python -m build``, pip's opt-in venv
isolation) leave only that environment, which has no torch; Python >= 3.11 records the
interpreter that made it (pyvenv.cfg's ``command``), the one pip installs into or that ran
``python -m build``, and the probe asks that one next (shown with ``pip -v``). Where no
maker is recorded (virtualenv's venvs, uv's own builds, Python 3.10) or it has no torch either,
``PINXFER_TORCH_PYTHON`` names the interpreter to use.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import subprocess
import sys

# The target environment's setuptools is used when it can build wheels and editable
# installs by itself: >= 70.1 has bdist_wheel built in; >= 64 (PEP 660 editables) needs the
# `wheel` package beside it. Otherwise pip is asked for _WANTED_SETUPTOOLS (needs an index).
_SELF_SUFFICIENT_SETUPTOOLS = (70, 1)
_MIN_SETUPTOOLS_WITH_WHEEL = (64, 0)
_WANTED_SETUPTOOLS = "setuptools>=70.1"

# Run by the target interpreter with pip's isolation undone: what it can import.
_PROBE = r"""
import json, sys
out = {"executable": sys.executable, "path": sys.path}
try:
    import torch
except Exception as err:  # ImportError, or a torch that fails to import
    out["torch_error"] = f"{type(err).__name__}: {err}"
else:
    out["torch"] = torch.__version__
    out["torch_file"] = torch.__file__
    out["torch_cuda"] = torch.version.cuda
from importlib.metadata import version
for name in ("setuptools", "wheel"):
    try:
        out[name] = version(name)
    except Exception:
        out[name] = None
print("PINXFER_PROBE" + json.dumps(out))
"""


class BuildEnvironmentError(SystemExit):
    """Stops the build with one message (SystemExit: pip shows it without a traceback)."""


def _fail(message: str):
    raise BuildEnvironmentError("\npinxfer: " + message + "\n")


def _under_pips_default_isolation() -> bool:
    """Whether pip's default build isolation runs this backend: in the interpreter being
    installed into, with PYTHONPATH naming a directory whose sitecustomize.py drops
    site-packages from sys.path, and PYTHONNOUSERSITE=1 (pip's build_env "virtual" mode).
    pip's opt-in venv isolation, python -m build and uv run it in a venv of their own."""
    if os.environ.get("PYTHONNOUSERSITE") != "1":
        return False
    entries = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    return any(
        entry and os.path.isfile(os.path.join(entry, "sitecustomize.py")) for entry in entries
    )


@functools.cache
def _torch_environment() -> dict | None:
    """The target interpreter's view (see _PROBE), or None when torch is importable here
    already (--no-build-isolation, or torch among the build requirements)."""
    python = os.environ.get("PINXFER_TORCH_PYTHON")
    if not python and importlib.util.find_spec("torch") is not None:
        return None
    found = _probe(python or sys.executable)
    if "torch" not in found and not python:
        maker = _build_venv_maker()
        made = _probe(maker, required=False) if maker is not None else {}
        if "torch" in made:
            found = made
            print(
                f"pinxfer: this build's virtual environment ({sys.prefix}) has no torch; "
                f"its maker, {maker}, has: building against that",
                file=sys.stderr,
                flush=True,
            )
    if "torch" not in found:
        _fail(_no_torch_message(found["executable"], found["torch_error"]))
    return found


def _probe(python: str, required: bool = True) -> dict:
    """What ``python`` can import (_PROBE's answer), with pip's default isolation undone. An
    interpreter that cannot be asked stops the build, unless not ``required`` (then {})."""
    env = dict(os.environ)
    if _under_pips_default_isolation():
        # Without pip's PYTHONPATH and PYTHONNOUSERSITE the interpreter sees its
        # site-packages, as when pinxfer is later imported. (The user's own PYTHONPATH, which
        # pip replaced, cannot be restored: _no_torch_message says so.) Elsewhere the
        # environment is the user's, PYTHONPATH included, and is left as it is.
        env.pop("PYTHONPATH", None)
        env.pop("PYTHONNOUSERSITE", None)
    try:
        proc = subprocess.run(
            [python, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        if not required:
            return {}
        _fail(f"could not ask {python} for its torch: {err}")
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("PINXFER_PROBE")), None)
    if line is None:
        if not required:
            return {}
        _fail(
            f"could not ask {python} for its torch (exit {proc.returncode}): "
            f"{(proc.stderr or proc.stdout).strip()[-2000:]}"
        )
    return json.loads(line[len("PINXFER_PROBE") :])


# The names build tools give their throwaway venvs: pip's TempDirectory of kind "build-env",
# python -m build's mkdtemp(prefix="build-env-"). A user's own venv in the temporary directory
# (a CI job's) is the install target: its maker's torch is another environment's.
_BUILD_VENV_PREFIXES = ("pip-build-env-", "build-env-")


def _build_venv_maker() -> str | None:
    """The interpreter that made the virtual environment this backend runs in, where that is a
    build tool's (pip's venv isolation, python -m build: a venv in the temporary directory,
    named as they name theirs, that pip's default isolation did not set up). Python >= 3.11's
    venv records the command that made it in pyvenv.cfg ("command = /path/to/python -m venv
    ..."); that interpreter is the one pip runs in, the environment it installs into, or the one
    that ran python -m build. Its ``home`` and ``executable`` name the base installation
    instead, which a target that is itself a venv is not. None where this is not such a venv,
    or pyvenv.cfg names no maker."""
    if (
        sys.prefix == sys.base_prefix
        or _under_pips_default_isolation()
        or not _in_a_temporary_directory(sys.prefix)
        or not os.path.basename(os.path.normpath(sys.prefix)).startswith(_BUILD_VENV_PREFIXES)
    ):
        return None
    try:
        with open(os.path.join(sys.prefix, "pyvenv.cfg")) as cfg:
            lines = cfg.read().splitlines()
    except OSError:
        return None
    for line in lines:
        key, sep, value = line.partition("=")
        if sep and key.strip() == "command":
            # Written unquoted: the interpreter's path is what comes before " -m venv".
            maker = value.strip().split(" -m venv", 1)[0].strip()
            # Compared unresolved: a venv's python is a link to its base's, a different
            # environment behind the same binary.
            if os.access(maker, os.X_OK) and os.path.abspath(maker) != os.path.abspath(
                sys.executable
            ):
                return maker
    return None


def _in_a_temporary_directory(path: str) -> bool:
    """True for a path under the temporary directory, where build tools make their venvs."""
    import tempfile

    temp = os.path.realpath(tempfile.gettempdir())
    return os.path.realpath(path).startswith(temp + os.sep)


def _no_torch_message(python: str, torch_error: str) -> str:
    """What to do when the probed interpreter cannot import torch. The advice depends on who
    runs this backend, and what works there comes first."""
    why = "pinxfer compiles against the torch it will run with"
    install_commands = f"    {python} -m pip install torch\n    {python} -m pip install .\n"
    if os.environ.get("PINXFER_TORCH_PYTHON"):
        return (
            f"cannot build: PINXFER_TORCH_PYTHON names {python}, which cannot import torch "
            f"({torch_error}), and {why}. Point PINXFER_TORCH_PYTHON at the Python pinxfer "
            "will run with, or install torch there first, then pinxfer:\n" + install_commands
        )
    if _under_pips_default_isolation():
        # pip replaced the user's PYTHONPATH before starting this process: whether it held a
        # torch cannot be known here, so the message gives the test that tells the two apart.
        return (
            f"cannot build: the Python being installed into ({python}) cannot import torch "
            f"with PYTHONPATH unset ({torch_error}), and {why}.\n"
            f'* If `{python} -c "import torch"` works in your shell, that torch comes from '
            "PYTHONPATH (`module load pytorch` and the like), which pip's build isolation "
            "hides from the build: build without isolation, against that torch:\n"
            f"    {python} -m pip install --no-build-isolation .\n"
            "* Otherwise install torch there first, then pinxfer:\n" + install_commands
        )
    if sys.prefix != sys.base_prefix and _in_a_temporary_directory(sys.prefix):
        # A venv in the temporary directory that pip's default isolation did not set up: a
        # build tool's own (python -m build, uv), which holds only the build requirements, so
        # installing torch there is no use. A venv elsewhere is the user's (e.g. with
        # --no-build-isolation): the last message, install torch there, is the one.
        maker = _build_venv_maker()
        made_by = f"; nor can {maker}, which made it" if maker else ""
        return (
            f"cannot build: this build runs in a virtual environment of its own ({python}: "
            f"python -m build, uv, pip's venv isolation?), which cannot import torch "
            f"({torch_error}){made_by}, and {why}. Name the Python pinxfer will run with, and "
            "build again:\n"
            "    export PINXFER_TORCH_PYTHON=/path/to/the/python/with/torch\n"
            "or build without isolation, in the environment that has torch (the one way where "
            "that torch comes from PYTHONPATH, which the build's venv does not see):\n"
            "    python -m build --no-isolation   (uv build --no-build-isolation, "
            "pip install --no-build-isolation .)\n"
            f"(If {python} is itself the environment pinxfer is for, install torch there.)\n"
        )
    return (
        f"cannot build: the Python being installed into ({python}) cannot import torch "
        f"({torch_error}), and {why}. Install torch there first, then pinxfer:\n" + install_commands
    )


def _use_target_torch() -> None:
    """Makes the target environment's torch (and the rest of its sys.path) importable here,
    after what the isolated environment holds, and its scripts (ninja) findable."""
    found = _torch_environment()
    if found is None:
        return
    for entry in found["path"]:
        if entry and entry not in sys.path:
            sys.path.append(entry)
    bin_dir = os.path.dirname(found["executable"])
    path = os.environ.get("PATH", "").split(os.pathsep)
    if bin_dir not in path:
        os.environ["PATH"] = os.pathsep.join([*path, bin_dir])  # e.g. the venv's ninja
    print(
        f"pinxfer: building against torch {found['torch']} (CUDA {found['torch_cuda']}) "
        f"from {os.path.dirname(found['torch_file'])}",
        file=sys.stderr,
        flush=True,
    )


def _setuptools_requirements() -> list[str]:
    """What pip must put in the isolated environment: nothing when the target environment's
    setuptools will do (the offline case), else a recent setuptools."""
    found = _torch_environment()
    if found is None:  # torch importable here: so is whatever this environment holds
        setuptools, wheel = _local_version("setuptools"), _local_version("wheel")
    else:
        setuptools, wheel = found["setuptools"], found["wheel"]
    return [] if _setuptools_builds_wheels(setuptools, wheel) else [_WANTED_SETUPTOOLS]


def _setuptools_builds_wheels(setuptools: str | None, wheel: str | None) -> bool:
    """Whether setuptools of this version (None: absent) builds wheels and editable installs,
    given the version of the `wheel` package beside it (None: absent)."""
    if setuptools is None:
        return False
    have = _version_tuple(setuptools)
    return have >= _SELF_SUFFICIENT_SETUPTOOLS or (
        have >= _MIN_SETUPTOOLS_WITH_WHEEL and wheel is not None
    )


def _local_version(name: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:  # noqa: BLE001 - not installed (or unreadable): ask for it
        return None


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def _setuptools_backend():
    _use_target_torch()
    try:
        from setuptools import build_meta
    except ImportError as err:
        _fail(
            f"setuptools is not importable ({err}): `pip install 'setuptools>=70.1'` in the "
            "environment pinxfer installs into, then build again."
        )
    return build_meta


def _wheel_backend():
    """setuptools' backend for the hooks that make a wheel or its metadata (both run
    bdist_wheel), once the setuptools it imported is known to build wheels. Under
    --no-build-isolation pip installs no build requirements, so the environment's own
    setuptools builds, however old: before 70.1 without the `wheel` package it fails with
    "invalid command 'bdist_wheel'" and no hint."""
    build_meta = _setuptools_backend()
    import setuptools

    wheel = _local_version("wheel")  # what setuptools < 70.1 finds bdist_wheel through
    if not _setuptools_builds_wheels(setuptools.__version__, wheel):
        with_wheel = f"wheel {wheel}" if wheel else "no `wheel` package"
        _fail(
            f"cannot build a wheel with setuptools {setuptools.__version__} "
            f"(imported from {os.path.dirname(setuptools.__file__)}) and {with_wheel}: "
            f"building needs setuptools >= {_version_text(_SELF_SUFFICIENT_SETUPTOOLS)}, or "
            f">= {_version_text(_MIN_SETUPTOOLS_WITH_WHEEL)} with `wheel` (older ones stop "
            "with \"invalid command 'bdist_wheel'\"). This is the setuptools of the environment "
            "the build runs in (with --no-build-isolation pip installs none for the build). "
            "Upgrade it there:\n"
            f"    {sys.executable} -m pip install '{_WANTED_SETUPTOOLS}'\n"
            "or build with isolation (without --no-build-isolation), where pip installs a "
            "recent setuptools for the build (from a package index)."
        )
    return build_meta


def _version_text(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))


def _requirements(hook: str, config_settings) -> list[str]:
    # Fails fast (in seconds) when the target environment has no torch.
    extra = _setuptools_requirements()
    if extra:
        # No usable setuptools yet: pip installs it, then calls the next hook.
        return extra
    backend = _setuptools_backend()
    wanted = getattr(backend, hook)(config_settings)
    # setuptools < 70.1 asks for "wheel"; drop it when the target environment has it (read
    # as _wheel_backend reads it: installed metadata on the path _use_target_torch extended).
    have_wheel = _local_version("wheel") is not None
    return [r for r in wanted if not (r.startswith("wheel") and have_wheel)]


# ---- PEP 517 / PEP 660 hooks: setuptools' own, after _use_target_torch (and, for
# those that make a wheel or its metadata, the check that setuptools can) ----


def get_requires_for_build_wheel(config_settings=None):
    return _requirements("get_requires_for_build_wheel", config_settings)


def get_requires_for_build_editable(config_settings=None):
    return _requirements("get_requires_for_build_editable", config_settings)


def get_requires_for_build_sdist(config_settings=None):
    return _requirements("get_requires_for_build_sdist", config_settings)


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    return _wheel_backend().prepare_metadata_for_build_wheel(metadata_directory, config_settings)


def prepare_metadata_for_build_editable(metadata_directory, config_settings=None):
    return _wheel_backend().prepare_metadata_for_build_editable(metadata_directory, config_settings)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    return _wheel_backend().build_wheel(wheel_directory, config_settings, metadata_directory)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    return _wheel_backend().build_editable(wheel_directory, config_settings, metadata_directory)


def build_sdist(sdist_directory, config_settings=None):
    return _setuptools_backend().build_sdist(sdist_directory, config_settings)
