// BatchSender (batch_sender.h): the send its queue's worker runs, and the hand-over at take().
#include "ops/cuda/batch_sender.h"

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/SmallVector.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <exception>
#include <iterator>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <utility>

#include "ops/kernels.h"
#include "runtime/cuda_runtime.h"
#include "runtime/fork.h"
#include "runtime/settings.h"
#include "runtime/steady_time.h"
#include "transfer/chunk_plan.h"
#include "transfer/cuda/pipeline.h"

namespace pinxfer::ops {

namespace {

// Set by a host function the worker queues after a job's copies: it runs on a CUDA
// driver thread once they have landed. Owned apart from the Job so that the host
// function never drops a job's last reference (a job's destructor returns an event and
// may free tensors; a host function must not call CUDA or wait for the GIL).
using LandedFlag = std::shared_ptr<std::atomic<bool>>;

void CUDART_CB do_nothing(void*) {}

void CUDART_CB mark_landed(void* flag) {
  auto* landed = static_cast<LandedFlag*>(flag);
  (*landed)->store(true, std::memory_order_release);
  delete landed;
}

std::atomic<bool> g_sender_tracing{false};  // set_sender_tracing

static_assert(std::size(kSenderOutputsNames) == 3 && std::size(kSenderLandingNames) == 3,
              "one name per OutputsMode and LandingMode value, in the enums' order");

// settings() accepts only the names of the lists, so the index is never -1 here.
BatchSender::OutputsMode outputs_mode_from(const std::string& name) {
  return static_cast<BatchSender::OutputsMode>(name_index(kSenderOutputsNames, name));
}

BatchSender::LandingMode landing_mode_from(const std::string& name) {
  return static_cast<BatchSender::LandingMode>(name_index(kSenderLandingNames, name));
}

}  // namespace

struct BatchSender::Job : SerialJobs::Job {
  BatchSender* sender = nullptr;   // outlives the job's run: ~BatchSender joins the worker
  std::vector<at::Tensor> leaves;  // the sources, until take() (see the header)
  transfer::StagingOptions options;
  std::vector<at::Tensor> outs;  // written by run(), read after the queue's wait
  cuda::Event event;             // after the copies, on the sender's stream
  LandedFlag landed = std::make_shared<std::atomic<bool>>(false);
  bool flagged = false;  // a host function sets `landed`; else take() asks the event
  bool taken = false;    // only the consumer's thread reads or sets it
  JobTrace trace;        // while tracing: submit() and the worker's send fill it; take() files it
  // "consumer" outputs (make_outputs): made at submit on `owner`, after which `outputs_made`
  // was recorded there; or the error making them raised, for the send to raise.
  std::optional<BatchOutputs> made;
  std::optional<c10::cuda::CUDAStream> owner;
  cuda::Event outputs_made;
  std::exception_ptr make_error;
  // The worker's stream once it may have queued a copy into `made`'s outputs.
  std::optional<c10::cuda::CUDAStream> copied_on;

  void run() override { sender->send(*this); }
  // Outputs dropped untaken (settled, failed, a take that raised, or the ticket gone): their
  // memory, which returns to the owner's stream, waits for the copies queued into it first.
  // After a take nothing is left here (take() moved the results out).
  void drop_untaken_outputs() {
    if (copied_on) {
      const auto keep_for_copies = [this](const std::vector<at::Tensor>& tensors) {
        for (const at::Tensor& t : tensors) {
          if (t.defined()) {
            c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), *copied_on);
          }
        }
      };
      keep_for_copies(outs);
      if (made) keep_for_copies(made->outs);
    }
    outs.clear();
    made.reset();
  }
  ~Job() override {
    try {
      drop_untaken_outputs();
    } catch (...) {
      // recordStream failed (nothing may escape a destructor; found by review, session 44):
      // the copies may still write into the outputs, so they are waited for before the
      // outputs' memory goes back to torch's allocator.
      if (copied_on && cudaStreamSynchronize(copied_on->stream()) != cudaSuccess) {
        (void)cudaGetLastError();
      }
      outs.clear();
      made.reset();
    }
    if (event.handle != nullptr) cuda::release_event(event);
    if (outputs_made.handle != nullptr) cuda::release_event(outputs_made);
  }
};

namespace {

// A countdown every WarmUp waits on until all have started (std::latch is C++20; torch 2.11
// builds extensions as C++17).
struct StartBarrier {
  std::mutex mu;
  std::condition_variable all_here;
  int missing;  // LOCK: mu

  explicit StartBarrier(int n) : missing(n) {}
  void arrive_and_wait() {
    std::unique_lock<std::mutex> lock(mu);
    if (--missing == 0) {
      all_here.notify_all();
      return;
    }
    all_here.wait(lock, [this] { return missing == 0; });
  }
  // `n` that were counted will never arrive (their jobs could not be submitted): the
  // ones waiting go on.
  void never_coming(int n) {
    std::lock_guard<std::mutex> lock(mu);
    missing -= n;
    if (missing <= 0) all_here.notify_all();
  }
};

}  // namespace

// One a worker: each waits in run() until all have started, so no worker takes two.
struct BatchSender::WarmUp : SerialJobs::Job {
  BatchSender* sender = nullptr;
  StartBarrier* all_started = nullptr;  // the constructor's, which waits for every WarmUp

  void run() override {
    all_started->arrive_and_wait();
    sender->warm_this_worker();
  }
};

BatchSender::BatchSender(c10::Device device)
    : device_(device.type(), device.index()),
      landing_(landing_mode_from(settings().sender_landing)),
      outputs_mode_(outputs_mode_from(settings().sender_outputs)),
      long_step_ns_(int64_t{2} * settings().spin_us * 1000),
      jobs_(settings().spin_us, "pinxfer.prefetch's batch sender", settings().sender_workers) {
  TORCH_CHECK(device.is_cuda() && device.has_index(),
              "pinxfer: a BatchSender needs a CUDA device with an index, got ", device);
  warm_workers();
}

void BatchSender::warm_workers() {
  // Why: a worker's first job made the CUDA calls a thread makes the first time (the
  // runtime's state for the thread, the stream pool, the event pool) and, at the process's
  // first cudaLaunchHostFunc, the driver's host-function thread, while the consumer's thread
  // went on. Session 35's hang was torch's lazy init (a dlopen) on that thread meeting these
  // first calls in the dynamic loader's locks; batch_sender() now runs that init first, but
  // any dlopen by the consumer during a pass's first jobs (a library torch loads lazily, a
  // compiled kernel's module) meets the same calls. Made here, they run while the caller
  // waits for them, before any job.
  const int n = jobs_.workers();
  StartBarrier all_started(n);
  std::vector<std::shared_ptr<WarmUp>> warm_ups;
  warm_ups.reserve(static_cast<size_t>(n));
  for (int w = 0; w < n; ++w) {
    auto job = std::make_shared<WarmUp>();
    job->sender = this;
    job->all_started = &all_started;
    warm_ups.push_back(job);
  }
  int submitted = 0;
  try {
    for (const auto& job : warm_ups) {
      jobs_.submit(job);
      ++submitted;
    }
  } catch (...) {
    // The WarmUps already submitted wait for the others: let them go, and wait for them
    // before the barrier goes out of scope (found by review, session 42).
    all_started.never_coming(n - submitted);
    for (int w = 0; w < submitted; ++w) jobs_.wait(warm_ups[static_cast<size_t>(w)]);
    throw;
  }
  // Every WarmUp waits for the others inside run(), so each worker runs exactly one; the
  // barrier outlives them all (each is waited for here before it goes out of scope).
  for (const auto& job : warm_ups) jobs_.wait(job);
  for (const auto& job : warm_ups) {
    if (job->failed()) job->rethrow();
  }
}

c10::cuda::CUDAStream BatchSender::worker_stream() {
  // Per worker thread (a worker serves one sender): two workers' jobs each hand over on
  // their own stream.
  thread_local std::optional<c10::cuda::CUDAStream> stream;
  if (!stream) stream = c10::cuda::getStreamFromPool(false, device_.index());
  return *stream;
}

void BatchSender::warm_this_worker() {
  const c10::cuda::CUDAStream stream = worker_stream();
  c10::cuda::CUDAStreamGuard on_stream(stream);
  const cuda::Event event = cuda::record_event(stream.unwrap());
  cuda::release_event(event);
  C10_CUDA_CHECK(cudaLaunchHostFunc(stream.stream(), &do_nothing, nullptr));
  C10_CUDA_CHECK(cudaStreamSynchronize(stream.stream()));
  warmed_.fetch_add(1, std::memory_order_relaxed);
}

std::shared_ptr<BatchSender::Job> BatchSender::submit(std::vector<at::Tensor> leaves,
                                                      int64_t chunk_bytes, int64_t num_buffers,
                                                      int64_t entered_ns) {
  auto job = std::make_shared<Job>();
  job->sender = this;
  job->leaves = std::move(leaves);
  job->options = staging_options(chunk_bytes, num_buffers, "auto", -1);
  const bool tracing = g_sender_tracing.load(std::memory_order_relaxed);
  const int64_t making = tracing ? steady_now_ns() : 0;
  // "consumer" outputs for batches staged without a ring only: a ring's staging thread waits
  // for a slot's DMA, which would wait for the consumer's queued work, and take() for that.
  // "auto": consumer outputs after short consumer steps (take to take), where they saved the
  // step most; after long ones the consumer's allocations and event at the submit, on a core
  // that was idle, cost more than the record and free events they save (csrc/README.md).
  const OutputsMode mode = outputs_mode();
  const bool on_consumer =
      (mode == OutputsMode::kConsumer ||
       (mode == OutputsMode::kAuto && !consumer_steps_long_.load(std::memory_order_relaxed))) &&
      std::all_of(job->leaves.begin(), job->leaves.end(), [&](const at::Tensor& t) {
        return transfer::fits_one_block(t.nbytes(), job->options.chunk_bytes,
                                        job->options.num_buffers);
      });
  if (on_consumer) make_outputs(*job);
  if (tracing) {
    for (const at::Tensor& t : job->leaves) job->trace.bytes += static_cast<int64_t>(t.nbytes());
    job->trace.submitted_ns = steady_now_ns();
    job->trace.entered_ns = entered_ns != 0 ? entered_ns : making;
    if (on_consumer) job->trace.outputs_ns = job->trace.submitted_ns - making;
  }
  jobs_.submit(job);
  // The worker never touches this field (its own are started_ns and sent_ns); take() reads it.
  if (job->trace.submitted_ns != 0) job->trace.queued_ns = steady_now_ns();
  return job;
}

void BatchSender::make_outputs(Job& job) const {
  try {
    const c10::DeviceIndex index = device_.index();
    c10::cuda::CUDAGuard on_device(index);
    const c10::cuda::CUDAStream owner = c10::cuda::getCurrentCUDAStream(index);
    // An event recorded on a capturing stream would join the capture, and the worker's stream
    // waiting on it would join it too: its copies captured, not run.
    cuda::check_stream_not_capturing(owner.unwrap(), index, "prefetch",
                                     "a batch cannot be sent into a capture (a replay would not "
                                     "send it again). Take batches before the capture or between "
                                     "replays.");
    job.made = batch_outputs(job.leaves, index);
    job.outputs_made = cuda::record_event(owner.unwrap());
    job.owner = owner;
  } catch (...) {
    job.made.reset();
    job.make_error = std::current_exception();
  }
}

std::vector<at::Tensor> BatchSender::take(const std::shared_ptr<Job>& job) {
  TORCH_CHECK(job != nullptr && !job->taken, "pinxfer.prefetch: a sent batch is taken once");
  const int64_t entered = job->trace.submitted_ns != 0 ? steady_now_ns() : 0;
  job->taken = true;
  jobs_.wait(job);
  const int64_t waited = entered != 0 ? steady_now_ns() : 0;
  std::vector<at::Tensor> leaves = std::move(job->leaves);  // dropped on return
  if (job->failed()) job->rethrow();

  if (landing_ == LandingMode::kAuto || outputs_mode() == OutputsMode::kAuto) {
    const int64_t now = steady_now_ns();
    const int64_t last = last_take_ns_.exchange(now, std::memory_order_relaxed);
    consumer_steps_long_.store(now - last > long_step_ns_, std::memory_order_relaxed);
  }
  const c10::cuda::CUDAStream cur = c10::cuda::getCurrentCUDAStream(device_.index());
  taken_.fetch_add(1, std::memory_order_relaxed);
  const bool landed =
      job->landed->load(std::memory_order_acquire) || (!job->flagged && event_landed(*job));
  if (landed) {
    // The copies are done: the results may be used on any stream now, with no wait.
    taken_landed_.fetch_add(1, std::memory_order_relaxed);
  } else {
    C10_CUDA_CHECK(
        cudaStreamWaitEvent(cur.stream(), static_cast<cudaEvent_t>(job->event.handle), 0));
  }
  const int64_t taken = entered != 0 ? steady_now_ns() : 0;
  // Keep each result's memory from the sender's next copies until `cur` is done with it
  // (a batch's small leaves share one storage: recorded once). A batch has few storages: a
  // linear search of an inline vector, where a set allocated at every take. Outputs made on
  // `cur` itself ("consumer" outputs) need nothing: that stream owns them.
  const bool owned = job->owner && *job->owner == cur;
  if (owned) taken_owned_.fetch_add(1, std::memory_order_relaxed);
  c10::SmallVector<const void*, 8> recorded;
  for (const at::Tensor& t : job->outs) {
    if (owned) break;
    if (!t.defined()) continue;
    const void* data = t.storage().data();
    if (std::find(recorded.begin(), recorded.end(), data) != recorded.end()) continue;
    recorded.push_back(data);
    c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), cur);
  }
  if (entered != 0) {  // traced at its submit (the worker has finished it)
    job->trace.take_entered_ns = entered;
    job->trace.waited_ns = waited;
    job->trace.taken_ns = taken;
    job->trace.recorded_ns = steady_now_ns();
    job->trace.flagged = job->flagged;
    job->trace.landed = landed;
    std::lock_guard<std::mutex> lock(traces_mutex_);
    if (traces_.size() < kJobTraces) {
      traces_.push_back(job->trace);
    } else {
      traces_[traces_next_] = job->trace;
    }
    traces_next_ = (traces_next_ + 1) % kJobTraces;
  }
  return std::move(job->outs);
}

void BatchSender::settle(const std::shared_ptr<Job>& job) {
  TORCH_CHECK(job != nullptr, "pinxfer: settle() of no job");
  jobs_.settle(job);
}

bool BatchSender::event_landed(const Job& job) {
  std::string error;
  const bool done = cuda::event_done(job.event, &error);
  TORCH_CHECK(error.empty(), "pinxfer.prefetch: the batch sender's event failed: ", error);
  return done;
}

// Less the constructor's WarmUp jobs, one a worker.
int64_t BatchSender::submitted() const { return jobs_.submitted() - jobs_.workers(); }
int BatchSender::workers() const { return jobs_.workers(); }
int64_t BatchSender::warmed_workers() const { return warmed_.load(std::memory_order_relaxed); }
int64_t BatchSender::taken() const { return taken_.load(std::memory_order_relaxed); }
int64_t BatchSender::taken_landed() const { return taken_landed_.load(std::memory_order_relaxed); }
int64_t BatchSender::sent_flagged() const { return sent_flagged_.load(std::memory_order_relaxed); }
int64_t BatchSender::taken_owned() const { return taken_owned_.load(std::memory_order_relaxed); }

std::vector<BatchSender::JobTrace> BatchSender::job_traces() const {
  std::lock_guard<std::mutex> lock(traces_mutex_);
  if (traces_.size() < kJobTraces) return traces_;
  std::vector<JobTrace> out(traces_.begin() + static_cast<std::ptrdiff_t>(traces_next_),
                            traces_.end());
  out.insert(out.end(), traces_.begin(),
             traces_.begin() + static_cast<std::ptrdiff_t>(traces_next_));
  return out;
}

void set_sender_tracing(bool on) { g_sender_tracing.store(on, std::memory_order_relaxed); }
bool sender_tracing() { return g_sender_tracing.load(std::memory_order_relaxed); }

void BatchSender::send(Job& job) {
  // The worker's own stream (made at its warm-up): its copies overlap the consumer's work,
  // and a host function on it delays nobody else's copies.
  const c10::cuda::CUDAStream stream = worker_stream();
  c10::cuda::CUDAStreamGuard on_stream(stream);
  const bool tracing = job.trace.submitted_ns != 0;
  if (tracing) job.trace.started_ns = steady_now_ns();
  try {
    // Every copy on the worker's stream, the pipelined leaves too (not the device's copy
    // stream): csrc/README.md, "The sender road", session 27.
    if (job.make_error) std::rethrow_exception(job.make_error);
    if (job.made) {
      // "consumer" outputs: their memory may still be used by work the consumer queued on
      // their stream before submit() made them (a block freed there is reused at once); the
      // copies wait for it.
      C10_CUDA_CHECK(cudaStreamWaitEvent(stream.stream(),
                                         static_cast<cudaEvent_t>(job.outputs_made.handle), 0));
      job.copied_on = stream;
      job.outs = send_batch_leaves(job.leaves, device_, job.options, LargeCopies::kCurrentStream,
                                   &*job.made);
      job.made.reset();  // job.outs holds them now
    } else {
      job.outs = send_batch_leaves(job.leaves, device_, job.options, LargeCopies::kCurrentStream);
    }
    if (tracing) {
      job.trace.sent_ns = steady_now_ns();
      // This thread's last single-block transfer, if this job made it (mustered after the
      // job began): its steps, from the muster.
      const transfer::SingleBlockTrace block = transfer::last_single_block_trace();
      job.trace.has_block = block.mustered_ns >= job.trace.started_ns;
      if (job.trace.has_block) job.trace.block = block;
      // And its packed copy of small leaves, if it made one (entered after the job began).
      const transfer::PackTrace pack = transfer::last_pack_trace();
      job.trace.has_pack = pack.entered_ns >= job.trace.started_ns;
      if (job.trace.has_pack) job.trace.pack = pack;
    }
    job.event = cuda::record_event(stream.unwrap());
    // How take() will know the copies have landed (PINXFER_SENDER_LANDING; csrc/README.md,
    // "The sender road"): a flag a host function sets (free to read after the consumer's
    // compute step, where a CUDA call on a core that was idle is slow), or the job's event
    // (no host function in the sender's cycle, nor the driver thread it wakes: back to back
    // that cycle bounds a small batch's step). `auto`: the flag after long consumer steps.
    const bool with_flag =
        landing_ == LandingMode::kFlag ||
        (landing_ == LandingMode::kAuto && consumer_steps_long_.load(std::memory_order_relaxed));
    if (!with_flag) return;
    auto* flag = new LandedFlag(job.landed);
    const cudaError_t err = cudaLaunchHostFunc(stream.stream(), &mark_landed, flag);
    if (err != cudaSuccess) {
      delete flag;
      C10_CUDA_CHECK(err);
    }
    job.flagged = true;
    sent_flagged_.fetch_add(1, std::memory_order_relaxed);
  } catch (...) {
    // Copies already queued read staging blocks the pool keeps until they are done, and
    // write outputs whose memory returns to a stream their later users are ordered on (the
    // worker's own, or, for "consumer" outputs, the owner's once the copies are recorded).
    job.drop_untaken_outputs();
    throw;
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
