#include "runtime/torch_team.h"

#include <ATen/Parallel.h>
#include <dirent.h>
#include <fcntl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <time.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "runtime/fork.h"
#include "runtime/libgomp.h"
#include "runtime/settings.h"
#include "runtime/share_split.h"
#include "runtime/steady_time.h"
#include "runtime/thread_pool.h"

namespace pinxfer {

namespace {

#if defined(__SANITIZE_THREAD__)
constexpr bool kProbeAllowed = false;  // TSan cannot see libgomp's fork and join
#else
constexpr bool kProbeAllowed = true;
#endif

// Team members watched: all spin and sleep together; a second is kept in case the first
// ends (libgomp ends members when a region asks for fewer threads than the last).
constexpr size_t kWatched = 2;

pid_t current_tid() { return static_cast<pid_t>(::syscall(SYS_gettid)); }

// A parallel region: body() runs once on each of the team's threads (the caller among
// them) and returns when all have; the first exception is kept and rethrown after the
// join (one must not leave an OpenMP region).
struct Region {
  const std::function<void()>* member;
  std::mutex mutex;
  std::exception_ptr error;  // LOCK: mutex

  static void body(void* self) {
    auto& r = *static_cast<Region*>(self);
    try {
      (*r.member)();
    } catch (...) {
      std::lock_guard<std::mutex> lock(r.mutex);
      if (!r.error) r.error = std::current_exception();
    }
  }
};

// When the calling thread's last region on its team (ours, or torch's op run by
// run_torch_op_on_team) ended: its members spin from then on (team_spin_window_us).
thread_local int64_t t_region_end_ns = 0;

void run_on_each_member(unsigned threads, const std::function<void()>& member) {
  Region r;
  r.member = &member;
  libgomp().parallel(&Region::body, &r, threads, 0);
  t_region_end_ns = steady_now_ns();
  if (r.error) std::rethrow_exception(r.error);
}

thread_local TeamRegionTrace t_region_trace;  // last_team_region_trace()
std::atomic<bool> g_trace_regions{false};     // set_team_region_tracing()

// fn over [0, n): member k of the team takes [k * share, (k + 1) * share), as torch's own
// parallel_for splits its range on this team, in pieces, then helps with what late members
// left (runtime/share_split.h). The same member takes the same part of every copy, so a copy
// of bytes copied or written just before (a torch op's output, the same tensor again) finds
// its part in that member's core's cache. Claiming chunks as members arrived (the first
// design) left the parts to chance: each member copied bytes another core had cached, and a
// 4 MiB pin_memory's region took 33 us against 16 for torch's copy_ of the same bytes on the
// same team (H100, diag_pin_copy; every member had arrived within 5 us).
void run_region(size_t n, size_t share, unsigned threads,
                const std::function<void(size_t, size_t)>& fn) {
  ShareSplit split(n, share, threads);
  // Per member (by place in the team, the first kTracedMembers): arrival and finish (ns
  // after `start`) and pieces taken; each member writes its own slot, read after the join.
  constexpr size_t kTracedMembers = 64;
  std::array<int64_t, kTracedMembers> arrive{}, done{};
  std::array<int, kTracedMembers> taken{};
  const bool tracing = g_trace_regions.load(std::memory_order_relaxed);
  const size_t traced_members = tracing ? std::min<size_t>(threads, kTracedMembers) : 0;
  const int64_t start = tracing ? steady_now_ns() : 0;
  run_on_each_member(threads, [&] {
    const auto me = static_cast<size_t>(libgomp().thread_num());
    const bool traced = me < traced_members;
    if (traced) arrive[me] = steady_now_ns() - start;
    const size_t ran = split.take(me, fn);
    if (traced) {
      taken[me] = static_cast<int>(ran);
      done[me] = steady_now_ns() - start;
    }
  });
  if (!tracing) return;
  TeamRegionTrace& t = t_region_trace;
  t.total_us = static_cast<double>(steady_now_ns() - start) / 1e3;
  t.chunks = split.pieces();
  t.arrive_us.clear();
  t.done_us.clear();
  t.member_chunks.assign(taken.begin(), taken.begin() + traced_members);
  for (size_t i = 0; i < traced_members; ++i) {
    t.arrive_us.push_back(static_cast<double>(arrive[i]) / 1e3);
    t.done_us.push_back(static_cast<double>(done[i]) / 1e3);
  }
}

// The calling thread's view of its team.
struct TeamProbe {
  pid_t pid = 0;    // process the team was learned in (a forked child learns again)
  int threads = 0;  // at::get_num_threads() when learned; 0: not learned
  // Threads every region asks for: the caller and the members seen spinning when the team
  // was learned. Never more: a region larger than the team makes libgomp start threads,
  // and it ends the process when it cannot (tests/test_limits.py); a smaller one makes it
  // end the members left out, which torch's next op starts again.
  int region_threads = 1;
  struct Member {
    pid_t tid;    // read by PINXFER_TEAM_PROBE=clock
    int stat_fd;  // its /proc stat file, read by PINXFER_TEAM_PROBE=proc
  };
  std::vector<Member> watched;  // at most kWatched

  TeamProbe() = default;
  TeamProbe(const TeamProbe&) = delete;
  TeamProbe& operator=(const TeamProbe&) = delete;
  ~TeamProbe() { forget(); }

  void forget() {
    for (const Member& m : watched) ::close(m.stat_fd);
    watched.clear();
    threads = 0;
  }

  // One parallel region, each member recording its thread id; the first two that are
  // not the caller are watched.
  void learn(int n, int team) {
    forget();
    pid = ::getpid();
    threads = n;
    region_threads = team;
    std::vector<pid_t> tids(static_cast<size_t>(team), 0);
    std::atomic<size_t> arrived{0};
    run_on_each_member(static_cast<unsigned>(team), [&] {
      const size_t i = arrived.fetch_add(1, std::memory_order_relaxed);
      if (i < tids.size()) tids[i] = current_tid();
    });
    const pid_t self = current_tid();
    for (pid_t tid : tids) {
      if (tid == 0 || tid == self || watched.size() == kWatched) continue;
      const std::string path = "/proc/self/task/" + std::to_string(tid) + "/stat";
      const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0) continue;
      watched.push_back({tid, fd});
    }
    if (watched.empty()) forget();  // no member to watch: try again at a later scan
  }

  // Reads "tid (comm) S ..." of a /proc stat file: the state ('R' running, 'S' sleeping,
  // ...; 0 if the thread is gone or unreadable) and, if asked, the comm.
  static char state_of(int fd, std::string* comm = nullptr) {
    char buf[512];
    const ssize_t got = ::pread(fd, buf, sizeof(buf) - 1, 0);
    if (got <= 0) return 0;
    buf[got] = '\0';
    // comm may hold spaces and parentheses: the first '(' opens it, the last ')' ends it.
    const char* open = std::strchr(buf, '(');
    const char* close = std::strrchr(buf, ')');
    if (open == nullptr || close == nullptr || close < open || close[1] != ' ') return 0;
    if (comm != nullptr) comm->assign(open + 1, close);
    return close[2];
  }

  // How many members of a team of n seem to exist and spin, seen without running a
  // region: the threads of this process other than the caller and pinxfer's copy threads
  // that are running, if at least max(2, (n - 1) / 2) (else 0). A region of our own would start a
  // team where torch never made one, and libgomp ends the process when it cannot start its threads
  // (tests/test_limits.py). One stat read per thread of the process: a few dozen microseconds, so
  // it is rationed (scan_due) and stops once the team is learned.
  static int others_running(int n) {
    DIR* dir = ::opendir("/proc/self/task");
    if (dir == nullptr) return 0;
    const pid_t self = current_tid();
    // Half the other members, and at least two: on a loaded machine some have already gone
    // to sleep, and that many running threads of this process that are not pinxfer's are a
    // team. One running thread is no sign (a data thread, a runner's I/O thread): a team of
    // two is never learned (CI, 2 CPUs: learning on one stray thread started a team under
    // RLIMIT_AS and libgomp ended the process).
    const int enough = std::max(2, (n - 1) / 2);
    int running = 0;
    std::string comm;
    while (const dirent* entry = ::readdir(dir)) {
      const pid_t tid = static_cast<pid_t>(std::atoi(entry->d_name));
      if (tid <= 0 || tid == self) continue;
      const std::string path = "/proc/self/task/" + std::to_string(tid) + "/stat";
      const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0) continue;
      const char state = state_of(fd, &comm);
      ::close(fd);
      if (state == 'R' && comm.rfind(kThreadNamePrefix, 0) != 0 && ++running == n - 1) break;
    }
    ::closedir(dir);
    return running >= enough ? running : 0;
  }

  // Scans (others_running) come at calls 1, 2, 4, ... 64, then every 64th, until the team
  // is learned: a process whose team never spins pays for few of them.
  bool scan_due() {
    if (++calls_since_scan < scan_every) return false;
    calls_since_scan = 0;
    scan_every = std::min(scan_every * 2, 64);
    return true;
  }
  int calls_since_scan = 0, scan_every = 1;

  // The members spin and sleep together: one read tells (a spinning member the scheduler
  // has descheduled is still 'R', runnable); the second is read only when the first has gone.
  // PINXFER_TEAM_PROBE=clock reads whether the member's CPU clock runs instead
  // (thread_running_now): two clock reads cost less than the /proc read, but a spinning
  // member the scheduler has descheduled is then taken for asleep.
  bool awake() {
    const bool by_clock = settings().team_probe_clock;
    for (const Member& m : watched) {
      // 1: running, 0: not, -1: the member is gone. By clock, a bare thread id: had a member
      // ended and a new thread of this process been given its id (ids wrap at pid_max), that
      // thread would be read; a wrong answer costs a copy its road, nothing more. The /proc
      // file stays the ended thread's, and its read fails.
      const int running = by_clock ? thread_running_now(m.tid) : running_by_state(m.stat_fd);
      if (running >= 0) return running == 1;
    }
    forget();  // every watched member is gone: the team was rebuilt; learn it next time
    return false;
  }

  // state_of as awake() asks it: 1 running ('R'), 0 another state, -1 gone or unreadable.
  static int running_by_state(int fd) {
    const char s = state_of(fd);
    return s == 0 ? -1 : s == 'R' ? 1 : 0;
  }
};

thread_local TeamProbe t_probe;
std::atomic<int64_t> g_team_copies{0};     // torch_team_state().copies
std::atomic<int64_t> g_state_reads{0};     // torch_team_state().state_reads
std::atomic<int64_t> g_window_answers{0};  // torch_team_state().window_answers

// Whether a region of this thread's team ended so recently that its members are surely still
// spinning (team_spin_window_us, for the team as the process's settings and CPUs make it).
bool within_spin_window(int team_threads) {
  if (t_region_end_ns == 0) return false;
  const Settings& s = settings();
  const int64_t window_us =
      team_spin_window_us(s.omp_wait_policy, s.gomp_spincount, team_threads, s.cpus.affinity_cpus);
  return window_us > 0 && steady_now_ns() - t_region_end_ns < window_us * 1000;
}

// The interpreter's main thread is the process's first thread (tid == pid). Only its team
// is probed: on another thread the first probe would create a team (libgomp starts one
// per thread on its first parallel region) that the thread's own work never needed.
bool on_main_thread() { return current_tid() == ::getpid(); }

}  // namespace

namespace {
std::atomic<bool> g_team_probe_enabled{true};  // set_team_probe_enabled (diagnostic)

// The clock id of thread `tid`'s CPU time (its sum_exec_runtime), as glibc's
// pthread_getcpuclockid makes it: the kernel's MAKE_THREAD_CPUCLOCK(tid, CPUCLOCK_SCHED),
// (~tid << 3) | CPUCLOCK_PERTHREAD_MASK | CPUCLOCK_SCHED. The kernel takes any thread of the
// calling process.
clockid_t thread_cpu_clock(int tid) {
  return static_cast<clockid_t>((~static_cast<unsigned>(tid) << 3) | 4u | 2u);
}
}  // namespace

int thread_running_now(int tid) {
  const clockid_t clock = thread_cpu_clock(tid);
  timespec first{}, second{};
  if (::clock_gettime(clock, &first) != 0 || ::clock_gettime(clock, &second) != 0) return -1;
  return first.tv_sec != second.tv_sec || first.tv_nsec != second.tv_nsec ? 1 : 0;
}

namespace {
// The self-test's threads: on every way out (an exception while starting them included) they
// are told to stop, woken and joined.
struct SelfTestThreads {
  std::atomic<bool> stop{false};
  std::mutex mutex;
  std::condition_variable wake;
  std::vector<std::thread> threads;
  ~SelfTestThreads() {
    {
      std::lock_guard<std::mutex> lock(mutex);
      stop.store(true);
    }
    wake.notify_all();
    for (std::thread& t : threads) {
      if (t.joinable()) t.join();
    }
  }
};

// No signal of the process is handled on a self-test thread: a handler run there would move
// its clock.
void block_signals() {
  sigset_t all;
  sigfillset(&all);
  pthread_sigmask(SIG_BLOCK, &all, nullptr);
}
}  // namespace

ThreadRunningCounts thread_running_self_test(int64_t samples) {
  TORCH_CHECK_VALUE(samples >= 1 && samples <= 1000000,
                    "_thread_running_self_test: samples must be from 1 to 1000000, got ", samples);
  std::atomic<int> spinner_tid{0}, sleeper_tid{0}, gone_tid{0};
  SelfTestThreads t;
  const int caller_cpu = ::sched_getcpu();
  t.threads.emplace_back([&] {
    block_signals();
    // Off the caller's CPU where the mask allows another: a spinner that shares the caller's
    // CPU is on it only when the caller is not, so never while the caller reads its clock.
    cpu_set_t mask;
    if (caller_cpu >= 0 && ::sched_getaffinity(0, sizeof(mask), &mask) == 0 &&
        CPU_ISSET(caller_cpu, &mask) && CPU_COUNT(&mask) > 1) {
      CPU_CLR(caller_cpu, &mask);
      ::sched_setaffinity(0, sizeof(mask), &mask);
    }
    spinner_tid.store(static_cast<int>(current_tid()));
    while (!t.stop.load(std::memory_order_relaxed)) {
    }
  });
  t.threads.emplace_back([&] {
    block_signals();
    std::unique_lock<std::mutex> lock(t.mutex);
    sleeper_tid.store(static_cast<int>(current_tid()));
    t.wake.wait(lock, [&] { return t.stop.load(); });
  });
  std::thread gone([&] {
    block_signals();
    gone_tid.store(static_cast<int>(current_tid()));
  });
  gone.join();
  while (spinner_tid.load() == 0 || sleeper_tid.load() == 0) std::this_thread::yield();
  // The sleeper sets its id under the lock, then waits: asleep once its state reads 'S'
  // (the last steps into the kernel's wait after that take far less than the pause).
  const std::string path = "/proc/self/task/" + std::to_string(sleeper_tid.load()) + "/stat";
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  TORCH_CHECK(fd >= 0, "_thread_running_self_test: cannot read ", path);
  while (TeamProbe::state_of(fd) != 'S') std::this_thread::yield();
  ::close(fd);
  std::this_thread::sleep_for(std::chrono::milliseconds(1));
  // At least `samples` questions, and on until the spinner has been seen running once or
  // two seconds have passed (on a machine whose other CPU is busy it may wait its turn).
  ThreadRunningCounts counts;
  const int64_t give_up_ns = steady_now_ns() + int64_t{2'000'000'000};
  for (int64_t i = 0; i < samples || (counts.spinner_running == 0 && steady_now_ns() < give_up_ns);
       ++i) {
    counts.spinner_running += thread_running_now(spinner_tid.load()) == 1;
    counts.sleeper_running += thread_running_now(sleeper_tid.load()) == 1;
  }
  counts.gone = thread_running_now(gone_tid.load());
  return counts;
}

void set_team_probe_enabled(bool on) { g_team_probe_enabled.store(on, std::memory_order_relaxed); }

bool torch_team_awake() {
  if (!g_team_probe_enabled.load(std::memory_order_relaxed)) return false;
  // Not in a forked child: its libgomp state is the parent's copy, and a region run on it
  // to learn the team could start threads or hang (found by review, session 42).
  if (!kProbeAllowed || !settings().torch_team || !libgomp().found() || at::in_parallel_region() ||
      !on_main_thread() || fork_generation() != 0) {
    return false;
  }
  const int n = at::get_num_threads();
  if (n <= 1) return false;
  if (t_probe.threads != n || t_probe.pid != ::getpid()) {
    // Not learned (or the team changed): learn it only once it is seen spinning.
    if (!t_probe.scan_due()) return false;
    const int members = TeamProbe::others_running(n);
    if (members == 0) return false;
    t_probe.learn(n, members + 1);
    t_probe.calls_since_scan = 0;
    t_probe.scan_every = 1;
  } else if (t_probe.region_threads < n && t_probe.scan_due()) {
    // Learned on part of the team (some members had gone to sleep at that scan): regions of
    // that size end the others at every copy and torch's next op starts them again. A later
    // scan that sees more of the team spinning learns it again, larger.
    const int members = TeamProbe::others_running(n);
    if (members + 1 > t_probe.region_threads) t_probe.learn(n, members + 1);
  }
  // Right after a region of our own the team spins: no /proc read needed (a back-to-back
  // copy saves the 1-5 us it costs).
  if (t_probe.threads == n && within_spin_window(n)) {
    g_window_answers.fetch_add(1, std::memory_order_relaxed);
    return true;
  }
  g_state_reads.fetch_add(1, std::memory_order_relaxed);
  return t_probe.awake();
}

void host_parallel_for(ThreadPool& pool, size_t n, size_t grain, size_t awake_grain,
                       const std::function<void(size_t, size_t)>& fn, int max_threads,
                       TeamAnswer team) {
  if (n == 0) return;
  awake_grain = std::max<size_t>(1, std::min(awake_grain, grain));
  // The probe costs a /proc read: asked only where two threads could share the copy.
  const auto awake = [team] {
    return team == TeamAnswer::kAsk ? torch_team_awake() : team == TeamAnswer::kAwake;
  };
  if (n <= awake_grain || !awake()) {
    pool.parallel_for(n, grain, fn, max_threads);
    return;
  }
  run_on_torch_team(n, awake_grain, fn);
}

void run_on_torch_team(size_t n, size_t grain, const std::function<void(size_t, size_t)>& fn) {
  g_team_copies.fetch_add(1, std::memory_order_relaxed);
  grain = std::max<size_t>(1, grain);
  // One share a member, of at least `grain` (run_region: member k always takes part k).
  const int team = t_probe.region_threads;
  const size_t share = std::max(grain, (n + team - 1) / static_cast<size_t>(team));
  // The region asks for the team as learned (region_threads), however few shares there
  // are; members beyond the shares find none and leave at once. A smaller region would
  // make libgomp end the members it leaves out, and torch's next op start them again
  // (diag_midsize, H100: a 1 MiB to_device on a 3-thread region, 67 -> 111 us, its helpers
  // 2 -> 24 us late).
  run_region(n, share, static_cast<unsigned>(team), fn);
}

void run_torch_op_on_team(const std::function<void()>& op) {
  g_team_copies.fetch_add(1, std::memory_order_relaxed);
  op();
  t_region_end_ns = steady_now_ns();
}

int team_spin_window_us(const std::string& wait_policy, const std::string& spincount,
                        int team_threads, int cpus) {
  // libgomp (env.c): unset, the team spins 300000 times after a region (about a millisecond
  // or more on current x86: each spin is a `pause`), 'passive' makes that 0, and with more
  // of its threads than CPUs it spins only 100 times (1000 with 'active'). A GOMP_SPINCOUNT of any
  // value is not second-guessed: the probe then reads /proc at every copy, as it always did.
  if (wait_policy == "passive" || !spincount.empty() || team_threads > cpus) return 0;
  return kTeamSpinWindowUs;
}

void run_on_each_team_member(const std::function<void(size_t, size_t)>& fn) {
  g_team_copies.fetch_add(1, std::memory_order_relaxed);
  const auto members = static_cast<size_t>(t_probe.region_threads);
  run_on_each_member(static_cast<unsigned>(members),
                     [&] { fn(static_cast<size_t>(libgomp().thread_num()), members); });
}

TeamRegionTrace last_team_region_trace() { return t_region_trace; }

void set_team_region_tracing(bool on) { g_trace_regions.store(on, std::memory_order_relaxed); }

bool team_region_tracing() { return g_trace_regions.load(std::memory_order_relaxed); }

int64_t torch_team_copies() { return g_team_copies.load(std::memory_order_relaxed); }

TorchTeamState torch_team_state() {
  TorchTeamState s;
  s.awake = torch_team_awake();
  s.threads = t_probe.threads;
  s.region_threads = t_probe.threads > 0 ? t_probe.region_threads : 0;
  s.copies = g_team_copies.load(std::memory_order_relaxed);
  s.state_reads = g_state_reads.load(std::memory_order_relaxed);
  s.window_answers = g_window_answers.load(std::memory_order_relaxed);
  return s;
}

}  // namespace pinxfer
