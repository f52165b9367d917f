// torch's intra-op thread team, seen from a host copy: whether it is awake, and running a
// copy on it when it is.
//
// Why. torch's parallel CPU ops (a t.pin_memory() copy, a collate, an augmentation) run on
// an OpenMP team per calling thread, and libgomp's team threads then spin for milliseconds
// before they sleep. A pinxfer copy that wakes its own copy threads in that window puts
// more runnable threads than cores on the machine: threads wait scheduler slices, and an
// 8 MiB to_device back to back after t.pin_memory() took 462 us median against 251 with
// OMP_WAIT_POLICY=PASSIVE, a 32 MiB one 2301 against 899 (H100,
// benchmarks/diag_midsize.py, 2026-11-26). The spinning team is idle CPU already paid for:
// a copy run on it meets no contention and starts at once.
//
// So, on the interpreter's main thread (the one whose team torch's own ops use in a
// training loop), when that team is awake, pinxfer's host copies run on it instead of on
// pinxfer's ThreadPool. pinxfer is not built with OpenMP (at::parallel_for compiled here
// would run serially): it calls GOMP_parallel, the entry point `#pragma omp parallel`
// compiles to, of the libgomp torch loaded; where torch has no libgomp this is all off. A team that
// sleeps is never woken for a copy: its spin after every transfer would cost milliseconds of CPU on
// every core (the design note, "Copy threads and torch's OpenMP threads").
//
// How "awake" is known: once at least max(2, (team-size - 1) / 2) threads of the process
// other than
// the caller and pinxfer's copy threads are seen running (a rationed scan of
// /proc/self/task), the main thread runs one (empty) region of that many threads and the
// caller (never more: a larger region makes libgomp start threads) that records its team
// members' thread ids; each later question reads the scheduler state of one of them from
// /proc/self/task/<tid>/stat (running: spinning; sleeping: asleep), a microsecond or two,
// and only where pinxfer would otherwise wake copy threads (PINXFER_TEAM_PROBE=clock reads
// whether that member's thread CPU clock runs instead: thread_running_now). Within
// kTeamSpinWindowUs of a region on the team from this thread (ours, or torch's op run by
// run_torch_op_on_team) the answer is "awake" without that read: libgomp's members spin for 300000
// spins after every region unless OMP_WAIT_POLICY, GOMP_SPINCOUNT or too few CPUs say otherwise
// (team_spin_window_us), so back-to-back copies skip the read. A team that changed
// (torch.set_num_threads, a fork) is learned again. pinxfer never runs a region before it has seen
// the team spin: one of its own would start a team where torch has not, and libgomp ends the
// process when it cannot start threads.
//
// The cost: the team spins again after each region, as after torch's own ops, so a loop
// whose transfers come closer together than that spin keeps it spinning where torch's last
// op alone would have let it sleep. PINXFER_TORCH_TEAM=off turns the road off.
//
// Thread-safe: the state is per thread. Off (always "asleep") under ThreadSanitizer,
// which cannot see libgomp's barriers, and where /proc cannot be read.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace pinxfer {

class ThreadPool;

// Whether the calling thread's torch intra-op team is awake now (its threads running).
// False on any thread but the interpreter's main thread, inside a parallel region, with
// one intra-op thread, and where it cannot be told.
bool torch_team_awake();

// fn(begin, end) over [0, n) on torch's intra-op team, the caller among its threads: one
// share of >= grain a member, member k always the k-th share (as torch's parallel_for, so
// the same member copies the same bytes each time and finds them in its core's cache),
// copied in four pieces; a member done early takes pieces a late member has left.
// Returns when all are done;
// rethrows the first exception. For a caller that has just seen torch_team_awake();
// counted in torch_team_state().copies. The team's threads are awake: all may take part,
// however few ThreadPool::threads_for_copy would wake.
void run_on_torch_team(size_t n, size_t grain, const std::function<void(size_t, size_t)>& fn);

// op(), one of torch's own parallel CPU ops called from here (its at::parallel_for is a region
// on the calling thread's team), counted in torch_team_state().copies. For a caller that has
// just seen torch_team_awake(): torch's op would otherwise start or wake the team.
void run_torch_op_on_team(const std::function<void()>& op);

// fn(member, members) once on every member of torch's intra-op team: member is its place
// in the team (the caller 0), members the team's size. For a body that shares out its own
// work (the single-block transfer's); as run_on_torch_team.
void run_on_each_team_member(const std::function<void(size_t, size_t)>& fn);

// What host_parallel_for knows of torch's team: nothing yet (kAsk: it asks
// torch_team_awake() itself), or the answer its caller got from torch_team_awake() for this
// same copy, so that one copy reads the team's state from /proc once, not twice.
enum class TeamAnswer { kAsk, kAwake, kAsleep };

// pool.parallel_for(n, grain, fn, max_threads), run on torch's intra-op team instead when
// that team is awake (torch_team_awake, or `team`), in chunks of at least awake_grain
// (<= grain: a chunk on the pool must be worth waking a thread, one on the awake team need
// not), and max_threads does not apply (see above). The team is asked about only when the
// copy could use two threads. fn must be safe on any thread (no thread-local state of
// pinxfer's pool) and may throw: the first exception is rethrown here, as parallel_for does.
void host_parallel_for(ThreadPool& pool, size_t n, size_t grain, size_t awake_grain,
                       const std::function<void(size_t, size_t)>& fn, int max_threads = 0,
                       TeamAnswer team = TeamAnswer::kAsk);

// TEST-ONLY (pinxfer._C._torch_team_state): team threads learned on this thread, whether
// the team is awake now, how many copies ran on a team (process total), and the threads
// each region asks for.
struct TorchTeamState {
  int threads = 0;
  int region_threads = 0;  // threads each region asks for (0: not learned)
  bool awake = false;
  int64_t copies = 0;
  int64_t state_reads = 0;     // /proc reads of a member's state so far (process total)
  int64_t window_answers = 0;  // probes answered by the spin window, no read (process total)
};

// How long after a region on torch's team ends its members are surely still spinning, so
// that torch_team_awake() answers without reading /proc: kTeamSpinWindowUs, or 0 where
// libgomp does not spin that long (OMP_WAIT_POLICY=passive, GOMP_SPINCOUNT set, or a team of
// more threads than the CPUs the process may use). The environment values as gomp_word reads
// them (runtime/parse.h: trimmed, lower-cased), "" unset or blank.
constexpr int kTeamSpinWindowUs = 100;
int team_spin_window_us(const std::string& wait_policy, const std::string& spincount,
                        int team_threads, int cpus);
TorchTeamState torch_team_state();

// DIAGNOSTIC (pinxfer._C._last_team_region_trace), recorded only while tracing is on
// (set_team_region_tracing, pinxfer._C._trace_team_regions; off by default: the clock reads
// and the copy-out cost each region a little): the calling thread's last shared-out
// region (run_on_torch_team): microseconds from the call to GOMP_parallel until each member
// (by place in the team) arrived and until it finished, the pieces it copied (its share's
// four, fewer or more where it helped a late member), the pieces, and the whole region.
struct TeamRegionTrace {
  double total_us = 0;
  size_t chunks = 0;
  std::vector<double> arrive_us, done_us;
  std::vector<int> member_chunks;
};
TeamRegionTrace last_team_region_trace();
void set_team_region_tracing(bool on);
// Whether thread `tid` of this process is on a CPU now: its thread CPU clock read twice
// (clock_gettime on the clock id the kernel makes from a thread id, as glibc's
// pthread_getcpuclockid does). The kernel brings a running thread's clock up to date at each
// read, so it moves between the two only if the thread ran between them. 1: running; 0: not
// (asleep, or runnable and waiting for a CPU: one sharing the caller's CPU always is while
// the caller asks); -1: no such thread in this process.
// PINXFER_TEAM_PROBE=clock asks a team member so.
int thread_running_now(int tid);
// TEST-ONLY (pinxfer._C._thread_running_self_test): at least `samples` questions each about
// a thread that spins (kept off the caller's CPU where it can be; asked up to two seconds
// until seen running once) and one that waits on a condition variable, and one about a
// thread that has ended.
struct ThreadRunningCounts {
  int64_t spinner_running = 0;  // answers "running" for the spinning thread
  int64_t sleeper_running = 0;  // answers "running" for the waiting thread
  int gone = 0;                 // the answer for the ended thread (-1 expected)
};
ThreadRunningCounts thread_running_self_test(int64_t samples);
// DIAGNOSTIC (pinxfer._C._set_team_probe): off, torch_team_awake() answers "asleep" without
// asking, as PINXFER_TORCH_TEAM=off does, so that one process can time calls with and
// without the probe in turn (on by default).
void set_team_probe_enabled(bool on);
// Whether that tracing is on (pinxfer.pin_memory's call trace is recorded under it too), and
// how many copies ran on a team so far (torch_team_state().copies, without its probe).
bool team_region_tracing();
int64_t torch_team_copies();

}  // namespace pinxfer
