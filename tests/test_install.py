"""Installing pinxfer: the in-tree build backend (build_backend/pinxfer_backend.py), the
build stamp that ties _C to its torch (pinxfer/_build_check.py), and what a user reads when
something is missing.

The backend's hooks run here as pip runs them under build isolation: a fresh interpreter
that cannot import the installed torch (``python -S``: no site-packages, like pip's
isolated environment). Quick, no compiling. The full ``pip wheel .`` build carries the
``build`` marker (minutes; deselected by default, run with ``-m build``).
"""

from __future__ import annotations

import glob
import importlib.metadata
import json
import os
import shutil
import struct
import subprocess
import sys
import tarfile
import time
import venv
import zipfile
from pathlib import Path

import pytest
import torch

import pinxfer
from pinxfer import _build_check

from .conftest import checkout_setup_lock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BACKEND_DIR = os.path.join(ROOT, "build_backend")


def _run_hook(
    code: str, tmp_path, env_extra=None, timeout=300, interpreter=(sys.executable, "-S")
) -> subprocess.CompletedProcess:
    """Runs ``code`` with the backend imported as ``backend``, by default in an interpreter
    that sees no site-packages (pip's build isolation hides them the same way), from the
    checkout."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PINXFER_TORCH_PYTHON")}
    env.update(env_extra or {})
    script = (
        f"import sys; sys.path.insert(0, {BACKEND_DIR!r}); import pinxfer_backend as backend\n"
        + code
    )
    with checkout_setup_lock():
        return subprocess.run(
            [*interpreter, "-c", script],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )


@pytest.fixture(scope="module")
def isolated_hooks(tmp_path_factory):
    """Every hook pip calls, run once in one isolated interpreter (one probe of the target
    torch; setup.py runs in-process for each hook): their answers as JSON."""
    out = tmp_path_factory.mktemp("hooks")
    code = (
        "import importlib.util, json\n"
        "torch_visible = importlib.util.find_spec('torch') is not None\n"
        "answers = {'torch_visible_before': torch_visible,\n"
        "           'wheel': backend.get_requires_for_build_wheel(),\n"
        "           'editable': backend.get_requires_for_build_editable(),\n"
        "           'sdist': backend.get_requires_for_build_sdist(),\n"
        f"           'metadata': backend.prepare_metadata_for_build_wheel({str(out)!r}),\n"
        f"           'sdist_name': backend.build_sdist({str(out)!r})}}\n"
        "print('HOOKS' + json.dumps(answers))\n"
    )
    proc = _run_hook(code, out)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("HOOKS"))
    return json.loads(line[5:]), proc, out


def test_isolated_interpreter_cannot_see_torch(isolated_hooks):
    # The premise of the hook tests: under -S, as under pip's isolation, no torch.
    answers, _, _ = isolated_hooks
    assert answers["torch_visible_before"] is False


def test_backend_asks_for_no_torch_and_downloads_nothing_here(isolated_hooks):
    """get_requires_for_build_wheel/editable/sdist never name torch; where the target
    environment has setuptools >= 70.1 (this one) they name nothing, so an offline pip
    install works."""
    answers, proc, _ = isolated_hooks
    for hook in ("wheel", "editable", "sdist"):
        reqs = answers[hook]
        assert not any(r.lower().startswith("torch") for r in reqs), (hook, reqs)
        assert reqs == [], (hook, reqs)
    assert f"building against torch {torch.__version__}" in proc.stderr


def test_backend_metadata_builds_against_the_installed_torch(isolated_hooks):
    """prepare_metadata_for_build_wheel runs setup.py (which imports torch) under isolation:
    the backend found the installed torch, and setup.py said which."""
    answers, proc, out = isolated_hooks
    metadata = (out / answers["metadata"] / "METADATA").read_text()
    assert "Name: pinxfer" in metadata
    assert "Provides-Extra: test" in metadata
    for dep in ("pytest", "numpy", "hypothesis"):
        assert any(
            ln.startswith(f"Requires-Dist: {dep}") and 'extra == "test"' in ln
            for ln in metadata.splitlines()
        ), dep
    assert f"torch        {torch.__version__}" in proc.stdout + proc.stderr


def test_sdist_carries_everything_a_build_needs(isolated_hooks):
    """An sdist (pip install pinxfer-*.tar.gz, pip install git+...) builds only if it holds
    the headers, the backend that pyproject.toml names, and setup.py."""
    answers, _, out = isolated_hooks
    with tarfile.open(out / answers["sdist_name"]) as tar:
        members = {m.name.split("/", 1)[1] for m in tar.getmembers() if "/" in m.name}
    for needed in (
        "pyproject.toml",
        "setup.py",
        "MANIFEST.in",
        "build_backend/pinxfer_backend.py",
        "csrc/module.cpp",
        "csrc/ops/kernels.h",
        "csrc/runtime/cuda_runtime.h",
        "csrc/python/fast_calls.cpp",
        "pinxfer/__init__.py",
        "pinxfer/_build_check.py",
    ):
        assert needed in members, needed
    assert not any(m.endswith(".so") for m in members)


def test_backend_without_torch_fails_in_seconds_saying_what_to_run(tmp_path):
    """The target environment has no torch: one message naming the commands, no traceback,
    long before anything compiles."""
    env_dir = tmp_path / "venv-without-torch"
    venv.create(env_dir, with_pip=False)
    python = str(env_dir / "bin" / "python")
    start = time.monotonic()
    proc = _run_hook(
        "backend.get_requires_for_build_wheel()",
        tmp_path,
        env_extra={"PINXFER_TORCH_PYTHON": python},
    )
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert elapsed < 30, elapsed
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "cannot import torch" in proc.stderr
    assert f"PINXFER_TORCH_PYTHON names {python}" in proc.stderr
    assert f"{python} -m pip install torch" in proc.stderr
    assert f"{python} -m pip install ." in proc.stderr


def _site_dir_of(distribution: str) -> str:
    """The directory that holds an installed distribution (its site-packages). From its
    metadata: importlib.util.find_spec("pip") would switch off setuptools' distutils shim in
    this process (its meta-path finder does that when pip is looked for), and the later
    in-process imports of setuptools (test_packaging) would fail."""
    return str(importlib.metadata.distribution(distribution).locate_file(""))


def test_pip_isolation_hiding_a_pythonpath_torch_says_no_build_isolation(tmp_path):
    """torch reached only through PYTHONPATH (`module load pytorch` on a cluster) in a venv
    without torch: pip's default build isolation replaces PYTHONPATH, so the build cannot see
    that torch. The message must lead to `pip install --no-build-isolation .` (PINXFER_TORCH_
    PYTHON cannot bring PYTHONPATH back), and must not call pip's isolation a venv of the
    build tool's own (it ran in the target venv). Real pip, offline, fails in seconds. If
    pip ever makes its venv isolation the default, this fails with the venv message."""
    env_dir = tmp_path / "venv-torch-on-pythonpath"
    venv.create(env_dir, with_pip=False)
    python = str(env_dir / "bin" / "python")
    module_load = os.pathsep.join(dict.fromkeys([_site_dir_of("torch"), _site_dir_of("pip")]))
    env = {k: v for k, v in os.environ.items() if k != "PINXFER_TORCH_PYTHON"}
    env.update(PYTHONPATH=module_load, PIP_CONFIG_FILE=os.devnull)
    env.pop("PYTHONNOUSERSITE", None)
    finds_torch = "import importlib.util as u; print(u.find_spec('torch') is not None)"

    def sees_torch(pythonpath: str | None) -> bool:
        probe_env = {k: v for k, v in env.items() if k != "PYTHONPATH"}
        if pythonpath is not None:
            probe_env["PYTHONPATH"] = pythonpath
        out = subprocess.run(
            [python, "-c", finds_torch], env=probe_env, capture_output=True, text=True, timeout=60
        )
        return out.stdout.strip() == "True"

    # The premise: this venv's torch is PYTHONPATH's, and only PYTHONPATH's.
    assert sees_torch(module_load) and not sees_torch(None)
    with checkout_setup_lock():
        proc = subprocess.run(
            [python, "-m", "pip", "wheel", "--no-deps", "--no-index", "-w", str(tmp_path), ROOT],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-4000:]
    assert f"({python}) cannot import torch with PYTHONPATH unset" in output, output[-4000:]
    no_isolation = f"{python} -m pip install --no-build-isolation ."
    assert no_isolation in output, output[-4000:]
    assert output.index(no_isolation) < output.index(f"{python} -m pip install torch")
    assert "virtual environment of its own" not in output


def _build_venv(tmp_path, maker: str | None = None) -> str:
    """A throwaway venv as python -m build or pip's venv isolation makes one in the temporary
    directory, made by ``maker`` (an interpreter; None: this one, which has torch), which
    Python >= 3.11 records in its pyvenv.cfg. Returns its interpreter."""
    env_dir = tmp_path / "build-env-made-by-a-tool"  # python -m build's mkdtemp prefix
    if maker is None:
        # Its python a link to this one's binary, as pip makes it: the same file behind two
        # environments (the backend once took them for one).
        venv.create(env_dir, with_pip=False, symlinks=True)
    else:
        subprocess.run(
            [maker, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=120
        )
    return str(env_dir / "bin" / "python")


def _run_in_build_venv(python: str, tmp_path) -> subprocess.CompletedProcess:
    # As python -m build runs it: the build venv's own interpreter, site-packages and all,
    # and no PYTHONNOUSERSITE (empty is unset), which only pip's default isolation sets.
    return _run_hook(
        "print('RESULT', backend.get_requires_for_build_wheel())",
        tmp_path,
        env_extra={"PYTHONNOUSERSITE": ""},
        interpreter=(python,),
    )


@pytest.mark.skipif(sys.version_info < (3, 11), reason="venv records its maker from 3.11 on")
def test_build_in_a_venv_of_its_own_builds_against_the_torch_of_the_python_that_made_it(tmp_path):
    """pip's venv isolation (pip 26's --use-feature venv-isolation) and python -m build run the
    backend in a throwaway venv that holds only the build requirements. It was made by the
    interpreter pip installs into (or that ran python -m build), which pyvenv.cfg records: the
    backend builds against that interpreter's torch, offline, as under pip's default isolation.
    Until session 51 it stopped there and asked for PINXFER_TORCH_PYTHON."""
    python = _build_venv(tmp_path)
    proc = _run_in_build_venv(python, tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert f"its maker, {sys.executable}, has: building against that" in proc.stderr
    assert f"building against torch {torch.__version__}" in proc.stderr, proc.stderr
    assert "RESULT []" in proc.stdout  # this environment's setuptools: nothing to download


def test_a_users_own_venv_without_torch_is_not_built_against_its_makers_torch(tmp_path):
    """A venv of the user's in the temporary directory (a CI job's), built from without
    isolation: it is the install target, and its maker's torch (here this interpreter's) is
    another environment's, whose ABI the installed pinxfer would not match. The build stops,
    saying (among the ways out) to install torch there, as before session 51 (found by review:
    the first form asked the maker of any venv in the temporary directory)."""
    env_dir = tmp_path / "user venv"
    venv.create(env_dir, with_pip=False, symlinks=True)
    python = str(env_dir / "bin" / "python")
    proc = _run_in_build_venv(python, tmp_path)
    assert proc.returncode != 0
    assert "its maker" not in proc.stderr and "which made it" not in proc.stderr, proc.stderr
    assert f"If {python} is itself the environment pinxfer is for, install torch there" in (
        proc.stderr
    )


def test_build_in_a_venv_of_its_own_names_pinxfer_torch_python_first(tmp_path):
    """Where neither the build's venv nor the interpreter that made it has torch (here a venv
    made by a venv without torch), the advice starts with PINXFER_TORCH_PYTHON, the one way
    that keeps isolation, then building without it; installing torch in the throwaway venv is
    no use."""
    plain = tmp_path / "no-torch"
    venv.create(plain, with_pip=False)
    maker = str(plain / "bin" / "python")
    python = _build_venv(tmp_path, maker=maker)
    proc = _run_in_build_venv(python, tmp_path)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    assert f"a virtual environment of its own ({python}" in proc.stderr, proc.stderr
    if sys.version_info >= (3, 11):  # venv records its maker from 3.11 on
        assert f"nor can {maker}, which made it" in proc.stderr, proc.stderr
    first_advice = proc.stderr.index("PINXFER_TORCH_PYTHON=/path/to/the/python/with/torch")
    assert first_advice < proc.stderr.index("python -m build --no-isolation")
    assert f"{python} -m pip install torch" not in proc.stderr


@pytest.mark.skipif(sys.version_info < (3, 11), reason="venv records its maker from 3.11 on")
def test_pips_venv_isolation_prepares_pinxfer_against_the_installed_torch(tmp_path):
    """Real pip, offline, with its opt-in venv isolation (pip 26: the build's venv made by the
    interpreter pip installs into): resolving pinxfer (get_requires and metadata, the hooks that
    find torch; --dry-run stops before the compile) succeeds, against this interpreter's torch.
    Before session 51 the backend stopped, asking for PINXFER_TORCH_PYTHON."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PINXFER_TORCH_PYTHON")}
    with checkout_setup_lock():
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                # No PIP_* variables or pip config of the machine: one that turns isolation
                # off, or requires a virtualenv, would change what is tested.
                "--isolated",
                "--dry-run",
                "--no-deps",
                "--no-index",
                "--use-feature",
                "venv-isolation",
                "-v",
                "--report",
                str(tmp_path / "r.json"),
                ROOT,
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
    if "invalid choice: 'venv-isolation'" in proc.stderr:
        pytest.skip("this pip has no venv isolation (pip 26 added it)")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    output = proc.stdout + proc.stderr
    assert f"its maker, {sys.executable}, has: building against that" in output, output[-4000:]
    report = json.loads((tmp_path / "r.json").read_text())
    assert [item["metadata"]["name"] for item in report["install"]] == ["pinxfer"]


def _fake_build_environment(root, setuptools: str, wheel: str | None):
    """What --no-build-isolation puts in front of the backend, reduced to what its setuptools
    check reads: a torch that is importable (so nothing is probed), a setuptools package of
    the given version whose build_meta only names the hook called, and, if ``wheel`` names a
    version, the wheel distribution's metadata (setuptools < 70.1 finds bdist_wheel through
    it). Run under ``python -S``: nothing else is importable."""
    (root / "torch").mkdir(parents=True)
    (root / "torch" / "__init__.py").write_text("")
    (root / "setuptools").mkdir()
    (root / "setuptools" / "__init__.py").write_text(f"__version__ = {setuptools!r}\n")
    hooks = (
        "prepare_metadata_for_build_wheel",
        "prepare_metadata_for_build_editable",
        "build_wheel",
        "build_editable",
        "build_sdist",
    )
    (root / "setuptools" / "build_meta.py").write_text(
        "".join(f"def {hook}(*args):\n    return 'stub {hook}'\n" for hook in hooks)
    )
    if wheel is not None:
        dist_info = root / f"wheel-{wheel}.dist-info"
        dist_info.mkdir()
        (dist_info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: wheel\nVersion: {wheel}\n"
        )


def _call_hook(hook: str, site, tmp_path) -> subprocess.CompletedProcess:
    return _run_hook(
        f"sys.path.insert(0, {str(site)!r})\n"
        f"print('RESULT', backend.{hook}({str(tmp_path / 'out')!r}))\n",
        tmp_path,
    )


WHEEL_HOOKS = [
    "prepare_metadata_for_build_wheel",
    "prepare_metadata_for_build_editable",
    "build_wheel",
    "build_editable",
]


@pytest.mark.parametrize(
    ("setuptools", "wheel", "builds"),
    [
        ("65.5.0", None, False),  # bundled with Python 3.11's ensurepip; no bdist_wheel
        ("63.4.3", "0.45.1", False),  # no PEP 660 editables before 64
        ("65.5.0", "0.45.1", True),  # bdist_wheel from the wheel package
        ("70.1.0", None, True),  # bdist_wheel built in
    ],
)
@pytest.mark.parametrize("hook", WHEEL_HOOKS)
def test_wheel_hooks_refuse_a_setuptools_that_cannot_build_wheels(
    tmp_path, hook, setuptools, wheel, builds
):
    """Under --no-build-isolation pip installs no build requirements, so an old setuptools in
    the environment (a --system-site-packages venv's, Python 3.11's bundled 65.5) builds and
    stopped with setuptools' "invalid command 'bdist_wheel'". The backend stops first with
    the version, where it came from, and the fix."""
    site = tmp_path / "site"
    _fake_build_environment(site, setuptools, wheel)
    proc = _call_hook(hook, site, tmp_path)
    if builds:
        assert proc.returncode == 0, proc.stderr
        assert f"RESULT stub {hook}" in proc.stdout
        return
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    assert f"cannot build a wheel with setuptools {setuptools}" in proc.stderr
    assert f"(imported from {site / 'setuptools'})" in proc.stderr
    assert ("and wheel 0.45.1" if wheel else "and no `wheel` package") in proc.stderr
    assert f"{sys.executable} -m pip install 'setuptools>=70.1'" in proc.stderr
    assert "--no-build-isolation" in proc.stderr


def test_an_sdist_builds_with_an_old_setuptools(tmp_path):
    """An sdist needs no bdist_wheel: the check is not in its way."""
    site = tmp_path / "site"
    _fake_build_environment(site, "65.5.0", None)
    proc = _call_hook("build_sdist", site, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "RESULT stub build_sdist" in proc.stdout


def test_pythons_bundled_old_setuptools_is_refused_with_the_fix(tmp_path):
    """The same with a real old setuptools: the one Python 3.11's ensurepip bundles (65.5.0,
    the setuptools of a fresh 3.11 venv), unpacked from its wheel; no index needed."""
    import ensurepip

    bundled = glob.glob(
        os.path.join(os.path.dirname(ensurepip.__file__), "_bundled", "setuptools-*.whl")
    )
    if not bundled:
        pytest.skip("this Python bundles no setuptools (3.12 and later)")
    site = tmp_path / "site"
    with zipfile.ZipFile(bundled[0]) as whl:
        whl.extractall(site)
    (site / "torch").mkdir()
    (site / "torch" / "__init__.py").write_text("")
    version = os.path.basename(bundled[0]).split("-")[1]
    proc = _call_hook("prepare_metadata_for_build_wheel", site, tmp_path)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "error: invalid command" not in proc.stdout + proc.stderr  # setuptools' own
    assert f"cannot build a wheel with setuptools {version}" in proc.stderr, proc.stderr
    assert f"(imported from {site / 'setuptools'})" in proc.stderr


# ---------------------------------------------------------------- the build stamp


def test_loaded_extension_is_stamped_with_this_torch():
    path = pinxfer._C.__file__
    stamp = _build_check.read_build_stamp(path)
    assert stamp == {"torch": torch.__version__, "cuda": torch.version.cuda or "none"}
    assert pinxfer._C.built_with_torch == torch.__version__
    assert pinxfer._C.built_with_torch_cuda == (torch.version.cuda or "none")
    assert _build_check.mismatch_message(stamp, path) is None


def _copy_package(dest, with_checkout: bool):
    """A copy of pinxfer's Python package (no _C) under dest/, optionally looking like a
    source checkout (setup.py and csrc/module.cpp beside it)."""
    shutil.copytree(
        os.path.join(ROOT, "pinxfer"),
        dest / "pinxfer",
        ignore=shutil.ignore_patterns("*.so", "__pycache__"),
    )
    if with_checkout:
        (dest / "csrc").mkdir()
        (dest / "csrc" / "module.cpp").write_text("")
        (dest / "setup.py").write_text("")


def _import_in(directory) -> subprocess.CompletedProcess:
    code = (
        "import sys\n"
        "try:\n"
        "    import pinxfer\n"
        "except ImportError as err:\n"
        "    print('IMPORT ERROR:', err)\n"
        "    print('C LOADED:', 'pinxfer._C' in sys.modules)\n"
        "    sys.exit(3)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=directory,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_extension_built_for_another_torch_is_refused_before_loading(tmp_path):
    """A _C whose stamp names another torch is never loaded: one ImportError with both
    versions and the command that rebuilds."""
    _copy_package(tmp_path, with_checkout=False)
    so = pinxfer._C.__file__
    with open(so, "rb") as f:
        data = f.read()
    old = f"torch={torch.__version__};".encode()
    assert data.count(old) == 1
    other = "9.99.9".ljust(len(torch.__version__), "x")  # same length: the file stays valid
    with open(tmp_path / "pinxfer" / os.path.basename(so), "wb") as f:
        f.write(data.replace(old, f"torch={other};".encode()))
    proc = _import_in(tmp_path)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert f"was built against torch {other}" in proc.stdout
    assert f"this process runs torch {torch.__version__}" in proc.stdout
    assert "pip install --force-reinstall --no-deps --no-cache-dir ." in proc.stdout
    assert "C LOADED: False" in proc.stdout


def test_checkout_without_build_says_so_not_circular_import(tmp_path):
    _copy_package(tmp_path, with_checkout=True)
    proc = _import_in(tmp_path)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert f"this checkout ({tmp_path}) has no built extension" in proc.stdout
    assert f"run `pip install -e .` in {tmp_path}" in proc.stdout
    assert "circular" not in proc.stdout


def test_install_without_extension_says_reinstall(tmp_path):
    _copy_package(tmp_path, with_checkout=False)
    proc = _import_in(tmp_path)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "installed without its compiled extension" in proc.stdout
    assert "pip install --force-reinstall" in proc.stdout


# ---------------------------------------------------------------- the full build (minutes)


@pytest.mark.build
def test_pip_wheel_builds_with_isolation_and_no_index(tmp_path):
    """`pip wheel --no-index .` with build isolation on (pip's default): no torch among the
    build requirements, nothing downloaded, and the wheel's _C is stamped with the installed
    torch, without debug information. About 4 minutes on 2 cores."""
    # Not the developer's build switches: the wheel is checked as a user's build makes it,
    # with the kernels' architectures setup.py chooses itself (no TORCH_CUDA_ARCH_LIST).
    skipped = {"PYTHONPATH", "PINXFER_DEBUG_INFO", "PINXFER_SANITIZE", "TORCH_CUDA_ARCH_LIST"}
    env = {k: v for k, v in os.environ.items() if k not in skipped}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-index",
            "--no-deps",
            "-v",
            "-w",
            str(tmp_path),
            ROOT,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    if "variant      CUDA" in proc.stdout:
        # The banner names the kernels' architectures: torch's own that nvcc knows.
        assert "(torch's own" in proc.stdout, proc.stdout[-4000:]
    wheels = list(tmp_path.glob("pinxfer-*.whl"))
    assert len(wheels) == 1
    with zipfile.ZipFile(wheels[0]) as whl:
        names = whl.namelist()
        so_name = next(n for n in names if n.startswith("pinxfer/_C") and n.endswith(".so"))
        whl.extract(so_name, tmp_path)
    # Every module of the source tree ships (a package missing from the list once made
    # the installed pinxfer fail at import).
    package_root = os.path.join(ROOT, "pinxfer")
    sources = {
        os.path.relpath(os.path.join(d, f), ROOT).replace(os.sep, "/")
        for d, _, files in os.walk(package_root)
        for f in files
        if f.endswith(".py")
    }
    assert sources <= set(names), sorted(sources - set(names))
    stamp = _build_check.read_build_stamp(str(tmp_path / so_name))
    assert stamp == {"torch": torch.__version__, "cuda": torch.version.cuda or "none"}
    # Built without debug information (setup.py's -g0): with Python's -g the wheel's _C was
    # 67 MB of torch's headers' DWARF, and each file took twice as long to compile.
    sections = _elf_section_names(tmp_path / so_name)
    assert ".text" in sections and ".symtab" in sections, sections  # the reader works
    assert not any(name.startswith(".debug_") for name in sections), sections


def _elf_section_names(path) -> set[str]:
    """The section names of a 64-bit little-endian ELF file (the header's section table and
    its string table; no library needed)."""
    data = Path(path).read_bytes()
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1, "not an ELF64 LE file"
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [data[shoff + i * shentsize : shoff + (i + 1) * shentsize] for i in range(shnum)]
    (strings_offset,) = struct.unpack_from("<Q", headers[shstrndx], 0x18)
    names = set()
    for header in headers:
        (name_offset,) = struct.unpack_from("<I", header, 0)
        start = strings_offset + name_offset
        names.add(data[start : data.index(b"\0", start)].decode())
    return names
