#include "memory/pinned_pool.h"

#include <pthread.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cctype>
#include <cstdlib>
#include <chrono>
#include <map>
#include <thread>

#include <c10/util/Exception.h>

#include "memory/host_allocator.h"
#include "runtime/settings.h"
#include "runtime/thread_pool.h"

namespace pinxfer {

namespace {

constexpr size_t kSmallMax = size_t{1} << 20;      // requests up to 1 MiB use the small pool
constexpr size_t kSmallSegment = size_t{2} << 20;  // small pool maps 2 MiB segments
constexpr size_t kSmallGranule = 512;
constexpr size_t kLargeGranule = size_t{64} << 10;

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

size_t rounded_size(size_t size) {
  return size <= kSmallMax ? round_up(size, kSmallGranule) : round_up(size, kLargeGranule);
}

std::atomic<int64_t> g_reserved_total{0};
std::atomic<int64_t> g_limit{-1};  // -1: not read from the environment yet

int64_t limit_now() {
  int64_t limit = g_limit.load();
  if (limit >= 0) return limit;
  limit = settings().max_pinned_bytes;
  int64_t expected = -1;
  g_limit.compare_exchange_strong(expected, limit);
  return g_limit.load();
}

bool try_reserve(int64_t bytes) {
  const int64_t limit = limit_now();
  int64_t cur = g_reserved_total.load();
  do {
    if (limit > 0 && cur + bytes > limit) return false;
  } while (!g_reserved_total.compare_exchange_weak(cur, cur + bytes));
  return true;
}

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

std::atomic<bool> g_warned_event_error{false};

// Test-only: sleep between the critical sections of one allocate/free call so
// thread storms interleave there (tests/test_allocator.py, the regression test
// of the allocate/free race).
std::atomic<int64_t> g_debug_pause_us{0};
void debug_pause() {
  const int64_t us = g_debug_pause_us.load(std::memory_order_relaxed);
  if (us > 0) std::this_thread::sleep_for(std::chrono::microseconds(us));
}

}  // namespace

void set_debug_pause_us(int64_t us) { g_debug_pause_us.store(us < 0 ? 0 : us); }

int64_t parse_byte_size(const std::string& text) {
  size_t i = 0;
  while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
  size_t j = i;
  while (j < text.size() && (std::isdigit(static_cast<unsigned char>(text[j])) || text[j] == '.')) {
    ++j;
  }
  TORCH_CHECK(j > i, "pinxfer: cannot read a byte size from '", text,
              "': expected a number with an optional unit, e.g. 1073741824, 512MiB, 8G");
  const double value = std::stod(text.substr(i, j - i));
  std::string unit;
  for (size_t k = j; k < text.size(); ++k) {
    if (!std::isspace(static_cast<unsigned char>(text[k]))) {
      unit.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(text[k]))));
    }
  }
  double scale = 1;
  if (unit.empty() || unit == "b") {
    scale = 1;
  } else if (unit == "k" || unit == "kb" || unit == "kib") {
    scale = 1024.0;
  } else if (unit == "m" || unit == "mb" || unit == "mib") {
    scale = 1024.0 * 1024;
  } else if (unit == "g" || unit == "gb" || unit == "gib") {
    scale = 1024.0 * 1024 * 1024;
  } else if (unit == "t" || unit == "tb" || unit == "tib") {
    scale = 1024.0 * 1024 * 1024 * 1024;
  } else {
    TORCH_CHECK(false, "pinxfer: unknown byte unit '", unit, "' in '", text,
                "': use B, KiB, MiB, GiB or TiB (K, M, G, T also accepted, all binary)");
  }
  return static_cast<int64_t>(value * scale);
}

void set_max_pinned_bytes(int64_t bytes) {
  TORCH_CHECK(bytes >= 0, "pinxfer: the pinned-memory cap must be >= 0 bytes (0 = unlimited), got ",
              bytes);
  g_limit.store(bytes);
}

int64_t max_pinned_bytes() { return limit_now(); }

PinnedPool::PinnedPool(int numa_node) : numa_node_(numa_node), generation_(fork_generation()) {}

c10::DataPtr PinnedPool::allocate(size_t size) {
  if (size == 0) return c10::DataPtr(nullptr, c10::Device(c10::DeviceType::CPU));
  const size_t rounded = rounded_size(size);
  const bool small = size <= kSmallMax;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    process_events_locked();
    if (Block* block = take_free_block_locked(rounded, small)) {
      ++stats_.num_cache_hits;
      return hand_out_locked(block, size);
    }
  }
  debug_pause();
  // A miss in the large pool merges: fully free large segments (each too
  // small for this request, or best fit would have found it) are unmapped
  // and their bytes become part of one new segment. Reserved memory then
  // grows only by what the request needs beyond the free bytes, and the pool
  // tends towards few large segments in which splitting and coalescing work.
  size_t segment_size = small ? kSmallSegment : rounded;
  if (!small) {
    std::vector<Segment*> merged;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      merged = collect_free_segments_locked(/*small=*/false);
      if (!merged.empty()) ++stats_.num_segment_merges;
    }
    size_t merged_bytes = 0;
    for (Segment* s : merged) merged_bytes += s->region.size;
    segment_size = std::max(segment_size, round_up(merged_bytes, kLargeGranule));
    unmap_segments(std::move(merged));
  }
  // Under the cap: first give back fully free segments of every pool, then
  // wait for blocks whose copies are still in flight, then give up.
  for (int attempt = 0; !try_reserve(static_cast<int64_t>(segment_size)); ++attempt) {
    if (attempt == 0) {
      for (PinnedPool* p : all_pools()) p->release_cached();
    } else if (attempt == 1) {
      for (PinnedPool* p : all_pools()) p->synchronize_pending();
      for (PinnedPool* p : all_pools()) p->release_cached();
    } else {
      // Retry the free set once more: the steps above may have freed a fit.
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (Block* block = take_free_block_locked(rounded, small)) {
          ++stats_.num_cache_hits;
          return hand_out_locked(block, size);
        }
        ++stats_.num_ooms;
      }
      throw_out_of_memory(size, segment_size);
    }
  }
  HostRegion region;
  RegionTimings timings;
  try {
    region = map_locked_region(segment_size, numa_node_, &timings);
  } catch (...) {
    g_reserved_total.fetch_sub(static_cast<int64_t>(segment_size));
    throw;
  }
  // map_locked_region rounds to whole pages; keep the cap accounting exact.
  g_reserved_total.fetch_add(static_cast<int64_t>(region.size) -
                             static_cast<int64_t>(segment_size));
  debug_pause();
  // The new segment's first block goes straight to the caller, in the same
  // critical section that makes the segment visible: no other thread ever sees
  // it free (see the invariants in pinned_pool.h).
  std::lock_guard<std::mutex> lock(mutex_);
  auto* segment = new Segment{region, this, small, generation_, nullptr};
  auto* block = new Block();
  block->ptr = static_cast<char*>(region.ptr);
  block->size = region.size;
  block->segment = segment;
  block->in_use = true;
  segment->head = block;
  segments_.insert(segment);
  stats_.segments.add(1);
  stats_.reserved_bytes.add(static_cast<int64_t>(region.size));
  stats_.reserved_by_kind[static_cast<int>(region.kind)] += static_cast<int64_t>(region.size);
  ++stats_.num_segment_maps;
  ++stats_.num_cache_misses;
  stats_.map_time_ns += timings.map_ns;
  stats_.touch_time_ns += timings.touch_ns;
  stats_.lock_time_ns += timings.lock_ns;
  split_locked(block, rounded);
  return hand_out_locked(block, size);
}

c10::DataPtr PinnedPool::hand_out_locked(Block* block, size_t size) {
  TORCH_INTERNAL_ASSERT(block->in_use && block->pending_events == 0 && block->stream_uses.empty());
  block->requested = size;
  live_.insert(block);
  ++stats_.num_allocs;
  stats_.requested_bytes.add(static_cast<int64_t>(size));
  stats_.allocated_bytes.add(static_cast<int64_t>(block->size));
  stats_.active_blocks.add(1);
  check_invariants_locked();
  return c10::DataPtr(block->ptr, block, &PinnedPool::delete_block,
                      c10::Device(c10::DeviceType::CPU));
}

void PinnedPool::throw_out_of_memory(size_t size, size_t segment_size) {
  const int64_t reserved = g_reserved_total.load();
  int64_t cached = 0, requested = 0;
  for (PinnedPool* p : all_pools()) {
    const PoolStats s = p->stats();
    cached += s.cached_bytes();
    requested += s.requested_bytes.current;
  }
  TORCH_CHECK_WITH(
      OutOfMemoryError, false, "pinxfer: out of pinned memory. Asked for ", human(size),
      ", which needs a new segment of ", human(segment_size), ", but the cap is ",
      human(limit_now()), ". Pinned now: ", human(reserved), ", of which cached (free) ",
      human(cached), "; requested by live tensors: ", human(requested),
      ". Free pinned tensors, call pinxfer.empty_cache(), or raise the cap "
      "(pinxfer.set_max_pinned_bytes() or PINXFER_MAX_PINNED_BYTES).");
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
  (small ? free_small_ : free_large_).insert(rest);  // rest->in_use is false: free
}

Block* PinnedPool::take_free_block_locked(size_t rounded, bool small) {
  auto& free_set = small ? free_small_ : free_large_;
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

void PinnedPool::return_to_free_locked(Block* block) {
  auto& free_set = block->segment->small ? free_small_ : free_large_;
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
  size_t live_seen = 0, free_seen = 0;
  for (Segment* seg : segments_) {
    auto& free_set = seg->small ? free_small_ : free_large_;
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
      TORCH_INTERNAL_ASSERT(!(prev && !prev->in_use && !b->in_use), "two free neighbours");
      live_seen += live;
      free_seen += in_free;
      bytes += b->size;
    }
    TORCH_INTERNAL_ASSERT(bytes == seg->region.size, "blocks do not cover their segment");
  }
  TORCH_INTERNAL_ASSERT(live_seen == live_.size(), "a live block outside every segment");
  TORCH_INTERNAL_ASSERT(free_seen == free_small_.size() + free_large_.size(),
                        "a free set holds a block of no segment");
}
#endif

void PinnedPool::delete_block(void* ctx) {
  auto* block = static_cast<Block*>(ctx);
  // A block inherited across fork() belongs to an abandoned pool whose lock
  // may be held by a thread that does not exist here: leave it alone.
  if (block->segment->generation != fork_generation()) return;
  block->segment->pool->free(block);
}

void PinnedPool::free(Block* block) {
  // State "freeing": out of live_, still in_use, in no free set and no FIFO,
  // so neither a neighbour's free nor empty_cache can touch it meanwhile.
  std::vector<c10::Stream> streams;
  LockKind kind;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_INTERNAL_ASSERT(live_.erase(block) == 1, "pinxfer: freeing a block that is not live");
    ++stats_.num_frees;
    stats_.requested_bytes.add(-static_cast<int64_t>(block->requested));
    stats_.allocated_bytes.add(-static_cast<int64_t>(block->size));
    stats_.active_blocks.add(-1);
    streams.swap(block->stream_uses);
    kind = block->segment->region.kind;
  }
  debug_pause();
  // Only CUDA-registered memory can be read by a copy still in flight: without
  // a usable CUDA device (CPU build, no GPU, forked child) no CUDA work exists
  // in this process, and recording an event would be an error.
  if (kind != LockKind::kCudaRegistered && !cuda::cuda_usable()) streams.clear();
  bool fenced = false;
  // Once installed, torch's copy_(non_blocking=True) records its streams with
  // us, exactly as it does with its own allocator; the fence is then redundant.
  if (streams.empty() && kind == LockKind::kCudaRegistered && !host_allocator_installed()) {
    c10::Stream current(c10::Stream::DEFAULT, c10::Device(c10::DeviceType::CPU));
    if (cuda::current_stream_if_active(&current)) {
      streams.push_back(current);
      fenced = true;
    }
  }
  std::vector<PendingUse> uses;
  bool event_failed = false;
  std::string error;
  for (const auto& s : streams) {
    cuda::Event ev;
    if (cuda::try_record_event(s, &ev, &error)) {
      uses.push_back({ev, block});
    } else {
      event_failed = true;
    }
  }
  std::lock_guard<std::mutex> lock(mutex_);
  if (fenced) ++stats_.num_fenced_frees;
  if (event_failed) {
    // We cannot prove the copies reading this block are done: never reuse it.
    // It stays in_use (poisoned) and its memory stays reserved.
    ++stats_.num_event_errors;
    block->pending_events = kPoisoned;
    if (!g_warned_event_error.exchange(true)) {
      TORCH_WARN("pinxfer: could not record a CUDA event for a freed pinned block (", error,
                 "); the block is kept out of the cache so no copy can read reused memory.");
    }
    for (auto& u : uses) cuda::release_event(u.event);
    check_invariants_locked();
    return;
  }
  if (uses.empty()) {
    return_to_free_locked(block);
  } else {
    block->pending_events = static_cast<int>(uses.size());
    stats_.pending_blocks.add(1);
    for (size_t i = 0; i < uses.size(); ++i) pending_[streams[i]].push_back(uses[i]);
  }
  check_invariants_locked();
}

void PinnedPool::process_events_locked() {
  for (auto it = pending_.begin(); it != pending_.end();) {
    auto& queue = it->second;
    while (!queue.empty()) {
      std::string error;
      PendingUse& front = queue.front();
      if (!cuda::event_done(front.event, &error)) break;
      cuda::release_event(front.event);
      Block* block = front.block;
      queue.pop_front();
      if (!error.empty()) {
        ++stats_.num_event_errors;
        if (block->pending_events > 0) stats_.pending_blocks.add(-1);
        block->pending_events = kPoisoned;  // never returns to the cache
        continue;
      }
      if (block->pending_events > 0 && --block->pending_events == 0) {
        stats_.pending_blocks.add(-1);
        return_to_free_locked(block);
      }
    }
    it = queue.empty() ? pending_.erase(it) : std::next(it);
  }
}

bool PinnedPool::record_stream(void* ctx, const c10::Stream& stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto* block = static_cast<Block*>(ctx);
  if (!live_.count(block)) return false;
  if (std::find(block->stream_uses.begin(), block->stream_uses.end(), stream) ==
      block->stream_uses.end()) {
    block->stream_uses.push_back(stream);
  }
  return true;
}

void PinnedPool::synchronize_pending() {
  std::vector<cuda::Event> events;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& [stream, queue] : pending_) {
      if (!queue.empty()) events.push_back(queue.back().event);
    }
    stats_.num_event_waits += static_cast<int64_t>(events.size());
  }
  // The last event of each stream covers the earlier ones (stream order).
  // An event may be recycled meanwhile; waiting on it then is merely early.
  for (const auto& ev : events) cuda::event_synchronize(ev);
  std::lock_guard<std::mutex> lock(mutex_);
  process_events_locked();
}

std::vector<Segment*> PinnedPool::collect_free_segments_locked(std::optional<bool> small) {
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
    stats_.reserved_by_kind[static_cast<int>(s->region.kind)] -= static_cast<int64_t>(s->region.size);
    ++stats_.num_segment_unmaps;
  }
  return out;
}

void PinnedPool::unmap_segments(std::vector<Segment*> segments) {
  int64_t ns = 0;
  for (Segment* s : segments) {
    ns += unmap_region(s->region);
    g_reserved_total.fetch_sub(static_cast<int64_t>(s->region.size));
    delete s;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.unpin_time_ns += ns;
}

size_t PinnedPool::release_cached() {
  std::vector<Segment*> segments;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    process_events_locked();
    segments = collect_free_segments_locked(std::nullopt);
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
  for (StatCounter* c : {&stats_.requested_bytes, &stats_.allocated_bytes, &stats_.reserved_bytes,
                         &stats_.active_blocks, &stats_.pending_blocks, &stats_.segments}) {
    c->peak = c->current;
  }
}

void PinnedPool::reset_accumulated_stats() {
  std::lock_guard<std::mutex> lock(mutex_);
  PoolStats& s = stats_;
  s.num_allocs = s.num_frees = s.num_cache_hits = s.num_cache_misses = 0;
  s.num_segment_maps = s.num_segment_unmaps = s.num_segment_merges = 0;
  s.num_ooms = s.num_event_waits = s.num_fenced_frees = s.num_event_errors = 0;
  s.map_time_ns = s.touch_time_ns = s.lock_time_ns = s.unpin_time_ns = 0;
}

PoolStats& PoolStats::operator+=(const PoolStats& o) {
  for (auto [mine, theirs] : {std::pair{&requested_bytes, &o.requested_bytes},
                              {&allocated_bytes, &o.allocated_bytes},
                              {&reserved_bytes, &o.reserved_bytes},
                              {&active_blocks, &o.active_blocks},
                              {&pending_blocks, &o.pending_blocks}, {&segments, &o.segments}}) {
    mine->current += theirs->current;
    mine->peak += theirs->peak;
  }
  for (size_t k = 0; k < reserved_by_kind.size(); ++k) reserved_by_kind[k] += o.reserved_by_kind[k];
  for (auto [mine, theirs] :
       {std::pair{&num_allocs, &o.num_allocs}, {&num_frees, &o.num_frees},
        {&num_cache_hits, &o.num_cache_hits}, {&num_cache_misses, &o.num_cache_misses},
        {&num_segment_maps, &o.num_segment_maps}, {&num_segment_unmaps, &o.num_segment_unmaps},
        {&num_segment_merges, &o.num_segment_merges}, {&num_ooms, &o.num_ooms},
        {&num_event_waits, &o.num_event_waits}, {&num_fenced_frees, &o.num_fenced_frees},
        {&num_event_errors, &o.num_event_errors}, {&map_time_ns, &o.map_time_ns},
        {&touch_time_ns, &o.touch_time_ns}, {&lock_time_ns, &o.lock_time_ns},
        {&unpin_time_ns, &o.unpin_time_ns}}) {
    *mine += *theirs;
  }
  return *this;
}

std::vector<std::pair<const char*, int64_t>> PoolStats::items() const {
  auto kind = [&](LockKind k) { return reserved_by_kind[static_cast<int>(k)]; };
  return {
      {"requested_bytes.current", requested_bytes.current},
      {"requested_bytes.peak", requested_bytes.peak},
      {"allocated_bytes.current", allocated_bytes.current},
      {"allocated_bytes.peak", allocated_bytes.peak},
      {"reserved_bytes.current", reserved_bytes.current},
      {"reserved_bytes.peak", reserved_bytes.peak},
      {"cached_bytes.current", cached_bytes()},
      {"active_blocks.current", active_blocks.current},
      {"active_blocks.peak", active_blocks.peak},
      {"pending_blocks.current", pending_blocks.current},
      {"pending_blocks.peak", pending_blocks.peak},
      {"segments.current", segments.current},
      {"segments.peak", segments.peak},
      {"reserved_bytes.cuda_registered", kind(LockKind::kCudaRegistered)},
      {"reserved_bytes.mlocked", kind(LockKind::kMlocked)},
      {"reserved_bytes.pageable", kind(LockKind::kPageable)},
      {"num_allocs", num_allocs},
      {"num_frees", num_frees},
      {"num_cache_hits", num_cache_hits},
      {"num_cache_misses", num_cache_misses},
      {"num_segment_maps", num_segment_maps},
      {"num_segment_unmaps", num_segment_unmaps},
      {"num_segment_merges", num_segment_merges},
      {"num_ooms", num_ooms},
      {"num_event_waits", num_event_waits},
      {"num_fenced_frees", num_fenced_frees},
      {"num_event_errors", num_event_errors},
      {"pin_time_ns", map_time_ns + touch_time_ns + lock_time_ns},
      {"map_time_ns", map_time_ns},
      {"touch_time_ns", touch_time_ns},
      {"lock_time_ns", lock_time_ns},
      {"unpin_time_ns", unpin_time_ns},
  };
}

LockKind PinnedPool::lock_kind_of(void* ctx) {
  return static_cast<Block*>(ctx)->segment->region.kind;
}

std::optional<LockKind> PinnedPool::lock_kind_if_pool(const c10::DataPtr& data) {
  if (data.get_deleter() != &PinnedPool::delete_block) return std::nullopt;
  return static_cast<Block*>(data.get_context())->segment->region.kind;
}

namespace {
std::mutex g_pools_mutex;
// Leaked on purpose (safe at exit). LOCK: g_pools_mutex
std::map<int, PinnedPool*>* g_pools = new std::map<int, PinnedPool*>();
// Lock-free lookup for the usual nodes (slot node + 1); a pool, once made,
// lives for the process, so a published pointer never dangles. Cleared in a
// forked child together with g_pools.
constexpr int kMaxFastNode = 63;
std::array<std::atomic<PinnedPool*>, kMaxFastNode + 2> g_pool_by_node{};

void pools_child_after_fork() {
  // Abandon the parent's pools: their locks may be held by threads that do
  // not exist in the child, and their memory is registered with the parent's
  // CUDA context. The child starts empty and (cuda_usable() is false) mlocks.
  new (&g_pools_mutex) std::mutex();
  g_pools = new std::map<int, PinnedPool*>();
  for (auto& slot : g_pool_by_node) slot.store(nullptr);
  g_reserved_total.store(0);
}

struct PoolForkHandlerInstaller {
  PoolForkHandlerInstaller() { pthread_atfork(nullptr, nullptr, &pools_child_after_fork); }
} g_pool_fork_handler;
}  // namespace

PinnedPool& pool_for_node(int numa_node) {
  // Every allocation asks: nodes -1..kMaxFastNode are answered without the lock.
  const bool cached = numa_node >= -1 && numa_node <= kMaxFastNode;
  if (cached) {
    if (PinnedPool* pool = g_pool_by_node[numa_node + 1].load(std::memory_order_acquire)) {
      return *pool;
    }
  }
  std::lock_guard<std::mutex> lock(g_pools_mutex);
  auto it = g_pools->find(numa_node);
  PinnedPool* pool = it != g_pools->end() ? it->second : nullptr;
  if (pool == nullptr) {
    pool = new PinnedPool(numa_node);
    g_pools->emplace(numa_node, pool);
  }
  if (cached) g_pool_by_node[numa_node + 1].store(pool, std::memory_order_release);
  return *pool;
}

std::vector<PinnedPool*> all_pools() {
  std::lock_guard<std::mutex> lock(g_pools_mutex);
  std::vector<PinnedPool*> out;
  for (auto& [node, pool] : *g_pools) out.push_back(pool);
  return out;
}

PinnedPool* PinnedPool::owner_of(void* ctx) {
  for (PinnedPool* pool : all_pools()) {
    std::lock_guard<std::mutex> lock(pool->mutex_);
    if (pool->live_.count(static_cast<Block*>(ctx))) return pool;
  }
  return nullptr;
}

}  // namespace pinxfer
