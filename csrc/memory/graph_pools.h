// The registry of CUDA-graph private pools: torch's graph-pool contract as the
// pools below the host allocator see it. See csrc/README.md, "Graph pools".
//
// torch's CUDAGraph::capture_begin calls the installed host allocator's
// begin_allocate_to_pool(id, filter) just before cudaStreamBeginCapture,
// capture_end calls end_allocate_to_pool(id), and the graph's reset/destructor
// calls release_pool(id) (memory/host_allocator.cpp forwards each here). While
// a capture is open, every pinned allocation made on a stream the capture's
// filter accepts belongs to that graph pool (PinnedPool::allocate asks
// pool_for_current_stream()); such memory is handed to nobody else until the
// pool's use count is back at zero and no replay can still read it.
//
// Use counts follow torch's CachingHostAllocatorImpl: each begin of an id
// counts one use (graphs sharing a pool through `pool=` each count), each
// release_pool drops one; at zero the pool is *released*, and its memory is
// returned to the shared free sets by pool_registry's release_graph_memory()
// after a device synchronize (a replay launched before the release may still
// run; torch's own allocator relies on cudaFreeHost's implicit synchronize).
//
// Thread safety: every function may be called from any thread. One leaf lock
// (a shared_mutex; never held while a pool lock is taken: filters call CUDA);
// the fast path of pool_for_current_stream() is one relaxed atomic load.
// Fork: a forked child has no CUDA (cuda_usable() is false), so it never
// begins a capture; its registry starts empty, with locks of its own (fork step
// kGraphPools: a parent thread may have held the parent's at fork()).
#pragma once

#include <c10/core/Stream.h>

#include <cstdint>
#include <functional>
#include <mutex>
#include <utility>
#include <vector>

namespace pinxfer::graph_pools {

// torch's c10::MempoolId_t, without including torch's allocator headers here.
using PoolId = std::pair<uint64_t, uint64_t>;
constexpr PoolId kShared{0, 0};  // not a graph pool: the shared free sets
// What pool_for_current_stream() answers while the current stream's capture is served by the
// host allocator installed before pinxfer's (begin_capture_served_elsewhere): not a pool id
// torch hands out (its ids have a zero half).
constexpr PoolId kServedElsewhere{UINT64_MAX, UINT64_MAX};
using StreamFilter = std::function<bool(c10::Stream)>;

// torch's begin_allocate_to_pool: counts one use of `id` (creating the pool on
// its first), and routes allocations on streams `filter` accepts to it until
// end_allocate_to_pool(id). `device` is the capture's device (synchronized
// before the pool's memory is reused). Throws if `id` is already routed, as
// torch does ("already recording to mempool_id").
void begin_allocate_to_pool(PoolId id, StreamFilter filter, int device);
// A capture on a pool id that torch's own allocator may already count graphs on (made before
// pinxfer.install(): a `pool=` handle shared with a graph captured before it). That allocator
// serves the capture from begin to release (host_allocator.cpp passes each step on); the
// registry only knows that the capture is open (nothing is unmapped or synchronized during
// it) and which streams it routes: pool_for_current_stream() answers kServedElsewhere there.
// Throws if `id` is already routed.
void begin_capture_served_elsewhere(PoolId id, StreamFilter filter);
// Stops routing to `id`. False if the pool is not pinxfer's: the capture was begun on the
// host allocator installed before pinxfer's, or served there (host_allocator.cpp passes it
// on there).
bool end_allocate_to_pool(PoolId id);
// Drops one use of `id`; at zero the pool is released (see take_released). False if `id` is
// not a pinxfer pool in use (as above; also a released pool whose id a later capture took to
// the other allocator).
bool release_pool(PoolId id);

// Runs `fn` with the registry's shared lock held if `id` is still one of its pools (not yet
// taken for return by take_released); returns whether it ran. `fn` may take a pool's lock
// (the order: registry, then pool) and nothing else.
bool while_registered(PoolId id, const std::function<void()>& fn);

// The graph pool the current thread's current stream allocates to, kShared, or
// kServedElsewhere.
// Lock-free while no capture is routed.
PoolId pool_for_current_stream();
// True while any begin_allocate_to_pool has no end yet (never in a forked child, whose
// registry starts empty).
bool any_capture_open();
// Graph pools whose graphs have not released them yet (use count > 0): torch
// will call release_pool for each on the host allocator installed *then*.
size_t live_pools();

// Released pools to give back: synchronizes their capture devices (every
// device with a context when `sync_all`, for blocks held outside any graph),
// then moves the pools out of the registry into *ids. Does nothing and returns
// false while a capture is open (a device synchronize would invalidate it);
// the synchronize runs under the registry lock, so no capture can begin during
// it. Returns true otherwise, also when nothing was released (no synchronize
// then unless sync_all). Throws c10::Error if the synchronize fails; the pools
// then stay released for the next call.
bool take_released(bool sync_all, std::vector<PoolId>* ids);

// No capture begins while the returned lock is held: begin_allocate_to_pool() takes it first.
// Held (lock order: this lock, then the registry's, then a pool's)
// - by pool_registry's release_graph_memory() from take_released() until the pools' memory is
//   back in the shared free sets: a capture reusing a taken id (torch's `pool=` handle, kept
//   after its graphs are gone) could otherwise map segments under the id in between, and the
//   return would make them shared while the new graph replays from them;
// - through hold_off_captures_to_unmap() by whatever unregisters pinned memory.
std::unique_lock<std::mutex> hold_off_capture_begins();

// For a caller about to unregister pinned memory (cudaHostUnregister synchronizes the device,
// which a capture forbids: CUDA refuses it, or the capture is invalidated): the lock of
// hold_off_capture_begins() if no capture is open, to hold until the last unregister; an empty
// lock (owns_lock() false) if one is, and then nothing may be unregistered.
std::unique_lock<std::mutex> hold_off_captures_to_unmap();

// Raises a c10::Error naming `op` if the current stream is capturing a CUDA
// graph but the allocation would not go to a pinxfer graph pool (pinxfer not installed,
// the capture was not begun through torch, or it is served elsewhere): such memory could be
// reused while a replay reads it. Cheap when CUDA has not been used.
void check_capture_allocation(const char* op);
// The error for a pinxfer allocation `op` on a stream whose capture is served elsewhere.
[[noreturn]] void raise_capture_served_elsewhere(const char* op);

}  // namespace pinxfer::graph_pools
