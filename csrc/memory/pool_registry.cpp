#include "memory/pool_registry.h"

#include <cstdlib>

#include "memory/graph_pools.h"
#include "memory/host_resource.h"
#include "memory/limit_adaptor.h"
#include "memory/pinned_pool.h"
#include "runtime/cuda_runtime.h"
#include "runtime/fork.h"
#include "runtime/node_registry.h"
#include "runtime/settings.h"

namespace pinxfer {

int64_t max_pinned_bytes_from_environment() { return settings().max_pinned_bytes; }

namespace {

// What the cap asks of the pools when a map would pass it. Runs on the
// allocating thread, which holds no pool lock at that point.
class ReleaseFromEveryPool final : public LimitingResource::Relief {
 public:
  void release_cached() override {
    for (PinnedPool* pool : all_pools()) pool->release_cached();
  }
  void wait_for_events_then_release() override {
    for (PinnedPool* pool : all_pools()) pool->synchronize_pending();
    // Released graph pools' memory is cached too, once their replays are done.
    release_graph_memory();
    release_cached();
  }
  PoolStats stats() override {
    PoolStats total;
    for (PinnedPool* pool : all_pools()) total += pool->stats();
    return total;
  }
};

// The composition below the pools, built while the extension loads (no
// allocation can come earlier) and leaked (safe at exit). Not a function-local
// static: its guard could be held by a parent thread at fork(), and the child
// handler below uses it.
LimitingResource* make_pinned_cap() {
  auto* cap = new LimitingResource(*new LockedRegionResource(), &max_pinned_bytes_from_environment);
  cap->set_relief(new ReleaseFromEveryPool());
  return cap;
}
LimitingResource* const g_pinned_cap = make_pinned_cap();

NodeRegistry<PinnedPool> g_pools;
void pools_child_after_fork() {
  // Abandon the parent's pools: their locks may be held by threads that do
  // not exist in the child, and their memory is registered with the parent's
  // CUDA context. The child starts empty and (cuda_usable() is false) mlocks.
  g_pools.forget_after_fork();
  g_pinned_cap->forget_reserved_after_fork();
}

struct PoolForkHandlerInstaller {
  PoolForkHandlerInstaller() {
    register_fork_child_handler(ForkChildStep::kPinnedPools, &pools_child_after_fork);
  }
} g_pool_fork_handler;

}  // namespace

PinnedPool& pool_for_node(int numa_node) {
  return g_pools.get(numa_node, [](int node) { return new PinnedPool(node, *g_pinned_cap); });
}

std::vector<PinnedPool*> all_pools() { return g_pools.all(); }

PinnedPool* PinnedPool::owner_of(void* ctx) {
  for (PinnedPool* pool : all_pools()) {
    if (pool->owns_live_block(ctx)) return pool;
  }
  return nullptr;
}

void set_max_pinned_bytes(int64_t bytes) { g_pinned_cap->set_cap(bytes); }

int64_t max_pinned_bytes() { return g_pinned_cap->cap(); }

size_t release_graph_memory() {
  if (!cuda::cuda_usable()) return 0;
  // No capture begins from the take to the return (graph_pools.h).
  const auto returning = graph_pools::hold_off_capture_begins();
  // Read before the synchronize: only blocks held by then are covered by it.
  const uint64_t held_upto = PinnedPool::hold_sequence();
  // Only held blocks of shared segments need every device synchronized: those of a live
  // graph's segments stay held whatever a synchronize says, and a released graph's
  // devices are synchronized by take_released (counting those forced a synchronize of
  // every device at each release and empty_cache while any graph lived; review, session 44).
  bool held = false;
  for (PinnedPool* pool : all_pools()) held = held || pool->holds_shared_blocks();
  std::vector<graph_pools::PoolId> ids;
  if (!graph_pools::take_released(/*sync_all=*/held, &ids)) return 0;  // a capture is open
  if (ids.empty() && !held) return 0;
  debug_pause();  // test only: a capture may try to begin here (tests/test_graphs_gpu.py)
  size_t returned = 0;
  for (PinnedPool* pool : all_pools()) returned += pool->return_graph_memory(ids, held_upto);
  return returned;
}

}  // namespace pinxfer
