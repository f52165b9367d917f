// Host -> device transfers: to_device (one tensor, chunked pipeline through a
// pinned ring) and to_device_many (many small tensors, one packed copy).
// Schemas in csrc/module.cpp, section "transfers"; Python in pinxfer/transfer.py.
//
// Streams. Every copy runs on a dedicated per-device copy stream (created
// once, non-blocking; not from c10's pool, whose streams torch.cuda.Stream()
// also hands out), never on the caller's current stream `cur`, so H2D overlaps
// the kernels queued on `cur`:
//   1. the output is allocated by the caching allocator *on the copy stream*:
//      its memory was last used by work ordered on that stream, so the copy
//      never waits for `cur` (which may be busy with a long step);
//   2. at the end `cur` waits on an event recorded after the last copy, so any
//      later use of the result on `cur` is ordered after the copy (that is what
//      makes non_blocking results safe to use without further syncs);
//   3. the output is record_stream'ed on `cur` (the caller uses it there): when
//      it is freed, the allocator hands its memory to the next copy only after
//      `cur` has passed the work queued on it so far.
// If we throw after queueing copies, the output is simply dropped: its memory
// goes back to the copy stream's pool, where any later use is stream-ordered
// after the copies already queued.
//
// Staging memory comes from pinxfer's pool for the device's NUMA node, a fresh
// set of blocks per call (the pool caches them: a second call is a cache hit).
// Before a block goes back to the pool it is marked as used by the copy stream,
// so the pool fences it with an event and never hands it out while a copy may
// still read it.
//
// The pipeline (pageable source). The tensor is cut into chunks: steady ones
// of at most chunk_bytes in the middle, halving down to 256 KiB at both ends so
// the first DMA starts early and the last one, which overlaps nothing, is short
// (chunk_bounds). A tensor that fits num_buffers x chunk_bytes is staged in one
// block, each chunk at its own offset; a larger one in a ring, chunk c in slot
// c % ring. Chunks are cut into pieces, about one per thread; the host threads
// of the node's ThreadPool claim pieces in order and copy each into staging
// (nontemporal or cached stores, see StageCopy). The thread that finishes the
// last piece of a chunk queues its cudaMemcpyAsync (and, in a ring, records the
// slot's event). A thread about to write into a ring slot first waits until the
// slot's previous chunk has been queued and then synchronizes its event: a
// staging slot is never refilled while its previous copy may still read it.
// Claims are in order and each claimed piece is finished by its claimer, so the
// waits only point backwards and cannot deadlock.
#include <ATen/ATen.h>
#include <ATen/core/CachingHostAllocator.h>
#include <ATen/record_function.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <nvtx3/nvToolsExt.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "memory/pinned_pool.h"
#include "memory/placement.h"
#include "runtime/cuda_runtime.h"
#include "runtime/thread_pool.h"

namespace pinxfer::ops {

namespace {

constexpr size_t kKiB = size_t{1} << 10;
constexpr size_t kMiB = size_t{1} << 20;
// Below this a transfer is one chunk copied by the calling thread: waking the
// pool's workers costs more than the copy.
constexpr size_t kSerialBytes = 256 * kKiB;
// Smallest chunk the pipeline cuts a large tensor into, and smallest piece a
// thread copies; both keep per-copy and per-claim overheads under a few %.
constexpr size_t kMinChunk = 1 * kMiB;
constexpr size_t kMinPiece = 64 * kKiB;
// First (and last) chunk of a pipelined transfer: a few microseconds of
// staging before the first DMA starts, and as little after the last one.
constexpr size_t kFirstChunk = 256 * kKiB;
// Offsets inside to_device_many's packed buffer: enough for every dtype's
// alignment and for vectorised kernels reading the views.
constexpr size_t kPackAlign = 256;

size_t round_up(size_t n, size_t m) { return (n + m - 1) / m * m; }

// A profiler range (torch.profiler, on the calling thread) and an NVTX range
// (nsys, on every thread) with one name.
class Range {
 public:
  explicit Range(const char* name) : record_(at::RecordScope::USER_SCOPE) {
    if (record_.isActive()) record_.before(name);
    nvtxRangePushA(name);
  }
  ~Range() { nvtxRangePop(); }
  Range(const Range&) = delete;
  Range& operator=(const Range&) = delete;

 private:
  at::RecordFunction record_;
};

// How pageable bytes are copied into staging memory. Measured on the H200 host
// (16 vCPUs, 2 MiB L2 per core, 300 MiB L3; benchmarks/sweep_to_device.py, the
// figures in benchmarks/results/h200/sweep.json):
//  * nontemporal stores: lines go straight to DRAM and the DMA engine reads
//    them there at once. Lowest latency: 8 MiB 31 GB/s against 15 for cached
//    stores. But with the DMA reading DRAM too they top out near 43 GB/s.
//  * cached stores (rep movsb): faster for long streams (1 GiB 53 GB/s), but a
//    DMA read of a line still dirty in a core's L2 is slow, and the last lines
//    staged are read at once: that final drain is on the critical path.
// So each chunk is staged with cached stores if at least `cached_tail` bytes
// (16 MiB) are staged after it, nontemporal otherwise: an 8 MiB tensor is all
// nontemporal, 1 GiB almost all cached. When the copy stream is still busy
// with earlier transfers (batches sent back to back, as by prefetch), the
// next transfer's staging hides the drain, so a tensor of >= 32 MiB is then
// staged all cached. PINXFER_STAGE_COPY=nt|movsb forces one kind and
// PINXFER_CACHED_TAIL sets the tail (benchmarks).
enum class StageCopy { kNontemporal, kCached };

struct StagePolicy {
  size_t cached_tail = 16 * kMiB;  // SIZE_MAX: never cached; 0: always
  StageCopy kind_for(size_t end, size_t nbytes) const {
    return nbytes - end >= cached_tail ? StageCopy::kCached : StageCopy::kNontemporal;
  }
};

constexpr size_t kStreamingCachedMinBytes = 32 * kMiB;

StagePolicy stage_policy(size_t nbytes, const c10::cuda::CUDAStream& copy_stream) {
  StagePolicy policy;
  const char* env = std::getenv("PINXFER_STAGE_COPY");
  if (env != nullptr && *env != '\0') {
    if (std::strcmp(env, "nt") == 0) {
      policy.cached_tail = SIZE_MAX;
    } else if (std::strcmp(env, "movsb") == 0) {
      policy.cached_tail = 0;
    } else {
      TORCH_CHECK(false, "PINXFER_STAGE_COPY: expected 'nt' or 'movsb', got '", env,
                  "'. Unset it to let pinxfer choose per chunk.");
    }
    return policy;
  }
  if (const char* tail = std::getenv("PINXFER_CACHED_TAIL")) {
    policy.cached_tail = static_cast<size_t>(std::atoll(tail));
    return policy;
  }
  if (nbytes >= kStreamingCachedMinBytes) {
    const cudaError_t busy = cudaStreamQuery(copy_stream.stream());
    if (busy == cudaErrorNotReady) {
      policy.cached_tail = 0;
    } else {
      C10_CUDA_CHECK(busy);
    }
  }
  return policy;
}

#if defined(__x86_64__)
bool has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2");
  return yes;
}

// n a multiple of 128, dst 32-byte aligned.
__attribute__((target("avx2"))) void stream_avx2(char* dst, const char* src, size_t n) {
  for (size_t i = 0; i < n; i += 128) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 32));
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 64));
    const __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 96));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 32), b);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 64), c);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 96), d);
  }
}

// n a multiple of 64, dst 16-byte aligned.
void stream_sse2(char* dst, const char* src, size_t n) {
  for (size_t i = 0; i < n; i += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
    const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
  }
}
#endif

// Copies pageable bytes into staging memory the CPU will not read again (see
// StageCopy above). After nontemporal stores the sfence makes them visible
// before the caller publishes "piece done" to the thread that queues the DMA.
void stage_copy(char* dst, const char* src, size_t n, StageCopy kind) {
#if defined(__x86_64__)
  if (kind == StageCopy::kCached) {
    // Fast-strings microcode picks the widest stores and skips the read for
    // ownership of whole destination lines.
    asm volatile("rep movsb" : "+D"(dst), "+S"(src), "+c"(n) : : "memory");
    return;
  }
  if (n >= 4096) {
    // Align the destination to 32 bytes with a short memcpy head.
    const size_t head = (32 - (reinterpret_cast<uintptr_t>(dst) & 31)) & 31;
    std::memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    const size_t body = n & ~size_t{127};
    if (has_avx2()) {
      stream_avx2(dst, src, body);
    } else {
      stream_sse2(dst, src, body);
    }
    std::memcpy(dst + body, src + body, n - body);
    _mm_sfence();
    return;
  }
#endif
  (void)kind;
  std::memcpy(dst, src, n);
}

void check_cuda_usable(const char* op) {
  TORCH_CHECK(cuda::cuda_usable(), "pinxfer.", op,
              ": expected a usable CUDA device, but CUDA is not usable in this process (no "
              "device, PINXFER_DISABLE_CUDA=1, or a forked child such as a DataLoader worker). "
              "Call it from the main process of a machine with a GPU.");
}

c10::DeviceIndex resolve_device(const c10::Device& device, const char* op) {
  TORCH_CHECK(device.is_cuda(), "pinxfer.", op, ": expected a CUDA device, got ", device,
              ". For a CPU target use tensor.to('cpu').");
  const c10::DeviceIndex index = device.has_index() ? device.index() : c10::cuda::current_device();
  TORCH_CHECK(index >= 0 && index < c10::cuda::device_count(), "pinxfer.", op,
              ": device index ", static_cast<int>(index), " is out of range: this process sees ",
              static_cast<int>(c10::cuda::device_count()), " CUDA device(s)");
  return index;
}

// Makes `waiter` wait for the work queued on `signaller` so far.
void stream_wait(const c10::cuda::CUDAStream& waiter, const c10::cuda::CUDAStream& signaller) {
  const cuda::Event ev = cuda::record_event(signaller.unwrap());
  const cudaError_t err =
      cudaStreamWaitEvent(waiter.stream(), static_cast<cudaEvent_t>(ev.handle), 0);
  // The wait captured the event's state; the event may be recycled now.
  cuda::release_event(ev);
  C10_CUDA_CHECK(err);
}

// The dedicated H2D stream of each device, created on first use. Not taken
// from c10's stream pool: torch.cuda.Stream() hands out those same streams, so
// a user's compute stream could turn out to be our copy stream.
c10::cuda::CUDAStream copy_stream_for(c10::DeviceIndex device) {
  static std::mutex mutex;
  // Leaked, as are the streams: they outlive every caller, including at exit.
  static auto* streams = new std::vector<cudaStream_t>();  // LOCK: mutex
  std::lock_guard<std::mutex> lock(mutex);
  if (static_cast<size_t>(device) >= streams->size()) streams->resize(device + 1, nullptr);
  cudaStream_t& slot = (*streams)[device];
  if (slot == nullptr) {
    c10::cuda::CUDAGuard guard(device);
    // Non-blocking: no implicit synchronisation with the legacy default stream.
    C10_CUDA_CHECK(cudaStreamCreateWithFlags(&slot, cudaStreamNonBlocking));
  }
  return c10::cuda::getStreamFromExternal(slot, device);
}

// The output of a transfer, allocated on the copy stream (see the note above).
at::Tensor empty_on_stream(at::IntArrayRef sizes, at::TensorOptions options,
                           const c10::cuda::CUDAStream& stream) {
  c10::cuda::CUDAStreamGuard guard(stream);
  return at::empty(sizes, options);
}

// Makes `cur` wait for the copies and keeps `out`'s memory from the next copy
// until `cur` is done with it.
void hand_over(const at::Tensor& out, const c10::cuda::CUDAStream& copy,
               const c10::cuda::CUDAStream& cur) {
  stream_wait(cur, copy);
  if (cur != copy) c10::cuda::CUDACachingAllocator::recordStream(out.storage().data_ptr(), cur);
}

// Sources pinned by neither pinxfer's pool nor torch's host allocator (e.g.
// memory registered by hand): nobody else knows a copy reads them, so we hold a
// reference to their storage until an event after the copy has completed.
struct KeptStorage {
  cuda::Event event;
  c10::Storage storage;
};
std::mutex g_kept_mutex;
std::deque<KeptStorage>* g_kept = new std::deque<KeptStorage>();  // LOCK: g_kept_mutex

void release_finished_kept() {
  std::vector<c10::Storage> drop;  // destroyed outside the lock
  std::lock_guard<std::mutex> lock(g_kept_mutex);
  while (!g_kept->empty()) {
    std::string error;
    if (!cuda::event_done(g_kept->front().event, &error)) break;
    if (!error.empty()) break;  // cannot prove the copy finished: keep holding
    cuda::release_event(g_kept->front().event);
    drop.push_back(std::move(g_kept->front().storage));
    g_kept->pop_front();
  }
}

// Tells whoever owns a pinned source's memory that `stream` reads it.
void record_source_use(const at::Tensor& src, const c10::cuda::CUDAStream& stream) {
  const c10::DataPtr& data = src.storage().data_ptr();
  if (PinnedPool* pool = PinnedPool::owner_of(data.get_context())) {
    pool->record_stream(data.get_context(), stream.unwrap());
    return;
  }
  if (at::getHostAllocator(at::kCUDA)->record_event(data.get(), data.get_context(),
                                                    stream.unwrap())) {
    return;
  }
  KeptStorage kept{cuda::record_event(stream.unwrap()), src.storage()};
  std::lock_guard<std::mutex> lock(g_kept_mutex);
  g_kept->push_back(std::move(kept));
}

// True if the DMA engine can read the tensor's memory directly.
bool is_dma_pinned(const at::Tensor& src) {
  void* ctx = src.storage().data_ptr().get_context();
  if (PinnedPool* pool = PinnedPool::owner_of(ctx)) {
    return pool->lock_kind_of(ctx) == LockKind::kCudaRegistered;
  }
  return cuda::is_cuda_pinned(src.data_ptr());
}

// A CPU tensor whose bytes are the values: conjugate/negative views resolved,
// contiguous. Non-contiguous inputs therefore cost one extra host pass here;
// the result on the device is contiguous.
at::Tensor dense_source(const at::Tensor& t, const char* op) {
  TORCH_CHECK(t.device().is_cpu(), "pinxfer.", op, ": expected CPU tensors, got one on ",
              t.device(), ". Tensors already on a GPU need no staging: use tensor.to(device).");
  TORCH_CHECK(t.layout() == at::kStrided && !t.is_quantized(), "pinxfer.", op,
              ": expected dense (strided, non-quantized) tensors, got layout ", t.layout(),
              " dtype ", t.scalar_type(), ". Use tensor.to(device) for these.");
  return t.resolve_conj().resolve_neg().contiguous();
}

// The chunk boundaries of a transfer of nbytes: offsets 0 = b[0] < b[1] < ...
// < b[k] = nbytes. Chunks in the middle are `steady` bytes; towards both ends
// they halve down to `first` bytes. A small first chunk lets the DMA start
// after a few microseconds of staging; a small last chunk keeps short the copy
// that overlaps no staging. Every boundary but the last is a multiple of 4 KiB.
std::vector<size_t> chunk_bounds(size_t nbytes, size_t steady, size_t first) {
  const size_t aligned = nbytes / (4 * kKiB) * (4 * kKiB);
  first = std::min(first, steady);
  std::vector<size_t> head, tail;  // chunk sizes from the front, and from the back
  size_t left = aligned, front = first, back = first;
  while (left > 0) {
    head.push_back(std::min(front, left));
    left -= head.back();
    front = std::min(front * 2, steady);
    if (left == 0) break;
    tail.push_back(std::min(back, left));
    left -= tail.back();
    back = std::min(back * 2, steady);
  }
  std::vector<size_t> bounds{0};
  for (size_t len : head) bounds.push_back(bounds.back() + len);
  for (auto it = tail.rbegin(); it != tail.rend(); ++it) bounds.push_back(bounds.back() + *it);
  if (nbytes > aligned) {
    if (bounds.size() == 1) bounds.push_back(nbytes);
    else bounds.back() = nbytes;  // the sub-4 KiB tail joins the last chunk
  }
  return bounds;
}

// Shared state of one pipelined transfer; lives on the caller's stack for the
// duration of the parallel_for.
//
// Staging. If the whole tensor fits the ring's budget (num_buffers x
// chunk_bytes) it is staged in one pinned block, chunk c at its own offset, and
// no thread ever waits for a DMA. Otherwise chunk c goes to slot c % ring of a
// ring of `ring` blocks, and overwriting a slot waits for the copy of the chunk
// staged there before (wait_slot_free).
struct Pipeline {
  const char* src = nullptr;
  char* dst = nullptr;
  size_t nbytes = 0;
  std::vector<size_t> bounds;   // chunk c is [bounds[c], bounds[c + 1])
  struct Piece {
    size_t chunk, begin, end;
  };
  std::vector<Piece> pieces;    // in chunk order: claimed front to back
  size_t num_chunks = 0;
  size_t ring = 0;              // staging slots; 0: one block for the whole tensor
  size_t slot_bytes = 0;        // capacity of each ring slot
  StagePolicy policy;
  c10::DeviceIndex device = 0;
  c10::cuda::CUDAStream stream;
  std::vector<c10::DataPtr> slots;                 // the staging block(s)
  std::unique_ptr<std::atomic<size_t>[]> left;     // pieces of each chunk not yet copied
  std::atomic<size_t> next_piece{0};
  std::atomic<bool> failed{false};

  std::mutex mutex;
  std::condition_variable queued_cv;
  std::vector<int64_t> queued;        // last chunk queued from each slot, -1: none. LOCK: mutex
  std::vector<cuda::Event> events;    // event after that chunk's copy. LOCK: mutex

  explicit Pipeline(c10::cuda::CUDAStream s) : stream(s) {}

  // Where chunk c is staged.
  char* staging_of(size_t c) const {
    if (ring == 0) return static_cast<char*>(slots[0].get()) + bounds[c];
    return static_cast<char*>(slots[c % ring].get());
  }

  // Blocks until ring slot c % ring may be overwritten with chunk c (c >= ring).
  // Returns false if the transfer failed meanwhile.
  bool wait_slot_free(size_t c) {
    const size_t slot = c % ring;
    cuda::Event ev;
    {
      std::unique_lock<std::mutex> lock(mutex);
      const int64_t previous = static_cast<int64_t>(c - ring);
      queued_cv.wait(lock, [&] { return failed.load() || queued[slot] >= previous; });
      if (failed.load()) return false;
      // The slot's event is replaced only when chunk c is queued, which needs
      // this piece first: the handle stays valid while we wait on it.
      ev = events[slot];
    }
    cuda::event_synchronize(ev);
    return true;
  }

  void queue_chunk(size_t c) {
    const size_t len = bounds[c + 1] - bounds[c];
    Range range("pinxfer::h2d");
    C10_CUDA_CHECK(cudaMemcpyAsync(dst + bounds[c], staging_of(c), len, cudaMemcpyHostToDevice,
                                   stream.stream()));
    if (ring == 0) return;  // nobody waits for single-block chunks
    const cuda::Event ev = cuda::record_event(stream.unwrap());
    const size_t slot = c % ring;
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

  void copy_piece(const Piece& p) {
    TORCH_INTERNAL_ASSERT(ring == 0 || p.end - bounds[p.chunk] <= slot_bytes,
                          "pinxfer: staging chunk larger than its ring slot");
    if (ring != 0 && p.chunk >= ring && !wait_slot_free(p.chunk)) return;
    {
      Range range("pinxfer::stage");
      stage_copy(staging_of(p.chunk) + (p.begin - bounds[p.chunk]), src + p.begin,
                 p.end - p.begin, policy.kind_for(bounds[p.chunk + 1], nbytes));
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
        if (p >= pieces.size()) return;
        copy_piece(pieces[p]);
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

// Hands staging blocks back to the pool, marked as read by `stream`, so the
// pool reuses them only after the copies queued so far have finished.
void return_staging(std::vector<c10::DataPtr>& blocks, PinnedPool& pool,
                    const c10::cuda::CUDAStream& stream) {
  for (auto& b : blocks) {
    if (b.get_context()) pool.record_stream(b.get_context(), stream.unwrap());
  }
  blocks.clear();
}

// Steady chunk size for a tensor of nbytes: at most chunk_bytes, and about a
// sixteenth of the tensor so that a tensor is cut into enough chunks to
// pipeline; but >= 1 MiB, so each DMA is long next to its launch gap.
// A multiple of 4 KiB (chunk_bytes is rounded down), as chunk_bounds expects.
size_t steady_chunk(size_t nbytes, size_t chunk_bytes) {
  const size_t sixteenth = round_up((nbytes + 15) / 16, 64 * kKiB);
  return std::min(chunk_bytes / (4 * kKiB) * (4 * kKiB), std::max(kMinChunk, sixteenth));
}

void pipelined_copy(const at::Tensor& src, at::Tensor& out, c10::DeviceIndex device,
                    const c10::cuda::CUDAStream& stream, size_t chunk_bytes, size_t num_buffers) {
  const int node = numa_node_for_device(device);
  PinnedPool& pool = pool_for_node(node);
  ThreadPool& threads = thread_pool_for_node(node);

  Pipeline pl(stream);
  pl.src = static_cast<const char*>(src.const_data_ptr());
  pl.dst = static_cast<char*>(out.data_ptr());
  pl.nbytes = src.nbytes();
  const bool serial = pl.nbytes <= kSerialBytes;
  const size_t steady = serial ? pl.nbytes : steady_chunk(pl.nbytes, chunk_bytes);
  pl.bounds = serial ? std::vector<size_t>{0, pl.nbytes}
                     : chunk_bounds(pl.nbytes, steady, kFirstChunk);
  pl.num_chunks = pl.bounds.size() - 1;
  const bool one_block = pl.nbytes <= chunk_bytes * num_buffers || pl.num_chunks <= num_buffers;
  pl.ring = one_block ? 0 : num_buffers;
  const size_t num_threads = serial ? 1 : static_cast<size_t>(threads.num_threads());
  // About one piece per thread per chunk, so all threads fill a chunk together
  // and its DMA starts as early as possible.
  for (size_t c = 0; c < pl.num_chunks; ++c) {
    const size_t begin = pl.bounds[c], end = pl.bounds[c + 1];
    const size_t piece =
        std::max(kMinPiece, round_up((end - begin + num_threads - 1) / num_threads, 4 * kKiB));
    for (size_t b = begin; b < end; b += piece) pl.pieces.push_back({c, b, std::min(end, b + piece)});
  }
  pl.policy = stage_policy(pl.nbytes, stream);
  pl.device = device;
  pl.left.reset(new std::atomic<size_t>[pl.num_chunks]);
  for (size_t c = 0; c < pl.num_chunks; ++c) pl.left[c].store(0);
  for (const auto& p : pl.pieces) pl.left[p.chunk].fetch_add(1, std::memory_order_relaxed);
  if (one_block) {
    pl.slots.push_back(pool.allocate(pl.nbytes));
  } else {
    pl.queued.assign(pl.ring, -1);
    pl.events.assign(pl.ring, cuda::Event{});
    // A slot holds the longest chunk: not always `steady`, since the sub-4 KiB
    // end of the tensor joins the last chunk, and a small chunk_bytes makes the
    // ramp's chunks as long as the steady ones.
    for (size_t c = 0; c < pl.num_chunks; ++c) {
      pl.slot_bytes = std::max(pl.slot_bytes, pl.bounds[c + 1] - pl.bounds[c]);
    }
    for (size_t s = 0; s < pl.ring; ++s) pl.slots.push_back(pool.allocate(pl.slot_bytes));
  }

  const size_t helpers = std::min(num_threads, pl.pieces.size());
  try {
    threads.parallel_for(helpers, 1, [&pl](size_t begin, size_t end) {
      for (size_t i = begin; i < end; ++i) pl.run();
    });
  } catch (...) {
    pl.release_events();
    return_staging(pl.slots, pool, stream);
    throw;
  }
  pl.release_events();
  return_staging(pl.slots, pool, stream);
}

// Copies a whole pinned source with one DMA.
void direct_copy(const at::Tensor& src, at::Tensor& out, const c10::cuda::CUDAStream& stream) {
  Range range("pinxfer::h2d");
  C10_CUDA_CHECK(cudaMemcpyAsync(out.data_ptr(), src.const_data_ptr(), src.nbytes(),
                                 cudaMemcpyHostToDevice, stream.stream()));
  record_source_use(src, stream);
}

at::Tensor to_device(const at::Tensor& self, c10::Device device, int64_t chunk_bytes,
                     int64_t num_buffers) {
  TORCH_CHECK(chunk_bytes >= 4096, "pinxfer.to_device: chunk_bytes must be >= 4096, got ",
              chunk_bytes);
  TORCH_CHECK(num_buffers >= 1, "pinxfer.to_device: num_buffers must be >= 1, got ", num_buffers);
  check_cuda_usable("to_device");
  const c10::DeviceIndex index = resolve_device(device, "to_device");
  c10::cuda::CUDAGuard guard(index);
  release_finished_kept();

  const at::Tensor src = dense_source(self, "to_device");
  const c10::cuda::CUDAStream cur = c10::cuda::getCurrentCUDAStream(index);
  const c10::cuda::CUDAStream copy = copy_stream_for(index);
  at::Tensor out = empty_on_stream(
      src.sizes(), src.options().device(c10::Device(c10::kCUDA, index)), copy);
  if (src.nbytes() == 0) return out;

  if (is_dma_pinned(src)) {
    direct_copy(src, out, copy);
  } else {
    pipelined_copy(src, out, index, copy, static_cast<size_t>(chunk_bytes),
                   static_cast<size_t>(num_buffers));
  }
  hand_over(out, copy, cur);
  return out;
}

std::vector<at::Tensor> to_device_many(at::TensorList tensors, c10::Device device) {
  check_cuda_usable("to_device_many");
  const c10::DeviceIndex index = resolve_device(device, "to_device_many");
  c10::cuda::CUDAGuard guard(index);

  std::vector<at::Tensor> srcs;
  std::vector<size_t> offsets;
  srcs.reserve(tensors.size());
  offsets.reserve(tensors.size());
  size_t total = 0;
  for (const auto& t : tensors) {
    srcs.push_back(dense_source(t, "to_device_many"));
    offsets.push_back(total);
    total = round_up(total + srcs.back().nbytes(), kPackAlign);
  }
  const c10::cuda::CUDAStream cur = c10::cuda::getCurrentCUDAStream(index);
  const c10::cuda::CUDAStream copy = copy_stream_for(index);
  at::Tensor packed = empty_on_stream(
      {static_cast<int64_t>(total)},
      at::TensorOptions().device(c10::Device(c10::kCUDA, index)).dtype(at::kByte), copy);

  if (total > 0) {
    const int node = numa_node_for_device(index);
    PinnedPool& pool = pool_for_node(node);
    std::vector<c10::DataPtr> staging;
    staging.push_back(pool.allocate(total));
    char* base = static_cast<char*>(staging[0].get());
    {
      Range range("pinxfer::stage");
      const StagePolicy policy = stage_policy(0, copy);  // small tensors: nontemporal
      auto pack = [&](size_t begin, size_t end) {
        for (size_t i = begin; i < end; ++i) {
          stage_copy(base + offsets[i], static_cast<const char*>(srcs[i].const_data_ptr()),
                     srcs[i].nbytes(), policy.kind_for(total, total));
        }
      };
      if (total <= kSerialBytes) {
        pack(0, srcs.size());
      } else {
        // Grain: about 64 KiB of average payload per claim.
        const size_t grain = std::max<size_t>(1, srcs.size() * 64 * kKiB / total);
        thread_pool_for_node(node).parallel_for(srcs.size(), grain, pack);
      }
    }
    try {
      Range range("pinxfer::h2d");
      C10_CUDA_CHECK(cudaMemcpyAsync(packed.data_ptr(), base, total, cudaMemcpyHostToDevice,
                                     copy.stream()));
    } catch (...) {
      return_staging(staging, pool, copy);
      throw;
    }
    return_staging(staging, pool, copy);
    hand_over(packed, copy, cur);
  }

  // Views of the packed bytes: aligned byte slices reinterpreted as each dtype.
  std::vector<at::Tensor> out;
  out.reserve(srcs.size());
  for (size_t i = 0; i < srcs.size(); ++i) {
    const auto& s = srcs[i];
    out.push_back(packed.narrow(0, static_cast<int64_t>(offsets[i]),
                                static_cast<int64_t>(s.nbytes()))
                      .view(s.scalar_type())
                      .view(s.sizes()));
  }
  return out;
}

std::vector<int64_t> copy_stream_op(c10::Device device) {
  check_cuda_usable("copy_stream");
  const c10::Stream s = copy_stream_for(resolve_device(device, "copy_stream")).unwrap();
  return {s.id(), static_cast<int64_t>(s.device_index()), static_cast<int64_t>(s.device_type())};
}

}  // namespace

// Both ops take CPU tensors, so they dispatch on the CPU key; the kernels exist
// only in CUDA builds (pinxfer/transfer.py says so in CPU-only builds).
TORCH_LIBRARY_IMPL(pinxfer, CPU, m) {
  m.impl("to_device", &to_device);
  m.impl("to_device_many", &to_device_many);
}

TORCH_LIBRARY_IMPL(pinxfer, CompositeExplicitAutograd, m) {
  m.impl("copy_stream", &copy_stream_op);
}

}  // namespace pinxfer::ops
