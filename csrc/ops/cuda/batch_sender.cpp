// BatchSender (batch_sender.h): the worker thread, and the hand-over at take().
#include "ops/cuda/batch_sender.h"

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <exception>
#include <map>
#include <optional>
#include <unordered_set>
#include <utility>

#include "ops/kernels.h"
#include "runtime/cuda_runtime.h"
#include "runtime/fork.h"
#include "runtime/settings.h"
#include "transfer/cuda/pipeline.h"

namespace pinxfer::ops {

namespace {

enum State : int { kQueued, kSending, kSent, kFailed };

// Set by a host function the worker queues after a job's copies: it runs on a CUDA
// driver thread once they have landed. Owned apart from the Job so that the host
// function never drops a job's last reference (a job's destructor returns an event and
// may free tensors; a host function must not call CUDA or wait for the GIL).
using LandedFlag = std::shared_ptr<std::atomic<bool>>;

void CUDART_CB mark_landed(void* flag) {
  auto* landed = static_cast<LandedFlag*>(flag);
  (*landed)->store(true, std::memory_order_release);
  delete landed;
}

// The leaves of one batch sent as pinxfer.to_device sends a batch of plain CPU tensors
// (pinxfer/transfer.py, _send_leaves): those of at most kCurrentStreamBytes packed into
// one copy when there are two or more, every other one alone. The current stream is the
// sender's: small copies are queued on it, larger ones handed over to it.
std::vector<at::Tensor> send_leaves(const std::vector<at::Tensor>& leaves, c10::Device device,
                                    const transfer::StagingOptions& options) {
  std::vector<at::Tensor> out(leaves.size());
  std::vector<size_t> small;
  for (size_t i = 0; i < leaves.size(); ++i) {
    if (leaves[i].nbytes() <= transfer::kCurrentStreamBytes) {
      small.push_back(i);
    } else {
      out[i] = send_to_device(leaves[i], device, options);
    }
  }
  if (small.size() == 1) {
    out[small[0]] = send_to_device(leaves[small[0]], device, options);
  } else if (!small.empty()) {
    std::vector<at::Tensor> packed_leaves;
    packed_leaves.reserve(small.size());
    for (size_t i : small) packed_leaves.push_back(leaves[i]);
    PackedOnDevice packed = pack_to_device(packed_leaves, device, /*want_views=*/true);
    for (size_t k = 0; k < small.size(); ++k) out[small[k]] = std::move(packed.views[k]);
  }
  return out;
}

int64_t micros_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() -
                                                               t0)
      .count();
}

}  // namespace

struct BatchSender::Job {
  std::vector<at::Tensor> leaves;  // the sources, until take() (see the header)
  transfer::StagingOptions options;
  std::vector<at::Tensor> outs;  // written by the worker before state becomes kSent
  cuda::Event event;             // after the copies, on the sender's stream
  LandedFlag landed = std::make_shared<std::atomic<bool>>(false);
  std::exception_ptr error;         // set before state becomes kFailed
  std::atomic<int> state{kQueued};  // kQueued -> kSending -> kSent | kFailed
  bool taken = false;               // only the consumer's thread reads or sets it
  ~Job() {
    if (event.handle != nullptr) cuda::release_event(event);
  }
};

BatchSender::BatchSender(c10::Device device) : device_(device.type(), device.index()) {
  TORCH_CHECK(device.is_cuda() && device.has_index(),
              "pinxfer: a BatchSender needs a CUDA device with an index, got ", device);
  worker_ = std::thread([this] { run(); });
}

BatchSender::~BatchSender() { close(); }

std::shared_ptr<BatchSender::Job> BatchSender::submit(std::vector<at::Tensor> leaves,
                                                      int64_t chunk_bytes, int64_t num_buffers) {
  auto job = std::make_shared<Job>();
  job->leaves = std::move(leaves);
  job->options = staging_options(chunk_bytes, num_buffers, "auto", -1);
  {
    std::lock_guard<std::mutex> lock(mu_);
    TORCH_CHECK(!closing_, "pinxfer.prefetch: this pass's sender is closed");
    queue_.push_back(job);
    queued_.store(true, std::memory_order_release);
    submitted_.fetch_add(1, std::memory_order_relaxed);
  }
  work_.notify_one();
  return job;
}

std::vector<at::Tensor> BatchSender::take(const std::shared_ptr<Job>& job) {
  TORCH_CHECK(job != nullptr && !job->taken, "pinxfer.prefetch: a sent batch is taken once");
  job->taken = true;
  // The worker usually sent it long ago; back to back it is sending it now: spin as long
  // as an idle copy thread would before sleeping.
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t spin_us = settings().spin_us;
  while (job->state.load(std::memory_order_acquire) < kSent && micros_since(t0) < spin_us) {
  }
  if (job->state.load(std::memory_order_acquire) < kSent) {
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, [&] { return job->state.load(std::memory_order_acquire) >= kSent; });
  }
  std::vector<at::Tensor> leaves = std::move(job->leaves);  // dropped on return
  if (job->state.load(std::memory_order_acquire) == kFailed) std::rethrow_exception(job->error);

  const c10::cuda::CUDAStream cur = c10::cuda::getCurrentCUDAStream(device_.index());
  taken_.fetch_add(1, std::memory_order_relaxed);
  if (job->landed->load(std::memory_order_acquire)) {
    // The copies are done: the results may be used on any stream now, with no wait.
    taken_landed_.fetch_add(1, std::memory_order_relaxed);
  } else {
    C10_CUDA_CHECK(
        cudaStreamWaitEvent(cur.stream(), static_cast<cudaEvent_t>(job->event.handle), 0));
  }
  // Keep each result's memory from the sender's next copies until `cur` is done with it
  // (a batch's small leaves share one storage: recorded once).
  std::unordered_set<const void*> recorded;
  for (const at::Tensor& t : job->outs) {
    if (t.defined() && recorded.insert(t.storage().data()).second) {
      c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), cur);
    }
  }
  return std::move(job->outs);
}

namespace {

std::exception_ptr closed_before_sent() {
  return std::make_exception_ptr(
      c10::Error({__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                 "pinxfer.prefetch: the pass was closed before this batch was sent"));
}

}  // namespace

void BatchSender::settle(const std::shared_ptr<Job>& job) {
  TORCH_CHECK(job != nullptr, "pinxfer: settle() of no job");
  std::unique_lock<std::mutex> lock(mu_);
  const auto queued = std::find(queue_.begin(), queue_.end(), job);
  if (queued != queue_.end()) {
    queue_.erase(queued);
    queued_.store(!queue_.empty(), std::memory_order_release);
    job->error = closed_before_sent();
    job->state.store(kFailed, std::memory_order_release);
    return;
  }
  done_.wait(lock, [&] { return job->state.load(std::memory_order_acquire) >= kSent; });
}

void BatchSender::close() {
  std::deque<std::shared_ptr<Job>> unsent;
  {
    std::lock_guard<std::mutex> lock(mu_);
    closing_ = true;
    unsent.swap(queue_);
    for (auto& job : unsent) {
      job->error = closed_before_sent();
      job->state.store(kFailed, std::memory_order_release);
    }
  }
  work_.notify_all();
  done_.notify_all();
  std::lock_guard<std::mutex> joining(join_mu_);
  if (worker_.joinable()) worker_.join();
}

int64_t BatchSender::submitted() const { return submitted_.load(std::memory_order_relaxed); }
int64_t BatchSender::taken() const { return taken_.load(std::memory_order_relaxed); }
int64_t BatchSender::taken_landed() const { return taken_landed_.load(std::memory_order_relaxed); }

void BatchSender::run() {
  // The sender's own stream, from torch's pool (made at the first job, where an error is
  // that job's): its copies overlap the consumer's work, and a host function on it
  // delays nobody else's copies.
  std::optional<c10::cuda::CUDAStream> stream;
  const int64_t spin_us = settings().spin_us;
  for (;;) {
    // Spin as an idle copy thread does, so back-to-back batches find this thread awake;
    // then sleep until a job or close() comes.
    const auto t0 = std::chrono::steady_clock::now();
    while (!queued_.load(std::memory_order_acquire) && micros_since(t0) < spin_us) {
    }
    std::shared_ptr<Job> job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      work_.wait(lock, [&] { return closing_ || !queue_.empty(); });
      if (closing_) return;  // close() failed the jobs not started
      job = std::move(queue_.front());
      queue_.pop_front();
      queued_.store(!queue_.empty(), std::memory_order_release);
      job->state.store(kSending, std::memory_order_relaxed);
    }
    const int outcome = send(*job, stream);
    {
      // Under the lock: a take() between its check and its wait would miss the notify.
      std::lock_guard<std::mutex> lock(mu_);
      job->state.store(outcome, std::memory_order_release);
    }
    done_.notify_all();
  }
}

int BatchSender::send(Job& job, std::optional<c10::cuda::CUDAStream>& stream) {
  try {
    if (!stream) stream = c10::cuda::getStreamFromPool(false, device_.index());
    c10::cuda::CUDAStreamGuard on_stream(*stream);
    job.outs = send_leaves(job.leaves, device_, job.options);
    job.event = cuda::record_event(stream->unwrap());
    auto* flag = new LandedFlag(job.landed);
    const cudaError_t err = cudaLaunchHostFunc(stream->stream(), &mark_landed, flag);
    if (err != cudaSuccess) {
      delete flag;
      C10_CUDA_CHECK(err);
    }
    return kSent;
  } catch (...) {
    // Copies already queued read staging blocks the pool keeps until they are done, and
    // write outputs whose memory returns to a stream their later users are ordered on.
    job.outs.clear();
    job.error = std::current_exception();
    return kFailed;
  }
}

namespace {

std::mutex g_senders_mutex;
// Leaked on purpose, as the thread pools: a worker must not be joined during static
// destruction at interpreter exit. LOCK: g_senders_mutex
std::map<c10::DeviceIndex, BatchSender*>* g_senders =
    new std::map<c10::DeviceIndex, BatchSender*>();

void child_after_fork() {
  // The child has no sender threads, and the parent's mutex may have been held: forget
  // the senders (leaked, never touched: destroying one would join a thread that is not
  // here) and start over. A child cannot use CUDA anyway (cuda_usable() is false there).
  new (&g_senders_mutex) std::mutex();
  g_senders = new std::map<c10::DeviceIndex, BatchSender*>();
}

struct ForkHandlerInstaller {
  ForkHandlerInstaller() {
    register_fork_child_handler(ForkChildStep::kBatchSenders, &child_after_fork);
  }
} g_fork_handler_installer;

}  // namespace

BatchSender& batch_sender_for(c10::DeviceIndex index) {
  std::lock_guard<std::mutex> lock(g_senders_mutex);
  BatchSender*& sender = (*g_senders)[index];
  if (sender == nullptr) sender = new BatchSender(c10::Device(c10::kCUDA, index));
  return *sender;
}

}  // namespace pinxfer::ops
