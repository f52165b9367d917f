"""Build pinxfer._C from csrc/ with torch.utils.cpp_extension.

Configuration (printed at build time):
  * torch is a CUDA build and a CUDA toolkit is found (CUDA_HOME or nvcc on PATH)
      -> CUDA build: csrc/**/*.cpp including csrc/ops/cuda/, and csrc/**/cuda/*.cu by nvcc,
         PINXFER_WITH_CUDA=1, links cudart. No GPU is needed to build this way: the kernels
         are compiled for TORCH_CUDA_ARCH_LIST, else the architectures torch was built for
         that nvcc knows (_cuda_architectures).
  * torch is a CUDA build but no toolkit is found
      -> error, unless PINXFER_CPU_ONLY=1 asks for the CPU-only variant on purpose.
  * torch is a CPU build, or PINXFER_CPU_ONLY=1
      -> CPU-only variant: the allocator page-locks with mlock, CUDA ops are absent.

Debug information: none by default (-g0: half the compile time, a _C of a few MB);
PINXFER_DEBUG_INFO=1 builds with -g.

Sanitizer builds (orthogonal to the above), PINXFER_SANITIZE=...:
  * address -> ASan + UBSan (-fsanitize=address,undefined); any UBSan report aborts
               (-fno-sanitize-recover=all), like an ASan report.
  * thread  -> TSan (-fsanitize=thread).
  Both compile with -g -O1 -fno-omit-frame-pointer -UNDEBUG, link the sanitizer
  runtime, and define PINXFER_DEBUG_INVARIANTS=1 (the pool's invariant checks).
  The extension then loads only into a process that starts with that runtime:
  run Python with LD_PRELOAD=$(g++ -print-file-name=libasan.so) (or libtsan.so).
  scripts/sanitize.sh does all of it, on the CPU-only variant, in a scratch copy.
"""

import glob
import os
import subprocess
import sys

import setuptools
from setuptools import setup


def _find_cuda_home() -> None:
    """torch guesses CUDA_HOME from `which nvcc`; a wrapper script on PATH (as on
    our machines, /usr/local/bin/nvcc) makes that guess /usr/local, which has no
    headers. Pick a toolkit root that really holds cuda_runtime.h, before
    torch.utils.cpp_extension reads the environment."""
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return
    import shutil

    candidates = []
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    candidates += ["/usr/local/cuda", *sorted(glob.glob("/usr/local/cuda-*"), reverse=True)]
    for root in candidates:
        if os.path.exists(os.path.join(root, "include", "cuda_runtime.h")):
            os.environ["CUDA_HOME"] = root
            return


_find_cuda_home()

import torch
from torch.utils import cpp_extension

HERE = os.path.dirname(os.path.abspath(__file__))


def _sources(with_cuda: bool) -> list[str]:
    files = sorted(glob.glob(os.path.join("csrc", "**", "*.cpp"), recursive=True))
    if with_cuda:  # kernels: plain CUDA files, compiled by nvcc
        files += sorted(glob.glob(os.path.join("csrc", "**", "cuda", "*.cu"), recursive=True))
    else:
        files = [f for f in files if os.sep + "cuda" + os.sep not in f]
    return files


def _configure():
    cpu_only = os.environ.get("PINXFER_CPU_ONLY", "0") == "1"
    torch_cuda = torch.version.cuda
    cuda_home = cpp_extension.CUDA_HOME
    if cpu_only:
        with_cuda, why = False, "PINXFER_CPU_ONLY=1"
    elif torch_cuda is None:
        with_cuda, why = False, f"torch {torch.__version__} is a CPU build"
    elif cuda_home is None:
        sys.exit(
            f"pinxfer: torch {torch.__version__} is a CUDA {torch_cuda} build, but no CUDA "
            "toolkit was found (set CUDA_HOME or put nvcc on PATH). Install the toolkit to build "
            "the CUDA paths, or set PINXFER_CPU_ONLY=1 to build the CPU-only variant on purpose."
        )
    else:
        with_cuda, why = True, f"torch CUDA {torch_cuda}, toolkit at {cuda_home}"
    return with_cuda, why


# PINXFER_SANITIZE value -> (banner text, compile flags, link flags).
_SANITIZERS = {
    "address": (
        "address (ASan + UBSan, reports abort)",
        ["-fsanitize=address,undefined", "-fno-sanitize-recover=all"],
        ["-fsanitize=address,undefined"],
    ),
    "thread": ("thread (TSan)", ["-fsanitize=thread"], ["-fsanitize=thread"]),
}


def _sanitizer():
    value = os.environ.get("PINXFER_SANITIZE", "").strip().lower()
    if value in ("", "0", "none", "off"):
        return None
    if value not in _SANITIZERS:
        sys.exit(
            f"pinxfer: unknown PINXFER_SANITIZE={os.environ['PINXFER_SANITIZE']!r}: use "
            f"{' or '.join(sorted(_SANITIZERS))} (or leave it unset for a normal build)."
        )
    return value


with_cuda, why = _configure()
sanitize = _sanitizer()
sources = _sources(with_cuda)
cxx_flags = ["-O3", "-Wno-interference-size", "-Wall", "-Wno-unused-parameter"]
# CI builds with PINXFER_WERROR=1: a warning in pinxfer's own code fails the build there.
# Off for users, whose compiler or torch headers may warn about things CI's do not.
werror = os.environ.get("PINXFER_WERROR", "0") == "1"
if werror:
    cxx_flags.append("-Werror")
# Without debug information by default: Python's CFLAGS carry -g, which doubles each
# file's compile time (torch's headers' debug info: 26 s against 13 s for one file on this
# project's 2-core machine) and made _C 67 MB. Symbols stay, so a crash's stack still names
# functions. PINXFER_DEBUG_INFO=1 builds with -g (line numbers in gdb); sanitizer builds always do.
debug_info = os.environ.get("PINXFER_DEBUG_INFO", "0") == "1"
if debug_info and not sanitize:  # a sanitizer build adds -g itself, below
    cxx_flags.append("-g")  # whether or not this Python's CFLAGS carry it
elif not sanitize:
    cxx_flags.append("-g0")
link_flags = []
define_macros = [
    ("PINXFER_WITH_CUDA", "1" if with_cuda else "0"),
    # The torch this build is for: _C carries both in a build stamp that pinxfer/__init__.py
    # reads before loading it (csrc/python/fast_calls.cpp), and refuses another torch.
    ("PINXFER_TORCH_VERSION_STR", f'"{torch.__version__}"'),
    ("PINXFER_TORCH_CUDA_VERSION_STR", f'"{torch.version.cuda or "none"}"'),
]
if sanitize:
    _, san_compile, san_link = _SANITIZERS[sanitize]
    # -O1 keeps stacks readable and runs fast enough; -UNDEBUG undoes Python's
    # -DNDEBUG so assert()s run too.
    cxx_flags = ["-g", "-O1", "-fno-omit-frame-pointer", "-UNDEBUG", *san_compile, *cxx_flags[1:]]
    link_flags = san_link
    define_macros.append(("PINXFER_DEBUG_INVARIANTS", "1"))


def _nvcc(*args: str) -> str | None:
    """This toolkit's nvcc run with `args`: its output, or None where it fails."""
    try:
        return subprocess.run(
            [os.path.join(cpp_extension.CUDA_HOME, "bin", "nvcc"), *args],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except Exception:  # noqa: BLE001 - each caller says what stands in
        return None


if with_cuda:
    # Record which toolkit we compiled against so Python can report it ("unknown" rather than
    # fail the build).
    version = _nvcc("--version") or ""
    release = (
        version.split("release ")[1].split(",")[0]
        if "release " in version
        else torch.version.cuda or "unknown"
    )
    define_macros.append(("PINXFER_CUDA_VERSION_STR", f'"{release}"'))


def _nvcc_architectures() -> set[int] | None:
    """The compute capabilities this nvcc compiles for (`nvcc --list-gpu-arch`: compute_90 ->
    90), or None where it cannot say (an nvcc before CUDA 11 has no such option): then torch's
    list is used unfiltered."""
    out = _nvcc("--list-gpu-arch") or ""
    found = {int(w[8:]) for w in out.split() if w.startswith("compute_") and w[8:].isdigit()}
    return found or None


def _cuda_architectures() -> str:
    """What nvcc compiles pinxfer's kernels (csrc/**/cuda/*.cu) for, said in the banner:
    TORCH_CUDA_ARCH_LIST when set (not blank); else the architectures this torch was built for
    that this nvcc knows, with PTX for the newest. Not torch's own default (the visible GPUs'):
    a build on a machine without a GPU (CI, a container image) would fail on its empty list, and
    a wheel built on one GPU's machine would hold the kernel for that GPU alone (elsewhere the
    copy engine reads instead: transfer/cuda/staged_read.h). The kernel is small: each
    architecture adds a second or two to the build."""
    given = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if given:
        os.environ["TORCH_CUDA_ARCH_LIST"] = given  # torch reads the raw value: no padding
        return f"{given} (TORCH_CUDA_ARCH_LIST)"
    os.environ.pop("TORCH_CUDA_ARCH_LIST", None)  # blank: unset
    known = _nvcc_architectures()
    capabilities = set()
    for flag in (torch._C._cuda_getArchFlags() or "").split():
        digits = flag.removeprefix("sm_")
        if flag.startswith("sm_") and digits.isdigit() and len(digits) >= 2:
            capabilities.add(int(digits))  # sm_90a and compute_* entries are left out
    usable = sorted(c for c in capabilities if known is None or c in known)
    if not usable:
        sys.exit(
            "pinxfer: torch names no GPU architecture it was built for that this nvcc compiles "
            f"for (torch: {torch._C._cuda_getArchFlags()!r}; nvcc: {sorted(known or [])}): set "
            "TORCH_CUDA_ARCH_LIST to the GPUs pinxfer will run on (e.g. TORCH_CUDA_ARCH_LIST=9.0)."
        )
    archs = [f"{c // 10}.{c % 10}" for c in usable]  # 90 -> 9.0, 120 -> 12.0
    archs[-1] += "+PTX"  # the newest also as PTX, which newer GPUs compile when loading it
    os.environ["TORCH_CUDA_ARCH_LIST"] = ";".join(archs)
    dropped = sorted(capabilities - set(usable))
    note = f"; {dropped} left out: this nvcc does not know them" if dropped else ""
    return f"{';'.join(archs)} (torch's own{note}; TORCH_CUDA_ARCH_LIST sets others)"


cuda_archs = _cuda_architectures() if with_cuda else "none (CPU-only)"

# Parallel compile by default: torch's ninja build reads MAX_JOBS (ninja's own default
# oversubscribes a shared machine; without ninja torch compiles one file at a time).
jobs = os.environ.setdefault("MAX_JOBS", str(len(os.sched_getaffinity(0))))
try:
    cpp_extension.verify_ninja_availability()
    compile_mode = f"ninja, MAX_JOBS={jobs} files at a time"
except RuntimeError:
    compile_mode = (
        "one file at a time: ninja not found (`pip install ninja` makes the build "
        f"{jobs}x parallel)"
    )

debug_info_text = (
    "-g (PINXFER_DEBUG_INFO=1 or a sanitizer)"
    if debug_info or sanitize
    else "none (-g0; PINXFER_DEBUG_INFO=1 builds with -g)"
)
Extension = cpp_extension.CUDAExtension if with_cuda else cpp_extension.CppExtension
print(
    "pinxfer build configuration:\n"
    f"  torch        {torch.__version__} (CUDA {torch.version.cuda})\n"
    f"  variant      {'CUDA' if with_cuda else 'CPU-only'} ({why})\n"
    f"  sanitizer    {_SANITIZERS[sanitize][0] if sanitize else 'none'}"
    f"{'' if not sanitize else ', PINXFER_DEBUG_INVARIANTS=1'}\n"
    f"  sources      {len(sources)} files under csrc/\n"
    f"  CUDA_HOME    {cpp_extension.CUDA_HOME}\n"
    f"  GPU archs    {cuda_archs}\n"
    f"  compile      {compile_mode}{', warnings are errors (PINXFER_WERROR=1)' if werror else ''}\n"
    f"  debug info   {debug_info_text}\n"
    "  Compiling takes about 4 minutes on 2 cores (each file includes all of torch's "
    "headers);\n  `pip install -v` shows each file as it compiles ([n/N] lines).\n",
    flush=True,
)


def _license_metadata() -> dict[str, object]:
    """pinxfer's license in the form this setuptools understands (pyproject.toml lists
    "license" as dynamic for this): PEP 639's SPDX expression and license file from setuptools
    77, where the free-text field is deprecated; the free-text field before 77, which does not
    know license_expression."""
    release = tuple(int(part) for part in setuptools.__version__.split(".")[:2] if part.isdigit())
    if release >= (77, 0) and _packaging_knows_licenses():
        return {"license_expression": "BSD-3-Clause", "license_files": ["LICENSE"]}
    return {"license": "BSD-3-Clause"}


def _packaging_knows_licenses() -> bool:
    """setuptools checks an SPDX expression with `packaging.licenses` (packaging >= 24.2), and an
    installed older `packaging` comes before the copy setuptools bundles on sys.path: the
    expression would then fail the build (ImportError) where the free-text field works."""
    try:
        import packaging.licenses  # noqa: F401
    except ImportError:
        return False
    return True


setup(
    **_license_metadata(),
    ext_modules=[
        Extension(
            "pinxfer._C",
            sources,
            include_dirs=[os.path.join(HERE, "csrc")],
            define_macros=define_macros,
            extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3"]},
            extra_link_args=link_flags,
            libraries=["pthread"],
        )
    ],
    cmdclass={"build_ext": cpp_extension.BuildExtension},
)
