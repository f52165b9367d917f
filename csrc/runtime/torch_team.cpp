#include "runtime/torch_team.h"

#include <ATen/Parallel.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <link.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <exception>
#include <mutex>
#include <string>
#include <vector>

#include "runtime/thread_pool.h"

namespace pinxfer {

namespace {

#if defined(__SANITIZE_THREAD__)
constexpr bool kProbeAllowed = false;  // TSan cannot see libgomp's fork and join
#else
constexpr bool kProbeAllowed = true;
#endif

// Team members watched: all spin and sleep together, two guard against one being
// descheduled at the moment it is read.
constexpr size_t kWatched = 2;

pid_t current_tid() { return static_cast<pid_t>(::syscall(SYS_gettid)); }

// libgomp's entry point for `#pragma omp parallel` (GCC's ABI since 4.9): runs fn(data) on
// the calling thread's team of num_threads (the caller included) and returns when all
// have. pinxfer is not built with -fopenmp, so at::parallel_for compiled here would run
// serially; the team torch uses is reached through the libgomp torch loaded.
using GompParallel = void (*)(void (*)(void*), void*, unsigned, unsigned);

int find_gomp(struct dl_phdr_info* info, size_t, void* out) {
  if (info->dlpi_name == nullptr || std::strstr(info->dlpi_name, "libgomp") == nullptr) return 0;
  void* lib = ::dlopen(info->dlpi_name, RTLD_LAZY | RTLD_NOLOAD);
  if (lib == nullptr) return 0;
  *static_cast<GompParallel*>(out) = reinterpret_cast<GompParallel>(::dlsym(lib, "GOMP_parallel"));
  ::dlclose(lib);  // NOLOAD took a reference to a library that stays loaded
  return *static_cast<GompParallel*>(out) != nullptr ? 1 : 0;
}

// torch's libgomp's GOMP_parallel; nullptr where torch's intra-op backend is not libgomp.
GompParallel gomp_parallel() {
  static const GompParallel fn = [] {
    GompParallel found = nullptr;
    ::dl_iterate_phdr(&find_gomp, &found);
    return found;
  }();
  return fn;
}

// fn over [0, n) in chunks of `chunk`, claimed by the team's threads as they arrive (a late
// one finds none left); the first exception is kept and rethrown after the join (one must
// not leave an OpenMP region).
struct Region {
  const std::function<void(size_t, size_t)>* fn;
  size_t n = 0, chunk = 1;
  std::atomic<size_t> next{0};
  std::mutex mutex;
  std::exception_ptr error;  // LOCK: mutex

  static void body(void* self) {
    auto& r = *static_cast<Region*>(self);
    for (;;) {
      const size_t begin = r.next.fetch_add(r.chunk, std::memory_order_relaxed);
      if (begin >= r.n) return;
      try {
        (*r.fn)(begin, std::min(r.n, begin + r.chunk));
      } catch (...) {
        std::lock_guard<std::mutex> lock(r.mutex);
        if (!r.error) r.error = std::current_exception();
      }
    }
  }
};

void run_region(size_t n, size_t chunk, unsigned threads,
                const std::function<void(size_t, size_t)>& fn) {
  Region r;
  r.fn = &fn;
  r.n = n;
  r.chunk = std::max<size_t>(1, chunk);
  gomp_parallel()(&Region::body, &r, threads, 0);
  if (r.error) std::rethrow_exception(r.error);
}

// The calling thread's view of its team.
struct TeamProbe {
  pid_t pid = 0;    // process the team was learned in (a forked child learns again)
  int threads = 0;  // at::get_num_threads() when learned; 0: not learned
  std::vector<int> stat_fds;

  TeamProbe() = default;
  TeamProbe(const TeamProbe&) = delete;
  TeamProbe& operator=(const TeamProbe&) = delete;
  ~TeamProbe() { forget(); }

  void forget() {
    for (int fd : stat_fds) ::close(fd);
    stat_fds.clear();
    threads = 0;
  }

  // One parallel region, each member recording its thread id; the first two that are
  // not the caller are watched.
  void learn(int n) {
    forget();
    pid = ::getpid();
    threads = n;
    std::vector<pid_t> tids(static_cast<size_t>(n), 0);
    run_region(tids.size(), 1, static_cast<unsigned>(n), [&tids](size_t begin, size_t end) {
      for (size_t i = begin; i < end; ++i) tids[i] = current_tid();
    });
    const pid_t self = current_tid();
    for (pid_t tid : tids) {
      if (tid == 0 || tid == self || stat_fds.size() == kWatched) continue;
      const std::string path = "/proc/self/task/" + std::to_string(tid) + "/stat";
      const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
      if (fd >= 0) stat_fds.push_back(fd);
    }
  }

  // 'R' running, 'S' sleeping, ...; 0 if the thread is gone or unreadable.
  static char state_of(int fd) {
    char buf[512];
    const ssize_t got = ::pread(fd, buf, sizeof(buf) - 1, 0);
    if (got <= 0) return 0;
    buf[got] = '\0';
    // "tid (comm) S ...": comm may hold spaces and parentheses, the last ')' ends it.
    const char* close = std::strrchr(buf, ')');
    if (close == nullptr || close[1] != ' ') return 0;
    return close[2];
  }

  bool awake() {
    bool any_running = false;
    for (int fd : stat_fds) {
      const char s = state_of(fd);
      if (s == 0) {  // a member is gone: the team was rebuilt; learn it next time
        forget();
        return false;
      }
      any_running |= s == 'R';
    }
    return any_running;
  }
};

thread_local TeamProbe t_probe;
std::atomic<int64_t> g_team_copies{0};  // torch_team_state().copies

// The interpreter's main thread is the process's first thread (tid == pid). Only its team
// is probed: on another thread the first probe would create a team (libgomp starts one
// per thread on its first parallel region) that the thread's own work never needed.
bool on_main_thread() { return current_tid() == ::getpid(); }

}  // namespace

bool torch_team_awake() {
  if (!kProbeAllowed || gomp_parallel() == nullptr || at::in_parallel_region() ||
      !on_main_thread()) {
    return false;
  }
  const int n = at::get_num_threads();
  if (n <= 1) return false;
  if (t_probe.threads != n || t_probe.pid != ::getpid()) t_probe.learn(n);
  return t_probe.awake();
}

void host_parallel_for(ThreadPool& pool, size_t n, size_t grain,
                       const std::function<void(size_t, size_t)>& fn, int max_threads) {
  if (n == 0) return;
  if (!torch_team_awake()) {
    pool.parallel_for(n, grain, fn, max_threads);
    return;
  }
  run_on_torch_team(n, grain, fn);
}

void run_on_torch_team(size_t n, size_t grain, const std::function<void(size_t, size_t)>& fn) {
  g_team_copies.fetch_add(1, std::memory_order_relaxed);
  grain = std::max<size_t>(1, grain);
  // Chunks of at least `grain`, four per thread (as ThreadPool::parallel_for), so a thread
  // that comes late leaves its share to the others.
  const int team = std::max(1, at::get_num_threads());
  const size_t threads = std::max<size_t>(1, std::min<size_t>(team, (n + grain - 1) / grain));
  const size_t chunk = std::max(grain, (n + threads * 4 - 1) / (threads * 4));
  // The region always asks for the whole team, as torch's own ops do; members beyond the
  // chunks find none and leave at once. A smaller region would make libgomp end the
  // members it leaves out, and torch's next op start them again (diag_midsize, H100: a
  // 1 MiB to_device on a 3-thread region, 67 -> 111 us, its helpers 2 -> 24 us late).
  run_region(n, chunk, static_cast<unsigned>(team), fn);
}

void run_on_each_team_member(const std::function<void()>& fn) {
  g_team_copies.fetch_add(1, std::memory_order_relaxed);
  const int team = std::max(1, at::get_num_threads());
  run_region(static_cast<size_t>(team), 1, static_cast<unsigned>(team),
             [&fn](size_t begin, size_t end) {
               for (size_t i = begin; i < end; ++i) fn();
             });
}

TorchTeamState torch_team_state() {
  TorchTeamState s;
  s.awake = torch_team_awake();
  s.threads = t_probe.threads;
  s.copies = g_team_copies.load(std::memory_order_relaxed);
  return s;
}

}  // namespace pinxfer
