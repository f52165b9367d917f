// The process's pinned pools: one PinnedPool per NUMA node, built on first
// use over the process's composition of resources,
//
//   LockedRegionResource  (memory/host_resource.h: mmap ... cudaHostRegister)
//     -> LimitingResource (memory/limit_adaptor.h: the cap over all pools)
//       -> PinnedPool     (memory/pinned_pool.h: one per node)
//
// and the relief the cap calls under pressure (release the cached segments of
// every pool; then wait for their pending events and release again).
//
// Thread safety: everything here may be called from any thread. pool_for_node()
// of nodes -1..63 is lock-free once the node's pool exists; the rest takes a
// leaf lock (never held while a pool lock is taken, or the other way round).
// Lifetime: pools and resources are leaked (nothing runs at exit). In a forked
// child (runtime/fork.h, step kPinnedPools) the parent's pools are abandoned
// untouched, and the child builds new ones on first use (without CUDA).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace pinxfer {

class PinnedPool;

// The pool for a NUMA node (-1: unbound). Created on first use.
PinnedPool& pool_for_node(int numa_node);
// Every pool built so far in this process (this fork generation).
std::vector<PinnedPool*> all_pools();

// Gives back the memory of CUDA graph pools whose use count fell to zero
// (memory/graph_pools.h), and blocks held because they were freed while a
// stream using them was capturing: synchronizes their devices (every active
// device when blocks are held), then PinnedPool::return_graph_memory on every
// pool. Does nothing while a capture is open (the synchronize would invalidate
// it): the next call after the capture does it. Returns the held blocks freed.
// Throws c10::Error if the synchronize fails; the memory then stays held.
size_t release_graph_memory();

// The cap on bytes reserved by all pools together; 0 = unlimited. Until set,
// the cap is max_pinned_bytes_from_environment(), read on first need.
void set_max_pinned_bytes(int64_t bytes);
int64_t max_pinned_bytes();
// PINXFER_MAX_PINNED_BYTES as bytes (runtime/parse.h forms), 0 when unset: the
// settings object's value (runtime/settings.h), which throws c10::ValueError
// when the variable cannot be read.
int64_t max_pinned_bytes_from_environment();

}  // namespace pinxfer
