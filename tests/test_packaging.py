"""What a release carries (issue 25): one version, written in pinxfer/__init__.py and read by
the packaging; every subpackage of pinxfer and its py.typed in the wheel; LICENSE and
CHANGELOG.md in the sdist. setup.py's build_py and sdist commands run for real (they import
torch, they compile nothing)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import tarfile

import pytest
import torch

import pinxfer

from .conftest import checkout_setup_lock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYPROJECT = os.path.join(ROOT, "pyproject.toml")

tomllib = pytest.importorskip("tomllib", reason="tomllib is Python >= 3.11")


def _setup_py(*args: str) -> subprocess.CompletedProcess:
    with checkout_setup_lock():
        proc = subprocess.run(
            [sys.executable, "setup.py", "-q", *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc


def _subpackages() -> set[str]:
    """Every package directory under pinxfer/ in the checkout, as a relative path."""
    found = set()
    for directory, _, files in os.walk(os.path.join(ROOT, "pinxfer")):
        if "__init__.py" in files and "__pycache__" not in directory:
            found.add(os.path.relpath(directory, ROOT))
    return found


def test_version_is_written_once_and_setuptools_reads_it():
    with open(PYPROJECT, "rb") as f:
        project = tomllib.load(f)["project"]
    assert "version" not in project, "pyproject.toml writes a version of its own"
    assert "version" in project["dynamic"]
    # setuptools' own resolution of the dynamic version, as a build does it. The dynamic
    # license comes from setup.py, which this reading does not run: its absence is no error.
    from setuptools.config.pyprojecttoml import read_configuration

    config = read_configuration(PYPROJECT, expand=True, ignore_option_errors=True)
    resolved = config["project"]["version"]
    assert resolved == pinxfer.__version__


def test_installed_metadata_reports_the_same_version():
    try:
        dist = importlib.metadata.distribution("pinxfer")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("pinxfer is not installed (a checkout used in place)")
    # An editable install records its checkout in direct_url.json.
    direct = json.loads(dist.read_text("direct_url.json") or "{}")
    url = direct.get("url", "")
    if url.removeprefix("file://") != ROOT:
        pytest.skip(f"the installed pinxfer is another checkout ({url or dist.locate_file('')})")
    assert dist.version == pinxfer.__version__


def test_wheel_carries_every_subpackage_and_py_typed(tmp_path):
    _setup_py("build_py", "--build-lib", str(tmp_path))
    built = {
        os.path.relpath(d, tmp_path) for d, _, files in os.walk(tmp_path) if "__init__.py" in files
    }
    assert built == _subpackages()
    assert (tmp_path / "pinxfer" / "py.typed").is_file()


def test_sdist_carries_license_changelog_and_py_typed(tmp_path):
    _setup_py("sdist", "--dist-dir", str(tmp_path))
    (archive,) = tmp_path.glob("pinxfer-*.tar.gz")
    with tarfile.open(archive) as tar:
        members = {m.name.split("/", 1)[1] for m in tar.getmembers() if "/" in m.name}
    for needed in ("LICENSE", "CHANGELOG.md", "pinxfer/py.typed"):
        assert needed in members, needed
    with tarfile.open(archive) as tar:
        license_text = tar.extractfile(f"{archive.name[: -len('.tar.gz')]}/LICENSE").read()
    assert b"BSD 3-Clause" in license_text or b"Redistribution and use" in license_text


def test_the_license_is_declared_in_the_form_the_building_setuptools_knows(tmp_path):
    """setuptools >= 77 takes PEP 639's SPDX expression and warns that the old form is
    deprecated (refused from 2027-02-18); older ones know only the free-text field and ignore
    the expression, so the metadata would then carry no license. setup.py picks the form
    (_license_metadata); whichever it picked, the building setuptools must not call it
    deprecated and the metadata must carry it (the rule itself is written once, there)."""
    proc = _setup_py("sdist", "--dist-dir", str(tmp_path))
    deprecations = [
        line
        for line in proc.stderr.splitlines()
        if "license" in line.lower() and "deprecat" in line
    ]
    assert not deprecations, proc.stderr[-3000:]
    (archive,) = tmp_path.glob("pinxfer-*.tar.gz")
    with tarfile.open(archive) as tar:
        info = tar.extractfile(f"{archive.name[: -len('.tar.gz')]}/PKG-INFO").read().decode()
    forms = {"License-Expression: BSD-3-Clause", "License: BSD-3-Clause"}
    assert len(forms & set(info.splitlines())) == 1, info[:2000]


def _setup_banner(tmp_path, nvcc_arches: str | None, arch_list: str | None):
    """setup.py's configuration run (`--name`: nothing compiled) against a fake toolkit whose
    nvcc reports `nvcc_arches` for --list-gpu-arch (None: that option fails, as on an nvcc
    before CUDA 11) and TORCH_CUDA_ARCH_LIST = `arch_list` (None: unset)."""
    nvcc = tmp_path / "bin" / "nvcc"
    nvcc.parent.mkdir(exist_ok=True)
    nvcc.write_text(
        "#!/bin/sh\n"
        'case "$1" in\n'
        '  --version) echo "Cuda compilation tools, release 13.0, V13.0.0" ;;\n'
        '  --list-gpu-arch) [ -n "$FAKE_ARCHES" ] && echo "$FAKE_ARCHES" || exit 1 ;;\n'
        "esac\n"
    )
    nvcc.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PINXFER_", "TORCH_CUDA"))}
    env.update(CUDA_HOME=str(tmp_path), FAKE_ARCHES=nvcc_arches or "")
    if arch_list is not None:
        env["TORCH_CUDA_ARCH_LIST"] = arch_list
    with checkout_setup_lock():
        return subprocess.run(
            [sys.executable, "setup.py", "--name"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )


def _banner_archs(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    lines = [line for line in proc.stdout.splitlines() if "GPU archs" in line]
    assert len(lines) == 1, proc.stdout
    return lines[0].split("GPU archs", 1)[1].strip()


@pytest.mark.skipif(torch.version.cuda is None, reason="a CUDA build of torch: its kernels' archs")
def test_kernel_architectures_are_torchs_that_nvcc_knows(tmp_path):
    """setup.py compiles csrc's CUDA kernels, unless TORCH_CUDA_ARCH_LIST says otherwise, for
    the architectures torch was built for that this nvcc knows, with PTX for the newest, with
    or without a GPU (torch's own default, the visible GPUs', fails where none is). An nvcc
    that cannot list its architectures gets torch's whole list; one that knows none of them
    stops the build saying what to set; a given list is used as given, trimmed."""
    torch_caps = sorted(
        int(f[3:]) for f in torch._C._cuda_getArchFlags().split() if f[3:].isdigit()
    )
    assert len(torch_caps) >= 2, torch._C._cuda_getArchFlags()

    def listed(caps: list[int]) -> str:
        return ";".join(f"{c // 10}.{c % 10}" for c in caps) + "+PTX"

    # nvcc knows all but torch's newest: that one is left out, and the next newest gets PTX.
    known = torch_caps[:-1]
    got = _banner_archs(_setup_banner(tmp_path, " ".join(f"compute_{c}" for c in known), None))
    assert got.startswith(listed(known) + " (torch's own; "), got
    assert f"[{torch_caps[-1]}] left out" in got, got
    # An nvcc that cannot say: torch's whole list.
    got = _banner_archs(_setup_banner(tmp_path, None, None))
    assert got.startswith(listed(torch_caps) + " (torch's own; TORCH_CUDA"), got
    # Given (padded): used as given, trimmed.
    got = _banner_archs(_setup_banner(tmp_path, "compute_90", " 9.0 "))
    assert got == "9.0 (TORCH_CUDA_ARCH_LIST)", got
    # An nvcc that knows none of torch's: a clear stop.
    proc = _setup_banner(tmp_path, "compute_10", None)
    assert proc.returncode != 0
    assert "set TORCH_CUDA_ARCH_LIST" in proc.stderr + proc.stdout, proc.stderr[-2000:]
