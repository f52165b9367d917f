"""Checks run by ``import pinxfer`` before it loads its compiled extension ``pinxfer._C``.

Loading ``_C`` runs its static initialisers (every ``TORCH_LIBRARY`` registration) against the
torch in the process, and ``pinxfer.install()`` then overrides ``at::HostAllocator``, whose
virtuals change between torch releases: a ``_C`` built for another torch can crash instead of
failing. So the torch version ``_C`` was built against is read from the library *file* (a
build stamp in its read-only data, csrc/python/fast_calls.cpp) before it is loaded, and an
import under another torch stops with one error that names both versions and the command
that rebuilds. Only the standard library and torch's version strings are used here.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import mmap
import os
import sys

import torch

_STAMP_START = b"PINXFER_BUILD_STAMP{"
_STAMP_MAX = 256

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def checkout_root() -> str | None:
    """The source checkout this package directory belongs to (it holds setup.py and csrc/),
    or None for an installed pinxfer."""
    root = os.path.dirname(PACKAGE_DIR)
    if os.path.isfile(os.path.join(root, "setup.py")) and os.path.isfile(
        os.path.join(root, "csrc", "module.cpp")
    ):
        return root
    return None


def rebuild_command() -> str:
    """What rebuilds _C against the running torch, for this copy of pinxfer."""
    root = checkout_root()
    if root is not None:
        return f"`pip install -e .` in {root} (rebuilds pinxfer/_C in place)"
    return (
        "`pip install --force-reinstall --no-deps --no-cache-dir .` in the pinxfer "
        "source checkout (a wheel built for another torch cannot be reused)"
    )


def read_build_stamp(path: str) -> dict[str, str] | None:
    """The build stamp of the library at ``path`` ({"torch": ..., "cuda": ...}), or None
    when it has none (built before builds were stamped, or not by pinxfer's setup.py)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        start = data.find(_STAMP_START)
        if start < 0:
            return None
        end = data.find(b"}", start, start + _STAMP_MAX)
        if end < 0:
            return None
        body = data[start + len(_STAMP_START) : end].decode("utf-8", "replace")
    fields = dict(item.split("=", 1) for item in body.split(";") if "=" in item)
    return fields if {"torch", "cuda"} <= fields.keys() else None


def running_torch() -> dict[str, str]:
    return {"torch": torch.__version__, "cuda": torch.version.cuda or "none"}


def mismatch_message(built: dict[str, str] | None, path: str) -> str | None:
    """The error for a _C at ``path`` stamped ``built`` under the running torch, or None
    when they match."""
    running = running_torch()
    if (
        built is not None
        and built["torch"] == running["torch"]
        and built["cuda"] == running["cuda"]
    ):
        return None
    if built is None:
        what = (
            "carries no build stamp (built by an older pinxfer), so the torch it was built "
            "for is unknown"
        )
    else:
        what = f"was built against torch {built['torch']} (CUDA {built['cuda']})"
    return (
        f"pinxfer's compiled extension {path} {what}, but this process runs torch "
        f"{running['torch']} (CUDA {running['cuda']}). It must be built against the torch that "
        f"imports it (it overrides torch's host allocator, whose layout changes between torch "
        f"releases), so it was not loaded. Rebuild it: {rebuild_command()}."
    )


def extension_path() -> str | None:
    """pinxfer/_C*.so beside this file, or None. Looked up in this directory only, not
    through the import system: another pinxfer's editable-install finder on sys.meta_path
    would answer for "pinxfer._C" with that checkout's library."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = os.path.join(PACKAGE_DIR, "_C" + suffix)
        if os.path.isfile(path):
            return path
    return None


def check_before_loading() -> str:
    """Finds pinxfer._C without loading it and checks its build stamp; returns its path.
    Raises ImportError saying what to run when there is none or it was built for another torch."""
    path = extension_path()
    if path is None:
        root = checkout_root()
        if root is not None:
            raise ImportError(
                f"pinxfer: this checkout ({root}) has no built extension (no "
                f"pinxfer/_C*.so): run `pip install -e .` in {root} to build it in place "
                '(4-5 minutes on 2 cores; `pip install -e ".[test]"` adds the test '
                "dependencies). A pinxfer installed with `pip install .` is not used from here: "
                "Python imports this checkout's pinxfer/ first; run from another directory to "
                "use the installed one."
            )
        raise ImportError(
            f"pinxfer is installed without its compiled extension pinxfer._C (in {PACKAGE_DIR}): "
            f"reinstall it: {rebuild_command()}."
        )
    message = mismatch_message(read_build_stamp(path), path)
    if message is not None:
        raise ImportError(message)
    return path


def load_extension(path: str):
    """Loads the library at ``path`` (the one checked) as pinxfer._C and returns it."""
    spec = importlib.util.spec_from_file_location("pinxfer._C", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["pinxfer._C"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules["pinxfer._C"]
        raise
    return module
