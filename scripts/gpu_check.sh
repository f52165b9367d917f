#!/usr/bin/env bash
# One call on the GPU machine: build pinxfer from source against the torch that
# is there (no network), then run the chosen steps and leave JSON results under
# $OUT (default: ./gpu_out) and logs under $OUT/logs. Exits non-zero if the build or any
# step failed; the last lines printed are a per-step summary (also appended to
# $OUT/logs/env.txt).
#
#   bash scripts/gpu_check.sh [STEP...] [-k PYTEST_EXPR]
#   bash scripts/gpu_check.sh "test stress memcheck"     # one quoted list works too
#   bash scripts/gpu_check.sh test "not prefetch"        # old form: a non-step word is -k
#                                                        # (refused when no step is named)
#
# Steps (run in this order whatever the order given; default: all; the build always runs first,
# and `build` alone stops after it):
#   sweep     to_device/prefetch settings swept by benchmarks/sweep_to_device.py
#   test      smoke check, then the README's test command (pytest -n auto; TEST_SERIAL=1: one
#             by one in this process, so a crash stops the run with faulthandler's stacks),
#             "PYTEST EXIT n"; then the soak-marked tests (-m soak), "SOAK EXIT n"
#   alone     each GPU test (-m gpu, no soak) in a fresh process of its own, ALONE_JOBS (8) at a
#             time: a test that passes only after other tests grew the pools or loaded CUDA
#             modules fails here (-k / PYTEST_K narrows it; ~5 s a test). logs/alone.txt
#   stress    scripts/stress_gpu.py (tests/stress/) --mode both (plain, then pinxfer.install())
#   memcheck  compute-sanitizer memcheck over tests/test_transfer_gpu.py and
#             tests/test_allocator_gpu.py; error count in logs/memcheck.txt
#   bench     benchmarks/bench_{allocator,pin_memory,transfer,small_calls}.py and `pinxfer bench`
#   bus       benchmarks/bench_bus.py: ratios to the pinned ceiling (one process; with 2+ GPUs
#             also 2 torchrun ranks at once); bus.json (+ bus_rank0/1.json); then
#             benchmarks/diag_prefetch.py (diag_prefetch.json). Set
#             PINXFER_MACHINE_KIND (e.g. nvidia-h100-x1) to name the machine in the JSON.
#   ab        benchmarks/bench_ab.py: this checkout against an older build, alternating fresh
#             processes round by round (same run, before vs after). AB_BEFORE_TAR names a tar of
#             the older tree (e.g. `git archive -o ab_before.tar 47d9773`, left untracked); it is
#             built in /tmp/ab_before with the compiler that built this one. ab.json.
#   loader    benchmarks/bench_loader.py: a worker-fed DataLoader, pin_memory=True vs prefetch
#             (staging) vs prefetch(slots=True). loader.json (with 2+ GPUs also 2 torchrun
#             ranks at once: loader_rank0/1.json).
#   loop      benchmarks/bench_loop.py (issue 22): every size 4 KiB - 1 GiB, back to back and
#             after a 20 ms idle gap (sleep; a GPU kernel the host waits on), pinxfer's ways
#             against torch's and the pinned copy, small-call rows, CPU per GB, idle CPU;
#             PASS/MISS against the issue's targets. loop.json, logs/loop.log (~5 min on an H100;
#             LOOP_ARGS e.g. "--quick" or "--sizes 4K,1M,8M"). Kind: PINXFER_MACHINE_KIND.
#   abenv     benchmarks/ab_env.py: settings of this build in alternating fresh processes (one
#             session file, abenv.json, rewritten after every run: a call cut short keeps what
#             finished). AB_VARIANTS names them ("flag:PINXFER_SENDER_LANDING=flag
#             auto:PINXFER_SENDER_LANDING=auto"); AB_ROUNDS (default 3); AB_COMMAND the
#             benchmark (default bench_loop --no-small --sizes $AB_SIZES (4K,64K,256K,1M)
#             --budget 25 --json {json}); the first two variants' bench_loop rows are compared.
#   all       all of the above but alone, ab, abenv, loader and loop (more than one 10-minute device call:
#             pick subsets)
#
# Environment:
#   OUT                   output folder (default ./gpu_out)
#   SKIP_BUILD            1: use the pinxfer/_C*.so already in the checkout (a second call
#                         on a warm machine); the C++ exception check still runs
#   PYTEST_K              pytest -k expression for the test step (or -k on the command line)
#   PYTEST_M              pytest -m expression for the test step (e.g. "gpu": the GPU tests only,
#                         when CI has just run the CPU ones)
#   STRESS_SECONDS        seconds per stress mode (default 90)
#   STRESS_MIN_TRANSFERS  fewest checked tensors per mode (default 500 per second of STRESS_SECONDS)
#   STRESS_ARGS           more stress_gpu.py arguments (e.g. "--threads 4 --seed 3")
#   MEMCHECK_TIMEOUT      seconds for the memcheck step (default 540)
#   MEMCHECK_K            pytest -k expression under memcheck
#   MEMCHECK_SKIP_TIMING  1: deselect the tests that assert a copy is still queued behind a
#                         sleep kernel (in case the sanitizer serialises launches). With every
#                         test in, one of them fails under memcheck with 0 memcheck errors, not
#                         always the same one (H200): test_cap_waits_for_in_flight_copies_
#                         before_out_of_memory in session 32, test_block_not_reused_while_a_
#                         slow_copy_on_another_stream_reads_it in session 33 (its block was no
#                         longer pending when freed: the copy behind the sleep had already run)
#   MEMCHECK_PYTEST_ARGS  pytest options under memcheck (default "-x")
#   MEMCHECK_API_ERRORS   compute-sanitizer --report-api-errors value (default "no": torch
#                         and pinxfer check every CUDA return code themselves)
#   MEMCHECK_FLAGS        more compute-sanitizer flags
#   LOOP_ARGS             more bench_loop.py arguments (--quick, --sizes, --budget SECONDS,
#                         --process-per-size: each size in a fresh process)
#   LOOP_TIMEOUT          seconds for the loop step (default 450)
#   MEMCHECK_NO_CACHING   1: PYTORCH_NO_CUDA_MEMORY_CACHING=1 (a cudaMalloc per tensor, so
#                         out-of-bounds accesses between tensors are caught; slower)
#
# Files written (at most 8 come back from the device; `all` writes exactly 8). Results, as
# JSON, under $OUT: stress.json, bench.json ({"allocator": ..., "pin_memory": ..., "transfer": ...}: the three bench
# scripts' JSON; split with
#   python3 -c "import json; d = json.load(open('bench.json'))
#   [json.dump(v, open(f'bench_{k}.json', 'w'), indent=1) for k, v in d.items()]"),
# bench_cli.json, sweep.json, loop.json (loop step). Logs under $OUT/logs: env.txt
# (environment + step summary), junit.xml, memcheck.txt, bench.log, loop.log (loop step).
# Keep them apart the same way in benchmarks/results/<machine>/ and <machine>/logs/. Build,
# pytest, stress and memcheck logs stay in /tmp (their tails are printed).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
LOGS="$OUT/logs"  # everything that is not a JSON result
mkdir -p "$OUT" "$LOGS"
export PYTHONUNBUFFERED=1  # TORCH_CUDA_ARCH_LIST as the caller left it: unset, setup.py chooses, as for a user

# ---- arguments: step names (separate or in one quoted list), -k EXPR, else a -k expression
STEP_WORDS="all build sweep test alone stress memcheck bench bus ab abenv loader loop"
steps=""
kexpr=${PYTEST_K:-}
bare_word=""  # a word that names no step: taken as -k only beside a step
while [ $# -gt 0 ]; do
  if [ "$1" = "-k" ]; then
    kexpr=${2:-}
    shift 2 || shift
    continue
  fi
  read -ra words <<< "$1"
  all_steps=${#words[@]}
  for w in "${words[@]}"; do
    case " $STEP_WORDS " in *" $w "*) ;; *) all_steps=0 ;; esac
  done
  if [ "$all_steps" -gt 0 ]; then steps="$steps ${words[*]}"; else kexpr=$1 bare_word=$1; fi
  shift
done
if [ -z "${steps// /}" ] && [ -n "$bare_word" ]; then
  # Without a step, a mistyped step name would run every step (about ten minutes of device
  # time) under a -k that selects almost nothing.
  echo "gpu_check.sh: '$bare_word' names no step ($STEP_WORDS). Name the steps, e.g." \
    "'test $bare_word' for a pytest -k expression, or 'build' to build alone." >&2
  exit 2
fi
[ -z "${steps// /}" ] && steps=all
want() {  # alone, ab, abenv, loader and loop only when named
  case " $steps " in *" $1 "*) return 0 ;; esac
  case "$1" in alone | ab | abenv | loader | loop) return 1 ;; esac
  case " $steps " in *" all "*) return 0 ;; esac
  return 1
}
echo "steps:$steps${kexpr:+ (pytest -k \"$kexpr\")}"

# ---- step bookkeeping: every step records OK or FAILED (why); the summary decides the exit
STEP_NAMES=()
STEP_STATUS=()
record() {
  STEP_NAMES+=("$1")
  STEP_STATUS+=("$2")
  echo "== step $1: $2"
}
status_of() {  # $1: exit code -> words
  if [ "$1" -eq 0 ]; then echo "OK"
  elif [ "$1" -eq 124 ] || [ "$1" -eq 137 ]; then echo "FAILED (timed out, exit $1)"
  elif [ "$1" -gt 128 ]; then echo "FAILED (crashed: signal $(( $1 - 128 )), exit $1)"
  else echo "FAILED (exit $1)"
  fi
}
finish() {
  local failed=0 i
  {
    echo "== summary ($(date -u +%FT%TZ))"
    for i in "${!STEP_NAMES[@]}"; do
      printf '  %-9s %s\n' "${STEP_NAMES[$i]}" "${STEP_STATUS[$i]}"
    done
  } | tee -a "$LOGS/env.txt"
  for i in "${!STEP_STATUS[@]}"; do
    case "${STEP_STATUS[$i]}" in OK*) ;; *) failed=1 ;; esac
  done
  echo "GPU CHECK $([ $failed -eq 0 ] && echo PASSED || echo FAILED)" | tee -a "$LOGS/env.txt"
  exit $failed
}

{
  nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
  nproc; ulimit -l; cat /sys/kernel/mm/transparent_hugepage/enabled
  echo "steps:$steps${kexpr:+ (pytest -k \"$kexpr\")}"
} > "$LOGS/env.txt" 2>&1
cat "$LOGS/env.txt"

# ---- build
build() {  # $1: C++ compiler; returns non-zero if the build or the import fails
  t0=$(date +%s)
  rm -rf build
  # Plain `pip install .` (build isolation on, as users type it): the in-tree backend
  # builds against the torch installed here and downloads nothing (no network here).
  CXX=$1 MAX_JOBS=16 python3 -m pip install --no-deps -v . > /tmp/pinxfer_build.log 2>&1 \
    || { tail -50 /tmp/pinxfer_build.log; echo "BUILD FAILED with $1"; return 1; }
  grep -A8 "pinxfer build configuration" /tmp/pinxfer_build.log | head -9
  echo "build with $1 ($($1 --version | head -1)): $(( $(date +%s) - t0 )) s"
  # Tests and benchmarks run from the checkout (tests import tests.conftest), so
  # put the freshly built extension beside the sources as an in-place build would.
  so=$(cd /tmp && python3 -c "import pinxfer._C as c; print(c.__file__)") || { echo "IMPORT FAILED"; return 1; }
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
              lambda: pinxfer._C.parse_cpulist('1-x')):
    try:
        probe()
    except (RuntimeError, ValueError) as e:
        caught += 1
print('exceptions OK' if caught == 2 else 'exceptions MISSING')
" 2>&1 | tail -3 | grep -q "exceptions OK"
}
echo "compilers: $(which -a g++ c++ 2>/dev/null | tr '\n' ' ')"
built=""
if [ "${SKIP_BUILD:-0}" = 1 ]; then
  if ls pinxfer/_C*.so >/dev/null 2>&1 && exception_check; then
    built="the existing $(ls pinxfer/_C*.so | head -1) (SKIP_BUILD=1)"
  else
    echo "SKIP_BUILD=1: no pinxfer/_C*.so here, or its C++ exceptions do not reach Python"
  fi
fi
for cxx in g++-12 ${CXX:-} c++ /usr/bin/g++ /usr/bin/c++ g++-13; do
  [ -n "$built" ] && break
  command -v "$cxx" >/dev/null || continue
  build "$cxx" || continue
  if exception_check; then echo "C++ exceptions reach Python with $cxx"; built=$cxx; break; fi
  echo "C++ exceptions CRASH with $cxx; ldd:"; ldd pinxfer/_C*.so | grep -E "stdc|gcc"
  cuda-gdb -batch -ex run -ex bt --args python3 -c "import torch, pinxfer; torch.ops.pinxfer.empty([-1], torch.float32, None)" 2>&1 | grep -E "^#" | head -12
done
if [ -z "$built" ]; then
  record build "FAILED (no compiler built an extension whose C++ exceptions reach Python)"
  finish
fi
record build "OK ($built)"
REPO=$PWD
xdist_off=$(python3 -c "import xdist" 2>/dev/null && echo "-p no:xdist")

if want sweep; then
  t0=$(date +%s)
  timeout 400 python3 "$REPO/benchmarks/sweep_to_device.py" --out "$OUT/sweep.json" 2>&1 | tail -40
  rc=${PIPESTATUS[0]}
  echo "sweep: $(( $(date +%s) - t0 )) s"
  record sweep "$(status_of "$rc")"
fi

if want test; then
  t0=$(date +%s)
  echo "== smoke"
  python3 -X faulthandler -c "
import torch, pinxfer
print(pinxfer.build_info())
for where in ('before CUDA use', 'after CUDA use'):
    try:
        torch.ops.pinxfer.empty([-1], torch.float32, None)
    except (RuntimeError, ValueError) as e:
        print(where, 'error raised as expected:', str(e).splitlines()[0])
    t = pinxfer.empty(1 << 20); t.fill_(1); print(t.is_pinned(), pinxfer.lock_kind(t))
" 2>&1 | tail -8
  rc=${PIPESTATUS[0]}
  record smoke "$(status_of "$rc")"
  # The README's test command (-n auto: one xdist worker per CPU; a test that crashes its
  # worker is reported as failed and fails the step). TEST_SERIAL=1: one by one in this
  # process, where a crash ends the run with faulthandler's stacks.
  parallel="-n auto"
  [ -z "$xdist_off" ] && parallel=""  # no pytest-xdist here: one by one
  [ "${TEST_SERIAL:-0}" = 1 ] && parallel=$xdist_off
  python3 -X faulthandler -m pytest -q -rfEs $parallel -p no:cacheprovider --junitxml "$LOGS/junit.xml" \
    ${kexpr:+-k "$kexpr"} ${PYTEST_M:+-m "$PYTEST_M"} tests > /tmp/pinxfer_pytest.log 2>&1
  rc=$?
  grep -E "crashed while running|node down" /tmp/pinxfer_pytest.log | head -5
  if [ "$rc" -gt 128 ] && grep -q "Fatal Python error" /tmp/pinxfer_pytest.log; then
    grep -B8 -A60 -m1 "Fatal Python error" /tmp/pinxfer_pytest.log | head -80  # the crash
  else
    tail -40 /tmp/pinxfer_pytest.log
  fi
  echo "PYTEST EXIT $rc"
  echo "tests: $(( $(date +%s) - t0 )) s"
  # The failed tests' ids in the summary (and env.txt), which a caller keeps when the log's
  # tail is cut: session 35 lost a timed-out test's name that way.
  failed_ids=$(grep -E "^(FAILED|ERROR) " /tmp/pinxfer_pytest.log | cut -d' ' -f2 | head -5 | paste -sd' ' -)
  record test "$(status_of "$rc")${failed_ids:+: $failed_ids}"
  # The soaks the README's test command deselects (README "Tests"): stress and leak runs.
  t0=$(date +%s)
  python3 -X faulthandler -m pytest -q -rfEs $xdist_off -p no:cacheprovider -m soak \
    ${kexpr:+-k "$kexpr"} tests > /tmp/pinxfer_soak.log 2>&1
  rc=$?
  tail -15 /tmp/pinxfer_soak.log
  echo "SOAK EXIT $rc"
  echo "soak: $(( $(date +%s) - t0 )) s"
  if [ "$rc" -eq 5 ] && [ -n "$kexpr" ]; then
    record soak "OK (no soak test matches -k)"  # pytest's 5: nothing collected
  else
    record soak "$(status_of "$rc")"
  fi
fi

if want alone; then
  t0=$(date +%s)
  # Each GPU test alone in a fresh process (session 28: the sender's copy-stream test passed
  # in the suite and failed every time alone, its first allocations waiting for a GPU sleep).
  only="gpu and not soak and not build and not stress"
  python3 -m pytest -q --collect-only -p no:cacheprovider -m "$only" ${kexpr:+-k "$kexpr"} tests \
    > /tmp/pinxfer_alone_collect.log 2>&1
  collected=$?
  grep "::" /tmp/pinxfer_alone_collect.log > /tmp/pinxfer_alone_ids.txt
  : > "$LOGS/alone.txt"
  if [ "$collected" -ne 0 ] && [ "$collected" -ne 5 ]; then  # 5: nothing matched
    tail -20 /tmp/pinxfer_alone_collect.log
    echo "FAILED collection (exit $collected)" >> "$LOGS/alone.txt"
  fi
  xargs -d '\n' -P "${ALONE_JOBS:-8}" -I{} sh -c \
    'timeout 300 python3 -X faulthandler -m pytest -q -p no:cacheprovider -m "$2" "$1" \
       > /tmp/pinxfer_alone_$$.log 2>&1 || { echo "FAILED $1 (exit $?)"; tail -15 /tmp/pinxfer_alone_$$.log; }' \
    _ {} "$only" < /tmp/pinxfer_alone_ids.txt >> "$LOGS/alone.txt"
  failed=$(grep -c "^FAILED " "$LOGS/alone.txt")
  head -60 "$LOGS/alone.txt"
  echo "alone: $(grep -c . /tmp/pinxfer_alone_ids.txt) tests, $failed failed, $(( $(date +%s) - t0 )) s"
  if [ "$failed" -eq 0 ]; then record alone OK; else record alone "FAILED ($failed tests)"; fi
fi

if want stress; then
  t0=$(date +%s)
  secs=${STRESS_SECONDS:-90}
  # The floor catches a run that stalled or checked little, not a slow machine: 500 checked
  # tensors a second per mode (the H200 hosts did 670-1200, 2026-11-26 - 2026-12-02).
  min_transfers=${STRESS_MIN_TRANSFERS:-$(( 500 * ${secs%.*} ))}
  # stress_gpu.py has its own watchdog (stacks, exit 1) at 2 x (secs + 90) + 120 s.
  timeout -k 30 $(( 2 * (${secs%.*} + 90) + 240 )) \
    python3 -X faulthandler "$REPO/scripts/stress_gpu.py" --mode both --seconds "$secs" \
    --min-transfers "$min_transfers" --json "$OUT/stress.json" ${STRESS_ARGS:-} \
    > /tmp/pinxfer_stress.log 2>&1
  rc=$?
  if [ "$rc" -ne 0 ]; then
    grep -E "MISMATCH|ERROR|CONTRACT|FATAL|Fatal Python|Traceback|Error:" /tmp/pinxfer_stress.log | head -40
  fi
  tail -40 /tmp/pinxfer_stress.log
  echo "STRESS EXIT $rc"
  echo "stress: $(( $(date +%s) - t0 )) s"
  record stress "$(status_of "$rc")"
fi

if want memcheck; then
  t0=$(date +%s)
  cs=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer \
       /usr/local/cuda-*/bin/compute-sanitizer /usr/local/cuda/compute-sanitizer/compute-sanitizer \
       2>/dev/null | head -1)
  if [ -z "$cs" ]; then
    echo "compute-sanitizer not found (PATH, /usr/local/cuda*/bin)" | tee "$LOGS/memcheck.txt"
    record memcheck "FAILED (compute-sanitizer not found)"
  else
    mk=${MEMCHECK_K:-}
    if [ "${MEMCHECK_SKIP_TIMING:-0}" = 1 ]; then
      timing="not busy_current_stream and not cannot_be_read_early and not slow_copy_on_another_stream"
      timing="$timing and not head_of_line and not cap_waits and not install_routes and not fenced_on_the_current"
      mk=${mk:+($mk) and }$timing
    fi
    nocache=()
    [ "${MEMCHECK_NO_CACHING:-0}" = 1 ] && nocache=(env PYTORCH_NO_CUDA_MEMORY_CACHING=1)
    cmd=("${nocache[@]}" timeout -k 30 "${MEMCHECK_TIMEOUT:-540}"
         "$cs" --tool memcheck --error-exitcode 1 --target-processes all
         --report-api-errors "${MEMCHECK_API_ERRORS:-no}" ${MEMCHECK_FLAGS:-}
         python3 -X faulthandler -m pytest -q -rfEs ${MEMCHECK_PYTEST_ARGS--x} $xdist_off
         -p no:cacheprovider ${mk:+-k "$mk"}
         tests/test_transfer_gpu.py tests/test_allocator_gpu.py)
    echo "${cmd[*]}"
    "${cmd[@]}" > /tmp/pinxfer_memcheck.log 2>&1
    rc=$?
    summaries=$(grep -c "ERROR SUMMARY" /tmp/pinxfer_memcheck.log)
    errors=$(grep -Eo "ERROR SUMMARY: [0-9]+ error" /tmp/pinxfer_memcheck.log | awk '{s += $3} END {print s + 0}')
    outcome=$(grep -E "[0-9]+ (passed|failed|skipped|deselected)|[0-9]+ errors? in|no tests ran" \
      /tmp/pinxfer_memcheck.log | tail -1)
    {
      echo "compute-sanitizer: $cs ($("$cs" --version 2>/dev/null | tail -1))"
      echo "command: ${cmd[*]}"
      echo "exit code: $rc"
      echo "memcheck errors: $errors (in $summaries ERROR SUMMARY lines)"
      echo "pytest: ${outcome:-no result line}"
      grep "ERROR SUMMARY" /tmp/pinxfer_memcheck.log
      echo "--- first sanitizer reports"
      grep -E "^========= " /tmp/pinxfer_memcheck.log | grep -v "ERROR SUMMARY" | head -80
      echo "--- pytest failures"
      grep -E "^(FAILED|ERROR) |Fatal Python error" /tmp/pinxfer_memcheck.log | head -20
    } > "$LOGS/memcheck.txt"
    tail -30 /tmp/pinxfer_memcheck.log
    cat "$LOGS/memcheck.txt" | head -20
    echo "MEMCHECK EXIT $rc, errors $errors"
    echo "memcheck: $(( $(date +%s) - t0 )) s"
    if [ "$summaries" -eq 0 ]; then
      record memcheck "FAILED (no ERROR SUMMARY: the sanitizer did not finish; $(status_of "$rc"))"
    elif [ "$errors" -gt 0 ]; then
      record memcheck "FAILED ($errors memcheck errors)"
    elif [ "$rc" -ne 0 ]; then
      record memcheck "FAILED (0 memcheck errors, but pytest failed under the sanitizer: $(status_of "$rc"); ${outcome:-})"
    else
      record memcheck "OK (0 memcheck errors; ${outcome:-})"
    fi
  fi
fi

if want bench; then
  t0=$(date +%s)
  bench_rc=0
  for b in allocator pin_memory transfer small_calls; do
    echo "== bench_$b"
    rm -f "/tmp/pinxfer_bench_$b.json"
    timeout 240 python3 "$REPO/benchmarks/bench_$b.py" --out "/tmp/pinxfer_bench_$b.json" 2>&1 | tail -25
    rc=${PIPESTATUS[0]}
    [ "$rc" -ne 0 ] && { echo "bench_$b: $(status_of "$rc")"; bench_rc=$rc; }
  done 2>&1 | tee "$LOGS/bench.log"
  # the loop ran in a pipeline's subshell: take its failures from the log
  grep -q "^bench_[a-z_]*: FAILED" "$LOGS/bench.log" && bench_rc=1
  python3 - "$OUT/bench.json" <<'EOF'
import json, os, sys
out = {}
for b in ("allocator", "pin_memory", "transfer", "small_calls"):
    path = f"/tmp/pinxfer_bench_{b}.json"
    try:
        with open(path) as f:
            out[b] = json.load(f)
    except (OSError, ValueError) as err:
        out[b] = {"error": f"{path}: {err}"}
with open(sys.argv[1], "w") as f:
    json.dump(out, f, indent=1)
EOF
  echo "== pinxfer bench (CLI)"
  timeout 120 python3 -m pinxfer bench --json "$OUT/bench_cli.json" --no-progress 2>&1 | tail -30
  rc=${PIPESTATUS[0]}
  [ "$rc" -ne 0 ] && bench_rc=$rc
  echo "benchmarks: $(( $(date +%s) - t0 )) s"
  record bench "$(status_of "$bench_rc")"
fi

if want bus; then
  t0=$(date +%s)
  kind=${PINXFER_MACHINE_KIND:-unknown}
  echo "== bench_bus ($kind)"
  timeout 420 python3 "$REPO/benchmarks/bench_bus.py" --kind "$kind" --out "$OUT/bus.json" 2>&1 | tail -20
  bus_rc=${PIPESTATUS[0]}
  if [ "$bus_rc" -eq 0 ] && [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
    echo "== bench_bus, torchrun 2 ranks"
    timeout 420 torchrun --standalone --nproc-per-node 2 "$REPO/benchmarks/bench_bus.py" \
      --kind "$kind" --out "$OUT/bus.json" 2>&1 | tail -30
    bus_rc=${PIPESTATUS[0]}
  fi
  if [ "$bus_rc" -eq 0 ]; then
    echo "== diag_prefetch (prefetch vs to_device one after another, suspect by suspect)"
    timeout 200 python3 "$REPO/benchmarks/diag_prefetch.py" --out "$OUT/diag_prefetch.json" 2>&1 \
      | tail -8 | cut -c1-600
    bus_rc=${PIPESTATUS[0]}
  fi
  echo "bus: $(( $(date +%s) - t0 )) s"
  record bus "$(status_of "$bus_rc")"
fi

if want ab; then
  t0=$(date +%s)
  ab_rc=0
  if [ -z "${AB_BEFORE_TAR:-}" ] || [ ! -f "$AB_BEFORE_TAR" ]; then
    echo "ab: AB_BEFORE_TAR is not a file (${AB_BEFORE_TAR:-unset})"; ab_rc=2
  else
    rm -rf /tmp/ab_before && mkdir -p /tmp/ab_before && tar -xf "$AB_BEFORE_TAR" -C /tmp/ab_before
    cxx=$(command -v g++-12 || echo c++)
    (cd /tmp/ab_before && CXX=$cxx MAX_JOBS=16 python3 setup.py build_ext --inplace \
      > /tmp/ab_before_build.log 2>&1) || { tail -30 /tmp/ab_before_build.log; ab_rc=3; }
    echo "ab: built the older tree with $cxx in $(( $(date +%s) - t0 )) s"
    if [ "$ab_rc" -eq 0 ]; then
      timeout 540 python3 "$REPO/benchmarks/bench_ab.py" --before /tmp/ab_before --after "$REPO" \
        --before-label "${AB_BEFORE_LABEL:-before}" --after-label "${AB_AFTER_LABEL:-after}" \
        --rounds "${AB_ROUNDS:-3}" --kind "${PINXFER_MACHINE_KIND:-unknown}" \
        --out "$OUT/ab.json" 2>&1 | tail -25
      ab_rc=${PIPESTATUS[0]}
    fi
  fi
  echo "ab: $(( $(date +%s) - t0 )) s"
  record ab "$(status_of "$ab_rc")"
fi

if want abenv; then
  t0=$(date +%s)
  read -ra variants <<< "${AB_VARIANTS:-}"
  variant_args=()
  for v in "${variants[@]}"; do variant_args+=(--variant "$v"); done
  default_cmd="python3 $REPO/benchmarks/bench_loop.py --no-small --sizes ${AB_SIZES:-4K,64K,256K,1M} --budget 25 --json {json}"
  read -ra ab_cmd <<< "${AB_COMMAND:-$default_cmd}"
  (cd /tmp && PYTHONPATH=$REPO timeout -k 20 "${AB_TIMEOUT:-540}" python3 "$REPO/benchmarks/ab_env.py" \
    --out "$OUT/abenv.json" --rounds "${AB_ROUNDS:-3}" --what "gpu_check abenv on ${PINXFER_MACHINE_KIND:-unknown}" \
    "${variant_args[@]}" -- "${ab_cmd[@]}")
  rc=$?
  if [ "${#variants[@]}" -ge 2 ] && [ -z "${AB_COMMAND:-}" ] && [ -f "$OUT/abenv.json" ]; then
    python3 "$REPO/benchmarks/compare_loop.py" --session "$OUT/abenv.json" \
      --before "${variants[0]%%:*}" --after "${variants[1]%%:*}" | tail -25
  fi
  echo "abenv: $(( $(date +%s) - t0 )) s"
  record abenv "$(status_of "$rc")"
fi

if want loader; then
  t0=$(date +%s)
  timeout 540 python3 "$REPO/benchmarks/bench_loader.py" --kind "${PINXFER_MACHINE_KIND:-unknown}" \
    --out "$OUT/loader.json" ${LOADER_ARGS:-} 2>&1 | tail -40
  rc=${PIPESTATUS[0]}
  if [ "$rc" -eq 0 ] && [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
    echo "== bench_loader, torchrun 2 ranks (8 workers each)"
    timeout 540 torchrun --standalone --nproc-per-node 2 "$REPO/benchmarks/bench_loader.py" \
      --kind "${PINXFER_MACHINE_KIND:-unknown}" --out "$OUT/loader.json" ${LOADER_ARGS:-} 2>&1 | tail -60
    rc=${PIPESTATUS[0]}
  fi
  echo "loader: $(( $(date +%s) - t0 )) s"
  record loader "$(status_of "$rc")"
fi

if want loop; then
  t0=$(date +%s)
  echo "== bench_loop (${PINXFER_MACHINE_KIND:-kind from the GPU name})"
  timeout -k 20 "${LOOP_TIMEOUT:-450}" python3 "$REPO/benchmarks/bench_loop.py" \
    --json "$OUT/loop.json" ${LOOP_ARGS:-} > "$LOGS/loop.log" 2>&1
  rc=$?
  # the compact table is printed last; the whole detail is in loop.log and loop.json
  awk '/^== loop table/ {p = 1} p' "$LOGS/loop.log" | tail -60
  [ "$rc" -ne 0 ] && tail -30 "$LOGS/loop.log"
  echo "loop: $(( $(date +%s) - t0 )) s"
  # The run's verdicts beside its exit status: bench_loop exits 0 with targets missed. The
  # last line is the whole run's (with --process-per-size each size's child prints its own
  # first; the first of those was taken for the run's, session 46). A run that failed has no
  # line of its own: its last one would be a size's child's.
  verdicts=""
  [ "$rc" -eq 0 ] && verdicts=$(grep '^targets: ' "$LOGS/loop.log" | tail -n 1)
  record loop "$(status_of "$rc")${verdicts:+ ($verdicts)}"
fi

finish
