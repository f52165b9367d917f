#include "runtime/serial_jobs.h"

#include <c10/util/Exception.h>
#include <pthread.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <random>
#include <stdexcept>
#include <utility>
#include <vector>

namespace pinxfer {

namespace {

int64_t micros_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() -
                                                               t0)
      .count();
}

}  // namespace

bool SerialJobs::Job::failed() const { return state_.load(std::memory_order_acquire) == kFailed; }

void SerialJobs::Job::rethrow() const { std::rethrow_exception(error_); }

namespace {
std::string dropped_message(const std::string& queue_name) {
  return queue_name + ": the job was dropped before it ran (settled, or the queue was closed)";
}
}  // namespace

SerialJobs::SerialJobs(int64_t spin_us, std::string name, int workers)
    : spin_us_(spin_us),
      name_(std::move(name)),
      // Not a c10::Error: shared by every job dropped this way, it must not take context.
      dropped_fallback_(std::make_exception_ptr(std::runtime_error(dropped_message(name_)))) {
  TORCH_CHECK(workers >= 1, name_, ": a job queue needs at least one worker, got ", workers);
  workers_.reserve(static_cast<size_t>(workers));
  try {
    for (int w = 0; w < workers; ++w) {
      workers_.emplace_back([this] { work(); });
      // Named so that runtime/torch_team.cpp does not count them as torch's team (they spin
      // after each job; counted, they made a main thread whose team never ran learn it
      // by starting one: found by review, session 42). Best effort: a name is not needed.
      pthread_setname_np(workers_.back().native_handle(), kJobsThreadName);
    }
  } catch (...) {
    close();  // a thread that could not start: join those that did, or their destructor aborts
    throw;
  }
}

SerialJobs::~SerialJobs() { close(); }

void SerialJobs::submit(std::shared_ptr<Job> job) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    TORCH_CHECK(!closing_, name_, ": a job was submitted after close()");
    queue_.push_back(std::move(job));
    queued_.store(true, std::memory_order_release);
    submitted_.fetch_add(1, std::memory_order_relaxed);
  }
  work_.notify_one();
}

void SerialJobs::wait(const std::shared_ptr<Job>& job) {
  // Usually done long ago; back to back the worker is running it now.
  const auto t0 = std::chrono::steady_clock::now();
  while (job->state_.load(std::memory_order_acquire) < kDone && micros_since(t0) < spin_us_) {
  }
  if (job->state_.load(std::memory_order_acquire) >= kDone) return;
  std::unique_lock<std::mutex> lock(mu_);
  done_.wait(lock, [&] { return job->state_.load(std::memory_order_acquire) >= kDone; });
}

void SerialJobs::drop_locked(Job& job) noexcept {
  try {
    // Its own error: a waiter may add context to what it catches.
    job.error_ = std::make_exception_ptr(
        c10::Error({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, dropped_message(name_)));
  } catch (...) {
    job.error_ = dropped_fallback_;
  }
  job.state_.store(kFailed, std::memory_order_release);
}

void SerialJobs::settle(const std::shared_ptr<Job>& job) {
  std::unique_lock<std::mutex> lock(mu_);
  const auto queued = std::find(queue_.begin(), queue_.end(), job);
  if (queued != queue_.end()) {
    queue_.erase(queued);
    queued_.store(!queue_.empty(), std::memory_order_release);
    drop_locked(*job);
    return;
  }
  done_.wait(lock, [&] { return job->state_.load(std::memory_order_acquire) >= kDone; });
}

void SerialJobs::close() {
  std::deque<std::shared_ptr<Job>> unsent;
  {
    std::lock_guard<std::mutex> lock(mu_);
    closing_ = true;
    unsent.swap(queue_);
    queued_.store(false, std::memory_order_release);
    for (auto& job : unsent) drop_locked(*job);
  }
  work_.notify_all();
  done_.notify_all();
  std::lock_guard<std::mutex> joining(join_mu_);
  for (auto& worker : workers_) {
    if (worker.joinable()) worker.join();
  }
}

void SerialJobs::work() {
  for (;;) {
    // Spin as an idle copy thread does, so back-to-back jobs find this thread awake; then
    // sleep until a job or close() comes.
    const auto t0 = std::chrono::steady_clock::now();
    while (!queued_.load(std::memory_order_acquire) && micros_since(t0) < spin_us_) {
    }
    std::shared_ptr<Job> job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      work_.wait(lock, [&] { return closing_ || !queue_.empty(); });
      if (closing_) return;  // close() dropped the jobs not started
      job = std::move(queue_.front());
      queue_.pop_front();
      queued_.store(!queue_.empty(), std::memory_order_release);
      job->state_.store(kRunning, std::memory_order_relaxed);
      job->start_order_ = started_++;
    }
    int outcome = kDone;
    try {
      job->run();
    } catch (...) {
      job->error_ = std::current_exception();
      outcome = kFailed;
    }
    {
      // Under the lock: a waiter between its check and its sleep would miss the notify.
      std::lock_guard<std::mutex> lock(mu_);
      job->state_.store(outcome, std::memory_order_release);
    }
    done_.notify_all();
  }
}

// ---- the self-test ----

namespace {

// What the jobs of one self-test share: how many ran, and how many ran at once.
struct SelfTestCounters {
  std::atomic<int64_t> ran{0};
  std::atomic<int64_t> running{0};
  std::atomic<int64_t> most_running{0};
};

struct CopyJob : SerialJobs::Job {
  std::vector<unsigned char> src, dst;
  bool fails = false;
  int64_t sleep_us = 0;
  std::atomic<int> runs{0};
  SelfTestCounters* counters = nullptr;
  void run() override {
    runs.fetch_add(1, std::memory_order_relaxed);
    counters->ran.fetch_add(1, std::memory_order_relaxed);
    const int64_t now = counters->running.fetch_add(1, std::memory_order_relaxed) + 1;
    int64_t most = counters->most_running.load(std::memory_order_relaxed);
    while (now > most && !counters->most_running.compare_exchange_weak(most, now)) {
    }
    if (sleep_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(sleep_us));
    if (!src.empty()) std::memcpy(dst.data(), src.data(), src.size());
    counters->running.fetch_sub(1, std::memory_order_relaxed);
    TORCH_CHECK(!fails, "self-test job failed on purpose");
  }
};

// One consumer's jobs are taken by the workers in the order it submitted them, whatever
// their number: `last` is the start order of the consumer's last job that started.
void check_started_in_order(const CopyJob& job, int64_t& last) {
  const int runs = job.runs.load(std::memory_order_relaxed);
  TORCH_CHECK((runs == 0) == (job.start_order() < 0), "pinxfer._serial_jobs_self_test: a job ran ",
              runs, " times with start order ", job.start_order());
  if (runs == 0) return;
  TORCH_CHECK(job.start_order() > last, "pinxfer._serial_jobs_self_test: a job started (",
              job.start_order(), ") before one submitted ahead of it (", last, ")");
  last = job.start_order();
}

// The job is over (waited for, settled or closed out): it ran at most once, a dropped job
// never ran, a done job copied every byte, a failed one that ran failed with its own error.
void check_over(const CopyJob& job, const std::string& dropped) {
  const int runs = job.runs.load(std::memory_order_relaxed);
  TORCH_CHECK(runs <= 1, "pinxfer._serial_jobs_self_test: a job ran ", runs, " times");
  if (!job.failed()) {
    TORCH_CHECK(runs == 1 && !job.fails && job.dst == job.src,
                "pinxfer._serial_jobs_self_test: a done job did not copy its bytes (runs ", runs,
                ")");
    return;
  }
  try {
    job.rethrow();
  } catch (const c10::Error& e) {
    const std::string what = e.what_without_backtrace();
    if (runs == 0) {
      TORCH_CHECK(what.find(dropped) != std::string::npos,
                  "pinxfer._serial_jobs_self_test: a job that never ran failed with: ", what);
    } else {
      TORCH_CHECK(job.fails && what.find("on purpose") != std::string::npos,
                  "pinxfer._serial_jobs_self_test: a job that ran failed with: ", what);
    }
  }
}

}  // namespace

int64_t serial_jobs_self_test(int64_t seed, int64_t jobs, int64_t consumers, int64_t workers) {
  TORCH_CHECK_VALUE(jobs >= 1 && jobs <= 100000 && consumers >= 1 && consumers <= 16 &&
                        workers >= 1 && workers <= 8,
                    "pinxfer._serial_jobs_self_test: expected 1..100000 jobs, 1..16 "
                    "consumers and 1..8 workers; got ",
                    jobs, " jobs, ", consumers, " consumers, ", workers, " workers");
  const std::string dropped = "dropped before it ran";
  std::vector<std::vector<std::shared_ptr<CopyJob>>> left(static_cast<size_t>(consumers));
  std::mutex error_mutex;
  std::exception_ptr error;
  SelfTestCounters counters;
  std::vector<int64_t> last_start(static_cast<size_t>(consumers), -1);  // check_started_in_order
  {
    SerialJobs queue(/*spin_us=*/20, "pinxfer._serial_jobs_self_test", static_cast<int>(workers));
    std::vector<std::thread> threads;
    for (int64_t c = 0; c < consumers; ++c) {
      threads.emplace_back([&, c] {
        try {
          std::mt19937 rng(static_cast<uint32_t>(seed * 1009 + c));
          std::deque<std::shared_ptr<CopyJob>> in_flight;
          const size_t depth = 1 + rng() % 3;
          for (int64_t i = 0; i < jobs; ++i) {
            auto job = std::make_shared<CopyJob>();
            job->counters = &counters;
            job->src.resize(rng() % 65536);
            for (auto& b : job->src) b = static_cast<unsigned char>(rng());
            job->dst.assign(job->src.size(), 0);
            job->fails = rng() % 10 == 0;
            job->sleep_us = rng() % 4 == 0 ? static_cast<int64_t>(rng() % 100) : 0;
            queue.submit(job);
            in_flight.push_back(job);
            if (in_flight.size() < depth) continue;
            auto oldest = std::move(in_flight.front());
            in_flight.pop_front();
            if (rng() % 7 == 0) {
              queue.settle(oldest);
            } else {
              queue.wait(oldest);
            }
            check_over(*oldest, dropped);
            check_started_in_order(*oldest, last_start[static_cast<size_t>(c)]);
            if (rng() % 5 == 0) std::this_thread::sleep_for(std::chrono::microseconds(rng() % 200));
          }
          // The last ones are left for close().
          left[static_cast<size_t>(c)].assign(in_flight.begin(), in_flight.end());
        } catch (...) {
          std::lock_guard<std::mutex> lock(error_mutex);
          if (!error) error = std::current_exception();
        }
      });
    }
    for (auto& t : threads) t.join();
    if (error) std::rethrow_exception(error);
    TORCH_CHECK(queue.submitted() == jobs * consumers,
                "pinxfer._serial_jobs_self_test: ", queue.submitted(), " submitted, expected ",
                jobs * consumers);
    queue.close();
    bool refused = false;
    try {
      auto late = std::make_shared<CopyJob>();
      late->counters = &counters;
      queue.submit(late);
    } catch (const c10::Error&) {
      refused = true;
    }
    TORCH_CHECK(refused, "pinxfer._serial_jobs_self_test: submit after close() was accepted");
  }
  for (size_t c = 0; c < left.size(); ++c) {
    for (const auto& job : left[c]) {
      check_over(*job, dropped);
      check_started_in_order(*job, last_start[c]);
    }
  }
  TORCH_CHECK(counters.most_running.load() <= workers,
              "pinxfer._serial_jobs_self_test: ", counters.most_running.load(),
              " jobs ran at once on ", workers, " workers");
  return counters.ran.load();
}

}  // namespace pinxfer
