// The caching pool of page-locked host memory. See csrc/README.md, "Note
// [pinxfer pool design]", for the whole picture; in short:
//
//  * Upstream: segments come from the HostResource the pool is built over
//    (memory/host_resource.h). In the process's composition
//    (memory/pool_registry.cpp) that is the cap, LimitingResource, over
//    LockedRegionResource (mmap, huge pages, NUMA bind, parallel first touch,
//    cudaHostRegister or mlock).
//  * Sizes: requests <= 1 MiB are rounded to 512 B and carved from 2 MiB
//    segments (the small pool); larger requests are rounded to 64 KiB and carved
//    from segments of at least 32 MiB (the large pool; a graph pool's segments, and
//    those mapped where the cap leaves less room, are the request's size). A live
//    block wastes < 64 KiB and never rounds to a power of two.
//  * Reuse: free blocks sit in a best-fit set per pool ordered by (size, ptr);
//    a bigger free block is split, neighbours coalesce when both are free.
//    A small block freed with nothing to wait for goes to a bin of its exact size
//    instead, unmerged, and the next request of that size takes it back without
//    touching the set (a cache hit then costs no split, merge or node allocation);
//    bins are emptied into the set before any miss or release (flush_bins_locked).
//    A large-pool miss maps >= 32 MiB (rounded up, so later requests share the
//    segment); only when reserved memory would pass twice the most ever allocated
//    does it merge every fully free large segment into the new one (unmap + one
//    bigger map): cudaHostUnregister waits for the device.
//  * Stream safety: a block records the CUDA streams that used it
//    (record_stream). When it is freed, an event is recorded on each of those
//    streams and the block waits in that stream's FIFO; it returns to the free
//    set only when all its events have completed. One FIFO per stream, so a
//    slow stream never holds back blocks used only by fast ones.
//  * A block freed with no recorded use while CUDA is active is fenced on the
//    freeing thread's current stream (covers `x.to(dev, non_blocking=True);
//    del x` on one stream; torch's copy_ only tells its *installed* host
//    allocator, see host_allocator.cpp). While pinxfer is installed as that
//    allocator torch reports every copy, so the adaptor turns the fence off
//    (set_fence_unrecorded_frees(false)), as torch's own allocator does; a block
//    handed out before install() keeps its fence (Block::lived_unreported).
//    A fenced *small* block records no event of its own: it joins its stream's
//    fence batch, and one event (a marker) recorded after the batch's last free
//    covers the whole batch (flush_fence_locked; csrc/README.md "The free fence").
//    So does a small block whose one recorded use its recorder said may wait there
//    (record_stream's UseWait::kFenceBatch: a staging block of the small pool sent
//    on the device's default stream).
//  * CUDA graphs: blocks allocated while a capture routes the current stream
//    to a graph pool (memory/graph_pools.h) come from segments owned by that
//    graph pool, with free sets of their own; they are never handed to anyone
//    else, and a freed block a graph may read is *held* (no event can prove a
//    replay done) until pool_registry's release_graph_memory() has synchronized
//    the device and calls return_graph_memory().
//  * Cap: enforced by the upstream (memory/limit_adaptor.h), which relieves
//    pressure through every pool and then declines with CapReached; the pool
//    looks at its free set once more and raises c10::OutOfMemoryError with the
//    cap, pinned, cached and requested bytes.
//
// Thread safety: every public member may be called from any thread. One mutex
// per pool guards blocks, free sets, event queues and stats; mmap, first touch,
// cudaHostRegister/Unregister, munmap and event recording run outside it (but a
// fence batch's marker, recorded inside it: see flush_fence_locked). The
// block states and the rule that keeps them consistent are at `struct Block`.
// Ownership: the pool owns segments; a Block is owned by its segment and lent to
// exactly one DataPtr at a time. Pools are never destroyed (safe at exit). In a
// forked child all pools of the parent are abandoned (never touched again) and
// fresh ones are built without CUDA (memory/pool_registry.h).
#pragma once

#include <c10/core/Allocator.h>
#include <c10/core/Storage.h>
#include <c10/core/Stream.h>
#include <c10/util/flat_hash_map.h>

#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "memory/graph_pools.h"
#include "memory/host_region.h"
#include "memory/host_resource.h"
#include "memory/pool_stats.h"
#include "runtime/cuda_runtime.h"

namespace pinxfer {

class PinnedPool;
struct Segment;

// A run of bytes inside a segment. Every field is guarded by the owning pool's
// mutex_ (LOCK: segment->pool->mutex_), except `ptr` and `segment`, which never
// change while the block exists and may be read by the DataPtr's holder.
//
// States and invariants (asserted by check_invariants_locked() in builds with
// PINXFER_DEBUG_INVARIANTS, i.e. the sanitizer builds):
//   free     in its pool's free set;      in_use == false; not in live_
//   binned   free, in bins_ at its size:  in_use == true (so no neighbour merges
//            into it), binned == true; not live, pending or held
//   live     handed to exactly one DataPtr; in_use == true; in live_
//   freeing  between free()'s two critical sections; in_use == true; in no set
//   pending  in_use == true; pending_events > 0 entries in the stream FIFOs (a
//            fenced small block's one entry may wait for its batch's marker)
//   poisoned an event could not be recorded/queried; in_use == true forever
//   held     freed, but a CUDA graph may read it: in held_, in_use == true,
//            pending_events == 0, until return_graph_memory()
// A block is in exactly one of these states; in_use <=> not in a free set.
// Every state change happens in the same critical section as the free-set,
// live_ or FIFO change that goes with it (a block taken from the free set is
// marked in_use before the lock is dropped), so a neighbour being freed never
// merges into a block that some thread holds, and empty_cache() never unmaps a
// segment with a block that is not free. No two free blocks are neighbours.
struct Block {
  char* ptr = nullptr;         // immutable
  size_t size = 0;             // bytes this block spans (rounded). LOCK: pool mutex_
  size_t requested = 0;        // bytes the caller asked for (0 unless live). LOCK: pool mutex_
  Segment* segment = nullptr;  // immutable
  Block* prev = nullptr;       // address-order neighbours in the segment. LOCK: pool mutex_
  Block* next = nullptr;       // LOCK: pool mutex_
  bool in_use = false;         // not in a free set. LOCK: pool mutex_
  int pending_events = 0;  // events still to complete before reuse, or kPoisoned. LOCK: pool mutex_
  std::vector<c10::Stream> stream_uses;  // streams that used it while live. LOCK: pool mutex_
  uint64_t held_seq = 0;  // when it became held (PinnedPool::hold_sequence()). LOCK: pool mutex_
  bool binned = false;    // in its pool's bin of this size (state "binned"). LOCK: pool mutex_
  // The free fence was on while it was live (pinxfer not installed then): torch may have
  // copied from it without telling pinxfer, so its free is fenced even if install() came
  // since. LOCK: pool mutex_
  bool lived_unreported = false;
  // Its one recorded use may wait in that stream's fence batch (record_stream's
  // UseWait::kFenceBatch). LOCK: pool mutex_
  bool use_in_fence_batch = false;
};
constexpr int kPoisoned = -1;

// One region from the upstream resource, carved into blocks. Immutable after
// creation except `head`'s block contents (the head block is never deleted:
// merges delete the later of two neighbours) and `graph`.
struct Segment {
  HostRegion region;
  PinnedPool* pool = nullptr;
  bool small = false;
  uint64_t generation = 0;  // fork generation it was mapped in
  Block* head = nullptr;    // first block by address
  // The CUDA graph pool that owns every block of it (kShared: none). Its free
  // blocks sit in that graph pool's free sets. Set when the segment is mapped
  // for a graph, back to kShared only by return_graph_memory. LOCK: pool mutex_
  graph_pools::PoolId graph = graph_pools::kShared;
};

class PinnedPool {
 public:
  // A pool of memory for `numa_node` (-1: unbound) mapped by `upstream`, which
  // must outlive the pool (both are leaked in practice).
  PinnedPool(int numa_node, HostResource& upstream);

  // What the caller does with a block first. kWrittenNow: the calling thread writes it
  // at once (pin_memory's copy), so a block it wrote recently, still in its core's
  // caches, is worth one stream query (take_back_if_stream_idle_locked).
  enum class Use : uint8_t { kAny, kWrittenNow };

  // A DataPtr to >= size bytes of locked memory (512-byte aligned) whose
  // context is the Block. size 0 gives an empty DataPtr. Throws
  // c10::OutOfMemoryError when the upstream declines (the cap) or the OS
  // refuses the memory.
  c10::DataPtr allocate(size_t size, Use use = Use::kAny);

  // How the free of a block waits for a stream's use (record_stream).
  enum class UseWait {
    kOwnEvent,  // an event of its own, recorded on the stream at the free
    // A small block used by this one stream only: a place in the stream's fence batch, as a
    // fenced free has (one marker for up to kFenceBatchBlocks frees, recorded at the batch's
    // flush, possibly later and from another thread). Only for a stream that outlives any
    // flush (the device's default stream); the block's copies were queued before its free, so
    // the marker covers them. A second stream recorded, or kOwnEvent, drops it.
    kFenceBatch,
  };
  // Marks that `stream` (a CUDA stream) uses the block behind ctx; returns
  // false if ctx is not a live block of this pool.
  bool record_stream(void* ctx, const c10::Stream& stream, UseWait wait = UseWait::kOwnEvent);

  // Gives fully free segments back to the OS (cudaHostUnregister + munmap).
  // Blocks waiting on events and live blocks are kept; the fence batches are
  // flushed and their markers waited for first (flush_fences_and_wait), so a
  // fenced block whose stream is done is released. Returns bytes released.
  size_t release_cached();

  // Blocks until every pending event of this pool has completed, then moves
  // those blocks to the free set.
  void synchronize_pending();

  // Holds a reference to `storage` until the work queued on `stream` so far has
  // completed: for a pinned source whose owner nobody can tell that a copy reads
  // it (memory registered by hand, a slot ring's mapping). An event of its own, in a
  // per-stream FIFO of kept storages apart from the blocks' (kept_): a fence batch still
  // waiting for its marker there would hold it past its copy, and an owner that frees
  // the memory itself (the slot ring) relies on release_finished() dropping every kept
  // storage whose copy is done. Throws c10::Error if the event cannot be recorded.
  void keep_until_done(c10::Storage storage, const c10::Stream& stream);
  // Processes completed events now and drops the kept storages they released
  // (outside the lock). Called before each transfer.
  void release_finished();

  PoolStats stats();
  void reset_peak_stats();
  void reset_accumulated_stats();
  int numa_node() const { return numa_node_; }

  // True if ctx is a live block of this pool (validates a foreign ctx).
  bool owns_live_block(void* ctx);
  // True if [lo, hi) overlaps a segment of this pool: memory reached through another
  // DataPtr (torch.from_numpy of a pool tensor's numpy view) that pin_ must not lock.
  bool overlaps_segments(uintptr_t lo, uintptr_t hi);
  // The pool of which ctx is a live block, or nullptr. Answered by the
  // registry, which knows every pool (memory/pool_registry.cpp).
  static PinnedPool* owner_of(void* ctx);
  // Lock kind of the block behind a DataPtr context of this pool.
  LockKind lock_kind_of(void* ctx);
  // The lock kind if `data` is a pool block (its deleter is the pool's), else
  // nullopt. Lock-free: a DataPtr that still holds the pool's deleter owns a
  // live block, whose segment cannot be unmapped meanwhile.
  static std::optional<LockKind> lock_kind_if_pool(const c10::DataPtr& data);

  // Whether a block freed with no recorded stream use, while CUDA is active,
  // is fenced on the freeing thread's current stream (default: yes). The
  // host-allocator adaptor turns it off while installed, because torch then
  // reports every copy through record_stream. Process-wide; lock-free.
  static void set_fence_unrecorded_frees(bool fence);

  // ---- CUDA graph pools (memory/graph_pools.h; csrc/README.md "Graph pools") ----
  // Gives back what CUDA graphs held: the segments of the graph pools `ids`
  // become shared again (their free blocks join the shared free sets, their
  // live blocks follow when freed) and every held block outside a graph
  // segment still owned, held at hold_sequence() <= held_upto, returns to its
  // free set. The caller guarantees that no replay of those graphs, and no work
  // queued before held_upto was read, can still run (it read held_upto, then
  // synchronized the devices with no capture open). Returns the blocks freed.
  size_t return_graph_memory(const std::vector<graph_pools::PoolId>& ids, uint64_t held_upto);
  // True if a held block lies in a shared segment (freed while a stream that used it was
  // capturing): only a synchronize of every device proves its readers done. Blocks held in
  // a graph's own segments wait for that graph's release instead.
  bool holds_shared_blocks();
  // Process-wide count of blocks ever held; a block held later has a larger number.
  static uint64_t hold_sequence();

  // One block, for torch's host snapshot (HostAllocator::get_segments).
  struct BlockInfo {
    uintptr_t address;
    size_t size;
    bool live;     // lent to a tensor
    bool waiting;  // freed, not reusable yet (pending events, held, poisoned)
    graph_pools::PoolId graph;
  };
  std::vector<BlockInfo> block_infos();

 private:
  // Members named *_locked run with mutex_ held; the others take it themselves.
  struct PendingUse;  // one entry of a stream's FIFO (below)
  struct StreamFifo;  // a stream's FIFO of pending uses and its fence batch (below)

  // One allocate() request: the size asked for, rounded to its pool's
  // granule, and which pool (small: <= 1 MiB, carved from 2 MiB segments).
  struct Request {
    size_t size;
    size_t rounded;
    bool small;
  };
  static Request make_request(size_t size);

  // The steps of allocate(), in order. Only the first runs on a cache hit.
  // A fitting free block, live for the caller; an empty DataPtr on a miss.
  c10::DataPtr take_cached(const Request& request, Use use);
  c10::DataPtr take_cached_locked(const Request& request);
  // A miss: maps a new segment for the request and hands out its first block.
  c10::DataPtr allocate_segment(const Request& request);
  // Large-pool miss: the size of the segment to map, max(rounded, 32 MiB) (rounded alone
  // where the cap's headroom is less than 32 MiB), unless the pool would then reserve more
  // than twice its allocated high-water mark: then every fully free large segment is
  // unmapped (a device-wide wait) and the one segment is at least their total. Checked
  // per miss: misses mapping at once may each pass the bound. A rounded-up size the cap
  // or the OS refuses falls back to the request's (allocate_segment).
  size_t large_segment_size_for_miss(size_t rounded);
  // The upstream declined: the relief may have freed a fit here; else raise.
  c10::DataPtr take_cached_or_raise(const Request& request, size_t segment_size,
                                    const CapReached& reached);
  // Makes a freshly mapped region a segment and hands its first block out.
  c10::DataPtr hand_out_new_segment(const Request& request, const HostRegion& region,
                                    const RegionTimings& timings,
                                    graph_pools::PoolId graph = graph_pools::kShared);

  static void delete_block(void* ctx);
  void free(Block* block);
  // Streams a freed block must wait for: its recorded uses, or the fence
  // (the current stream) when it has none and `fence_unrecorded`. Sets *fenced for the fence.
  std::vector<c10::Stream> streams_to_wait_for(std::vector<c10::Stream> uses, LockKind kind,
                                               bool fence_unrecorded, bool* fenced);

  // Marks a block taken from the free set (or a new segment's first block)
  // live for a caller who asked for `size` bytes; returns its DataPtr.
  c10::DataPtr hand_out_locked(Block* block, size_t size);
  // Splits an in-use block at `rounded` bytes when the rest is at least one
  // granule; the rest goes to the free set. The one place a block is split.
  void split_locked(Block* block, size_t rounded);
#if PINXFER_DEBUG_INVARIANTS
  void check_invariants_locked();
#else
  void check_invariants_locked() {}
#endif

  Block* take_free_block_locked(size_t rounded, bool small);
  void return_to_free_locked(Block* block);
  // Bins: small blocks of shared segments freed with nothing to wait for, by exact
  // size, taken back by a request of that size (state "binned" at struct Block).
  Block* take_binned_locked(size_t rounded);
  bool bin_holds_locked(size_t rounded) const;  // a binned block of this size exists
  void bin_locked(Block* block);
  // A block freed with nothing (more) to wait for, at its free or when its last event
  // completes: binned if small and of a shared segment, else back to the free set.
  void cache_freed_locked(Block* block);
  // Every binned block back to the free sets (merged with its free neighbours):
  // before a request is called a miss, and before free segments are collected.
  void flush_bins_locked();
  void process_events_locked();
  // One FIFO entry whose wait is over (its event, or its batch's marker, is done, with
  // `error` if the query failed): the event goes back to its free list and the block, at
  // its last event, to its bin or free set (poisoned on an error).
  void release_pending_use_locked(const PendingUse& use, const std::string& error);
  // A small request the caller writes at once (Use::kWrittenNow) with no block in its
  // bin, while the current stream's fence batch holds a block of its size: one
  // cudaStreamQuery of that stream (not while it or any capture pinxfer knows of is
  // open). Idle, every entry of its FIFO is done, so all are released, oldest first,
  // and the bin's last block, the latest freed, is the caller's (csrc/README.md "The
  // free fence"). Counted in num_idle_reclaims.
  void take_back_if_stream_idle_locked(size_t rounded);
  // The free fence of a small block: queued in `stream`'s fence batch, which is
  // flushed once it holds kFenceBatchBlocks blocks or kFenceBatchBytes bytes.
  void fence_in_batch_locked(Block* block, const c10::Stream& stream);
  // Records the marker that covers `fifo`'s batch. If the stream is capturing now or
  // began to during the record (the event would be captured: record_use_event) the
  // batch's blocks are held instead; on a CUDA error they are poisoned. Returns the marker (none:
  // no batch, or not recorded).
  cuda::Event flush_fence_locked(const c10::Stream& stream, StreamFifo& fifo);
  std::vector<cuda::Event> flush_fences_locked();
  // Flushes every fence batch and, if `may_wait`, waits for the markers, so the batches'
  // blocks are free once their streams' work queued before this call is done. The caller
  // passes false while a capture pinxfer knows of is open (the wait could break it), and
  // holds hold_off_captures_to_unmap() across the call so that none begins.
  void flush_fences_and_wait(bool may_wait);
  void unmap_segments(std::vector<Segment*> segments);
  // Removes fully free segments (of one pool kind, or both) from the free sets
  // and the stats; the caller unmaps them with unmap_segments().
  std::vector<Segment*> collect_free_segments_locked(std::optional<bool> small);

  const int numa_node_;
  const uint64_t generation_;
  HostResource& upstream_;

  struct BlockOrder {
    bool operator()(const Block* a, const Block* b) const {
      return a->size != b->size ? a->size < b->size : a->ptr < b->ptr;
    }
  };
  // One entry of a stream's FIFO. kBlock: a freed block gated by its own event.
  // kFencedBlock: a fenced small block with no event; it is covered by the first
  // kFenceMarker behind it, an event recorded after it was queued (under the lock),
  // so after its free. kFenceMarker: that event.
  struct PendingUse {
    enum class Kind : uint8_t { kBlock, kFencedBlock, kFenceMarker };
    Kind kind = Kind::kBlock;
    cuda::Event event;  // none for kFencedBlock
    Block* block = nullptr;
  };
  // A foreign storage kept alive until its copy is done (keep_until_done).
  struct KeptStorage {
    cuda::Event event;
    c10::Storage storage;
  };
  // A stream's FIFO and its fence batch: the kFencedBlock entries queued since its
  // last marker, which no event covers yet.
  struct StreamFifo {
    std::deque<PendingUse> uses;
    size_t batch_blocks = 0;
    size_t batch_bytes = 0;
  };

  std::mutex mutex_;
  std::set<Block*, BlockOrder> free_small_;  // LOCK: mutex_
  std::set<Block*, BlockOrder> free_large_;  // LOCK: mutex_
  // Handed out, not yet freed: answers whether a foreign DataPtr context is a live block.
  // Open addressing: an insert or erase allocates nothing (a node set did, twice a hit).
  ska::flat_hash_set<Block*> live_;                      // LOCK: mutex_
  std::unordered_map<c10::Stream, StreamFifo> pending_;  // LOCK: mutex_
  // Kept storages per stream, in the order of their events (keep_until_done).
  std::unordered_map<c10::Stream, std::deque<KeptStorage>> kept_;  // LOCK: mutex_
  std::unordered_set<Segment*> segments_;                          // LOCK: mutex_
  // bins_[size / kSmallGranule]: binned blocks of that size, the latest freed last.
  std::vector<std::vector<Block*>> bins_;  // LOCK: mutex_
  size_t binned_blocks_ = 0;               // LOCK: mutex_

  // Kept storages whose event has completed, destroyed by release_finished()
  // outside the lock (a foreign deleter may do anything). LOCK: mutex_
  std::vector<c10::Storage> finished_storages_;

  PoolStats stats_;  // LOCK: mutex_
  // The most bytes live blocks ever spanned at once, since the last release_cached() (by
  // empty_cache or the cap's relief): what the pool may keep cached without merging
  // (large_segment_size_for_miss). Unlike stats_.allocated_bytes.peak, the user's
  // reset_peak_memory_stats() leaves it. LOCK: mutex_
  int64_t allocated_high_water_ = 0;

  // ---- CUDA graph pools: private members ----
  using FreeSet = std::set<Block*, BlockOrder>;
  struct GraphFreeSets {
    FreeSet small, large;
  };
  // allocate() for a capture routed to graph pool `graph`: a fit from its own
  // free sets, else a new segment owned by it (never a shared block). nullopt if the pool
  // has left the registry since the routing (released and taken for return: its capture
  // ended), and a segment mapped meanwhile is made shared (hand_out_new_segment).
  std::optional<c10::DataPtr> allocate_for_graph(const Request& request, graph_pools::PoolId graph);
  // The free set a free block of `segment` belongs in: the shared one of its
  // kind, or its graph pool's.
  FreeSet& free_set_locked(const Segment* segment);
  // Best fit from one free set, marked in_use and split; nullptr on a miss.
  Block* take_from_set_locked(FreeSet& free_set, size_t rounded);
  // free() of a block a CUDA graph may read: no event can prove the replays
  // done, so it is held until return_graph_memory(). Block is out of live_.
  void hold_locked(Block* block);

  // Free sets of each graph pool with segments here. LOCK: mutex_
  std::map<graph_pools::PoolId, GraphFreeSets> graph_free_;
  // Held blocks (state "held" at struct Block). LOCK: mutex_
  std::unordered_set<Block*> held_;
};

// Test-only: every allocate/free sleeps this long between its critical
// sections (0: off), to widen interleavings in thread-storm tests (the regression test
// of the allocate/free race in tests/test_allocator.py), and so does release_graph_memory
// between taking released graph pools and returning their memory.
void set_debug_pause_us(int64_t us);
// Sleeps as set_debug_pause_us says (nothing when off): where the pauses are.
void debug_pause();
// Test-only: while held, every event a freed block's stream use (or a fence batch's flush)
// records waits, after the capture check before it, until released (at most 10 s), so that a
// test can begin a capture on the stream in between (pinned_pool.cpp, record_use_event);
// use_records_waiting() says how many wait now.
void hold_use_records(bool hold);
int use_records_waiting();

}  // namespace pinxfer
