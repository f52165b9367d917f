// BatchSender: batches of plain CPU tensors sent to one GPU by threads of its own, so
// that the thread asking for them never waits for their staging or their copies:
// pinxfer.prefetch's sender road (pinxfer/prefetch.py; csrc/README.md, "The sender road").
//
// Why C++ threads. prefetch's caller's road sent the next batch inside next(), after the
// consumer's compute step: after an idle gap every CUDA call and every line of Python on
// the consumer's cold core is slow (diag_idle_wake.py: an event query 42 µs, a 4 KiB
// pinned copy + synchronize 240 µs), so next() paid a whole small transfer, and a plain
// loop of .to() was as fast. A Python producer thread hands every batch over through the
// GIL, which the consumer holds while it runs (75-96 µs a 4 KiB step on the H100, against
// 27 for the plain loop). These threads take no GIL: each sends on a stream of its own while
// the consumer computes, and the batch is on the GPU before the consumer asks for it.
//
// Protocol (the queue, its workers and its waits are runtime/serial_jobs.h's, tested under
// TSan and ASan; this class adds the CUDA send and the hand-over):
//   submit(leaves, chunk_bytes, num_buffers)
//                   queues the leaves (each a plain dense CPU tensor: the caller checked,
//                   pinxfer._C.plain_leaves_max_bytes) to be sent as to_device sends a
//                   batch (send_batch_leaves, ops/kernels.h) with those staging settings;
//                   returns at once.
//   take(job)       waits until the job is sent (its copies queued), then makes the
//                   results safe on the caller's current stream: if the copies have
//                   already landed (a host function the worker queued after them has
//                   run, or, for a job sent without one, its event is complete:
//                   LandingMode below) nothing is queued at all; else the current
//                   stream waits on the job's
//                   event. Either way each result is record_stream'ed on the current
//                   stream, unless that stream owns them ("Outputs" below). Rethrows what
//                   sending raised. Once per job.
//   settle(job)     a job that will not be taken (its pass stopped): dropped if not
//                   started, else waited for until sent, so no copy of it is queued after.
// The destructor ends the threads once their current jobs are sent (jobs not started fail);
// the process's senders are never destroyed.
// One sender serves every pass of a process on its device (batch_sender_for, made at the
// first use and leaked, as the thread pools are; a forked child starts with none): jobs
// start in the order submitted, so no pass pays for starting a thread.
// Workers (PINXFER_SENDER_WORKERS, default 2): each sends on a stream of its own, every copy
// of its jobs (their pipelined leaves too: LargeCopies::kCurrentStream, not the device's copy
// stream to_device uses, so two workers' DMAs never queue in one FIFO and no hand-over is
// made; csrc/README.md, "The sender road", session 27). With two,
// the next batch starts while the last one's staging ends: one worker's cycle per batch is
// the send's setup before its first DMA, the staging, and the small leaves' send after the
// big one, all on the host (8 MiB back to back on the H200: 216 µs a batch against a
// 152 µs DMA, diag_sender.py --trace), so with one worker the copy engine idled between
// batches. Two batches in flight share the copy threads and the engine.
// Outputs (PINXFER_SENDER_OUTPUTS). "worker" (the default): the worker allocates a job's
// device memory on its own stream, and take() records each result's use on the consumer's
// stream (recordStream), so the caching allocator keeps the memory from the worker's next
// copies until the consumer is done with it: at the result's free, one event a storage and a
// stream. "consumer": submit() makes the outputs on the consumer's current stream
// (batch_outputs, before the job is queued) and records an event there; the worker's stream
// waits for that event before its copies, so they never write memory the consumer's queued
// work still reads (a block freed on that stream is reused by the next allocation on it at
// once). The consumer's stream then owns the results as if it had allocated them itself: a
// take() on that stream records nothing and their free makes no event, as a plain loop's. A
// take() on another stream records the use as before. "auto": "consumer" outputs while the
// consumer's steps (take to take) are shorter than twice the spin, "worker" ones after a
// longer step (after a gap the consumer's allocations and event at the submit, on a core that
// was idle, cost more than they save: H200, session 40). A batch with a leaf staged through a
// ring (larger than chunk_bytes x num_buffers) keeps "worker" outputs: the worker's thread
// waits for a ring slot's DMA, which would wait for the consumer's queued work, and take()
// for the worker. A job's outputs that are dropped
// untaken after its copies were queued (settled, failed, or its ticket dropped) have the
// worker's stream recorded first, so their memory waits for those copies.
// Sources are referenced by the job until take() or the job's end: a pageable source is
// staged before its send returns, a pinned one is kept by pinxfer's source use until the
// copy has read it (transfer/cuda/source_use.h), as with to_device.
//
// Waits (take, settle) may last a transfer: call them without the GIL (a source
// tensor's last reference dropped by the worker may need it to free its Python object).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/cuda/CUDAStream.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <vector>

#include "runtime/serial_jobs.h"
#include "transfer/cuda/pipeline.h"

namespace pinxfer::ops {

class BatchSender {
 public:
  struct Job;
  struct WarmUp;

  // How take() knows a job's copies are done (PINXFER_SENDER_LANDING, read at construction):
  // kFlag: a host function queued after them sets a flag; kEvent: take() asks the job's
  // event; kAuto: the flag when the consumer's last step (take to take) was longer than
  // twice the spin, else the event. In the order of settings.h's kSenderLandingNames.
  enum class LandingMode { kAuto, kFlag, kEvent };

  // device: a CUDA device with an index. Returns once every worker has made its first CUDA
  // calls (warm_workers): call it without the GIL.
  explicit BatchSender(c10::Device device);
  BatchSender(const BatchSender&) = delete;
  BatchSender& operator=(const BatchSender&) = delete;

  // entered_ns: when the caller's call began, for the job's trace (0: now).
  std::shared_ptr<Job> submit(std::vector<at::Tensor> leaves, int64_t chunk_bytes,
                              int64_t num_buffers, int64_t entered_ns = 0);
  std::vector<at::Tensor> take(const std::shared_ptr<Job>& job);
  void settle(const std::shared_ptr<Job>& job);

  // Jobs submitted, taken, and taken with their copies landed (no stream wait): what the
  // tests and diagnostics read.
  int64_t submitted() const;
  int64_t taken() const;
  int64_t taken_landed() const;
  int64_t sent_flagged() const;  // jobs sent with a landing host function
  // Jobs taken on the stream their outputs were made on ("consumer" outputs): no stream use
  // recorded.
  int64_t taken_owned() const;
  // PINXFER_SENDER_OUTPUTS ("Outputs" above), in the order of settings.h's kSenderOutputsNames.
  enum class OutputsMode { kWorker, kConsumer, kAuto };
  OutputsMode outputs_mode() const { return outputs_mode_.load(std::memory_order_relaxed); }
  // DIAGNOSTIC (benchmarks/diag_sender.py's "owned" way, the tests): the setting for the jobs
  // submitted from now on, so that settings can be timed in one process (each job keeps its
  // own).
  void set_outputs_mode(OutputsMode mode) { outputs_mode_.store(mode, std::memory_order_relaxed); }
  int workers() const;             // PINXFER_SENDER_WORKERS at construction
  int64_t warmed_workers() const;  // workers that made their first CUDA calls (warm_workers)

  // DIAGNOSTIC (benchmarks/diag_sender.py --trace): what the last taken jobs did, while
  // set_sender_tracing(true) (off by default: a few clock reads and a copy per job). Times
  // on the steady clock in ns (steady_now_ns: time.perf_counter_ns's clock).
  struct JobTrace {
    int64_t entered_ns = 0;       // the submitting call began (the binding's: before it took
                                  // the batch apart; submit()'s own start otherwise)
    int64_t outputs_ns = 0;       // of those until submitted_ns, making the outputs and their
                                  // event ("consumer" outputs; 0 otherwise)
    int64_t submitted_ns = 0;     // the job made, about to be queued
    int64_t queued_ns = 0;        // queued: submit() returning (a lock, a push, a notify)
    int64_t started_ns = 0;       // the worker began sending it
    int64_t sent_ns = 0;          // its send returned: every copy queued
    int64_t take_entered_ns = 0;  // take() began
    int64_t waited_ns = 0;        // take() found the job done (its wait returned)
    int64_t taken_ns = 0;         // take() had it, safe on the consumer's stream
    int64_t recorded_ns = 0;      // the results' stream uses recorded: take() returning
    int64_t bytes = 0;            // of its leaves
    bool flagged = false;         // sent with a landing host function
    bool landed = false;          // its copies had landed when taken
    bool has_block = false;       // a leaf went through the single-block pipeline: `block` is
                                  // the last such leaf's trace (the worker thread's own)
    transfer::SingleBlockTrace block;
    bool has_pack = false;  // small leaves went packed: `pack` is that copy's trace (the worker
                            // thread's own); a leaf sent before it (apart, or pipelined) took
                            // the time from started_ns to pack.entered_ns
    transfer::PackTrace pack;
  };
  static constexpr size_t kJobTraces = 256;
  std::vector<JobTrace> job_traces() const;  // oldest first; at most kJobTraces

 private:
  // On the consumer's thread, in submit(), with PINXFER_SENDER_OUTPUTS=consumer: the job's
  // outputs on the current stream and the event the worker's stream waits for (an error is
  // kept in the job and raised by its send, so that take() raises it).
  void make_outputs(Job& job) const;
  // One job's send, on the worker thread (Job::run).
  void send(Job& job);
  // The calling worker's own stream, from torch's pool (made at its first call).
  c10::cuda::CUDAStream worker_stream();
  // The constructor's last step: one WarmUp job a worker, the constructor waiting; then no
  // worker makes the CUDA calls that a thread, or the process, makes the first time during
  // a job, beside whatever the consumer's thread does meanwhile (csrc/README.md, "The
  // sender road", session 36).
  void warm_workers();
  // On a worker thread (WarmUp::run): its stream, an event, a host function and a wait.
  void warm_this_worker();
  // Whether the job's copies are done (cudaEventQuery); a CUDA error raises.
  static bool event_landed(const Job& job);

  const c10::Device device_;
  std::atomic<int64_t> taken_{0}, taken_landed_{0}, taken_owned_{0}, sent_flagged_{0}, warmed_{0};
  const LandingMode landing_;
  std::atomic<OutputsMode> outputs_mode_;  // PINXFER_SENDER_OUTPUTS
  // kAuto: the consumer's last step (take to take) was longer than long_step_ns_ (twice
  // the spin), so the next job gets a host function.
  const int64_t long_step_ns_;
  // The last take(); atomic: passes on several threads may share the device's sender.
  std::atomic<int64_t> last_take_ns_{0};
  std::atomic<bool> consumer_steps_long_{true};
  mutable std::mutex traces_mutex_;
  std::vector<JobTrace> traces_;  // a ring of kJobTraces. LOCK: traces_mutex_
  size_t traces_next_ = 0;        // LOCK: traces_mutex_
  SerialJobs jobs_;  // last: destroyed first, so its workers are joined before the rest goes
};

// The process's sender for CUDA device `index` (made at the first call; never destroyed).
BatchSender& batch_sender_for(c10::DeviceIndex index);

// DIAGNOSTIC: every sender records its taken jobs' traces while this is on.
void set_sender_tracing(bool on);
// Whether set_sender_tracing(true) is on: a binding that times its own part of a submit.
bool sender_tracing();

}  // namespace pinxfer::ops
