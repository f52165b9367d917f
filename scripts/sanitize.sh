#!/usr/bin/env bash
# Builds pinxfer with a sanitizer and runs the pool's stress test, the
# allocator tests and the pin_memory tests under it.
#
#   bash scripts/sanitize.sh address   # ASan + UBSan (reports abort)
#   bash scripts/sanitize.sh thread    # TSan
#
# The build is the CPU-only variant (PINXFER_CPU_ONLY=1: no GPU in CI, memory is
# mlocked; the pool, pin_memory, pin_/unpin_ and the thread pool are the same
# code as in the CUDA build) with PINXFER_SANITIZE=MODE, made in a scratch copy
# of the tree so the checkout's in-place build is never touched.
#
# Environment:
#   PINXFER_STRESS_SECONDS   passed to tests/test_pool_stress.py (its default: 2)
#   PINXFER_SANITIZE_DIR     where to build and keep logs (default: a new mktemp dir, whose
#                            scratch build is removed after a clean job; its logs stay)
#   PINXFER_SANITIZE_TESTS   test files to run (default: the ones named below)
#   PINXFER_SANITIZE_MARKS   pytest -m expression (default "not build": the soak-marked
#                            stress tests run here, unlike in the plain test command)
# Exit status: non-zero on a failed build, a failed test, or any sanitizer report
# (from pytest's process or any child it spawned or forked).
set -euo pipefail

MODE="${1:-}"
case "$MODE" in
  address) RUNTIME=libasan.so ;;
  thread) RUNTIME=libtsan.so ;;
  *) echo "usage: bash scripts/sanitize.sh address|thread" >&2; exit 2 ;;
esac

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
WORK="${PINXFER_SANITIZE_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/pinxfer-sanitize-$MODE.XXXXXX")}"
mkdir -p "$WORK"
# The real interpreter (a pyenv shim is a shell script: keep the preload off it).
PY="$(python3 -c 'import sys; print(sys.executable)')"
# Issue 27: the bad-input tests and the fuzz suite's short profile run under the
# sanitizers too, so an overflow or use-after-free on an error path is a report.
# tests/test_serial_jobs.py: the queue of prefetch's batch sender (CUDA-free protocol).
# tests/test_piece_claims.py: the claims, steals and source close of to_device's single-block
# path (CUDA-free protocol; a late read of a freed source is a report under ASan).
# tests/test_torch_team.py: host copies on torch's OpenMP team (skipped under TSan, which
# cannot see libgomp's barriers; its subprocesses inherit the sanitizer).
# tests/test_batch_layout.py: to_device's one-call batch walk and rebuild in C
# (python/plain_calls.cpp's PlainBatch: references it holds across the GIL release; a
# reference count off by one is a use-after-free under ASan).
TESTS="${PINXFER_SANITIZE_TESTS:-tests/test_pool_stress.py tests/test_serial_jobs.py tests/test_piece_claims.py tests/test_allocator.py tests/test_pin_memory.py tests/test_limits.py tests/test_fuzz.py tests/test_torch_team.py tests/test_batch_layout.py}"

echo "== pinxfer sanitizer job: $MODE, in $WORK"
# A fresh copy of the tree; $WORK/src/build survives a rerun in the same
# PINXFER_SANITIZE_DIR, and cp -a keeps modification times, so only changed
# sources recompile there.
rm -rf "$WORK/logs" "$WORK/src/setup.py" "$WORK/src/pyproject.toml" "$WORK/src/README.md" "$WORK/src/csrc" \
  "$WORK/src/pinxfer" "$WORK/src/tests"
mkdir -p "$WORK/src" "$WORK/logs"
cp -a "$ROOT/setup.py" "$ROOT/pyproject.toml" "$ROOT/README.md" "$ROOT/csrc" "$ROOT/pinxfer" "$ROOT/tests" "$WORK/src/"
# Never pick up the checkout's own build or caches.
find "$WORK/src/pinxfer" "$WORK/src/tests" \( -name '*.so' -o -name __pycache__ \) -prune \
  -exec rm -rf {} +

t0=$(date +%s)
if ! (cd "$WORK/src" && PINXFER_SANITIZE="$MODE" PINXFER_CPU_ONLY=1 MAX_JOBS="${MAX_JOBS:-2}" \
      "$PY" setup.py build_ext --inplace) > "$WORK/build.log" 2>&1; then
  tail -60 "$WORK/build.log"
  echo "== sanitizer build ($MODE) FAILED; full log: $WORK/build.log" >&2
  exit 1
fi
t1=$(date +%s)
grep -A8 "pinxfer build configuration" "$WORK/build.log" | head -9
echo "== build: $((t1 - t0)) s"

SO="$(ls "$WORK"/src/pinxfer/_C*.so)"
# The runtime the extension was linked against (ldd), else the compiler's.
RT="$(ldd "$SO" | awk -v r="${RUNTIME%.so}" '$1 ~ r {print $3; exit}')"
[ -n "$RT" ] || RT="$(${CXX:-g++} -print-file-name="$RUNTIME")"
[ -e "$RT" ] || { echo "sanitizer runtime $RUNTIME not found ($RT)" >&2; exit 1; }
# ASan intercepts __cxa_throw by looking up the real one when it starts; python
# itself does not load libstdc++, so without preloading it too the interceptor
# has nothing to call and the first C++ throw aborts ("real___cxa_throw != 0").
STDCXX="$(ldd "$SO" | awk '$1 ~ /^libstdc\+\+/ {print $3; exit}')"
[ -n "$STDCXX" ] && RT="$RT $STDCXX"
echo "== runtime: LD_PRELOAD=$RT"

SUPP="$ROOT/scripts/sanitizers"
LOG="$WORK/logs/report"  # every process (children, forks) writes LOG.<pid>
# detect_leaks=0: CPython and torch keep memory until exit by design.
# protect_shadow_gap=0: lets a CUDA driver map its memory (harmless without one).
# log_path: reports of every process land in files that are checked below,
# including those of subprocesses whose stderr a test captures.
export ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:abort_on_error=0:exitcode=66:protect_shadow_gap=0:strict_init_order=1:check_initialization_order=1:detect_stack_use_after_return=1:suppressions=$SUPP/asan.supp:log_path=$LOG"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:exitcode=67:suppressions=$SUPP/ubsan.supp:log_path=$LOG"
# die_after_fork=0: tests fork (os.fork) while threads run; the children only query
# and exit. A child that starts threads (its own pool's copy threads, DataLoader workers)
# is skipped under TSan, which does not support it: session 50's CI hung in such a child,
# its first thread start spinning on a sanitizer lock the fork had left held
# (tests/test_allocator.py, skip_forked_threads_under_tsan).
export TSAN_OPTIONS="halt_on_error=0:exitcode=66:second_deadlock_stack=1:die_after_fork=0:suppressions=$SUPP/tsan.supp:log_path=$LOG"
export PINXFER_STRESS_SECONDS="${PINXFER_STRESS_SECONDS:-2}"

cd "$WORK/src"
set +e
LD_PRELOAD="$RT" "$PY" -c "import pinxfer, pinxfer._C as c; print('== extension', c.__file__, pinxfer.build_info())" \
  2>&1 | tee "$WORK/import.log"
import_rc=${PIPESTATUS[0]}
t2=$(date +%s)
# shellcheck disable=SC2086
LD_PRELOAD="$RT" timeout "${PINXFER_SANITIZE_TIMEOUT:-2400}" \
  "$PY" -m pytest -v -rs -p no:cacheprovider -m "${PINXFER_SANITIZE_MARKS:-not build}" $TESTS 2>&1 \
  | tee "$WORK/pytest.log"
pytest_rc=${PIPESTATUS[0]}
t3=$(date +%s)
set -e

reports=0
for f in "$WORK"/logs/report.*; do
  [ -e "$f" ] || continue
  if grep -qE "WARNING: ThreadSanitizer|ERROR: AddressSanitizer|runtime error:|ERROR: LeakSanitizer|ThreadSanitizer: |AddressSanitizer: " "$f"; then
    reports=$((reports + 1))
    echo "==== sanitizer report in $f"
    cat "$f"
  fi
done
# Reports that went to a terminal stream instead of log_path (e.g. a child that
# reset its options) still count.
if grep -qE "WARNING: ThreadSanitizer|ERROR: AddressSanitizer|runtime error:" "$WORK/pytest.log" "$WORK/import.log"; then
  reports=$((reports + 1))
fi

summary="$(grep -E "[0-9]+ (passed|failed|error)" "$WORK/pytest.log" | tail -1 || true)"
echo "== $MODE: ${summary:-no pytest summary} in $((t3 - t2)) s (build $((t1 - t0)) s); "\
"stress ${PINXFER_STRESS_SECONDS} s; sanitizer reports: $reports; pytest exit $pytest_rc; logs in $WORK"
if [ "$import_rc" -ne 0 ] || [ "$pytest_rc" -ne 0 ] || [ "$reports" -ne 0 ]; then
  echo "== sanitizer job ($MODE) FAILED" >&2
  exit 1
fi
echo "== sanitizer job ($MODE) clean"
# A clean job in a directory of its own making leaves only its logs: the scratch build is
# hundreds of MB with debug info, and CI runs both modes on one disk.
if [ -z "${PINXFER_SANITIZE_DIR:-}" ]; then
  rm -rf "$WORK/src"
  echo "== scratch build removed; logs kept in $WORK"
fi
