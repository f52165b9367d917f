// SerialJobs: jobs started in the order submitted by the queue's own worker threads: one
// worker runs them one at a time; with `workers` > 1 a job may start while the one before it
// still runs (prefetch's sender: the next batch's setup and first DMA while the last one's
// staging ends, see ops/cuda/batch_sender.h). Whoever submitted a job waits for it, or
// settles a job it will no longer wait for. prefetch's BatchSender (ops/cuda/batch_sender.h) is
// this queue with a CUDA send as its jobs' run(); no CUDA here, so the protocol is tested with
// plain threads under TSan and ASan (serial_jobs_self_test, tests/test_serial_jobs.py).
//
// A job's state: queued -> running -> done | failed (run() threw: its exception is kept),
// or queued -> failed (dropped: settled before it started, or the queue closed). Every
// change happens under the queue's lock; a job's run() is called at most once, on a
// worker, with no lock held. A worker spins for spin_us after a job (back-to-back
// submissions find it awake), then sleeps until the next submit or close: an idle queue
// uses no CPU. Waits spin for spin_us, then sleep.
//
// Thread safety: submit, wait, settle and close may be called from any thread. A job's
// fields written by run() are visible to whoever returns from wait() for it.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace pinxfer {

// The name of every SerialJobs worker thread (at most 15 characters: the kernel's limit;
// "pinxfer-" first, as every thread pinxfer starts: runtime/thread_pool.h).
inline constexpr const char* kJobsThreadName = "pinxfer-jobs";

class SerialJobs {
 public:
  class Job {
   public:
    virtual ~Job() = default;
    // Runs on the worker thread, once; an exception fails the job.
    virtual void run() = 0;
    // After wait(): whether the job failed (run() threw, or it was dropped), and its error.
    bool failed() const;
    [[noreturn]] void rethrow() const;
    // After wait(), for a job that started: its place in the order the queue's jobs were
    // taken by workers (0, 1, ...), which is the order they were submitted in; -1 if it
    // never started.
    int64_t start_order() const { return start_order_; }

   private:
    friend class SerialJobs;
    std::atomic<int> state_{0};  // State; written under the queue's lock
    std::exception_ptr error_;   // set before state_ becomes failed
    int64_t start_order_ = -1;   // written under the queue's lock as a worker takes it
  };

  // name: what errors call the queue (a job dropped before it ran, a submit after close).
  // workers: threads that take jobs (1: one job at a time), at least 1.
  SerialJobs(int64_t spin_us, std::string name, int workers = 1);
  ~SerialJobs();  // close()
  SerialJobs(const SerialJobs&) = delete;
  SerialJobs& operator=(const SerialJobs&) = delete;

  // Queues a job (not submitted before). Throws c10::Error once the queue is closed.
  void submit(std::shared_ptr<Job> job);
  // Returns once the job has run or failed.
  void wait(const std::shared_ptr<Job>& job);
  // A job nobody will wait for: dropped if it has not started, else waited for.
  void settle(const std::shared_ptr<Job>& job);
  // Drops the jobs not started, waits for the running ones and ends the workers. Idempotent.
  void close();

  int64_t submitted() const { return submitted_.load(std::memory_order_relaxed); }
  int workers() const { return static_cast<int>(workers_.size()); }

 private:
  enum State : int { kQueued = 0, kRunning, kDone, kFailed };
  void work();
  void drop_locked(Job& job) noexcept;

  const int64_t spin_us_;
  const std::string name_;
  // What a dropped job fails with where a fresh error cannot be built: dropping happens
  // under the lock and in close() from the destructor, where building one (allocating) could
  // throw midway and leave a job neither queued nor failed, its waiter blocked for good.
  // A std::runtime_error (immutable): every job dropped this way shares it.
  const std::exception_ptr dropped_fallback_;
  std::mutex mu_;
  std::condition_variable work_;            // the workers: a job queued, or close()
  std::condition_variable done_;            // waiters: a job done or failed
  std::deque<std::shared_ptr<Job>> queue_;  // LOCK: mu_
  bool closing_ = false;                    // LOCK: mu_
  std::atomic<bool> queued_{false};         // queue_ not empty: what idle workers spin on
  std::atomic<int64_t> submitted_{0};
  int64_t started_ = 0;               // jobs taken by workers. LOCK: mu_
  std::mutex join_mu_;                // one close() joins, the others wait for it
  std::vector<std::thread> workers_;  // started last, joined by close()
};

// TEST-ONLY: `consumers` threads each submit `jobs` jobs that copy random bytes (some
// sleeping, about one in ten throwing) through one queue of `workers`, keep 1-3 in flight, wait for
// most and settle some, and leave some for close(). Checks: no job runs twice, a settled or
// closed-out job either ran whole or never ran, a waited job is done with its bytes or
// failed with its own error, submit after close throws. Returns the jobs that ran.
int64_t serial_jobs_self_test(int64_t seed, int64_t jobs, int64_t consumers, int64_t workers);

}  // namespace pinxfer
