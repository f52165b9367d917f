// A persistent pool of worker threads for host-side memory work (first touch
// of fresh pages, pageable -> pinned copies).
//
// Threads are created once and live until the process exits (or a fork: the
// child builds a new pool on first use, see runtime/fork.h). Optionally the
// workers are pinned to a CPU set, e.g. the CPUs of the NUMA node that owns the
// memory they touch.
//
// Thread safety: parallel_for() may be called from any number of threads at
// once; jobs from concurrent callers share the workers, and every caller also
// works on its own job, so a call never waits for a free pool.
//
// Idle workers spin for a short while before they sleep (each on a futex word of its
// own, so a job wakes the sleepers it wants, the most recently active first, and as many
// again to race: thread_pool.cpp, post()): transfers come back to back (one per batch, one per
// tensor of a batch), and a sleeping worker takes tens of microseconds to wake (more on a virtual
// machine), which is a large share of an 8 MiB transfer. The spin is PINXFER_SPIN_US when set;
// otherwise 100 us, or an eighth of the last job's wall time when that is longer (at most
// kMaxAdaptiveSpinUs): a caller that spends a little time between long jobs (a prefetch producer
// running Python between batches) then finds the workers awake, and the spin costs at most an
// eighth more CPU than the job itself. No CPU is used once the spin ends.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include <c10/util/SmallVector.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace pinxfer {

// One step of a spin-wait: tells the core this thread is spinning (pause/yield).
inline void cpu_relax() {
#if defined(__x86_64__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// The name of every ThreadPool worker thread (at most 15 characters: the kernel's limit).
inline constexpr const char* kCopyThreadName = "pinxfer-copy";
// What every thread pinxfer starts is named beginning with (ThreadPool's, SerialJobs'):
// runtime/torch_team.cpp counts the running threads that are not pinxfer's.
inline constexpr const char* kThreadNamePrefix = "pinxfer-";

class ThreadPool {
 public:
  // num_threads counts the caller too: a pool of N runs N-1 workers.
  // cpus: CPU ids the workers may run on; empty means "no binding".
  ThreadPool(int num_threads, std::vector<int> cpus);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // Calls fn(begin, end) over [0, n) split into chunks of at least grain items,
  // on at most max_threads threads (0: all). Returns when every chunk is done;
  // rethrows the first exception a chunk threw.
  void parallel_for(size_t n, size_t grain, const std::function<void(size_t, size_t)>& fn,
                    int max_threads = 0);

  struct Job;  // defined in thread_pool.cpp
  // An offer of work to the workers that the caller does not wait for (offer/withdraw).
  using Offer = std::shared_ptr<Job>;

  // Offers fn(i, i + 1) for i in [0, helpers) to up to `helpers` workers and returns at once
  // (helpers is capped by the pool's workers; nullptr when none). The caller does its own
  // share and never waits for them: fn must own (share) everything it touches, and must
  // not throw. For work whose stragglers the caller can finish itself (the transfer
  // pipeline's single-block path, transfer/cuda/pipeline.cpp).
  Offer offer(int helpers, std::function<void(size_t, size_t)> fn);
  // Takes an offer back from the queue: a worker that has not started it never will (one
  // that has, runs on). Records its wall time for the adaptive spin.
  void withdraw(const Offer& offer);

  // After an idle gap, wakes ahead of a job the sleeping workers a job of `helpers` helpers
  // would still want (as post() counts them: less the spinning ones and those already
  // rising, twice over), so that they rise while the caller prepares the job; they then
  // spin for it. For a caller that knows it will offer work but has slow steps to take
  // first (a transfer: the output's allocation, stream hand-over and staging block, which
  // after an idle gap cost tens of microseconds each, about what a sleeping worker takes to
  // rise). A worker woken so that sees no job spins for one as after any job, then sleeps.
  // Only after a gap: when the pool's last job ended more than twice its longest spin ago.
  // Back to back the setup is short, and waking workers early then only adds runnable
  // threads while the caller prepares; on the H200, with torch's OpenMP team spinning on
  // every core, the caller's setup took 28-377 us instead of 7-32 in four processes
  // (benchmarks/diag_wake.py; csrc/README.md, "Woken ahead"). The caller wakes one worker
  // and that one, as it rises, wakes the others (relay_): the wake-ups are system calls of
  // several microseconds each on the caller's idle core, and on the H100 a to_device's setup
  // after a gap took 83-104 us with the caller waking them all against 65-73 without any.
  void wake_ahead(int helpers);
  // Whether wake_ahead() wakes workers now: wake-ahead is on (set_wake_ahead_enabled) and
  // the pool's last job ended more than twice its longest spin ago. A caller that must pay
  // for its decision (pin_memory's torch-team probe) asks this first.
  bool wakes_ahead_now() const;

  int num_threads() const { return static_cast<int>(workers_.size()) + 1; }
  // Workers spinning for work right now (they take a job at once, with no
  // wake-up). A snapshot: it may change as soon as it is read.
  int spinning_workers() const { return spinning_.load(std::memory_order_relaxed); }

  // How many threads (the caller included) a host copy of `nbytes` should
  // use: awake workers per 256 KiB, sleeping ones per 512 KiB (the .cpp says
  // what was measured), at most num_threads(). For parallel_for's max_threads.
  int threads_for_copy(size_t nbytes) const;
  const std::vector<int>& cpus() const { return cpus_; }

 private:
  void worker_loop(int me);
  // Worker `me`'s next job: the queue's first, once there is one (asleep on its own word
  // while there is none); nullptr when the pool is stopping, or when the worker was woken
  // ahead of a job (wake_ahead) and none has come yet: it then spins for one.
  std::shared_ptr<Job> next_job(int me);
  // Tells every worker to stop and joins them (the destructor, and a
  // constructor that could not start all its threads).
  void stop_and_join();
  void spin_for_work() const;
  static void run_chunks(Job& job);
  // Queues a job (stamping its start) and wakes the workers it may use.
  void post(const std::shared_ptr<Job>& job);
  // Takes up to kWakeHedge x (helpers less the workers spinning or rising) off asleep_,
  // most recent first, into `out`. Caller holds mutex_.
  void take_sleepers(int helpers, c10::SmallVectorImpl<int>& out);
  // A worker risen from a wake-ahead wakes the workers relay_ holds.
  void wake_relayed();
  // Wakes worker `worker`, which the caller has just taken off asleep_, with `why`
  // (kWokenForJob or kWokenAhead) in its word.
  void wake(int worker, uint32_t why);
  // Takes a job off the queue if no worker did, and records its wall time for the
  // adaptive spin (parallel_for once its chunks are done; withdraw).
  void retire(Job& job);
  // The caller, its own chunks done: spins while the helpers finish theirs (at most as
  // long as the job has run), then sleeps until they have.
  void wait_for_helpers(Job& job) const;

  std::vector<int> cpus_;
  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::deque<std::shared_ptr<Job>> jobs_;  // LOCK: mutex_
  // Each worker's futex word, on a cache line of its own: kAsleep while it sleeps (or is
  // about to), kWokenForJob or kWokenAhead once a waker has taken it off asleep_. A worker
  // sleeps only while its word is kAsleep, so a wake-up that comes before its wait is not
  // lost.
  static constexpr uint32_t kAsleep = 0, kWokenForJob = 1, kWokenAhead = 2;
  struct alignas(64) WakeWord {
    std::atomic<uint32_t> word{0};
  };
  std::unique_ptr<WakeWord[]> wake_words_;  // one per worker, built before the workers start
  // Workers asleep or about to sleep, the most recent last: post() wakes from the back
  // (LIFO). LOCK: mutex_
  std::vector<int> asleep_;
  // Workers woken ahead of a job (wake_ahead) that have not yet risen: post() counts them
  // as on their way. LOCK: mutex_
  int rising_ = 0;
  // Of those, the ones not yet woken: wake_ahead wakes one worker and leaves the others
  // here for it to wake as it rises (wake_relayed); post() wakes any still here, and
  // stop_and_join too. LOCK: mutex_
  c10::SmallVector<int, 16> relay_;
  // Written under mutex_ (so sleeping workers cannot miss it), also read
  // without it by spinning workers.
  std::atomic<bool> stopping_{false};
  // jobs_.size(), written under mutex_, read without it by spinning workers.
  std::atomic<size_t> queued_jobs_{0};
  std::atomic<int> spinning_{0};  // workers inside spin_for_work()
  int spin_us_ = 0;               // the shortest spin (PINXFER_SPIN_US or 100)
  bool spin_adaptive_ = false;
  // Wall time of the pool's last parallel_for, for the adaptive spin; relaxed:
  // a stale value only changes how long a worker spins.
  std::atomic<int64_t> last_job_us_{0};
  // When the pool's last job was retired (steady_clock, ns), for wake_ahead's gap test;
  // relaxed: a stale value only decides whether workers are woken early.
  std::atomic<int64_t> last_retired_ns_{0};
};

// TEST-ONLY (pinxfer._C._thread_pool_self_test): `callers` threads share one pool of
// `workers` workers for `rounds` rounds each; a round offers `items` claims to the workers
// and takes the rest itself without waiting for them (the single-block transfer's pattern:
// the claims' state is shared and dropped by whoever leaves last), then runs a parallel_for
// over `items`. Every item must be claimed exactly once (a c10::Error otherwise). Returns
// the claims the offered workers took. Run under TSan by scripts/sanitize.sh.
int64_t thread_pool_self_test(int64_t workers, int64_t callers, int64_t rounds, int64_t items);

// DIAGNOSTIC (pinxfer._C._wake_probe, benchmarks/diag_wake.py): how waking copy workers
// scales. A pool of `workers` workers (unbound, as a node's pool on a one-node host); each
// of `rounds` rounds sleeps `gap_us` (longer than the workers' spin: they sleep too), then
// offers `helpers` items, each of which records when it started and holds its worker until
// every item has started (or 20 ms have passed), so each item is a different worker's
// arrival. Per round: the microseconds the caller spent in the offer (the wake-up call) and
// each arrival after the offer began, sorted; -1 for an item no worker took within 20 ms.
// ahead_us >= 0: the round first wakes the helpers ahead (wake_ahead) and is busy for
// ahead_us before it offers, as a transfer preparing its copy is; -1: no wake-ahead.
struct WakeSample {
  double offer_us = 0;
  std::vector<double> arrivals_us;
};
std::vector<WakeSample> wake_probe(int64_t workers, int64_t helpers, int64_t gap_us, int64_t rounds,
                                   int64_t ahead_us);

// DIAGNOSTIC (pinxfer._C._set_wake_ahead, benchmarks/diag_wake.py): whether
// ThreadPool::wake_ahead wakes anyone (on by default; off, helpers are woken when the work
// is offered, as before 2026-11-27), for A/B runs in one process.
void set_wake_ahead_enabled(bool on);

// The process's budget of threads for host copies, shared by all its node
// pools: PINXFER_NUM_THREADS, else derived from the process's CPUs, cgroup
// quota and ranks on the host (copy_threads_for() in runtime/thread_budget.h).
int default_num_threads();

// How long an idle worker spins before sleeping: PINXFER_SPIN_US, else 100.
int default_spin_us();
// Whether the spin grows with the last job (PINXFER_SPIN_US unset).
bool default_spin_adaptive();

// The process-wide pool for a NUMA node (-1: unbound). Built on first use with
// the node's share of default_num_threads(), its workers bound to the node's
// CPUs in the process's affinity mask (node_pool_plan() in runtime/thread_budget.h;
// unbound when the node has none). Never destroyed (safe at interpreter exit);
// rebuilt in a forked child.
ThreadPool& thread_pool_for_node(int numa_node);

}  // namespace pinxfer
