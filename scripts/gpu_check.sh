#!/usr/bin/env bash
# One call on the GPU machine: build pinxfer from source against the torch that
# is there (no network), run the whole test suite including GPU tests, run the
# benchmarks, and leave logs and JSON under $OUT (default: ./gpu_out).
#
#   bash scripts/gpu_check.sh [all|test|bench|sweep] [pytest -k expression]
#   (sweep: to_device/prefetch settings swept by benchmarks/sweep_to_device.py; all runs it too)
#
# Files written under $OUT (at most 8 come back from the device): env.txt, junit.xml,
# bench_{allocator,pin_memory,transfer,cli}.json, bench.log, sweep.json. Build and pytest
# logs stay in /tmp (their tails are printed).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
what=${1:-all}
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}

{
  nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
  nproc; ulimit -l; cat /sys/kernel/mm/transparent_hugepage/enabled
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

build() {  # $1: C++ compiler
  t0=$(date +%s)
  rm -rf build
  CXX=$1 MAX_JOBS=16 python3 -m pip install --no-build-isolation --no-deps -v . > /tmp/pinxfer_build.log 2>&1 \
    || { tail -50 /tmp/pinxfer_build.log; echo "BUILD FAILED"; exit 1; }
  grep -A5 "pinxfer build configuration" /tmp/pinxfer_build.log | head -6
  echo "build with $1 ($($1 --version | head -1)): $(( $(date +%s) - t0 )) s"
  # Tests and benchmarks run from the checkout (tests import tests.conftest), so
  # put the freshly built extension beside the sources as an in-place build would.
  so=$(cd /tmp && python3 -c "import pinxfer._C as c; print(c.__file__)") || { echo "IMPORT FAILED"; exit 1; }
  cp "$so" pinxfer/
}
# A C++ exception thrown in the extension must reach Python as an error. An
# extension built by a compiler whose runtime differs from torch's can crash
# instead; try each compiler there until one passes.
exception_check() {
  # Both kinds: a c10::Error (RuntimeError) and a c10::ValueError. With the
  # wrong compiler the first has been seen to crash while the second worked.
  python3 -X faulthandler -c "
import torch, pinxfer
caught = 0
for probe in (lambda: torch.ops.pinxfer.empty([-1], torch.float32, None),
              lambda: torch.ops.pinxfer.parse_cpulist('1-x')):
    try:
        probe()
    except (RuntimeError, ValueError) as e:
        caught += 1
print('exceptions OK' if caught == 2 else 'exceptions MISSING')
" 2>&1 | tail -3 | grep -q "exceptions OK"
}
echo "compilers: $(which -a g++ c++ 2>/dev/null | tr '\n' ' ')"
for cxx in g++-12 ${CXX:-} c++ /usr/bin/g++ /usr/bin/c++ g++-13; do
  command -v "$cxx" >/dev/null || continue
  build "$cxx"
  if exception_check; then echo "C++ exceptions reach Python with $cxx"; break; fi
  echo "C++ exceptions CRASH with $cxx; ldd:"; ldd pinxfer/_C*.so | grep -E "stdc|gcc"
  cuda-gdb -batch -ex run -ex bt --args python3 -c "import torch, pinxfer; torch.ops.pinxfer.empty([-1], torch.float32, None)" 2>&1 | grep -E "^#" | head -12
done
REPO=$PWD

if [ "$what" = all ] || [ "$what" = sweep ]; then
  t0=$(date +%s)
  timeout 400 python3 "$REPO/benchmarks/sweep_to_device.py" --out "$OUT/sweep.json" 2>&1 | tail -40
  echo "sweep: $(( $(date +%s) - t0 )) s"
fi

if [ "$what" = all ] || [ "$what" = test ]; then
  t0=$(date +%s)
  echo "== smoke"
  python3 -X faulthandler -c "
import torch, pinxfer
print(pinxfer.build_info())
for where in ('before CUDA use', 'after CUDA use'):
    try:
        torch.ops.pinxfer.empty([-1], torch.float32, None)
    except RuntimeError as e:
        print(where, 'error raised as expected:', str(e).splitlines()[0])
    t = pinxfer.empty(1 << 20); t.fill_(1); print(t.is_pinned(), pinxfer.lock_kind(t))
" 2>&1 | tail -8
  # pytest-xdist (on the device image) replaces a crashed worker and goes on,
  # so one crash does not hide the rest of the suite.
  xdist=$(python3 -c "import xdist" 2>/dev/null && echo "-n 1")
  kexpr=${2:-}
  python3 -m pytest -q -rs $xdist -p no:cacheprovider --junitxml "$OUT/junit.xml" \
    ${kexpr:+-k "$kexpr"} tests 2>&1 | tee /tmp/pinxfer_pytest.log | tail -40
  echo "tests: $(( $(date +%s) - t0 )) s"
fi

if [ "$what" = all ] || [ "$what" = bench ]; then
  t0=$(date +%s)
  for b in allocator pin_memory transfer; do
    echo "== bench_$b"
    timeout 240 python3 "$REPO/benchmarks/bench_$b.py" --out "$OUT/bench_$b.json" 2>&1 | tail -25
  done 2>&1 | tee "$OUT/bench.log"
  echo "== pinxfer bench (CLI)"
  timeout 120 python3 -m pinxfer bench --json "$OUT/bench_cli.json" --no-progress 2>&1 | tail -30
  echo "benchmarks: $(( $(date +%s) - t0 )) s"
fi
