#include "runtime/thread_pool.h"

#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <string>
#include <system_error>
#include <thread>

#include <c10/util/Exception.h>
#include <c10/util/SmallVector.h>

#include "runtime/fork.h"
#include "runtime/node_registry.h"
#include "runtime/settings.h"
#include "runtime/steady_time.h"
#include "runtime/thread_budget.h"
#include "runtime/topology.h"

namespace pinxfer {
namespace {

// The futex word is the atomic's own 32 bits (lock-free, no padding).
static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t) &&
              std::atomic<uint32_t>::is_always_lock_free);

uint32_t* futex_word(std::atomic<uint32_t>& word) { return reinterpret_cast<uint32_t*>(&word); }

// Sleeps while `word` still holds `seen` (returns at once if it does not). EAGAIN (the word
// changed) and EINTR are the normal ways out, and the caller looks again either way. Any
// other failure cannot happen with these arguments; if it did, a short sleep keeps the
// caller's loop from spinning on a core.
void futex_wait(std::atomic<uint32_t>& word, uint32_t seen) {
  if (syscall(SYS_futex, futex_word(word), FUTEX_WAIT_PRIVATE, seen, nullptr, nullptr, 0) == 0) {
    return;
  }
  if (errno != EAGAIN && errno != EINTR) std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

// Wakes the thread sleeping on `word` (each word has one sleeper at most).
void futex_wake_one(std::atomic<uint32_t>& word) {
  syscall(SYS_futex, futex_word(word), FUTEX_WAKE_PRIVATE, 1, nullptr, nullptr, 0);
}

}  // namespace

struct ThreadPool::Job {
  std::function<void(size_t, size_t)> fn;
  std::chrono::steady_clock::time_point started;
  size_t n = 0;
  size_t chunk = 1;
  size_t num_chunks = 0;
  int max_helpers = 0;  // workers allowed to join, besides the caller
  std::atomic<size_t> next_chunk{0};
  std::atomic<int> helpers{0};
  // Chunks finished. Atomic so the caller can poll it while it spins; the thread that
  // finishes the last chunk also notifies done_cv under done_mutex (no lost wake-up:
  // the caller checks it under that mutex before it sleeps).
  std::atomic<size_t> chunks_done{0};
  std::mutex done_mutex;
  std::condition_variable done_cv;
  std::exception_ptr error;  // LOCK: done_mutex

  bool finished() const { return chunks_done.load(std::memory_order_acquire) == num_chunks; }
};

ThreadPool::ThreadPool(int num_threads, std::vector<int> cpus)
    : cpus_(std::move(cpus)), spin_us_(default_spin_us()), spin_adaptive_(default_spin_adaptive()) {
  num_threads = std::max(1, num_threads);
  workers_.reserve(num_threads - 1);
  wake_words_ = std::make_unique<WakeWord[]>(static_cast<size_t>(num_threads - 1));
  // No allocation under mutex_ later: each list holds a worker at most once.
  asleep_.reserve(static_cast<size_t>(num_threads - 1));
  relay_.reserve(static_cast<size_t>(num_threads - 1));
  for (int i = 0; i < num_threads - 1; ++i) {
    try {
      workers_.emplace_back([this, i] { worker_loop(i); });
    } catch (const std::exception& e) {
      // The OS refused a thread (std::system_error: address space, ulimit -u, cgroup
      // pids.max), or its state could not be allocated (std::bad_alloc: caught too since
      // session 44's review, which found it escaping with started threads joinable).
      // A constructor that throws runs no destructor: stop and join the
      // workers already started here, or they would wait on a condition
      // variable that is about to be destroyed (a hang at
      // pthread_cond_destroy), and std::thread's destructor would terminate.
      stop_and_join();
      TORCH_CHECK(false, "pinxfer: could not start copy thread ", i + 1, " of ", num_threads - 1,
                  " (", e.what(),
                  "). Set PINXFER_NUM_THREADS to fewer "
                  "threads, or raise the process's thread or memory limits.");
    }
    // Named, so that tools (top -H, py-spy) and the torch-team probe (runtime/torch_team.h)
    // tell pinxfer's copy threads from the process's others; named here, before the
    // constructor returns, not by each thread as it starts: a probe right after the pool's
    // construction (a first transfer's muster) can see workers not yet started, runnable
    // and unnamed, and take them for torch's spinning team. On the H100 a pin_memory that
    // probed there (a variant not kept) then ran a region of that team, and under
    // test_limits.py's memory limit libgomp ended the process (2026-11-27).
    pthread_setname_np(workers_.back().native_handle(), kCopyThreadName);
    if (!cpus_.empty()) {
      // Sized for the highest id (a fixed cpu_set_t holds 1024 CPUs).
      const int bits = std::max(CPU_SETSIZE, *std::max_element(cpus_.begin(), cpus_.end()) + 1);
      if (cpu_set_t* set = CPU_ALLOC(bits)) {
        const size_t bytes = CPU_ALLOC_SIZE(bits);
        CPU_ZERO_S(bytes, set);
        for (int cpu : cpus_) {
          if (cpu >= 0) CPU_SET_S(cpu, bytes, set);
        }
        // Best effort: a failed binding (CPU offline, cgroup) leaves the thread free.
        pthread_setaffinity_np(workers_.back().native_handle(), bytes, set);
        CPU_FREE(set);
      }
    }
  }
}

ThreadPool::~ThreadPool() { stop_and_join(); }

void ThreadPool::stop_and_join() {
  std::vector<int> sleeping;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
    sleeping.swap(asleep_);
    sleeping.insert(sleeping.end(), relay_.begin(), relay_.end());  // taken off asleep_
    relay_.clear();
  }
  for (const int w : sleeping) wake(w, kWokenForJob);
  for (auto& t : workers_) {
    if (t.joinable()) t.join();
  }
}

void ThreadPool::run_chunks(Job& job) {
  for (;;) {
    const size_t c = job.next_chunk.fetch_add(1, std::memory_order_relaxed);
    if (c >= job.num_chunks) return;
    const size_t begin = c * job.chunk;
    const size_t end = std::min(job.n, begin + job.chunk);
    std::exception_ptr err;
    try {
      job.fn(begin, end);
    } catch (...) {
      err = std::current_exception();
    }
    if (err) {
      std::lock_guard<std::mutex> lock(job.done_mutex);
      if (!job.error) job.error = err;
    }
    // acq_rel: the caller that sees every chunk done sees every chunk's writes.
    if (job.chunks_done.fetch_add(1, std::memory_order_acq_rel) + 1 == job.num_chunks) {
      std::lock_guard<std::mutex> lock(job.done_mutex);
      job.done_cv.notify_all();
    }
  }
}

void ThreadPool::wait_for_helpers(Job& job) const {
  using Clock = std::chrono::steady_clock;
  // The caller has run out of chunks; helpers are finishing theirs. Sleeping here gives
  // the caller's core away, and when something else is runnable there (torch's OpenMP
  // team spins for milliseconds after each parallel op; a data-loading thread) the woken
  // caller waits a scheduler slice, about a millisecond, to get a core back: an 8 MiB
  // transfer right after a torch CPU op took 1.3-1.6 ms instead of 0.26 (design note,
  // "Copy threads and torch's OpenMP threads"). So the caller spins first, for as long
  // as the job has run so far (at least the pool's spin, at most kMaxAdaptiveSpinUs):
  // its CPU cost is bounded by the job's own wall time on one thread.
  const auto now = Clock::now();
  const int64_t ran_us =
      std::chrono::duration_cast<std::chrono::microseconds>(now - job.started).count();
  const int64_t spin_us =
      std::min<int64_t>(kMaxAdaptiveSpinUs, std::max<int64_t>(spin_us_, ran_us));
  const auto deadline = now + std::chrono::microseconds(spin_us);
  for (unsigned i = 1; !job.finished(); ++i) {
    cpu_relax();
    if (i % 64 == 0 && Clock::now() >= deadline) {
      std::unique_lock<std::mutex> lock(job.done_mutex);
      job.done_cv.wait(lock, [&] { return job.finished(); });
      return;
    }
  }
}

void ThreadPool::spin_for_work() const {
  using Clock = std::chrono::steady_clock;
  int64_t spin = spin_us_;
  if (spin_adaptive_) {
    const int64_t eighth = last_job_us_.load(std::memory_order_relaxed) / 8;
    spin = std::max<int64_t>(spin, std::min<int64_t>(kMaxAdaptiveSpinUs, eighth));
  }
  const auto deadline = Clock::now() + std::chrono::microseconds(spin);
  for (unsigned i = 1;; ++i) {
    if (queued_jobs_.load(std::memory_order_relaxed) > 0 ||
        stopping_.load(std::memory_order_relaxed)) {
      return;
    }
    cpu_relax();
    if (i % 64 == 0 && Clock::now() >= deadline) return;
  }
}

void ThreadPool::worker_loop(int me) {
  for (;;) {
    if (spin_us_ > 0 || spin_adaptive_) {
      spinning_.fetch_add(1, std::memory_order_relaxed);
      spin_for_work();
      spinning_.fetch_sub(1, std::memory_order_relaxed);
    }
    const std::shared_ptr<Job> job = next_job(me);
    if (job) {
      run_chunks(*job);
    } else if (stopping_.load()) {
      return;
    }  // else woken ahead of a job that has not come yet: spin for it
  }
}

std::shared_ptr<ThreadPool::Job> ThreadPool::next_job(int me) {
  std::atomic<uint32_t>& word = wake_words_[me].word;
  bool woken_ahead = false;
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (woken_ahead) --rising_;
      if (stopping_) return nullptr;
      if (!jobs_.empty()) {
        std::shared_ptr<Job> job = jobs_.front();
        // A job leaves the queue once it has all the helpers it may use or has
        // no chunks left to hand out.
        if (job->helpers.fetch_add(1) + 1 >= job->max_helpers ||
            job->next_chunk.load() >= job->num_chunks) {
          jobs_.pop_front();
          queued_jobs_.store(jobs_.size(), std::memory_order_relaxed);
        }
        return job;
      }
      if (woken_ahead) return nullptr;  // the job is on its way: spin for it
      // Nothing to do: onto the sleepers' stack, with the word cleared under the lock, so
      // a waker (who takes this worker off the stack under the same lock) sets it after.
      word.store(kAsleep, std::memory_order_relaxed);
      asleep_.push_back(me);
    }
    uint32_t why;
    while ((why = word.load(std::memory_order_acquire)) == kAsleep) futex_wait(word, kAsleep);
    woken_ahead = why == kWokenAhead;
    if (woken_ahead) wake_relayed();
  }
}

namespace {
// Room for `workers` indices in a list, made before a lock is taken. Out of line: inlined,
// SmallVector's grow makes GCC 12 warn, falsely, that the list may be used uninitialised.
[[gnu::noinline]] void reserve_room(c10::SmallVectorImpl<int>& list, size_t workers) {
  list.reserve(workers);
}

// Worker indices a call wakes, on the caller's stack: room for the workers of any pool but a
// very large host's, so that post() allocates nothing on the transfer's path (with room for
// 16 it allocated on every post of a pool of more workers, on hosts with more than 16 CPUs;
// lists kept per thread instead could be used after their thread_local destructor ran at
// exit: review, session 45). 512 bytes a list.
constexpr unsigned kWakeListInline = 128;
using WakeList = c10::SmallVector<int, kWakeListInline>;
}  // namespace

void ThreadPool::wake_relayed() {
  WakeList relayed;
  reserve_room(relayed, workers_.size());  // no allocation under the lock (post() says why)
  {
    std::lock_guard<std::mutex> lock(mutex_);
    relayed.append(relay_.begin(), relay_.end());
    relay_.clear();
  }
  for (const int w : relayed) wake(w, kWokenAhead);
}

void ThreadPool::wake(int worker, uint32_t why) {
  std::atomic<uint32_t>& word = wake_words_[worker].word;
  word.store(why, std::memory_order_release);
  futex_wake_one(word);
}

void ThreadPool::parallel_for(size_t n, size_t grain, const std::function<void(size_t, size_t)>& fn,
                              int max_threads) {
  if (n == 0) return;
  grain = std::max<size_t>(1, grain);
  int threads = num_threads();
  if (max_threads > 0) threads = std::min(threads, max_threads);
  const size_t max_chunks = (n + grain - 1) / grain;
  if (threads <= 1 || max_chunks <= 1) {
    fn(0, n);
    return;
  }
  auto job = std::make_shared<Job>();
  job->fn = fn;
  job->n = n;
  // Four chunks per thread balances uneven progress without tiny chunks.
  const size_t want_chunks = std::min<size_t>(max_chunks, static_cast<size_t>(threads) * 4);
  job->chunk = (n + want_chunks - 1) / want_chunks;
  job->num_chunks = (n + job->chunk - 1) / job->chunk;
  job->max_helpers = std::min<int>(threads - 1, static_cast<int>(job->num_chunks) - 1);
  post(job);
  run_chunks(*job);
  wait_for_helpers(*job);
  retire(*job);
  std::exception_ptr error;
  {
    std::lock_guard<std::mutex> lock(job->done_mutex);
    error = job->error;
  }
  if (error) std::rethrow_exception(error);
}

// Sleeping workers woken per helper a job still wants (post() says why).
constexpr int kWakeHedge = 2;

void ThreadPool::post(const std::shared_ptr<Job>& job) {
  job->started = std::chrono::steady_clock::now();
  // Room for every worker before the job is queued (each list holds workers' indices, each
  // at most once): a failed allocation after the job is queued would leave a job that no
  // Offer handle can withdraw, whose helpers could read a source after its caller returned.
  WakeList to_wake, relayed;
  reserve_room(to_wake, workers_.size());
  reserve_room(relayed, workers_.size());
  {
    std::lock_guard<std::mutex> lock(mutex_);
    jobs_.push_back(job);
    queued_jobs_.store(jobs_.size(), std::memory_order_relaxed);
    take_sleepers(job->max_helpers, to_wake);
    // Workers woken ahead whose relay has not come yet (wake_ahead): the job is here, so
    // they are woken now, as woken ahead (they are counted in rising_).
    relayed.append(relay_.begin(), relay_.end());
    relay_.clear();
  }
  for (const int w : relayed) wake(w, kWokenAhead);
  // Wake the sleeping workers the job may use (spinning ones need no wake-up: they see
  // queued_jobs_), the most recently active first (a LIFO stack of sleepers), and as many
  // again: the job takes the first to arrive, the others find it full and sleep again.
  // Measured (benchmarks/diag_wake.py, H100 and H200; csrc/README.md, "How they are
  // woken"): a condition variable's notify_all woke every sleeper for every job, which
  // cost the caller 9-65 us inside the wake call back to back (2-4 helpers wanted, the
  // other workers asleep) and 16-30 us after a 20 ms gap. Waking exactly the helpers
  // wanted cut that to under 4 and 7-15 us, but after a gap one slow riser then held the
  // whole job: the 2nd of 2 helpers came up after 140-210 us in four of eight H200
  // processes, against 49-89 with notify_all, where the first two of eleven woken had
  // raced. A wake-up's latency on these hosts varies that much from worker to worker,
  // so the wake is hedged (kWakeHedge), for about 2 us a worker in the wake call.
  // (Tried 2026-11-25: the caller waking one worker and each woken worker two
  // more, a tree. It took no wake-up off a small transfer that threads_for_copy
  // had not already, and with it a 32 MiB transfer back to back took 2.8 ms
  // instead of 1.7 on both the H100 and the H200 -- most likely the last
  // helpers coming up three wake-ups late; the tree was the only change on
  // that path, but no A/B run isolated it. results/<kind>/loop.json are of
  // that trial.)
  for (const int w : to_wake) wake(w, kWokenForJob);
}

void ThreadPool::take_sleepers(int helpers, c10::SmallVectorImpl<int>& out) {
  // Workers rising from an earlier wake_ahead will take the job as spinning ones do.
  const int wanted = helpers - spinning_workers() - rising_;
  for (int n = wanted > 0 ? kWakeHedge * wanted : 0; n > 0 && !asleep_.empty(); --n) {
    out.push_back(asleep_.back());
    asleep_.pop_back();
  }
}

namespace {
std::atomic<bool> g_wake_ahead_enabled{true};  // set_wake_ahead_enabled (diagnostic)
}  // namespace

void set_wake_ahead_enabled(bool on) { g_wake_ahead_enabled.store(on, std::memory_order_relaxed); }

bool ThreadPool::wakes_ahead_now() const {
  if (!g_wake_ahead_enabled.load(std::memory_order_relaxed)) return false;
  // A gap: the pool idle for more than twice its longest spin (thread_pool.h says why).
  const int64_t gap_ns = int64_t{2000} * std::max(spin_us_, kMaxAdaptiveSpinUs);
  return steady_now_ns() - last_retired_ns_.load(std::memory_order_relaxed) >= gap_ns;
}

void ThreadPool::wake_ahead(int helpers) {
  helpers = std::min<int>(helpers, static_cast<int>(workers_.size()));
  // Without a spin (PINXFER_SPIN_US=0, not adaptive) a worker woken ahead finds no job, goes
  // back to sleep at once and post() wakes it again: two wake-ups for one (review, session 44).
  if (spin_us_ == 0 && !spin_adaptive_) return;
  if (helpers <= 0 || !wakes_ahead_now()) return;
  // No allocation under the lock: a throw there would leave the workers taken off asleep_
  // asleep for good, never to be woken.
  WakeList to_wake;
  reserve_room(to_wake, workers_.size());
  {
    std::lock_guard<std::mutex> lock(mutex_);
    take_sleepers(helpers, to_wake);
    if (to_wake.empty()) return;
    rising_ += static_cast<int>(to_wake.size());
    // The caller wakes one; that one, as it rises, wakes the rest (wake_relayed): each
    // wake-up is a system call of several microseconds on a core that has just been idle,
    // and the caller's are on the transfer's path (thread_pool.h says what was measured).
    relay_.append(to_wake.begin() + 1, to_wake.end());
  }
  wake(to_wake.front(), kWokenAhead);
}

void ThreadPool::retire(Job& job) {
  {
    // Drop the job if no worker got round to taking it off the queue.
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = std::find_if(jobs_.begin(), jobs_.end(),
                           [&job](const std::shared_ptr<Job>& j) { return j.get() == &job; });
    if (it != jobs_.end()) jobs_.erase(it);
    queued_jobs_.store(jobs_.size(), std::memory_order_relaxed);
  }
  const auto now = std::chrono::steady_clock::now();
  last_job_us_.store(
      std::chrono::duration_cast<std::chrono::microseconds>(now - job.started).count(),
      std::memory_order_relaxed);
  last_retired_ns_.store(
      std::chrono::duration_cast<std::chrono::nanoseconds>(now.time_since_epoch()).count(),
      std::memory_order_relaxed);
}

ThreadPool::Offer ThreadPool::offer(int helpers, std::function<void(size_t, size_t)> fn) {
  helpers = std::min<int>(helpers, static_cast<int>(workers_.size()));
  if (helpers <= 0) return nullptr;
  auto job = std::make_shared<Job>();
  job->fn = std::move(fn);
  job->n = static_cast<size_t>(helpers);
  job->chunk = 1;
  job->num_chunks = job->n;
  job->max_helpers = helpers;
  post(job);
  return job;
}

void ThreadPool::withdraw(const Offer& job) {
  if (!job) return;
  // A worker that takes it from here on claims no chunk (run_chunks sees none left).
  job->next_chunk.store(job->num_chunks, std::memory_order_relaxed);
  retire(*job);
}

// Spinning workers join at once; a sleeping one costs a wake-up, and on the
// virtual machines we run on a worker woken after a compute step copies its
// first bytes tens of microseconds later, on a core that was idle
// (benchmarks/diag_latency.py, H100: a 1 MiB to_device after a 20 ms gap took
// 431 µs with the caller alone and 473 µs with 11 helpers woken). So a
// sleeping worker is woken only per kBytesPerWokenHelper of the copy, about
// what the caller copies while the helper comes up. Even an awake one costs
// its share of claims and of a chunk's completion (a chunk's DMA waits for
// its slowest piece): at 1 MiB back to back one thread took 106 µs and twelve
// 120 µs on the same H100. So an awake worker joins per kBytesPerAwakeHelper.
constexpr size_t kBytesPerWokenHelper = size_t{512} << 10;
constexpr size_t kBytesPerAwakeHelper = size_t{256} << 10;

int ThreadPool::threads_for_copy(size_t nbytes) const {
  const size_t awake =
      std::min(static_cast<size_t>(spinning_workers()), nbytes / kBytesPerAwakeHelper);
  const size_t helpers = std::max(awake, nbytes / kBytesPerWokenHelper);
  return 1 + static_cast<int>(std::min(helpers, workers_.size()));
}

int64_t thread_pool_self_test(int64_t workers, int64_t callers, int64_t rounds, int64_t items) {
  TORCH_CHECK_VALUE(workers >= 0 && workers <= 64 && callers >= 1 && callers <= 64 && rounds >= 1 &&
                        items >= 1 && items <= (int64_t{1} << 20),
                    "pinxfer._thread_pool_self_test: expected 0..64 workers, 1..64 callers, "
                    "rounds >= 1 and 1..2^20 items; got ",
                    workers, ", ", callers, ", ", rounds, ", ", items);
  ThreadPool pool(static_cast<int>(workers) + 1, {});
  const size_t n = static_cast<size_t>(items);
  struct Claims {
    explicit Claims(size_t count) : hits(count) {}
    std::atomic<size_t> next{0};
    std::vector<std::atomic<int>> hits;
    std::atomic<size_t> done{0};
    std::atomic<int64_t> by_helpers{0};
  };
  auto take = [](Claims& c, bool helper) {
    for (;;) {
      const size_t i = c.next.fetch_add(1, std::memory_order_relaxed);
      if (i >= c.hits.size()) return;
      c.hits[i].fetch_add(1, std::memory_order_relaxed);
      if (helper) c.by_helpers.fetch_add(1, std::memory_order_relaxed);
      c.done.fetch_add(1, std::memory_order_release);
    }
  };
  auto check = [](const std::vector<std::atomic<int>>& hits, const char* what) {
    for (size_t i = 0; i < hits.size(); ++i) {
      const int h = hits[i].load(std::memory_order_relaxed);
      TORCH_CHECK(h == 1, "pinxfer._thread_pool_self_test: ", what, " item ", i, " taken ", h,
                  " times");
    }
  };
  std::atomic<int64_t> by_helpers{0};
  std::mutex error_mutex;
  std::exception_ptr error;
  auto caller = [&] {
    try {
      for (int64_t r = 0; r < rounds; ++r) {
        auto claims = std::make_shared<Claims>(n);
        const ThreadPool::Offer offer =
            pool.offer(static_cast<int>(workers),
                       [claims, take](size_t, size_t) { take(*claims, true); });
        take(*claims, false);
        pool.withdraw(offer);
        // Every claim has been handed out; wait for those in flight to be counted (not for
        // the workers to leave: they drop their share of `claims` when they do).
        while (claims->done.load(std::memory_order_acquire) < n) cpu_relax();
        check(claims->hits, "offered");
        by_helpers.fetch_add(claims->by_helpers.load(std::memory_order_relaxed));
        std::vector<std::atomic<int>> hits(n);
        pool.parallel_for(n, 1, [&hits](size_t begin, size_t end) {
          for (size_t i = begin; i < end; ++i) hits[i].fetch_add(1, std::memory_order_relaxed);
        });
        check(hits, "parallel_for");
      }
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mutex);
      if (!error) error = std::current_exception();
    }
  };
  std::vector<std::thread> threads;
  for (int64_t c = 1; c < callers; ++c) threads.emplace_back(caller);
  caller();
  for (auto& t : threads) t.join();
  if (error) std::rethrow_exception(error);
  return by_helpers.load();
}

std::vector<WakeSample> wake_probe(int64_t workers, int64_t helpers, int64_t gap_us, int64_t rounds,
                                   int64_t ahead_us) {
  TORCH_CHECK_VALUE(workers >= 1 && workers <= 256 && helpers >= 1 && helpers <= workers &&
                        gap_us >= 0 && gap_us <= 1000000 && rounds >= 1 && rounds <= 10000 &&
                        ahead_us >= -1 && ahead_us <= 1000000,
                    "pinxfer._wake_probe: expected 1..256 workers, 1..workers helpers, a gap "
                    "of 0..1e6 us, 1..10000 rounds and a wake-ahead of -1 (none) or 0..1e6 us; "
                    "got ",
                    workers, ", ", helpers, ", ", gap_us, ", ", rounds, ", ", ahead_us);
  using Clock = std::chrono::steady_clock;
  static constexpr auto kHold = std::chrono::milliseconds(20);
  ThreadPool pool(static_cast<int>(workers) + 1, {});
  struct Round {
    explicit Round(size_t n) : arrived_ns(n) {
      for (auto& a : arrived_ns) a.store(-1, std::memory_order_relaxed);
    }
    Clock::time_point start;
    std::vector<std::atomic<int64_t>> arrived_ns;
    std::atomic<size_t> arrivals{0};
  };
  const size_t n = static_cast<size_t>(helpers);
  // Items and caller alike wait until every item has started, or the hold has passed.
  const auto waiting = [n](const Round& round) {
    return round.arrivals.load(std::memory_order_acquire) < n && Clock::now() - round.start < kHold;
  };
  std::vector<WakeSample> out;
  out.reserve(static_cast<size_t>(rounds));
  for (int64_t r = 0; r < rounds; ++r) {
    if (gap_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(gap_us));
    if (ahead_us >= 0) {
      // As a transfer does: wake the helpers, then prepare (here: busy for ahead_us).
      pool.wake_ahead(static_cast<int>(helpers));
      const auto until = Clock::now() + std::chrono::microseconds(ahead_us);
      while (Clock::now() < until) cpu_relax();
    }
    auto round = std::make_shared<Round>(n);
    round->start = Clock::now();
    const ThreadPool::Offer offer =
        pool.offer(static_cast<int>(helpers), [round, waiting](size_t i, size_t) {
          const auto now = Clock::now();
          round->arrived_ns[i].store(
              std::chrono::duration_cast<std::chrono::nanoseconds>(now - round->start).count(),
              std::memory_order_relaxed);
          round->arrivals.fetch_add(1, std::memory_order_acq_rel);
          // Hold this worker until every item has started, so no worker takes two items.
          while (waiting(*round)) cpu_relax();
        });
    const double offer_us =
        std::chrono::duration<double, std::micro>(Clock::now() - round->start).count();
    while (waiting(*round)) cpu_relax();
    pool.withdraw(offer);
    WakeSample sample;
    sample.offer_us = offer_us;
    for (size_t i = 0; i < n; ++i) {
      const int64_t ns = round->arrived_ns[i].load(std::memory_order_relaxed);
      sample.arrivals_us.push_back(ns < 0 ? -1.0 : static_cast<double>(ns) / 1000.0);
    }
    std::sort(sample.arrivals_us.begin(), sample.arrivals_us.end(),
              [](double a, double b) { return (a < 0 ? 1e300 : a) < (b < 0 ? 1e300 : b); });
    out.push_back(std::move(sample));
  }
  return out;
}

int default_num_threads() { return settings().copy_threads; }

int default_spin_us() { return settings().spin_us; }

bool default_spin_adaptive() { return settings().spin_adaptive; }

namespace {
// Leaked with their pools: worker threads must not be joined during static destruction at
// interpreter exit.
NodeRegistry<ThreadPool> g_pools;

// The child has no worker threads; the old pools' mutexes may have been held by threads that
// no longer exist. Forget them (leaked) and start over.
void child_after_fork() { g_pools.forget_after_fork(); }

struct ForkHandlerInstaller {
  ForkHandlerInstaller() {
    register_fork_child_handler(ForkChildStep::kThreadPools, &child_after_fork);
  }
} g_fork_handler_installer;
}  // namespace

ThreadPool& thread_pool_for_node(int numa_node) {
  return g_pools.get(numa_node, [](int node) {
    std::vector<int> cpus;
    if (node >= 0) cpus = node_cpus(node, sysfs_root());
    // The node's share of the process's one budget, on the node's CPUs that the
    // process may use (node_pool_plan() in runtime/thread_budget.h says why).
    const Settings& s = settings();
    const NodePoolPlan plan =
        node_pool_plan(default_num_threads(), cpus, s.cpus.affinity_ids, s.copy_threads_from_env);
    // Unbound workers inherit the creating thread's mask: under an OpenMP binding that is
    // one core, so they are bound to the process's CPUs instead (CpuResources says why).
    const bool unbound_under_omp = plan.cpus.empty() && s.cpus.affinity_from_cpuset;
    return new ThreadPool(plan.threads, unbound_under_omp ? s.cpus.affinity_ids : plan.cpus);
  });
}

}  // namespace pinxfer
