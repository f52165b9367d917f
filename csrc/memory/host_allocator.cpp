#include "memory/host_allocator.h"

#include <atomic>
#include <mutex>

#include <ATen/core/CachingHostAllocator.h>

#include "memory/pinned_pool.h"
#include "memory/placement.h"
#include "memory/pool_registry.h"

namespace pinxfer {

namespace {

class PoolHostAllocator final : public at::HostAllocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    return pool_for_node(numa_node_for_current_device()).allocate(n);
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  // Called by copy_(non_blocking=True) for every host tensor it copies. A
  // tensor pinned by torch's own allocator before install() is still cached
  // there: pass its copy on, or torch could reuse its block while the copy
  // reads it. Anything else answers false, as torch's own allocator does.
  bool record_event(void* ptr, void* ctx, c10::Stream stream) override;

  void empty_cache() override {
    for (PinnedPool* pool : all_pools()) pool->release_cached();
  }

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
std::mutex g_install_mutex;
// Written under g_install_mutex, read lock-free by record_event.
std::atomic<at::HostAllocator*> g_torch_allocator{nullptr};
std::atomic<bool> g_installed{false};


bool PoolHostAllocator::record_event(void* ptr, void* ctx, c10::Stream stream) {
  if (PinnedPool* pool = PinnedPool::owner_of(ctx)) {
    if (pool->record_stream(ctx, stream)) return true;
  }
  at::HostAllocator* previous = g_torch_allocator.load();
  return previous != nullptr && previous->record_event(ptr, ctx, stream);
}

}  // namespace

bool install_host_allocator(bool enable) {
#if PINXFER_WITH_CUDA
  static PoolHostAllocator* ours = new PoolHostAllocator();  // leaked: lives past exit
  std::lock_guard<std::mutex> lock(g_install_mutex);
  if (enable == g_installed.load()) return true;
  if (enable) {
    if (g_torch_allocator.load() == nullptr) g_torch_allocator = at::getHostAllocator(at::kCUDA);
    at::setHostAllocator(at::kCUDA, ours, kPriority);
  } else {
    at::setHostAllocator(at::kCUDA, g_torch_allocator.load(), kPriority);
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

}  // namespace pinxfer
