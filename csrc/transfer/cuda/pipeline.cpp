#include "transfer/cuda/pipeline.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "memory/pinned_pool.h"
#include "memory/placement.h"
#include "memory/pool_registry.h"
#include "runtime/cuda_runtime.h"
#include "runtime/settings.h"
#include "runtime/step_stamps.h"
#include "runtime/thread_pool.h"
#include "runtime/torch_team.h"
#include "transfer/chunk_plan.h"
#include "transfer/cuda/copy_streams.h"
#include "transfer/cuda/source_use.h"
#include "transfer/cuda/staged_read.h"
#include "transfer/piece_claims.h"
#include "transfer/stage_copy.h"

namespace pinxfer::transfer {

namespace {

// Microseconds from `from` to `to` (the traces' unit).
double us_between(std::chrono::steady_clock::time_point from,
                  std::chrono::steady_clock::time_point to) {
  return std::chrono::duration<double, std::micro>(to - from).count();
}

// Blocks of the staged-read kernel on `device` (transfer/cuda/staged_read.h): one per SM, or 0
// where the device cannot use a registered host pointer or the build has no image of the kernel
// for it (the copy engine then reads). Asked of the device once, with `device` current, by the
// first transfer with a chunk the kernel could read; the answer holds for the process (a probe
// that failed for a passing reason, the GPU's memory full as the module loads, leaves that
// device to the engine).
int staged_read_blocks(c10::DeviceIndex device) {
  static const c10::DeviceIndex devices = c10::cuda::device_count();
  // 0: not asked yet; -1: no kernel there. Leaked: read at exit.
  static std::atomic<int>* const blocks_of = new std::atomic<int>[devices]();
  if (device < 0 || device >= devices) return 0;
  int blocks = blocks_of[device].load(std::memory_order_relaxed);
  if (blocks == 0) {
    int host_pointer = 0, sms = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&host_pointer,
                                          cudaDevAttrCanUseHostPointerForRegisteredMem, device));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    blocks = host_pointer != 0 && sms > 0 && staged_read_runs_here() == cudaSuccess ? sms : -1;
    blocks_of[device].store(blocks, std::memory_order_relaxed);
  }
  return blocks > 0 ? blocks : 0;
}

// Queues one send of staged bytes: by the staged-read kernel of `blocks` blocks (> 0) where
// the pointers suit it, else by the copy engine. Returns whether the kernel sent them.
bool send_staged(void* dst, const void* src, size_t len, int blocks, cudaStream_t stream) {
  if (blocks > 0 && staged_read_fits(dst, src, len)) {
    C10_CUDA_CHECK(launch_staged_read(dst, src, len, blocks, stream));
    return true;
  }
  C10_CUDA_CHECK(cudaMemcpyAsync(dst, src, len, cudaMemcpyHostToDevice, stream));
  return false;
}

// Shared state of one pipelined transfer through a ring of staging slots; lives on the
// caller's stack for the duration of the parallel_for.
struct Pipeline {
  const char* src = nullptr;
  char* dst = nullptr;
  size_t nbytes = 0;
  ChunkPlan plan;
  StagePolicy policy;
  c10::DeviceIndex device = 0;
  c10::cuda::CUDAStream stream;
  std::vector<c10::DataPtr> slots;              // the staging block(s)
  std::unique_ptr<std::atomic<size_t>[]> left;  // pieces of each chunk not yet copied
  std::atomic<size_t> next_piece{0};
  std::atomic<bool> failed{false};

  std::mutex mutex;
  std::condition_variable queued_cv;
  std::vector<int64_t> queued;      // last chunk queued from each slot, -1: none. LOCK: mutex
  std::vector<cuda::Event> events;  // event after that chunk's copy. LOCK: mutex
  // The slot's one waiter on the copy: the latest chunk whose DMA from each slot is known
  // to be done (-1: none), and whether a thread is waiting for that slot's event now. LOCK: mutex
  std::vector<int64_t> freed;
  std::vector<uint8_t> watched;

  explicit Pipeline(c10::cuda::CUDAStream s) : stream(s) {}

  // Where chunk c is staged (ring slot c % ring).
  char* staging_of(size_t c) const { return static_cast<char*>(slots[c % plan.ring].get()); }

  // Blocks until ring slot c % ring may be overwritten with chunk c (c >= ring).
  // Returns false if the transfer failed meanwhile.
  //
  // Every piece of chunk c waits for the same DMA (chunk c - ring's, from the slot), and
  // with staging ahead of the bus most pieces do. One of them watches the slot's event
  // (event_wait_sleeping: a short spin, then polls between sleeps); the others sleep on
  // the condition variable until it reports the slot free. Each thread polling the event
  // itself cost CPU time and driver calls beside the DMAs being queued (issue 22: CPU
  // seconds per GB).
  bool wait_slot_free(size_t c) {
    const size_t slot = c % plan.ring;
    const int64_t previous = static_cast<int64_t>(c - plan.ring);
    cuda::Event ev;
    {
      std::unique_lock<std::mutex> lock(mutex);
      queued_cv.wait(lock, [&] {
        return failed.load() ||
               (queued[slot] >= previous && (freed[slot] >= previous || watched[slot] == 0));
      });
      if (failed.load()) return false;
      if (freed[slot] >= previous) return true;
      // The slot's event is replaced only when chunk c is queued, which needs
      // this piece first: the handle stays valid while we wait on it.
      ev = events[slot];
      watched[slot] = 1;
    }
    cuda::event_wait_sleeping(ev);  // on a throw, run() marks the transfer failed
    {
      std::lock_guard<std::mutex> lock(mutex);
      watched[slot] = 0;
      freed[slot] = std::max(freed[slot], previous);
    }
    queued_cv.notify_all();
    return true;
  }

  void queue_chunk(size_t c) {
    const size_t len = plan.bounds[c + 1] - plan.bounds[c];
    Range range("pinxfer::h2d");
    C10_CUDA_CHECK(cudaMemcpyAsync(dst + plan.bounds[c], staging_of(c), len, cudaMemcpyHostToDevice,
                                   stream.stream()));
    const cuda::Event ev = cuda::record_event(stream.unwrap());
    const size_t slot = c % plan.ring;
    cuda::Event old;
    {
      std::lock_guard<std::mutex> lock(mutex);
      old = events[slot];
      events[slot] = ev;
      queued[slot] = static_cast<int64_t>(c);
    }
    queued_cv.notify_all();
    if (old.handle) cuda::release_event(old);
  }

  void copy_piece(const ChunkPlan::Piece& p) {
    const auto& b = plan.bounds;
    TORCH_INTERNAL_ASSERT(p.end - b[p.chunk] <= plan.slot_bytes,
                          "pinxfer: staging chunk larger than its ring slot");
    if (p.chunk >= plan.ring && !wait_slot_free(p.chunk)) return;
    {
      Range range("pinxfer::stage");
      stage_copy(staging_of(p.chunk) + (p.begin - b[p.chunk]), src + p.begin, p.end - p.begin,
                 policy.kind_for(b[p.chunk + 1], nbytes));
    }
    // acq_rel: the thread that queues the chunk sees every piece's bytes.
    if (left[p.chunk].fetch_sub(1, std::memory_order_acq_rel) == 1) queue_chunk(p.chunk);
  }

  // Body run by each participating thread: claim pieces in order until none
  // are left or the transfer failed.
  void run() {
    c10::cuda::CUDAGuard guard(device);
    try {
      while (!failed.load(std::memory_order_relaxed)) {
        const size_t p = next_piece.fetch_add(1, std::memory_order_relaxed);
        if (p >= plan.pieces.size()) return;
        copy_piece(plan.pieces[p]);
      }
    } catch (...) {
      {
        std::lock_guard<std::mutex> lock(mutex);
        failed.store(true);
      }
      queued_cv.notify_all();
      throw;
    }
  }

  void release_events() {
    std::lock_guard<std::mutex> lock(mutex);
    for (auto& ev : events) {
      if (ev.handle) cuda::release_event(ev);
      ev = cuda::Event{};
    }
  }
};

// The single-block path (plan.ring == 0: the whole tensor staged in one block), where the
// caller never waits for a helper that the scheduler has parked: who stages each piece, the
// steals and when the source may be let go are PieceClaims' (transfer/piece_claims.h says
// why and how; CUDA-free, so it runs under TSan and ASan). Here the caller sends the chunks
// (SpanGate) and the state is shared (shared_ptr) by the caller and the helpers, so the
// block lives until the last helper has left, however late; the block goes back to the pool
// marked as read by the stream (the pool's event FIFO keeps it from reuse until the DMAs are
// done), spares likewise.
// A ring (plan.ring > 0: larger than num_buffers chunks) keeps the Pipeline above: its slots
// are refilled within the transfer, so a late helper's bytes could land in a later chunk.

std::atomic<uint64_t> g_stolen_pieces{0};
thread_local SingleBlockTrace t_last_trace;  // last_single_block_trace()
std::atomic<int64_t> g_helper_stall_us{0};   // test hook (set_helper_stall_us)

// The chunk timeline (set_chunk_timeline): timing events of the calling thread's last
// single-block transfer, read and destroyed by last_chunk_timeline() or the next recording.
std::atomic<bool> g_chunk_timeline{false};
struct ChunkTimelineRecorder {
  cudaEvent_t start = nullptr;
  std::chrono::steady_clock::time_point started;
  std::vector<cudaEvent_t> done;  // after each span's DMA, in order
  std::vector<ChunkTimelineEntry> entries;
  // Events of earlier recordings, kept for the next ones: a cudaEventCreate in the middle of
  // a transfer would be timed as part of it. Kept while the thread lives (a diagnostic's few).
  std::vector<cudaEvent_t> spare;
  int spare_device = -1;  // the device they were created on

  // Events belong to their device: the spares are dropped when a recording begins on another
  // one. Asked once per recording, in begin(), so no span pays a cudaGetDevice inside the
  // timed transfer (the transfer's device is current throughout it).
  void use_device_of_this_recording() {
    int device = 0;
    C10_CUDA_CHECK(cudaGetDevice(&device));
    if (device == spare_device) return;
    // Best effort: a diagnostic's leftover events must not make a transfer fail.
    for (cudaEvent_t ev : spare) (void)cudaEventDestroy(ev);
    spare.clear();
    spare_device = device;
  }
  cudaEvent_t take_event() {
    if (!spare.empty()) {
      cudaEvent_t ev = spare.back();
      spare.pop_back();
      return ev;
    }
    cudaEvent_t ev = nullptr;
    C10_CUDA_CHECK(cudaEventCreate(&ev));
    return ev;
  }
  void clear() {
    if (start) spare.push_back(start);
    spare.insert(spare.end(), done.begin(), done.end());
    start = nullptr;
    done.clear();
    entries.clear();
  }
  void begin(cudaStream_t stream) {
    clear();
    use_device_of_this_recording();
    start = take_event();
    started = std::chrono::steady_clock::now();
    C10_CUDA_CHECK(cudaEventRecord(start, stream));
  }
  void span_queued(cudaStream_t stream, size_t begin, size_t end) {
    cudaEvent_t ev = take_event();
    done.push_back(ev);
    C10_CUDA_CHECK(cudaEventRecord(ev, stream));
    ChunkTimelineEntry e;
    e.begin = static_cast<int64_t>(begin);
    e.end = static_cast<int64_t>(end);
    e.queued_us = us_between(started, std::chrono::steady_clock::now());
    entries.push_back(e);
  }
};
thread_local ChunkTimelineRecorder t_chunk_timeline;

struct SingleBlock {
  SingleBlock(c10::cuda::CUDAStream s, ChunkPlan p) : plan(std::move(p)), claims(plan), stream(s) {}
  SingleBlock(const SingleBlock&) = delete;
  SingleBlock& operator=(const SingleBlock&) = delete;

  const char* src = nullptr;
  char* dst = nullptr;
  size_t nbytes = 0;
  const ChunkPlan plan;
  PieceClaims claims;  // of plan's pieces
  StagePolicy policy;
  // Bytes [0, kernel_end) (the chunks staged with cached stores, when the kernel reads them:
  // kernel_read_end) go by the staged-read kernel of kernel_blocks blocks; the rest by the engine.
  size_t kernel_end = 0;
  int kernel_blocks = 0;
  c10::DeviceIndex device = 0;
  c10::cuda::CUDAStream stream;
  PinnedPool* pool = nullptr;
  c10::DataPtr block;
  // For the trace (last_single_block_trace): when the call began, when the first helper
  // claimed a piece (ns after `started`, -1: none yet), and the pieces helpers published.
  std::chrono::steady_clock::time_point started;
  std::atomic<int64_t> first_claim_ns{-1};
  std::atomic<int64_t> helper_pieces{0};

  // The last participant out returns the block (a late helper, possibly), marked as read
  // by the stream. A destructor must not throw: if the device cannot be set (the process
  // is exiting), the block is kept out of the pool for good rather than freed unmarked.
  ~SingleBlock() {
    if (!block.get_context()) return;
    try {
      c10::cuda::CUDAGuard guard(device);
      pool->record_stream(block.get_context(), stream.unwrap());
      block.clear();
    } catch (...) {
      (void)block.release_context();
    }
  }

  void stage(size_t p, char* into) const {
    const auto& piece = plan.pieces[p];
    Range range("pinxfer::stage");
    stage_copy(into, src + piece.begin, piece.end - piece.begin,
               policy.kind_for(plan.bounds[piece.chunk + 1], nbytes));
  }
  void stage_in_block(size_t p) const {
    stage(p, static_cast<char*>(block.get()) + plan.pieces[p].begin);
  }

  // A pool helper's share (PieceClaims::help). No CUDA call, no throw.
  void help() {
    const int64_t published = claims.help(
        [this](size_t) {
          if (first_claim_ns.load(std::memory_order_relaxed) < 0) {
            int64_t none = -1;
            first_claim_ns.compare_exchange_strong(
                none,
                std::chrono::duration_cast<std::chrono::nanoseconds>(
                    std::chrono::steady_clock::now() - started)
                    .count(),
                std::memory_order_relaxed);
          }
          if (const int64_t stall = g_helper_stall_us.load(std::memory_order_relaxed)) {
            std::this_thread::sleep_for(std::chrono::microseconds(stall));
          }
        },
        [this](size_t p) { stage_in_block(p); });
    helper_pieces.fetch_add(published, std::memory_order_relaxed);
  }
};

// On torch's team: pieces first, first + step, ... not yet claimed (kFree -> kClaimed),
// staged and published, after_each(when its staging began) after each (the caller queues
// chunks there); returns the pieces staged. No steal happens on the team.
size_t stage_every(SingleBlock& sb, size_t first, size_t step, bool helper,
                   const std::function<void(std::chrono::steady_clock::time_point)>& after_each) {
  size_t staged = 0;
  for (size_t p = first; p < sb.claims.pieces(); p += step) {
    if (!sb.claims.is_free(p)) continue;
    const auto staging = std::chrono::steady_clock::now();
    if (!sb.claims.claim_and_stage(p, [&sb](size_t q) { sb.stage_in_block(q); })) continue;
    if (helper) sb.helper_pieces.fetch_add(1, std::memory_order_relaxed);
    ++staged;
    if (after_each) after_each(staging);
  }
  return staged;
}

// The end of the bytes the staged-read kernel sends (0: the engine sends them all), for a
// reader other than kEngine: the chunks staged with cached stores (the plan's first:
// StagePolicy::kind_for), where the block is CUDA-registered. A kernel must never read host
// memory the device has not mapped: a block the pool could only mlock (or not lock) would fault
// it, and a fault ends the process's CUDA context. Under kKernelIfIdle only for a caller on the
// device's default stream with nothing pending there (one cudaStreamQuery, asked only where some
// chunk is staged cached): that is where a training loop's steps run, and where their absence
// can be seen. A caller on another stream (prefetch's producer thread, whose batches overlap the
// step on the default stream; a user's side stream) keeps the engine: the step the kernel would
// slow is not on its stream.
size_t kernel_read_end(const SingleBlock& sb, const StagingOptions& options) {
  size_t end = 0;
  for (size_t c = 0; c < sb.plan.num_chunks(); ++c) {
    if (sb.policy.kind_for(sb.plan.bounds[c + 1], sb.nbytes) == StageCopy::kCached) {
      end = sb.plan.bounds[c + 1];
    }
  }
  if (end == 0 || PinnedPool::lock_kind_if_pool(sb.block) != LockKind::kCudaRegistered) return 0;
  if (staged_read_blocks(sb.device) == 0) return 0;  // the first such transfer probes the device
  if (options.reader == StagedReader::kKernelIfIdle &&
      (!options.caller ||
       *options.caller != c10::cuda::getDefaultCUDAStream(options.caller->device_index()) ||
       stream_busy(*options.caller))) {
    return 0;
  }
  return end;
}

// Queues block bytes [begin, end) (the transfer's, at their offset in the block): those below
// sb.kernel_end by the staged-read kernel, the others by the engine. Returns the kernel's sends.
size_t send_block_range(const SingleBlock& sb, size_t begin, size_t end) {
  const char* block = static_cast<const char*>(sb.block.get());
  const cudaStream_t stream = sb.stream.stream();
  const size_t cut = std::clamp(sb.kernel_end, begin, end);
  size_t by_kernel = 0;
  if (begin < cut) {
    by_kernel += send_staged(sb.dst + begin, block + begin, cut - begin, sb.kernel_blocks, stream);
  }
  if (cut < end) send_staged(sb.dst + cut, block + cut, end - cut, 0, stream);
  return by_kernel;
}

// Queues chunks [first, last)'s bytes as few sends as it can: runs of pieces from the block, a
// stolen piece from its spare (by the engine: a spare's lines are the stealer's, and steals
// are rare). Returns the sends the staged-read kernel made.
size_t queue_single_block_span(const SingleBlock& sb, size_t first, size_t last,
                               const std::vector<c10::DataPtr>& spares) {
  Range range("pinxfer::h2d");
  size_t by_kernel = 0;
  size_t run = sb.plan.bounds[first];  // start of the run of block bytes not yet queued
  for (size_t p = sb.claims.first_piece(first); p < sb.claims.first_piece(last); ++p) {
    if (!sb.claims.stolen(p)) continue;
    const auto& piece = sb.plan.pieces[p];
    if (run < piece.begin) by_kernel += send_block_range(sb, run, piece.begin);
    send_staged(sb.dst + piece.begin, spares[p].get(), piece.end - piece.begin, 0,
                sb.stream.stream());
    run = piece.end;
  }
  const size_t end = sb.plan.bounds[last];
  if (run < end) by_kernel += send_block_range(sb, run, end);
  return by_kernel;
}

// When the caller sends staged chunks (issue 22, benchmarks/diag_chunk_timeline.py). Each DMA
// costs the copy engine 2.5-3 us beside its bytes (H200: 8 MiB of pinned memory took 158 us
// as one DMA and 189 in the plan's 11 chunks), and at 8 MiB staging outruns the bus: staged by
// 90 us, its 11 DMAs kept the engine busy until 229. The engine, not the staging, was the
// bound. So chunks that are staged while the engine still has a span running and another
// queued behind it wait, and go together as one longer DMA when the running span ends: the
// engine always has the next span queued, and the spans grow as far as staging is ahead.
// Until the engine holds two spans (the plan's ramp, at the start), a chunk goes as soon as
// it is staged.
class SpanGate {
 public:
  explicit SpanGate(c10::Stream stream) : stream_(stream) {}
  SpanGate(const SpanGate&) = delete;
  SpanGate& operator=(const SpanGate&) = delete;
  ~SpanGate() {
    for (const auto& ev : in_flight_) cuda::release_event(ev);
  }

  // Whether the engine has a span running and another queued behind it.
  bool engine_has_next() {
    while (!in_flight_.empty()) {
      std::string error;
      ++queries_;
      const bool done = cuda::event_done(in_flight_.front(), &error);
      TORCH_CHECK(error.empty(), "pinxfer.to_device: ", error);
      if (!done) break;
      cuda::release_event(in_flight_.front());
      in_flight_.erase(in_flight_.begin());
    }
    return in_flight_.size() >= 2;
  }
  // After a span was queued.
  void sent() {
    in_flight_.push_back(cuda::record_event(stream_));
    ++spans_;
  }
  size_t spans() const { return spans_; }
  size_t queries() const { return queries_; }

 private:
  c10::Stream stream_;
  std::vector<cuda::Event> in_flight_;  // after each span still possibly running, oldest first
  size_t spans_ = 0;
  size_t queries_ = 0;  // event queries (the trace's gate_queries)
};

void single_block_copy(const at::Tensor& src, at::Tensor& out, c10::DeviceIndex device,
                       const c10::cuda::CUDAStream& stream, ChunkPlan plan, StagePolicy policy,
                       const StagingOptions& options, PinnedPool& pool, ThreadPool& threads,
                       const CopyCrew& crew) {
  using Clock = std::chrono::steady_clock;
  const auto started = Clock::now();
  auto sb = std::make_shared<SingleBlock>(stream, std::move(plan));
  sb->started = started;
  auto us_since_start = [&sb](Clock::time_point t) { return us_between(sb->started, t); };
  SingleBlockTrace trace;
  trace.setup_us = us_between(crew.mustered, sb->started);
  trace.mustered_ns =
      std::chrono::duration_cast<std::chrono::nanoseconds>(crew.mustered.time_since_epoch())
          .count();
  sb->src = static_cast<const char*>(src.const_data_ptr());
  sb->dst = static_cast<char*>(out.data_ptr());
  sb->nbytes = src.nbytes();
  sb->policy = policy;
  sb->device = device;
  sb->pool = &pool;
  const auto& pieces = sb->plan.pieces;
  const size_t chunks = sb->plan.num_chunks();
  PieceClaims& claims = sb->claims;
  sb->block = pool.allocate(sb->nbytes);
  trace.alloc_us = us_since_start(Clock::now());
  if (options.reader != StagedReader::kEngine) {
    sb->kernel_end = kernel_read_end(*sb, options);
    if (sb->kernel_end > 0) sb->kernel_blocks = staged_read_blocks(device);
  }

  // What may throw comes before the offer: from the offer on, helpers may read the source,
  // and only the try below (withdraw, close_free_pieces, close_source) makes the call wait
  // for them before it returns (found by review, session 42; the timeline diagnostic's start
  // event is now recorded before the offer, a few microseconds earlier than before).
  std::vector<c10::DataPtr> spares(pieces.size());
  const bool timeline = g_chunk_timeline.load(std::memory_order_relaxed);
  if (timeline) t_chunk_timeline.begin(stream.stream());
  // torch's team awake (runtime/torch_team.h): its threads stage the pieces beside the
  // caller, which joins them all; none is parked by contention, so nothing is stolen.
  const bool on_team = sb->plan.threads > 1 && crew.on_torch_team;
  const int helpers = static_cast<int>(sb->plan.threads) - 1;
  const ThreadPool::Offer offer =
      on_team ? nullptr : threads.offer(helpers, [sb](size_t, size_t) { sb->help(); });
  trace.nbytes = static_cast<int64_t>(sb->nbytes);
  trace.pieces = static_cast<int64_t>(pieces.size());
  trace.on_torch_team = on_team;
  trace.helpers_offered = on_team || offer ? helpers : 0;
  trace.offered_us = us_since_start(Clock::now());
  size_t queued = 0;  // chunks queued, in order
  SpanGate gate(stream.unwrap());
  // Sends the staged chunks that follow the last one sent, as one span, unless the engine
  // has enough queued and more chunks are to come (SpanGate).
  auto queue_ready = [&] {
    size_t ready = queued;
    while (ready < chunks && claims.chunk_final(ready)) ++ready;
    if (ready == queued) return;
    if (ready < chunks) {
      const auto asked = Clock::now();
      const bool hold = gate.engine_has_next();
      trace.gate_us += us_between(asked, Clock::now());
      if (hold) return;
    }
    const auto queueing = Clock::now();
    trace.kernel_reads += static_cast<int64_t>(queue_single_block_span(*sb, queued, ready, spares));
    gate.sent();
    const auto sent = Clock::now();
    trace.queue_us += us_between(queueing, sent);
    trace.last_queued_us = us_since_start(sent);
    if (queued == 0) trace.first_queued_us = trace.last_queued_us;
    if (timeline) {
      t_chunk_timeline.span_queued(stream.stream(), sb->plan.bounds[queued],
                                   sb->plan.bounds[ready]);
    }
    queued = ready;
  };
  // The trace's account of a piece the caller staged from `staging` until now.
  auto note_own_piece = [&](Clock::time_point staging) {
    const auto done = Clock::now();
    trace.own_stage_us += us_between(staging, done);
    if (trace.first_own_done_us < 0) trace.first_own_done_us = us_since_start(done);
  };
  // After each piece the caller staged: its account in the trace, then the chunks now ready.
  const auto after_own = [&](Clock::time_point staging) {
    note_own_piece(staging);
    queue_ready();
  };
  const auto stage_in_block = [&sb](size_t p) { sb->stage_in_block(p); };
  if (offer && g_helper_stall_us.load(std::memory_order_relaxed) > 0) {
    // Test hook on: a helper claims the first piece before the caller starts, so that a
    // stalled helper is there to be stolen from whatever the scheduler does.
    const auto until = Clock::now() + std::chrono::seconds(1);
    while (claims.none_taken() && Clock::now() < until) {
      std::this_thread::yield();
    }
  }
  try {
    if (on_team) {
      // Member k stages pieces k, k + members, ...: the same ones at every transfer of that
      // size, as torch's ops split their ranges on this team, so a member finds the bytes
      // it staged last time (or a torch op just wrote) in its core's cache (pin_memory's
      // copies on the team, split so, took half the time: runtime/torch_team.cpp). Chunks
      // still complete in order. The caller (member 0) then stages what members not yet
      // arrived have left.
      size_t own = 0;
      run_on_each_team_member([&](size_t member, size_t members) {
        if (member != 0) {
          stage_every(*sb, member, members, /*helper=*/true, nullptr);
          return;
        }
        own += stage_every(*sb, 0, members, /*helper=*/false, after_own);
        own += stage_every(*sb, 0, 1, /*helper=*/false, after_own);
      });
      trace.own_pieces = static_cast<int64_t>(own);
      trace.own_done_us = us_since_start(Clock::now());
      queue_ready();  // every piece is final once the team has joined
      TORCH_INTERNAL_ASSERT(queued == chunks, "pinxfer: a chunk left unsent after the join");
    } else {
      const auto own_started = Clock::now();
      const size_t own = claims.stage_own_share(stage_in_block, after_own);
      const auto own_done = Clock::now();
      trace.own_pieces = static_cast<int64_t>(own);
      trace.own_done_us = us_since_start(own_done);
      // Parked helpers' pieces are staged again into spares and sent from there.
      const size_t stolen = claims.finish_after_own_share(
          PieceClaims::patience(own_done - own_started, own),
          [&] {
            queue_ready();
            return queued;
          },
          [&](size_t p) {
            spares[p] = pool.allocate(pieces[p].end - pieces[p].begin);
            sb->stage(p, static_cast<char*>(spares[p].get()));
          });
      g_stolen_pieces.fetch_add(stolen, std::memory_order_relaxed);
      trace.stolen = static_cast<int64_t>(stolen);
    }
  } catch (...) {
    threads.withdraw(offer);
    claims.close_free_pieces();
    (void)claims.close_source();
    // Nothing more is queued; what was queued reads the block and spares, which go back
    // to the pool marked by the stream (the block when the last helper leaves).
    for (auto& sp : spares) {
      if (sp.get_context()) pool.record_stream(sp.get_context(), stream.unwrap());
    }
    throw;
  }
  threads.withdraw(offer);
  trace.reader_wait_us = claims.close_source();
  for (auto& sp : spares) {
    if (sp.get_context()) pool.record_stream(sp.get_context(), stream.unwrap());
  }
  trace.helper_pieces = sb->helper_pieces.load(std::memory_order_relaxed);
  const int64_t first_claim = sb->first_claim_ns.load(std::memory_order_relaxed);
  trace.first_helper_us = first_claim < 0 ? -1.0 : static_cast<double>(first_claim) / 1e3;
  trace.dma_spans = static_cast<int64_t>(gate.spans());
  trace.gate_queries = static_cast<int64_t>(gate.queries());
  // -1: a step the op did not mark (a caller of pipelined_copy that is not send_to_device).
  const auto from_muster = [&crew](std::chrono::steady_clock::time_point t) {
    if (t.time_since_epoch().count() == 0) return -1.0;
    return us_between(crew.mustered, t);
  };
  trace.entry_us = from_muster(crew.entered);
  trace.probed_us = from_muster(crew.probed);
  trace.checked_us = from_muster(crew.checked);
  trace.streams_us = from_muster(crew.streams_found);
  trace.output_us = from_muster(crew.output_made);
  trace.total_us = us_since_start(Clock::now());
  t_last_trace = trace;
}

// Hands staging blocks back to the pool, marked as read by `stream`, so the
// pool reuses them only after the copies queued so far have finished.
// On the device's default stream (where a training loop sends, and a stream that is never
// destroyed) a small block waits in the stream's fence batch instead of recording an event of
// its own (PinnedPool::UseWait): one event record for up to eight small sends. The caller's
// staged copy of 4 KiB went from 5.5 to 4.0 us with it (H100; csrc/README.md, "The small
// road's blocks in the fence batch"). Another stream may be a user's, which could be
// destroyed before a later flush records on it: an event of its own, recorded now.
void return_staging(std::vector<c10::DataPtr>& blocks, PinnedPool& pool,
                    const c10::cuda::CUDAStream& stream) {
  const PinnedPool::UseWait wait = stream == c10::cuda::getDefaultCUDAStream(stream.device_index())
                                       ? PinnedPool::UseWait::kFenceBatch
                                       : PinnedPool::UseWait::kOwnEvent;
  for (auto& b : blocks) {
    if (b.get_context()) pool.record_stream(b.get_context(), stream.unwrap(), wait);
  }
  blocks.clear();
}

}  // namespace

StagedReader staged_reader_setting() {
  // Settings never change: the name is looked up once, not at every pipelined transfer. (A
  // malformed variable throws here, and the next call asks again, as settings() does.)
  static const StagedReader reader = [] {
    const int index = name_index(kStagedReaderNames, settings().h2d_read);
    TORCH_INTERNAL_ASSERT(index >= 0, "pinxfer: PINXFER_H2D_READ parsed to an unknown reader");
    return static_cast<StagedReader>(index);
  }();
  return reader;
}

CopyCrew muster_copy_crew(c10::DeviceIndex device, size_t nbytes) {
  CopyCrew crew;
  crew.mustered = std::chrono::steady_clock::now();
  crew.node = numa_node_for_device(device);
  crew.pool = &thread_pool_for_node(crew.node);
  crew.threads = crew.pool->threads_for_copy(nbytes);
  // The team probe costs a /proc read: asked only where two threads could share the copy.
  crew.on_torch_team = crew.threads > 1 && torch_team_awake();
  if (crew.threads > 1 && !crew.on_torch_team) crew.pool->wake_ahead(crew.threads - 1);
  crew.probed = std::chrono::steady_clock::now();
  return crew;
}

void pipelined_copy(const at::Tensor& src, at::Tensor& out, c10::DeviceIndex device,
                    const c10::cuda::CUDAStream& stream, const StagingOptions& options,
                    const CopyCrew& mustered) {
  CopyCrew crew = mustered;
  crew.entered = std::chrono::steady_clock::now();
  PinnedPool& pool = pool_for_node(crew.node);
  ThreadPool& threads = *crew.pool;

  Pipeline pl(stream);
  pl.src = static_cast<const char*>(src.const_data_ptr());
  pl.dst = static_cast<char*>(out.data_ptr());
  pl.nbytes = src.nbytes();
  pl.plan = plan_chunks(pl.nbytes, options.chunk_bytes, options.num_buffers,
                        static_cast<size_t>(crew.threads));
  pl.policy = stage_policy(options.mode, options.cached_tail, pl.nbytes,
                           [&stream] { return stream_busy(stream); });
  if (pl.plan.ring == 0) {
    single_block_copy(src, out, device, stream, std::move(pl.plan), pl.policy, options, pool,
                      threads, crew);
    return;
  }
  pl.device = device;
  const size_t chunks = pl.plan.num_chunks();
  pl.left.reset(new std::atomic<size_t>[chunks]);
  for (size_t c = 0; c < chunks; ++c) pl.left[c].store(0);
  for (const auto& p : pl.plan.pieces) pl.left[p.chunk].fetch_add(1, std::memory_order_relaxed);
  pl.queued.assign(pl.plan.ring, -1);
  pl.events.assign(pl.plan.ring, cuda::Event{});
  pl.freed.assign(pl.plan.ring, -1);
  pl.watched.assign(pl.plan.ring, 0);
  for (size_t s = 0; s < pl.plan.ring; ++s) pl.slots.push_back(pool.allocate(pl.plan.slot_bytes));

  try {
    const auto run = [&pl](size_t begin, size_t end) {
      for (size_t i = begin; i < end; ++i) pl.run();
    };
    if (crew.on_torch_team && pl.plan.threads > 1) {
      run_on_torch_team(pl.plan.threads, 1, run);
    } else {
      threads.parallel_for(pl.plan.threads, 1, run);
    }
  } catch (...) {
    pl.release_events();
    return_staging(pl.slots, pool, stream);
    throw;
  }
  pl.release_events();
  return_staging(pl.slots, pool, stream);
}

SingleBlockTrace last_single_block_trace() { return t_last_trace; }

void set_chunk_timeline(bool on) { g_chunk_timeline.store(on, std::memory_order_relaxed); }

std::vector<ChunkTimelineEntry> last_chunk_timeline() {
  ChunkTimelineRecorder& rec = t_chunk_timeline;
  if (rec.start == nullptr) return {};
  std::vector<ChunkTimelineEntry> out = rec.entries;
  for (size_t c = 0; c < rec.done.size(); ++c) {
    C10_CUDA_CHECK(cudaEventSynchronize(rec.done[c]));
    float ms = 0;
    C10_CUDA_CHECK(cudaEventElapsedTime(&ms, rec.start, rec.done[c]));
    out[c].dma_done_us = static_cast<double>(ms) * 1e3;
  }
  rec.clear();
  return out;
}

uint64_t stolen_pieces() { return g_stolen_pieces.load(std::memory_order_relaxed); }

void set_helper_stall_us(int64_t us) {
  TORCH_CHECK_VALUE(us >= 0 && us <= 10'000'000, "pinxfer._set_helper_stall_us: expected 0 to ",
                    "10^7 microseconds, got ", us);
  g_helper_stall_us.store(us, std::memory_order_relaxed);
}

void caller_staged_copy(const at::Tensor& src, at::Tensor& out, c10::DeviceIndex device,
                        const c10::cuda::CUDAStream& stream, const StagingOptions& options,
                        StepStamps& stamps) {
  const size_t nbytes = src.nbytes();
  TORCH_INTERNAL_ASSERT(nbytes <= kCurrentStreamBytes, "pinxfer: caller_staged_copy of ", nbytes,
                        " bytes");
  PinnedPool& pool = pool_for_node(numa_node_for_device(device));
  std::vector<c10::DataPtr> staging;
  staging.push_back(pool.allocate(nbytes));
  stamps.mark("block");
  {
    Range range("pinxfer::stage");
    stage_copy(static_cast<char*>(staging[0].get()), static_cast<const char*>(src.const_data_ptr()),
               nbytes, small_copy_kind(options.mode, options.cached_tail, nbytes));
  }
  stamps.mark("staged");
  try {
    Range range("pinxfer::h2d");
    C10_CUDA_CHECK(cudaMemcpyAsync(out.data_ptr(), staging[0].get(), nbytes, cudaMemcpyHostToDevice,
                                   stream.stream()));
  } catch (...) {
    return_staging(staging, pool, stream);
    throw;
  }
  stamps.mark("queued");
  return_staging(staging, pool, stream);
  stamps.mark("returned");
}

void direct_copy(const at::Tensor& src, at::Tensor& out, const c10::cuda::CUDAStream& stream) {
  Range range("pinxfer::h2d");
  C10_CUDA_CHECK(cudaMemcpyAsync(out.data_ptr(), src.const_data_ptr(), src.nbytes(),
                                 cudaMemcpyHostToDevice, stream.stream()));
  // After the copy: keep_until_done's event must follow it. If recording fails, nothing
  // keeps the source while the queued copy reads it, and the caller may free it as soon as
  // the error reaches it: the copy is waited for first (found by review, session 44).
  try {
    record_source_use(src, stream);
  } catch (...) {
    if (cudaStreamSynchronize(stream.stream()) != cudaSuccess) (void)cudaGetLastError();
    throw;
  }
}

void packed_copy(const std::vector<at::Tensor>& srcs, const std::vector<size_t>& offsets,
                 size_t total, at::Tensor& packed, c10::DeviceIndex device,
                 const c10::cuda::CUDAStream& stream, PackSteps& steps) {
  using Clock = std::chrono::steady_clock;
  const int node = numa_node_for_device(device);
  PinnedPool& pool = pool_for_node(node);
  std::vector<c10::DataPtr> staging;
  staging.push_back(pool.allocate(total));
  steps.block_taken = Clock::now();
  char* base = static_cast<char*>(staging[0].get());
  {
    Range range("pinxfer::stage");
    // Small tensors, read by the DMA at once: nontemporal unless overridden.
    const StagePolicy policy = stage_policy(StagingMode::kAuto, -1, 0, [] { return false; });
    auto pack = [&](size_t begin, size_t end) {
      for (size_t i = begin; i < end; ++i) {
        const size_t bytes = srcs[i].nbytes();
        const size_t next = i + 1 < srcs.size() ? offsets[i + 1] : total;
        stage_copy(base + offsets[i], static_cast<const char*>(srcs[i].const_data_ptr()), bytes,
                   policy.kind_for(total, total));
        std::memset(base + offsets[i] + bytes, 0, next - offsets[i] - bytes);
      }
    };
    // Groups of consecutive tensors of at least kMinChunk bytes each: the
    // thread that packs a group's last tensor queues that group's DMA, so the
    // bus starts after the first group rather than after the whole batch.
    std::vector<size_t> group_of(srcs.size());
    std::vector<size_t> group_begin;  // tensor index of each group's first tensor
    for (size_t i = 0; i < srcs.size(); ++i) {
      if (group_begin.empty() || offsets[i] - offsets[group_begin.back()] >= kMinChunk) {
        group_begin.push_back(i);
      }
      group_of[i] = group_begin.size() - 1;
    }
    const size_t groups = group_begin.size();
    auto group_bytes = [&](size_t g) {
      const size_t end = g + 1 < groups ? offsets[group_begin[g + 1]] : total;
      return std::make_pair(offsets[group_begin[g]], end);
    };
    std::unique_ptr<std::atomic<size_t>[]> left(new std::atomic<size_t>[groups]);
    for (size_t g = 0; g < groups; ++g) {
      const size_t end = g + 1 < groups ? group_begin[g + 1] : srcs.size();
      left[g].store(end - group_begin[g], std::memory_order_relaxed);
    }
    const bool serial = total <= kSerialBytes;  // else on the node's copy threads
    auto pack_and_send = [&](size_t begin, size_t end) {
      for (size_t i = begin; i < end; ++i) {
        pack(i, i + 1);
        // acq_rel: the thread that queues the group sees every tensor's bytes.
        if (left[group_of[i]].fetch_sub(1, std::memory_order_acq_rel) != 1) continue;
        const auto [lo, hi] = group_bytes(group_of[i]);
        if (serial && hi == total) steps.staged = Clock::now();
        Range range("pinxfer::h2d");
        // A copy thread's current device may be another GPU (or none yet): a copy queued
        // there would make a context on it (found by review, session 44).
        const c10::cuda::CUDAGuard on_device(device);
        C10_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(packed.data_ptr()) + lo, base + lo,
                                       hi - lo, cudaMemcpyHostToDevice, stream.stream()));
      }
    };
    try {
      if (serial) {
        pack_and_send(0, srcs.size());
      } else {
        // Grain: about 64 KiB of average payload per claim.
        const size_t grain = std::max<size_t>(1, srcs.size() * 64 * kKiB / total);
        ThreadPool& threads = thread_pool_for_node(node);
        host_parallel_for(threads, srcs.size(), grain, grain, pack_and_send,
                          threads.threads_for_copy(total));
      }
    } catch (...) {
      // Groups already queued read the block: it goes back marked by the stream.
      return_staging(staging, pool, stream);
      throw;
    }
  }
  steps.queued = Clock::now();
  return_staging(staging, pool, stream);
  steps.returned = Clock::now();
}

namespace {
thread_local PackTrace t_last_pack_trace;  // last_pack_trace()
}  // namespace

void record_pack_trace(const PackSteps& steps, size_t nbytes, size_t tensors) {
  auto since_entry = [&steps](std::chrono::steady_clock::time_point t) {
    return us_between(steps.entered, t);
  };
  PackTrace trace;
  trace.nbytes = static_cast<int64_t>(nbytes);
  trace.tensors = static_cast<int64_t>(tensors);
  trace.entered_ns =
      std::chrono::duration_cast<std::chrono::nanoseconds>(steps.entered.time_since_epoch())
          .count();
  trace.checked_us = since_entry(steps.checked);
  trace.output_us = since_entry(steps.output_made);
  if (nbytes > 0) {  // else no copy ran
    trace.block_us = since_entry(steps.block_taken);
    if (steps.staged != std::chrono::steady_clock::time_point{}) {
      trace.staged_us = since_entry(steps.staged);
    }
    trace.queued_us = since_entry(steps.queued);
    trace.returned_us = since_entry(steps.returned);
  }
  trace.total_us = since_entry(std::chrono::steady_clock::now());
  t_last_pack_trace = trace;
}

PackTrace last_pack_trace() { return t_last_pack_trace; }

}  // namespace pinxfer::transfer
