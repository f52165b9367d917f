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
