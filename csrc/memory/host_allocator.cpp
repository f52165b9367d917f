#include "memory/host_allocator.h"

#include <atomic>
#include <mutex>
#include <vector>

#include <ATen/core/CachingHostAllocator.h>
#if PINXFER_WITH_CUDA
#include <ATen/cuda/MemPool.h>
#endif
#include <c10/util/Exception.h>
#include <torch/version.h>

#include "memory/graph_pools.h"
#include "memory/pinned_pool.h"
#include "memory/placement.h"
#include "memory/pool_registry.h"
#include "runtime/fork.h"

namespace pinxfer {

namespace {

graph_pools::PoolId to_id(c10::MempoolId_t id) {
  return {static_cast<uint64_t>(id.first), static_cast<uint64_t>(id.second)};
}

class PoolHostAllocator final : public at::HostAllocator {
 public:
  c10::DataPtr allocate(size_t n) override;

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  // Called by copy_(non_blocking=True) for every host tensor it copies. A
  // tensor pinned by torch's own allocator before install() is still cached
  // there: pass its copy on, or torch could reuse its block while the copy
  // reads it. Anything else answers false, as torch's own allocator does.
  bool record_event(void* ptr, void* ctx, c10::Stream stream) override;

  // torch.cuda.host_memory_empty_cache() (2.14) and at::getHostAllocator()->empty_cache():
  // released graph pools' memory comes back first, then free segments go.
  void empty_cache() override {
    release_graph_memory();
    for (PinnedPool* pool : all_pools()) pool->release_cached();
    empty_previous_allocator_cache();
  }

  // ---- torch's graph-pool contract (CUDAGraph::capture_begin/capture_end/reset;
  // memory/graph_pools.h has the semantics). The same virtuals in torch 2.11 and 2.14.
  // A pool id made before install() may already count graphs captured on torch's allocator
  // (a `pool=` handle, torch.compile's cudagraph pool): torch then serves the capture, and
  // every later step of it (otherwise the first graph's release, which reaches pinxfer, would
  // give back the second graph's memory while it lives; session 43's note).
  void begin_allocate_to_pool(c10::MempoolId_t pool_id,
                              std::function<bool(c10::Stream)> filter) override;

  // A capture begun before install() was begun on torch's allocator: its end and its
  // release go there too (torch asks whichever allocator is installed at each step; found
  // by review, session 43: pinxfer refused them, failing capture_end, leaking torch's pool).
  void end_allocate_to_pool(c10::MempoolId_t pool_id) override;

  // Called from CUDAGraph::reset(), hence from its destructor: nothing may
  // escape. On a failure the graph's memory stays held (never reused), which
  // is safe, and the warning says so.
  void release_pool(c10::MempoolId_t pool_id) override;

#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 14)
  // ---- history and snapshots (torch >= 2.14: _record_memory_history(...,
  // record_pinned_host_memory=True), torch.cuda.memory._snapshot()). pinxfer
  // records no host allocation traces: recording is refused with a warning
  // (is_history_enabled stays false, so torch gathers no stacks for us), and
  // snapshots list pinxfer's blocks without stacks.
  void record_history(bool enabled, c10::CachingDeviceAllocator::CreateContextFn, size_t,
                      c10::CachingDeviceAllocator::RecordContext, bool) override {
    if (enabled) {
      TORCH_WARN_ONCE("pinxfer's host allocator (pinxfer.install()) does not record pinned "
                      "allocation history: host traces stay empty and host segments carry no "
                      "stacks. Device history is recorded as usual; call pinxfer.uninstall() "
                      "to record host history with torch's own allocator.");
    }
  }
  bool is_history_enabled() const override { return false; }
  std::vector<at::HostSegmentInfo> get_segments() override;
  std::vector<c10::CachingDeviceAllocator::TraceEntry> get_traces() override { return {}; }
  // Memory pinned outside any allocator (cudaHostRegister by hand) is only
  // traced by an allocator that records history; pinxfer records none.
  void record_external_register(void*, size_t) override {}
  void record_external_unregister(void*) override {}
#endif

  at::HostStats get_stats() override {
    PoolStats sum;
    for (PinnedPool* pool : all_pools()) sum += pool->stats();
    at::HostStats out;
    out.active_requests.current = sum.active_blocks.current;
    out.active_requests.peak = sum.active_blocks.peak;
    out.active_bytes.current = sum.allocated_bytes.current;
    out.active_bytes.peak = sum.allocated_bytes.peak;
    out.allocations.current = sum.segments.current;
    out.allocations.peak = sum.segments.peak;
    out.allocated_bytes.current = sum.reserved_bytes.current;
    out.allocated_bytes.peak = sum.reserved_bytes.peak;
    out.num_host_alloc = sum.num_segment_maps;
    out.num_host_free = sum.num_segment_unmaps;
    // What torch's Stat keeps as `allocated`/`freed`: requests, bytes handed out and given
    // back, segments and their bytes, and the time to pin a segment (mapping, touching,
    // locking: what cudaHostAlloc does for torch) or to unpin one, in microseconds.
    out.active_requests.allocated = sum.num_allocs;
    out.active_requests.freed = sum.num_frees;
    out.active_bytes.allocated = sum.allocated_bytes.gained;
    out.active_bytes.freed = sum.allocated_bytes.lost;
    out.allocations.allocated = sum.num_segment_maps;
    out.allocations.freed = sum.num_segment_unmaps;
    out.allocated_bytes.allocated = sum.reserved_bytes.gained;
    out.allocated_bytes.freed = sum.reserved_bytes.lost;
    out.host_alloc_time.total = (sum.map_time_ns + sum.touch_time_ns + sum.lock_time_ns) / 1000;
    out.host_alloc_time.count = sum.num_segment_maps;
    out.host_free_time.total = sum.unpin_time_ns / 1000;
    out.host_free_time.count = sum.num_segment_unmaps;
    return out;
  }

  void reset_accumulated_stats() override {
    for (PinnedPool* pool : all_pools()) pool->reset_accumulated_stats();
  }

  void reset_peak_stats() override {
    for (PinnedPool* pool : all_pools()) pool->reset_peak_stats();
  }
};

// Above torch's own registration (priority 0); setHostAllocator replaces
// when the new priority is >= the current one, so we restore torch's at ours.
constexpr uint8_t kPriority = 64;
// Leaked, and made anew in a forked child: a parent thread inside install() at fork() would
// otherwise leave it locked there for good (review, session 44).
std::mutex* g_install_mutex = new std::mutex();
void install_mutex_child_after_fork() { g_install_mutex = new std::mutex(); }
struct InstallForkHandler {
  InstallForkHandler() {
    register_fork_child_handler(ForkChildStep::kHostAllocator, &install_mutex_child_after_fork);
  }
} g_install_fork_handler;
// Written under g_install_mutex, read lock-free by record_event.
std::atomic<at::HostAllocator*> g_torch_allocator{nullptr};
std::atomic<bool> g_installed{false};

// torch makes graph pool ids from two counters that only grow (at::cuda::MemPool::
// graph_pool_handle: {n, 0} for a graph's own pool, {0, n} for a handle). The first ids made
// after the latest install(): anything below was made before it. Written under
// g_install_mutex before g_installed; read by captures begun while installed.
std::atomic<uint64_t> g_first_graph_id_after_install{0};
std::atomic<uint64_t> g_first_handle_id_after_install{0};

bool made_before_install(c10::MempoolId_t id) {
  return id.first != 0 ? id.first < g_first_graph_id_after_install.load()
                       : id.second < g_first_handle_id_after_install.load();
}

c10::DataPtr PoolHostAllocator::allocate(size_t n) {
  // The one pool id pinxfer compares here is its sentinel; the lookup is one atomic load
  // unless a capture is open.
  if (graph_pools::pool_for_current_stream() == graph_pools::kServedElsewhere) {
    return g_torch_allocator.load()->allocate(n);
  }
  return pool_for_node(numa_node_for_current_device()).allocate(n);
}

void PoolHostAllocator::begin_allocate_to_pool(c10::MempoolId_t pool_id,
                                               std::function<bool(c10::Stream)> filter) {
  // uninstall() holds this lock across its checks and the swap: a capture torch began on
  // pinxfer just before it would otherwise register here after the checks and end on
  // torch's allocator, open in pinxfer's registry for good (found by review, session 44).
  std::lock_guard<std::mutex> no_uninstall(*g_install_mutex);
  at::HostAllocator* previous = g_torch_allocator.load();
  if (!g_installed.load() && previous != nullptr) {
    previous->begin_allocate_to_pool(pool_id, std::move(filter));  // uninstalled meanwhile
    return;
  }
  if (previous == nullptr || !made_before_install(pool_id)) {
    graph_pools::begin_allocate_to_pool(to_id(pool_id), std::move(filter), cuda::current_device());
    return;
  }
  previous->begin_allocate_to_pool(pool_id, filter);
  try {
    graph_pools::begin_capture_served_elsewhere(to_id(pool_id), std::move(filter));
  } catch (...) {
    // The capture does not begin: it has no end, and its graph no release (CUDAGraph counts
    // the pool as its own only once the begin returns). torch's begin counted a use.
    previous->end_allocate_to_pool(pool_id);
    previous->release_pool(pool_id);
    throw;
  }
}

void PoolHostAllocator::end_allocate_to_pool(c10::MempoolId_t pool_id) {
  if (graph_pools::end_allocate_to_pool(to_id(pool_id))) return;
  at::HostAllocator* previous = g_torch_allocator.load();
  TORCH_CHECK(previous != nullptr, "pinxfer: end_allocate_to_pool: graph pool (", pool_id.first,
              ", ", pool_id.second,
              ") is not being allocated to (no begin_allocate_to_pool without an end)");
  previous->end_allocate_to_pool(pool_id);
}

void PoolHostAllocator::release_pool(c10::MempoolId_t pool_id) {
  try {
    if (graph_pools::release_pool(to_id(pool_id))) {
      release_graph_memory();
    } else if (at::HostAllocator* previous = g_torch_allocator.load()) {
      previous->release_pool(pool_id);
    }
  } catch (const std::exception& e) {
    TORCH_WARN("pinxfer: could not give back the pinned memory of CUDA graph pool (", pool_id.first,
               ", ", pool_id.second, "): ", e.what(),
               ". That memory stays out of the cache (no copy can read reused memory); "
               "pinxfer.empty_cache() tries again.");
  }
}

bool PoolHostAllocator::record_event(void* ptr, void* ctx, c10::Stream stream) {
  if (PinnedPool* pool = PinnedPool::owner_of(ctx)) {
    if (pool->record_stream(ctx, stream)) return true;
  }
  at::HostAllocator* previous = g_torch_allocator.load();
  return previous != nullptr && previous->record_event(ptr, ctx, stream);
}

#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 14)
std::vector<at::HostSegmentInfo> PoolHostAllocator::get_segments() {
  std::vector<at::HostSegmentInfo> out;
  for (PinnedPool* pool : all_pools()) {
    for (const PinnedPool::BlockInfo& b : pool->block_infos()) {
      at::HostSegmentInfo seg;
      seg.address = b.address;
      seg.size = b.size;
      seg.allocated = b.live;
      seg.active = b.live || b.waiting;
      seg.owner_private_pool_id = {b.graph.first, b.graph.second};
      out.push_back(std::move(seg));
    }
  }
  return out;
}
#endif

}  // namespace

bool install_host_allocator(bool enable) {
#if PINXFER_WITH_CUDA
  static PoolHostAllocator* ours = new PoolHostAllocator();  // leaked: lives past exit
  std::lock_guard<std::mutex> lock(*g_install_mutex);
  if (enable == g_installed.load()) return true;
  if (enable) {
    at::HostAllocator* current = at::getHostAllocator(at::kCUDA);
    // Before torch can ask pinxfer to begin a capture. Taking an id of each kind moves torch's
    // counters on by one: harmless, ids are not dense.
    g_first_graph_id_after_install = at::cuda::MemPool::graph_pool_handle(false).first;
    g_first_handle_id_after_install = at::cuda::MemPool::graph_pool_handle(true).second;
    at::setHostAllocator(at::kCUDA, ours, kPriority);
    // torch keeps an allocator registered at a higher priority without a word: pinxfer would
    // then think itself installed and stop fencing frees, while torch reported every copy to
    // the other allocator (found by review, session 43).
    TORCH_CHECK(at::getHostAllocator(at::kCUDA) == ours,
                "pinxfer.install(): torch kept its current CUDA host allocator, which another "
                "library registered at a priority above pinxfer's (",
                static_cast<int>(kPriority),
                "); pinxfer is not installed and its pool works as without install(). Drop "
                "the other library's host allocator to install pinxfer's.");
    if (g_torch_allocator.load() == nullptr) g_torch_allocator = current;
  } else {
    // A CUDA graph calls release_pool on the host allocator installed when it
    // is destroyed, not on the one that served its capture: torch's own would
    // look its pool up, fail (std::out_of_range in a destructor) and abort the
    // process. So pinxfer stays installed while one of its graph pools lives.
    // A capture torch's allocator serves for pinxfer (begin_capture_served_elsewhere) would
    // end on torch's directly and stay open in pinxfer's registry.
    TORCH_CHECK(!graph_pools::any_capture_open(),
                "pinxfer.uninstall(): a CUDA graph capture is open; end it first.");
    const size_t live = graph_pools::live_pools();
    TORCH_CHECK(live == 0, "pinxfer.uninstall(): ", live,
                " CUDA graph pool(s) captured while "
                "pinxfer was installed are still alive; their graphs will give them back to "
                "whichever host allocator is installed when they are destroyed, and torch's "
                "own does not know them (it would abort the process). Delete those graphs "
                "first (CUDAGraph objects, make_graphed_callables results; for "
                "torch.compile(mode='reduce-overhead') call torch._dynamo.reset()), run "
                "gc.collect(), then uninstall.");
    at::setHostAllocator(at::kCUDA, g_torch_allocator.load(), kPriority);
    if (at::getHostAllocator(at::kCUDA) != g_torch_allocator.load()) {
      TORCH_WARN("pinxfer.uninstall(): torch kept a CUDA host allocator registered since "
                 "install() at a priority above pinxfer's; it stays torch's host allocator.");
    }
  }
  // Installed, torch's copy_(non_blocking=True) reports every copy from our
  // blocks through record_event, so a free without recorded uses needs no fence.
  PinnedPool::set_fence_unrecorded_frees(!enable);
  g_installed.store(enable);
  return true;
#else
  return false;
#endif
}

bool host_allocator_installed() { return g_installed.load(); }

void empty_previous_allocator_cache() {
#if PINXFER_WITH_CUDA
  // Not in a forked child (no CUDA there: torch's allocator would query the parent's events).
  if (!g_installed.load() || !cuda::cuda_usable()) return;
  at::HostAllocator* previous = g_torch_allocator.load();
  if (previous == nullptr) return;
  const auto no_capture = graph_pools::hold_off_captures_to_unmap();
  if (no_capture.owns_lock()) previous->empty_cache();
#endif
}

#if PINXFER_WITH_CUDA
namespace {
class RivalHostAllocator final : public at::HostAllocator {
 public:
  explicit RivalHostAllocator(at::HostAllocator* inner) : inner_(inner) {}
  c10::DataPtr allocate(size_t n) override { return inner_->allocate(n); }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    inner_->copy_data(dest, src, count);
  }
  bool record_event(void* ptr, void* ctx, c10::Stream stream) override {
    return inner_->record_event(ptr, ctx, stream);
  }
  void empty_cache() override { inner_->empty_cache(); }
  at::HostStats get_stats() override { return inner_->get_stats(); }
  void reset_accumulated_stats() override { inner_->reset_accumulated_stats(); }
  void reset_peak_stats() override { inner_->reset_peak_stats(); }

 private:
  at::HostAllocator* inner_;
};
}  // namespace
#endif

bool register_rival_host_allocator_for_tests(int priority) {
#if PINXFER_WITH_CUDA
  TORCH_CHECK_VALUE(priority >= 0 && priority <= 255,
                    "_register_rival_host_allocator: priority must be 0 to 255, got ", priority);
  auto* rival = new RivalHostAllocator(at::getHostAllocator(at::kCUDA));  // leaked: for good
  at::setHostAllocator(at::kCUDA, rival, static_cast<uint8_t>(priority));
  return at::getHostAllocator(at::kCUDA) == rival;
#else
  return false;
#endif
}

}  // namespace pinxfer
