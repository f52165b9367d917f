#include "memory/pinned_pool.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>

#include <c10/util/Exception.h>

#include "runtime/checked_size.h"
#include "runtime/fork.h"
#include "runtime/settings.h"

namespace pinxfer {

namespace {

constexpr size_t kSmallMax = size_t{1} << 20;      // requests up to 1 MiB use the small pool
constexpr size_t kSmallSegment = size_t{2} << 20;  // small pool maps 2 MiB segments
constexpr size_t kSmallGranule = 512;
constexpr size_t kLargeGranule = size_t{64} << 10;
// The least a large-pool miss maps: requests of other sizes then split and coalesce in one
// segment instead of each mapping its own (mixed 4 KiB-16 MiB batches: reserved/peak 1.09
// against 1.30 with segments of the request's size, and a third of the maps; CPU build).
constexpr size_t kLargeSegmentMin = size_t{32} << 20;
// A large miss unmaps (merges) the free large segments only when reserved memory would
// otherwise pass this many times the most ever allocated (PinnedPool::allocated_high_water_).
constexpr int kMergeAboveHighWater = 2;

std::string human(int64_t bytes) {
  char buf[64];
  if (bytes >= (int64_t{1} << 30)) {
    snprintf(buf, sizeof(buf), "%.2f GiB", bytes / double(int64_t{1} << 30));
  } else if (bytes >= (int64_t{1} << 20)) {
    snprintf(buf, sizeof(buf), "%.2f MiB", bytes / double(int64_t{1} << 20));
  } else {
    snprintf(buf, sizeof(buf), "%lld bytes", static_cast<long long>(bytes));
  }
  return std::to_string(bytes) + " bytes (" + buf + ")";
}

// The out-of-memory report, from the figures the cap declined with.
[[noreturn]] void raise_out_of_memory(size_t size, size_t segment_size, const CapReached& reached) {
  const bool capturing = graph_pools::any_capture_open();
  TORCH_CHECK_WITH(OutOfMemoryError, false, "pinxfer: out of pinned memory. Asked for ",
                   human(size), ", which needs a new segment of ", human(segment_size),
                   ", but the cap is ", human(reached.cap),
                   ". Pinned now: ", human(reached.reserved), ", of which cached (free) ",
                   human(reached.pools.cached_bytes()),
                   "; requested by live tensors: ", human(reached.pools.requested_bytes.current),
                   capturing ? ". A CUDA graph capture is open, and no cached memory is "
                               "unmapped during a capture (that would synchronize the device): "
                               "call pinxfer.empty_cache() before capturing, or"
                             : ". Free pinned tensors, call pinxfer.empty_cache(), or",
                   " raise the cap "
                   "(pinxfer.set_max_pinned_bytes() or PINXFER_MAX_PINNED_BYTES).");
}

std::atomic<bool> g_warned_event_error{false};

// On unless the host-allocator adaptor is installed (see the header).
std::atomic<bool> g_fence_unrecorded_frees{true};

bool fence_is_on() { return g_fence_unrecorded_frees.load(std::memory_order_relaxed); }

// Whether a block freed with no recorded use is fenced on the current stream: only
// CUDA-registered memory can be read by torch's unreported copies, and only while the fence
// is on or was on while the block lived (a block handed out before install() may have been
// copied unreported, then freed after it; found by review, session 44). LOCK: pool mutex_
bool fenced_when_unrecorded_locked(const Block* block) {
  return block->segment->region.kind == LockKind::kCudaRegistered &&
         (fence_is_on() || block->lived_unreported);
}

// A stream's fence batch is flushed (one event for all its blocks) at this many blocks
// or bytes, whichever comes first. The event's cost (~0.5 us) is shared by up to 8 frees
// of the smallest blocks, where it is most of a call. The byte bound keeps what a batch
// holds back from reuse within a core's L2: with 2 MiB batches, pin_memory of 64 KiB and
// 256 KiB back to back (a synchronize after each call) got 20-40% slower on the H100, its
// copies writing to blocks rotated out of cache; a 256 KiB block's event is ~2% of its call.
constexpr size_t kFenceBatchBlocks = 8;
constexpr size_t kFenceBatchBytes = size_t{256} << 10;

std::atomic<int64_t> g_debug_pause_us{0};
// Test-only (hold_use_records): records held, and how many are waiting now.
std::atomic<bool> g_use_records_held{false};
std::atomic<int> g_use_records_waiting{0};
constexpr auto kUseRecordHoldLimit = std::chrono::seconds(10);

// Whether a stream may get an event that says when the work queued on it so far is done.
enum class StreamState {
  kClear,      // not capturing (record_use_event: and the event is recorded)
  kCapturing,  // capturing a CUDA graph: an event recorded there is captured, no such event
  kFailed,     // a CUDA error (in *error)
};

StreamState capture_state(const c10::Stream& stream, std::string* error) {
  const bool capturing = cuda::stream_is_capturing(stream, error);
  if (!error->empty()) return StreamState::kFailed;
  return capturing ? StreamState::kCapturing : StreamState::kClear;
}

// An event on `stream` behind the work queued on it so far, for a freed block or a fence
// batch's marker: kClear with *out recorded, unless the stream captures (kCapturing: the
// caller holds the blocks, as a free under a capture does) or CUDA fails (kFailed).
// The stream is asked before the record and again after it: another thread may begin a
// capture on the stream in between, and the capture then takes the record, which says nothing
// of the work queued before the capture (its query fails afterwards: cudaErrorInvalidValue on
// an H100, session 48). Such an event is abandoned: neither waited for nor put back in the
// free list (one cudaEvent_t leaked per race). Not seen: a capture that begins after the first
// question and ends before the second, the freeing thread descheduled across all of it.
StreamState record_use_event(const c10::Stream& stream, cuda::Event* out, std::string* error) {
  const StreamState before = capture_state(stream, error);
  if (before != StreamState::kClear) return before;
  if (g_use_records_held.load()) {  // tests only: a capture may begin on the stream now
    g_use_records_waiting.fetch_add(1);
    const auto deadline = std::chrono::steady_clock::now() + kUseRecordHoldLimit;
    while (g_use_records_held.load() && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    g_use_records_waiting.fetch_sub(1);
  }
  if (!cuda::try_record_event(stream, out, error)) return StreamState::kFailed;
  // Abandoned (see above) also when the question fails: the event may have been captured.
  const StreamState after = capture_state(stream, error);
  if (after != StreamState::kClear) *out = cuda::Event{};
  return after;
}

}  // namespace

void hold_use_records(bool hold) { g_use_records_held.store(hold); }
int use_records_waiting() { return g_use_records_waiting.load(); }

void debug_pause() {
  const int64_t us = g_debug_pause_us.load(std::memory_order_relaxed);
  if (us > 0) std::this_thread::sleep_for(std::chrono::microseconds(us));
}

void set_debug_pause_us(int64_t us) { g_debug_pause_us.store(us < 0 ? 0 : us); }

void PinnedPool::set_fence_unrecorded_frees(bool fence) { g_fence_unrecorded_frees.store(fence); }

PinnedPool::PinnedPool(int numa_node, HostResource& upstream)
    : numa_node_(numa_node), generation_(fork_generation()), upstream_(upstream) {}

// ---- allocate: cache hit, else a new segment, else out of memory ----

PinnedPool::Request PinnedPool::make_request(size_t size) {
  const bool small = size <= kSmallMax;
  return {size,
          checked_round_up(size, small ? kSmallGranule : kLargeGranule,
                           "pinxfer: a pinned allocation"),
          small};
}

c10::DataPtr PinnedPool::allocate(size_t size, Use use) {
  if (size == 0) return c10::DataPtr(nullptr, c10::Device(c10::DeviceType::CPU));
  const Request request = make_request(size);
  // While a CUDA graph capture routes this stream to its private pool, the
  // memory must come from that pool (see "CUDA graph pools" at the bottom).
  if (const graph_pools::PoolId graph = graph_pools::pool_for_current_stream();
      graph != graph_pools::kShared) {
    // host_allocator.cpp hands torch's allocations there to the other allocator; pinxfer's
    // own calls have nowhere to put the memory.
    if (graph == graph_pools::kServedElsewhere) {
      graph_pools::raise_capture_served_elsewhere("a pinxfer pinned allocation");
    }
    if (std::optional<c10::DataPtr> out = allocate_for_graph(request, graph)) {
      return std::move(*out);
    }
    // The pool's memory was taken back since the routing (the capture ended, the graph was
    // destroyed): no graph reads this allocation, so it is shared memory.
  }
  if (c10::DataPtr hit = take_cached(request, use)) return hit;
  debug_pause();
  return allocate_segment(request);
}

c10::DataPtr PinnedPool::take_cached(const Request& request, Use use) {
  std::lock_guard<std::mutex> lock(mutex_);
  // No event is queried while the bin of this size has a block: take_cached_locked pops it.
  if (!request.small || !bin_holds_locked(request.rounded)) {
    process_events_locked();
    if (request.small && use == Use::kWrittenNow) take_back_if_stream_idle_locked(request.rounded);
  }
  if (c10::DataPtr hit = take_cached_locked(request)) return hit;
  // A miss: the fence batches get their markers now, so their blocks come back once
  // their copies are done instead of waiting for more frees to fill the batches.
  (void)flush_fences_locked();
  return {};
}

c10::DataPtr PinnedPool::take_cached_locked(const Request& request) {
  Block* block = request.small ? take_binned_locked(request.rounded) : nullptr;
  if (block == nullptr) block = take_free_block_locked(request.rounded, request.small);
  if (block == nullptr && binned_blocks_ > 0) {
    // Binned blocks merged with their free neighbours may fit what no single one does.
    flush_bins_locked();
    block = take_free_block_locked(request.rounded, request.small);
  }
  if (block == nullptr) return {};
  ++stats_.num_cache_hits;
  return hand_out_locked(block, request.size);
}

c10::DataPtr PinnedPool::allocate_segment(const Request& request) {
  size_t segment_size =
      request.small ? kSmallSegment : large_segment_size_for_miss(request.rounded);
  HostRegion region;
  RegionTimings timings;
  // A large segment rounded up past the request: if the cap (another thread took the
  // headroom large_segment_size_for_miss saw) or the OS refuses it, the request alone.
  // Never a small request: its blocks are carved from kSmallSegment-sized segments only.
  auto map_request_alone_or_rethrow = [&] {
    if (request.small || segment_size == request.rounded) throw;
    segment_size = request.rounded;
    return upstream_.map(segment_size, numa_node_, &timings);
  };
  try {
    try {
      region = upstream_.map(segment_size, numa_node_, &timings);
    } catch (const CapReached&) {
      region = map_request_alone_or_rethrow();
    } catch (const c10::OutOfMemoryError&) {
      region = map_request_alone_or_rethrow();
    }
  } catch (const CapReached& reached) {
    return take_cached_or_raise(request, segment_size, reached);
  }
  debug_pause();
  return hand_out_new_segment(request, region, timings);
}

size_t PinnedPool::large_segment_size_for_miss(size_t rounded) {
  // Fully free large segments are each too small for this request (best fit would have
  // found them). Unmapping them and mapping one segment of their total keeps reserved
  // memory near what is needed, but cudaHostUnregister waits for the whole device and
  // blocks other threads' kernel launches meanwhile: a merge in the middle of a training
  // step stalls it until the GPU drains (csrc/README.md, "Reuse"). So a miss maps a new
  // segment of at least kLargeSegmentMin (where later requests of other sizes split and
  // coalesce), and merges only when the pool would otherwise reserve more than
  // kMergeAboveHighWater times the most it ever had allocated. Memory that was once all in
  // use (a ring's slots, the last batch) stays cached, as torch's caches keep theirs; a
  // pool whose requests keep growing merges, and each merge doubles what it can serve.
  // Rounded up only where the cap leaves room for it without relief (which would unmap
  // every pool's free segments: the device-wide wait this avoids).
  const size_t fresh = upstream_.headroom() >= static_cast<int64_t>(kLargeSegmentMin)
                           ? std::max(rounded, kLargeSegmentMin)
                           : rounded;
  auto merge_wanted_locked = [&] {
    // In 128 bits: `rounded` may be near 2^63 (such a request fails in map(), unmerged).
    using Wide = __int128;
    const Wide in_use_after = Wide{stats_.allocated_bytes.current} + Wide{rounded};
    const Wide reserved_after = Wide{stats_.reserved_bytes.current} + Wide{fresh};
    const Wide basis =
        std::max({Wide{allocated_high_water_}, in_use_after, Wide{kLargeSegmentMin}});
    return reserved_after > kMergeAboveHighWater * basis;
  };
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!merge_wanted_locked()) return fresh;
  }
  // A merge unmaps: not while a capture is open, and none begins until its last unmap
  // (graph_pools.h). Whether to merge is asked again under both locks.
  const auto unmapping = graph_pools::hold_off_captures_to_unmap();
  if (!unmapping.owns_lock()) return fresh;
  std::vector<Segment*> merged;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!merge_wanted_locked()) return fresh;
    merged = collect_free_segments_locked(/*small=*/false);
    if (!merged.empty()) ++stats_.num_segment_merges;
  }
  size_t merged_bytes = 0;
  for (Segment* s : merged) merged_bytes += s->region.size;
  unmap_segments(std::move(merged));
  return std::max(fresh, checked_round_up(merged_bytes, kLargeGranule, "pinxfer: a segment"));
}

c10::DataPtr PinnedPool::take_cached_or_raise(const Request& request, size_t segment_size,
                                              const CapReached& reached) {
  {
    // The cap's relief may have completed events of this pool and so freed a
    // fit that is not a whole segment: look once more before giving up.
    std::lock_guard<std::mutex> lock(mutex_);
    if (c10::DataPtr hit = take_cached_locked(request)) return hit;
    ++stats_.num_ooms;
  }
  raise_out_of_memory(request.size, segment_size, reached);
}

c10::DataPtr PinnedPool::hand_out_new_segment(const Request& request, const HostRegion& region,
                                              const RegionTimings& timings,
                                              graph_pools::PoolId graph) {
  // The new segment's first block goes straight to the caller, in the same
  // critical section that makes the segment visible: no other thread ever sees
  // it free (see the invariants in pinned_pool.h).
  std::lock_guard<std::mutex> lock(mutex_);
  // The graph pool may have been released and its memory returned while this segment was
  // mapped (the capture ended, its graph was destroyed): no graph can read this memory, and
  // a segment of a pool with no free sets breaks the first split or free (found by review,
  // session 44). It is shared memory then.
  if (graph != graph_pools::kShared && graph_free_.find(graph) == graph_free_.end()) {
    graph = graph_pools::kShared;
  }
  auto* segment = new Segment{region, this, request.small, generation_, nullptr};
  auto* block = new Block();
  block->ptr = static_cast<char*>(region.ptr);
  block->size = region.size;
  block->segment = segment;
  block->in_use = true;
  segment->head = block;
  segment->graph = graph;
  if (graph != graph_pools::kShared) stats_.graph_segments.add(1);
  segments_.insert(segment);
  stats_.segments.add(1);
  stats_.reserved_bytes.add(static_cast<int64_t>(region.size));
  stats_.reserved_by_kind[static_cast<int>(region.kind)] += static_cast<int64_t>(region.size);
  ++stats_.num_segment_maps;
  ++stats_.num_cache_misses;
  stats_.map_time_ns += timings.map_ns;
  stats_.touch_time_ns += timings.touch_ns;
  stats_.lock_time_ns += timings.lock_ns;
  split_locked(block, request.rounded);
  return hand_out_locked(block, request.size);
}

c10::DataPtr PinnedPool::hand_out_locked(Block* block, size_t size) {
  TORCH_INTERNAL_ASSERT(block->in_use && block->pending_events == 0 && block->stream_uses.empty());
  block->requested = size;
  block->lived_unreported = fence_is_on();
  block->use_in_fence_batch = false;
  live_.insert(block);
  ++stats_.num_allocs;
  stats_.requested_bytes.add(static_cast<int64_t>(size));
  stats_.allocated_bytes.add(static_cast<int64_t>(block->size));
  allocated_high_water_ = std::max(allocated_high_water_, stats_.allocated_bytes.current);
  stats_.active_blocks.add(1);
  check_invariants_locked();
  return c10::DataPtr(block->ptr, block, &PinnedPool::delete_block,
                      c10::Device(c10::DeviceType::CPU));
}

void PinnedPool::split_locked(Block* block, size_t rounded) {
  const bool small = block->segment->small;
  if (block->size - rounded < (small ? kSmallGranule : kLargeGranule)) return;
  auto* rest = new Block();
  rest->ptr = block->ptr + rounded;
  rest->size = block->size - rounded;
  rest->segment = block->segment;
  rest->prev = block;
  rest->next = block->next;
  if (block->next) block->next->prev = rest;
  block->next = rest;
  block->size = rounded;
  free_set_locked(block->segment).insert(rest);  // rest->in_use is false: free
}

Block* PinnedPool::take_free_block_locked(size_t rounded, bool small) {
  return take_from_set_locked(small ? free_small_ : free_large_, rounded);
}

Block* PinnedPool::take_from_set_locked(FreeSet& free_set, size_t rounded) {
  Block key;
  key.size = rounded;
  key.ptr = nullptr;
  auto it = free_set.lower_bound(&key);
  if (it == free_set.end()) return nullptr;
  Block* block = *it;
  free_set.erase(it);
  // Same critical section as the erase: a concurrent free of a neighbour must
  // never see this block as free and merge into it.
  block->in_use = true;
  split_locked(block, rounded);
  return block;
}

bool PinnedPool::bin_holds_locked(size_t rounded) const {
  const size_t index = rounded / kSmallGranule;
  return index < bins_.size() && !bins_[index].empty();
}

Block* PinnedPool::take_binned_locked(size_t rounded) {
  if (!bin_holds_locked(rounded)) return nullptr;
  const size_t index = rounded / kSmallGranule;
  Block* block = bins_[index].back();
  bins_[index].pop_back();
  --binned_blocks_;
  block->binned = false;  // in_use stayed true while binned
  return block;
}

void PinnedPool::bin_locked(Block* block) {
  const size_t index = block->size / kSmallGranule;
  if (bins_.size() <= index) bins_.resize(kSmallMax / kSmallGranule + 1);
  block->requested = 0;
  block->pending_events = 0;
  block->stream_uses.clear();
  block->binned = true;
  bins_[index].push_back(block);
  ++binned_blocks_;
}

void PinnedPool::cache_freed_locked(Block* block) {
  if (block->segment->small && block->size <= kSmallMax &&
      block->segment->graph == graph_pools::kShared) {
    bin_locked(block);
  } else {
    return_to_free_locked(block);
  }
}

void PinnedPool::flush_bins_locked() {
  if (binned_blocks_ == 0) return;
  for (auto& bin : bins_) {
    for (Block* block : bin) {
      block->binned = false;
      return_to_free_locked(block);
    }
    bin.clear();
  }
  binned_blocks_ = 0;
}

void PinnedPool::return_to_free_locked(Block* block) {
  auto& free_set = free_set_locked(block->segment);
  block->in_use = false;
  block->requested = 0;
  block->pending_events = 0;
  block->stream_uses.clear();
  if (Block* prev = block->prev; prev && !prev->in_use) {
    free_set.erase(prev);
    prev->size += block->size;
    prev->next = block->next;
    if (block->next) block->next->prev = prev;
    delete block;
    block = prev;
  }
  if (Block* next = block->next; next && !next->in_use) {
    free_set.erase(next);
    block->size += next->size;
    block->next = next->next;
    if (next->next) next->next->prev = block;
    delete next;
  }
  free_set.insert(block);
}

#if PINXFER_DEBUG_INVARIANTS
void PinnedPool::check_invariants_locked() {
  // Walks every segment's block list; O(blocks), so debug/sanitizer builds only.
  size_t live_seen = 0, free_seen = 0, held_seen = 0, binned_seen = 0;
  for (Segment* seg : segments_) {
    TORCH_INTERNAL_ASSERT(seg->graph == graph_pools::kShared || graph_free_.count(seg->graph),
                          "a graph segment without its graph pool's free sets");
    auto& free_set = free_set_locked(seg);
    auto& other_set = seg->small ? free_large_ : free_small_;
    size_t bytes = 0;
    const Block* prev = nullptr;
    TORCH_INTERNAL_ASSERT(seg->head && seg->head->prev == nullptr, "segment without a head");
    for (const Block* b = seg->head; b; prev = b, b = b->next) {
      TORCH_INTERNAL_ASSERT(b->segment == seg && b->prev == prev, "broken block list");
      TORCH_INTERNAL_ASSERT(b->ptr == static_cast<char*>(seg->region.ptr) + bytes,
                            "blocks of a segment are not contiguous");
      const bool in_free = free_set.count(const_cast<Block*>(b)) != 0;
      TORCH_INTERNAL_ASSERT(!other_set.count(const_cast<Block*>(b)), "block in the wrong free set");
      TORCH_INTERNAL_ASSERT(b->in_use != in_free, "in_use must equal 'not in a free set'");
      const bool live = live_.count(const_cast<Block*>(b)) != 0;
      TORCH_INTERNAL_ASSERT(!live || b->in_use, "a live block is marked free");
      TORCH_INTERNAL_ASSERT(!(live && b->pending_events > 0), "a live block waits on events");
      const bool held = held_.count(const_cast<Block*>(b)) != 0;
      TORCH_INTERNAL_ASSERT(!held || (b->in_use && !live && b->pending_events == 0),
                            "a held block must be in use, not live, not pending");
      held_seen += held;
      TORCH_INTERNAL_ASSERT(!b->binned || (b->in_use && !live && !held && b->pending_events == 0 &&
                                           seg->graph == graph_pools::kShared && seg->small),
                            "a binned block must be in use, not live, held or pending, of a "
                            "shared small segment");
      binned_seen += b->binned;
      TORCH_INTERNAL_ASSERT(!(prev && !prev->in_use && !b->in_use), "two free neighbours");
      live_seen += live;
      free_seen += in_free;
      bytes += b->size;
    }
    TORCH_INTERNAL_ASSERT(bytes == seg->region.size, "blocks do not cover their segment");
  }
  TORCH_INTERNAL_ASSERT(live_seen == live_.size(), "a live block outside every segment");
  size_t graph_free = 0;
  for (const auto& [id, sets] : graph_free_) graph_free += sets.small.size() + sets.large.size();
  TORCH_INTERNAL_ASSERT(free_seen == free_small_.size() + free_large_.size() + graph_free,
                        "a free set holds a block of no segment");
  TORCH_INTERNAL_ASSERT(held_seen == held_.size(), "a held block outside every segment");
  size_t in_bins = 0;
  for (size_t index = 0; index < bins_.size(); ++index) {
    for (const Block* b : bins_[index]) {
      TORCH_INTERNAL_ASSERT(b->binned && b->size / kSmallGranule == index,
                            "a block in the wrong bin");
    }
    in_bins += bins_[index].size();
  }
  TORCH_INTERNAL_ASSERT(binned_seen == in_bins && in_bins == binned_blocks_,
                        "a binned block outside every segment, or a wrong count");
  // Each FIFO entry of a pending block stands for one of its pending events (a poisoned
  // block's other entries stay until their events are processed); a fence batch counts
  // the fenced entries behind its FIFO's last marker.
  size_t pending_entries = 0;
  for (const auto& [stream, fifo] : pending_) {
    size_t batch = 0;
    for (const PendingUse& u : fifo.uses) {
      if (u.kind == PendingUse::Kind::kFenceMarker) batch = 0;
      if (u.kind == PendingUse::Kind::kFencedBlock) ++batch;
      if (u.block == nullptr) continue;
      TORCH_INTERNAL_ASSERT(u.block->pending_events > 0 || u.block->pending_events == kPoisoned,
                            "a FIFO entry for a block that waits on no event");
      pending_entries += u.block->pending_events > 0;
    }
    TORCH_INTERNAL_ASSERT(batch == fifo.batch_blocks, "a fence batch miscounted");
  }
  size_t pending_events = 0;
  for (Segment* seg : segments_) {
    for (const Block* b = seg->head; b; b = b->next) {
      if (b->pending_events > 0) pending_events += static_cast<size_t>(b->pending_events);
    }
  }
  TORCH_INTERNAL_ASSERT(pending_entries == pending_events,
                        "a pending block's events and its FIFO entries disagree");
}
#endif

// ---- free: back to the free set, or to the stream FIFOs until the copies are done ----

void PinnedPool::delete_block(void* ctx) {
  auto* block = static_cast<Block*>(ctx);
  // A block inherited across fork() belongs to an abandoned pool whose lock
  // may be held by a thread that does not exist here: leave it alone.
  if (block->segment->generation != fork_generation()) return;
  block->segment->pool->free(block);
}

std::vector<c10::Stream> PinnedPool::streams_to_wait_for(std::vector<c10::Stream> uses,
                                                         LockKind kind, bool fence_unrecorded,
                                                         bool* fenced) {
  *fenced = false;
  // Only CUDA-registered memory can be read by a copy still in flight: without
  // a usable CUDA device (CPU build, no GPU, forked child) no CUDA work exists
  // in this process, and recording an event would be an error.
  if (kind != LockKind::kCudaRegistered && !cuda::cuda_usable()) return {};
  if (!uses.empty() || !fence_unrecorded) return uses;
  // No recorded use: torch's copy_(non_blocking=True) told only its own
  // allocator. Fence on the current stream, where such a copy most likely ran.
  c10::Stream current(c10::Stream::DEFAULT, c10::Device(c10::DeviceType::CPU));
  if (cuda::current_stream_if_active(&current)) {
    uses.push_back(current);
    *fenced = true;
  }
  return uses;
}

void PinnedPool::free(Block* block) {
  // State "freeing": out of live_, still in_use, in no free set and no FIFO,
  // so neither a neighbour's free nor empty_cache can touch it meanwhile.
  std::vector<c10::Stream> uses;
  LockKind kind;
  bool fence_unrecorded = false;
  bool use_in_fence_batch = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_INTERNAL_ASSERT(live_.erase(block) == 1, "pinxfer: freeing a block that is not live");
    use_in_fence_batch = block->use_in_fence_batch;
    block->use_in_fence_batch = false;
    ++stats_.num_frees;
    stats_.requested_bytes.add(-static_cast<int64_t>(block->requested));
    stats_.allocated_bytes.add(-static_cast<int64_t>(block->size));
    stats_.active_blocks.add(-1);
    if (block->segment->graph != graph_pools::kShared) {
      // A graph pool's block: events cannot tell when replays are done, and
      // the pool hands it to no one else anyway. Unused, it is free for the
      // same graph pool again (as in torch's private pools); used by a stream,
      // a replay may read it, so it is held until the pool is released.
      if (block->stream_uses.empty()) {
        return_to_free_locked(block);
      } else {
        hold_locked(block);
      }
      check_invariants_locked();
      return;
    }
    kind = block->segment->region.kind;
    fence_unrecorded = fenced_when_unrecorded_locked(block);
    // No stream to wait for (no recorded use, and no fence: streams_to_wait_for would
    // answer none): free in this critical section, without a second. A small block goes
    // to the bin of its size, where the next request of that size takes it.
    if (block->stream_uses.empty() && !fence_unrecorded) {
      cache_freed_locked(block);
      check_invariants_locked();
      return;
    }
    uses.swap(block->stream_uses);
  }
  debug_pause();
  bool fenced = false;
  const std::vector<c10::Stream> streams =
      streams_to_wait_for(std::move(uses), kind, fence_unrecorded, &fenced);
  // An event recorded on a capturing stream is captured and says nothing about when the
  // captured copy (or a replay) reads the block: the block is held until a device
  // synchronize with no capture open (record_use_event).
  // The fence of a small block, or its one use where the user of that stream said it may
  // wait so (UseWait::kFenceBatch): no event of its own, a place in the stream's fence batch
  // (one event for up to kFenceBatchBlocks frees, recorded at the batch's flush), so its
  // stream is only asked now. segment->small never changes.
  const bool in_fence_batch =
      block->segment->small && (fenced || (use_in_fence_batch && streams.size() == 1));
  std::vector<PendingUse> pending;
  std::vector<c10::Stream> waited;
  std::string error;
  StreamState state = StreamState::kClear;
  if (in_fence_batch) {
    state = capture_state(streams.front(), &error);
  } else {
    for (const auto& s : streams) {
      cuda::Event ev;
      state = record_use_event(s, &ev, &error);
      if (state != StreamState::kClear) break;
      pending.push_back({PendingUse::Kind::kBlock, ev, block});
      waited.push_back(s);
    }
  }
  std::lock_guard<std::mutex> lock(mutex_);
  if (fenced) ++stats_.num_fenced_frees;
  if (state != StreamState::kClear) {
    // The events recorded on the streams before are sound, but no longer needed.
    for (auto& p : pending) cuda::release_event(p.event);
    if (state == StreamState::kCapturing) {
      hold_locked(block);
    } else {
      // We cannot prove the copies reading this block are done: never reuse it.
      // It stays in_use (poisoned) and its memory stays reserved.
      ++stats_.num_event_errors;
      block->pending_events = kPoisoned;
      if (!g_warned_event_error.exchange(true)) {
        TORCH_WARN("pinxfer: could not record or check a CUDA event for a freed pinned block (",
                   error,
                   "); the block is kept out of the cache so no copy can read reused memory.");
      }
    }
    check_invariants_locked();
    return;
  }
  if (in_fence_batch) {
    fence_in_batch_locked(block, streams.front());
    check_invariants_locked();
    return;
  }
  if (pending.empty()) {
    cache_freed_locked(block);
  } else {
    block->pending_events = static_cast<int>(pending.size());
    stats_.pending_blocks.add(1);
    for (size_t i = 0; i < pending.size(); ++i) pending_[waited[i]].uses.push_back(pending[i]);
  }
  check_invariants_locked();
}

void PinnedPool::process_events_locked() {
  for (auto it = pending_.begin(); it != pending_.end();) {
    auto& queue = it->second.uses;
    // The marker found done for the fenced blocks ahead of it.
    const void* done_marker = nullptr;
    std::string marker_error;
    // Set at the first fenced block with no marker behind it: its batch is not flushed, so
    // it and every fenced block after it wait. Entries with events of their own behind them
    // are still checked, in order (found by review, session 53: a small send on the default
    // stream leaves a batch open there at each call, and a pinned source's or a large
    // block's event behind it would wait for the batch's flush).
    bool batch_open = false;
    for (auto use = queue.begin(); use != queue.end();) {
      std::string error;
      if (use->kind == PendingUse::Kind::kFencedBlock) {
        if (!batch_open) {
          // Covered by the first marker behind it. None: its batch is open, and so is the
          // batch of every fenced block after it (a flush queues its marker behind them all).
          const auto marker = std::find_if(use, queue.end(), [](const PendingUse& u) {
            return u.kind == PendingUse::Kind::kFenceMarker;
          });
          batch_open = marker == queue.end();
          if (!batch_open && marker->event.handle != done_marker) {
            marker_error.clear();
            if (!cuda::event_done(marker->event, &marker_error)) break;
            done_marker = marker->event.handle;
          }
        }
        if (batch_open) {
          ++use;
          continue;
        }
        error = marker_error;
      } else if (!cuda::event_done(use->event, &error)) {
        break;  // events on one stream complete in order: nothing behind it is done
      }
      // A marker: the blocks it covered were ahead of it, all released; its event goes
      // back to the free list, so it must not be taken for the next batch's.
      if (use->kind == PendingUse::Kind::kFenceMarker) done_marker = nullptr;
      release_pending_use_locked(*use, error);
      use = queue.erase(use);
    }
    it = queue.empty() ? pending_.erase(it) : std::next(it);
  }
  for (auto it = kept_.begin(); it != kept_.end();) {
    auto& queue = it->second;
    while (!queue.empty()) {
      std::string error;
      KeptStorage& front = queue.front();
      if (!cuda::event_done(front.event, &error)) break;
      cuda::release_event(front.event);
      // Released once its copy is proven done. If the event reports an error we cannot
      // prove it, so the reference is leaked on purpose (held forever, like a poisoned
      // block), and the FIFO goes on.
      if (error.empty()) {
        finished_storages_.push_back(std::move(front.storage));
      } else {
        ++stats_.num_event_errors;
        new c10::Storage(std::move(front.storage));  // never destroyed
      }
      queue.pop_front();
    }
    it = queue.empty() ? kept_.erase(it) : std::next(it);
  }
}

void PinnedPool::release_pending_use_locked(const PendingUse& use, const std::string& error) {
  if (use.kind != PendingUse::Kind::kFencedBlock) cuda::release_event(use.event);
  if (use.kind == PendingUse::Kind::kFenceMarker) return;
  Block* block = use.block;
  if (!error.empty()) {
    ++stats_.num_event_errors;
    if (block->pending_events > 0) stats_.pending_blocks.add(-1);
    block->pending_events = kPoisoned;  // never returns to the cache
    return;
  }
  if (block->pending_events > 0 && --block->pending_events == 0) {
    stats_.pending_blocks.add(-1);
    cache_freed_locked(block);  // its copies are done: as a free with nothing to wait for
  }
}

void PinnedPool::take_back_if_stream_idle_locked(size_t rounded) {
  if (pending_.empty() || !settings().idle_reclaim) return;
  c10::Stream current(c10::Stream::DEFAULT, c10::Device(c10::DeviceType::CPU));
  if (!cuda::current_stream_if_active(&current)) return;
  const auto it = pending_.find(current);
  if (it == pending_.end()) return;
  // Only a block of this size in the open batch (or the one just flushed: a batch closes
  // at its 8th block, a marker behind it) is worth the query: it is what a loop of
  // same-sized calls freed last, and the batch holds it back from the bin.
  const std::deque<PendingUse>& uses = it->second.uses;
  const size_t recent = std::min(uses.size(), kFenceBatchBlocks + 1);
  const bool batch_holds_size =
      std::any_of(uses.end() - recent, uses.end(), [&](const PendingUse& u) {
        return u.kind == PendingUse::Kind::kFencedBlock && u.block->size == rounded;
      });
  if (!batch_holds_size || graph_pools::any_capture_open()) return;
  std::string error;
  if (capture_state(current, &error) != StreamState::kClear) return;
  // Under the lock: every entry in the FIFO was queued, its event or marker recorded on
  // this stream, before this query, so an idle stream has completed them all.
  if (!cuda::stream_idle(current)) return;
  ++stats_.num_idle_reclaims;
  StreamFifo done = std::move(it->second);
  pending_.erase(it);
  // Oldest first, as process_events_locked would: the block freed last is binned last,
  // and a bin hands out its last block.
  for (const PendingUse& use : done.uses) release_pending_use_locked(use, /*error=*/"");
}

void PinnedPool::fence_in_batch_locked(Block* block, const c10::Stream& stream) {
  StreamFifo& fifo = pending_[stream];
  PendingUse use;
  use.kind = PendingUse::Kind::kFencedBlock;
  use.block = block;
  fifo.uses.push_back(std::move(use));
  block->pending_events = 1;
  stats_.pending_blocks.add(1);
  ++fifo.batch_blocks;
  fifo.batch_bytes += block->size;
  if (fifo.batch_blocks >= kFenceBatchBlocks || fifo.batch_bytes >= kFenceBatchBytes) {
    (void)flush_fence_locked(stream, fifo);
  }
}

cuda::Event PinnedPool::flush_fence_locked(const c10::Stream& stream, StreamFifo& fifo) {
  if (fifo.batch_blocks == 0) return {};
  fifo.batch_blocks = 0;
  fifo.batch_bytes = 0;
  // Recorded under the lock: a marker covers exactly the fenced entries queued before
  // it, each freed before this record.
  std::string error;
  cuda::Event marker;
  const StreamState state = record_use_event(stream, &marker, &error);
  const bool capturing = state == StreamState::kCapturing;
  if (state == StreamState::kClear) {
    PendingUse use;
    use.kind = PendingUse::Kind::kFenceMarker;
    use.event = marker;
    fifo.uses.push_back(std::move(use));
    ++stats_.num_fence_markers;
    return marker;
  }
  // No marker: the batch (the fenced entries behind the last marker) leaves the FIFO.
  // A capture began on the stream since the frees (or during the marker's record:
  // record_use_event): an event now would be captured, so the blocks are held, as a free
  // under capture is. A CUDA error: poisoned.
  auto last_marker = std::find_if(fifo.uses.rbegin(), fifo.uses.rend(), [](const PendingUse& u) {
    return u.kind == PendingUse::Kind::kFenceMarker;
  });
  auto batch_start = last_marker.base();  // the first entry after the last marker
  for (auto u = batch_start; u != fifo.uses.end();) {
    if (u->kind != PendingUse::Kind::kFencedBlock) {
      ++u;
      continue;
    }
    Block* block = u->block;
    u = fifo.uses.erase(u);
    stats_.pending_blocks.add(-1);
    if (capturing) {
      block->pending_events = 0;
      hold_locked(block);
    } else {
      ++stats_.num_event_errors;
      block->pending_events = kPoisoned;
    }
  }
  if (!capturing && !g_warned_event_error.exchange(true)) {
    TORCH_WARN("pinxfer: could not record or check a CUDA event for freed pinned blocks (", error,
               "); the blocks are kept out of the cache so no copy can read reused memory.");
  }
  return {};
}

std::vector<cuda::Event> PinnedPool::flush_fences_locked() {
  std::vector<cuda::Event> markers;
  for (auto& [stream, fifo] : pending_) {
    if (cuda::Event marker = flush_fence_locked(stream, fifo); marker.handle) {
      markers.push_back(marker);
    }
  }
  return markers;
}

void PinnedPool::flush_fences_and_wait(bool may_wait) {
  std::vector<cuda::Event> markers;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    markers = flush_fences_locked();
  }
  if (!may_wait) return;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stats_.num_event_waits += static_cast<int64_t>(markers.size());
  }
  // A marker may be recycled meanwhile (its blocks released by another thread): waiting
  // on it then is merely early or late (or fails); process_events decides from each event.
  for (const auto& marker : markers) (void)cuda::event_synchronize(marker);
}

void PinnedPool::keep_until_done(c10::Storage storage, const c10::Stream& stream) {
  const cuda::Event ev = cuda::record_event(stream);
  std::lock_guard<std::mutex> lock(mutex_);
  kept_[stream].push_back({ev, std::move(storage)});
}

void PinnedPool::release_finished() {
  std::vector<c10::Storage> drop;  // destroyed after the lock is released
  std::lock_guard<std::mutex> lock(mutex_);
  if (pending_.empty() && kept_.empty() && finished_storages_.empty()) return;
  process_events_locked();
  drop.swap(finished_storages_);
}

bool PinnedPool::record_stream(void* ctx, const c10::Stream& stream, UseWait wait) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto* block = static_cast<Block*>(ctx);
  if (!live_.count(block)) return false;
  if (std::find(block->stream_uses.begin(), block->stream_uses.end(), stream) ==
      block->stream_uses.end()) {
    block->stream_uses.push_back(stream);
  }
  block->use_in_fence_batch = wait == UseWait::kFenceBatch && block->stream_uses.size() == 1;
  return true;
}

void PinnedPool::synchronize_pending() {
  std::vector<cuda::Event> events;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    (void)flush_fences_locked();  // after it no FIFO ends with an entry that has no event
    for (auto& [stream, fifo] : pending_) {
      if (!fifo.uses.empty()) events.push_back(fifo.uses.back().event);
    }
  }
  // The last event of each stream covers the earlier ones (stream order).
  // An event may be recycled meanwhile; waiting on it then is merely early (or fails).
  // No wait while a capture is open (as release_cached's): the events done already are
  // still released below. The capture-begins lock is held across the waits, so none begins
  // during them (a check alone let one begin during a long wait; found by review, session 44).
  const auto no_capture = graph_pools::hold_off_captures_to_unmap();
  const bool wait = no_capture.owns_lock();
  if (wait) {
    for (const auto& ev : events) (void)cuda::event_synchronize(ev);
  }
  std::lock_guard<std::mutex> lock(mutex_);
  if (wait) stats_.num_event_waits += static_cast<int64_t>(events.size());
  process_events_locked();
}

// ---- releasing memory, stats, queries ----

std::vector<Segment*> PinnedPool::collect_free_segments_locked(std::optional<bool> small) {
  flush_bins_locked();  // a binned block keeps its segment from looking free
  std::vector<Segment*> out;
  for (auto* set : {&free_small_, &free_large_}) {
    if (small.has_value() && (set == &free_small_) != *small) continue;
    for (auto it = set->begin(); it != set->end();) {
      Block* b = *it;
      if (!b->prev && !b->next) {  // one free block spanning its whole segment
        out.push_back(b->segment);
        it = set->erase(it);
        delete b;
      } else {
        ++it;
      }
    }
  }
  for (Segment* s : out) {
    segments_.erase(s);
    stats_.segments.add(-1);
    stats_.reserved_bytes.add(-static_cast<int64_t>(s->region.size));
    stats_.reserved_by_kind[static_cast<int>(s->region.kind)] -=
        static_cast<int64_t>(s->region.size);
    ++stats_.num_segment_unmaps;
  }
  return out;
}

void PinnedPool::unmap_segments(std::vector<Segment*> segments) {
  int64_t ns = 0;
  for (Segment* s : segments) {
    ns += upstream_.unmap(s->region);
    delete s;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.unpin_time_ns += ns;
}

size_t PinnedPool::release_cached() {
  // While a CUDA graph capture pinxfer knows of is open, nothing is waited for or unmapped
  // (the cap's relief and empty_cache then release nothing; graph_pools.h says why), and
  // none begins from the first wait to the last unmap. The next call after the capture
  // releases what is free. (A capture pinxfer does not know of, begun without install(), is
  // met by unmap_region: a region CUDA would not unregister stays mapped.)
  const auto unmapping = graph_pools::hold_off_captures_to_unmap();
  flush_fences_and_wait(unmapping.owns_lock());
  std::vector<Segment*> segments;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    process_events_locked();
    if (!unmapping.owns_lock()) return 0;
    segments = collect_free_segments_locked(std::nullopt);
    // What is cached now is given back: the next misses size the pool afresh.
    allocated_high_water_ = stats_.allocated_bytes.current;
  }
  size_t bytes = 0;
  for (Segment* s : segments) bytes += s->region.size;
  unmap_segments(std::move(segments));
  return bytes;
}

PoolStats PinnedPool::stats() {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

void PinnedPool::reset_peak_stats() {
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.reset_peaks();
}

void PinnedPool::reset_accumulated_stats() {
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.reset_accumulated();
}

bool PinnedPool::overlaps_segments(uintptr_t lo, uintptr_t hi) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const Segment* seg : segments_) {
    const auto begin = reinterpret_cast<uintptr_t>(seg->region.ptr);
    if (lo < begin + seg->region.size && begin < hi) return true;
  }
  return false;
}

bool PinnedPool::owns_live_block(void* ctx) {
  std::lock_guard<std::mutex> lock(mutex_);
  return live_.count(static_cast<Block*>(ctx)) != 0;
}

LockKind PinnedPool::lock_kind_of(void* ctx) {
  return static_cast<Block*>(ctx)->segment->region.kind;
}

std::optional<LockKind> PinnedPool::lock_kind_if_pool(const c10::DataPtr& data) {
  if (data.get_deleter() != &PinnedPool::delete_block) return std::nullopt;
  const Segment* segment = static_cast<Block*>(data.get_context())->segment;
  // A forked child inherits the parent's blocks but neither their mlock nor
  // their CUDA registration: there they are plain pageable memory.
  if (segment->generation != fork_generation()) return LockKind::kPageable;
  return segment->region.kind;
}

// ---- CUDA graph pools (memory/graph_pools.h; csrc/README.md "Graph pools") ----
//
// A graph pool owns whole segments, so its blocks never split from or merge
// with a shared block: coalescing stays inside one owner, and nothing of a
// graph pool reaches the shared free sets until return_graph_memory().

PinnedPool::FreeSet& PinnedPool::free_set_locked(const Segment* segment) {
  if (segment->graph == graph_pools::kShared) return segment->small ? free_small_ : free_large_;
  auto it = graph_free_.find(segment->graph);
  TORCH_INTERNAL_ASSERT(it != graph_free_.end(), "pinxfer: a graph segment without free sets");
  return segment->small ? it->second.small : it->second.large;
}

namespace {
std::atomic<uint64_t> g_hold_sequence{0};
}  // namespace

uint64_t PinnedPool::hold_sequence() { return g_hold_sequence.load(); }

void PinnedPool::hold_locked(Block* block) {
  // State "held": in_use stays true (no neighbour merges into it, no unmap).
  block->held_seq = ++g_hold_sequence;
  block->requested = 0;
  block->stream_uses.clear();
  held_.insert(block);
  stats_.held_blocks.add(1);
}

std::optional<c10::DataPtr> PinnedPool::allocate_for_graph(const Request& request,
                                                           graph_pools::PoolId graph) {
  std::optional<c10::DataPtr> hit;
  // Under the registry's lock: a pool taken for return between the routing and here would
  // otherwise get its free sets back from the operator[] below, and a segment mapped for it
  // would stay a graph's that the registry no longer knows, never shared nor unmapped
  // (found by review, session 44).
  const bool registered = graph_pools::while_registered(graph, [&] {
    std::lock_guard<std::mutex> lock(mutex_);
    GraphFreeSets& sets = graph_free_[graph];  // created on the graph's first block here
    if (Block* block =
            take_from_set_locked(request.small ? sets.small : sets.large, request.rounded)) {
      ++stats_.num_cache_hits;
      ++stats_.num_graph_allocs;
      hit = hand_out_locked(block, request.size);
    }
  });
  if (!registered) return std::nullopt;
  if (hit) return hit;
  // A miss maps a segment for the graph alone (no merging of shared segments:
  // a graph keeps its memory until released, so it takes only what it needs).
  const size_t segment_size = request.small ? kSmallSegment : request.rounded;
  HostRegion region;
  RegionTimings timings;
  try {
    region = upstream_.map(segment_size, numa_node_, &timings);
  } catch (const CapReached& reached) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ++stats_.num_ooms;
    }
    raise_out_of_memory(request.size, segment_size, reached);
  }
  c10::DataPtr out = hand_out_new_segment(request, region, timings, graph);
  std::lock_guard<std::mutex> lock(mutex_);
  ++stats_.num_graph_allocs;
  return out;
}

std::vector<PinnedPool::BlockInfo> PinnedPool::block_infos() {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<BlockInfo> out;
  for (Segment* seg : segments_) {
    for (const Block* b = seg->head; b; b = b->next) {
      const bool live = live_.count(const_cast<Block*>(b)) != 0;
      out.push_back({reinterpret_cast<uintptr_t>(b->ptr), b->size, live,
                     b->in_use && !live && !b->binned, seg->graph});
    }
  }
  return out;
}

bool PinnedPool::holds_shared_blocks() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const Block* b : held_) {
    if (b->segment->graph == graph_pools::kShared) return true;
  }
  return false;
}

size_t PinnedPool::return_graph_memory(const std::vector<graph_pools::PoolId>& ids,
                                       uint64_t held_upto) {
  std::lock_guard<std::mutex> lock(mutex_);
  size_t returned = 0;
  for (Segment* seg : segments_) {
    if (seg->graph == graph_pools::kShared ||
        std::find(ids.begin(), ids.end(), seg->graph) == ids.end()) {
      continue;
    }
    // Move the segment's free blocks to the shared sets, then make it shared.
    FreeSet& from = free_set_locked(seg);
    FreeSet& to = seg->small ? free_small_ : free_large_;
    for (Block* b = seg->head; b; b = b->next) {
      if (!b->in_use) {
        from.erase(b);
        to.insert(b);
      }
    }
    seg->graph = graph_pools::kShared;
    stats_.graph_segments.add(-1);
  }
  for (const graph_pools::PoolId& id : ids) {
    auto it = graph_free_.find(id);
    if (it == graph_free_.end()) continue;
    TORCH_INTERNAL_ASSERT(it->second.small.empty() && it->second.large.empty(),
                          "pinxfer: a graph pool's free block outside its segments");
    graph_free_.erase(it);
  }
  // Held blocks of segments that are shared now (just returned, or freed under
  // a capture): the caller's synchronize proved their readers done.
  for (auto it = held_.begin(); it != held_.end();) {
    Block* b = *it;
    if (b->segment->graph != graph_pools::kShared || b->held_seq > held_upto) {
      ++it;  // a live graph may replay and read it / held after the synchronize began
      continue;
    }
    it = held_.erase(it);
    stats_.held_blocks.add(-1);
    return_to_free_locked(b);
    ++returned;
  }
  check_invariants_locked();
  return returned;
}

}  // namespace pinxfer
