#include "memory/pool_stats.h"

#include <initializer_list>

namespace pinxfer {

void PoolStats::reset_peaks() {
  for (StatCounter* c : {&requested_bytes, &allocated_bytes, &reserved_bytes, &active_blocks,
                         &pending_blocks, &segments, &graph_segments, &held_blocks}) {
    c->peak = c->current;
  }
}

void PoolStats::reset_accumulated() {
  for (StatCounter* c : {&requested_bytes, &allocated_bytes, &reserved_bytes, &active_blocks,
                         &pending_blocks, &segments, &graph_segments, &held_blocks}) {
    c->gained = c->lost = 0;
  }
  num_allocs = num_frees = num_cache_hits = num_cache_misses = 0;
  num_segment_maps = num_segment_unmaps = num_segment_merges = 0;
  num_ooms = num_event_waits = num_fenced_frees = num_event_errors = 0;
  num_graph_allocs = num_fence_markers = num_idle_reclaims = 0;
  map_time_ns = touch_time_ns = lock_time_ns = unpin_time_ns = 0;
}

PoolStats& PoolStats::operator+=(const PoolStats& o) {
  for (auto [mine, theirs] : {std::pair{&requested_bytes, &o.requested_bytes},
                              {&allocated_bytes, &o.allocated_bytes},
                              {&reserved_bytes, &o.reserved_bytes},
                              {&active_blocks, &o.active_blocks},
                              {&pending_blocks, &o.pending_blocks},
                              {&segments, &o.segments},
                              {&graph_segments, &o.graph_segments},
                              {&held_blocks, &o.held_blocks}}) {
    mine->current += theirs->current;
    mine->peak += theirs->peak;
    mine->gained += theirs->gained;
    mine->lost += theirs->lost;
  }
  for (size_t k = 0; k < reserved_by_kind.size(); ++k) reserved_by_kind[k] += o.reserved_by_kind[k];
  for (auto [mine, theirs] : {std::pair{&num_allocs, &o.num_allocs},
                              {&num_frees, &o.num_frees},
                              {&num_cache_hits, &o.num_cache_hits},
                              {&num_cache_misses, &o.num_cache_misses},
                              {&num_segment_maps, &o.num_segment_maps},
                              {&num_segment_unmaps, &o.num_segment_unmaps},
                              {&num_segment_merges, &o.num_segment_merges},
                              {&num_ooms, &o.num_ooms},
                              {&num_event_waits, &o.num_event_waits},
                              {&num_fenced_frees, &o.num_fenced_frees},
                              {&num_fence_markers, &o.num_fence_markers},
                              {&num_idle_reclaims, &o.num_idle_reclaims},
                              {&num_event_errors, &o.num_event_errors},
                              {&map_time_ns, &o.map_time_ns},
                              {&touch_time_ns, &o.touch_time_ns},
                              {&lock_time_ns, &o.lock_time_ns},
                              {&unpin_time_ns, &o.unpin_time_ns},
                              {&num_graph_allocs, &o.num_graph_allocs}}) {
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
      {"graph_segments.current", graph_segments.current},
      {"graph_segments.peak", graph_segments.peak},
      {"held_blocks.current", held_blocks.current},
      {"held_blocks.peak", held_blocks.peak},
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
      {"num_fence_markers", num_fence_markers},
      {"num_idle_reclaims", num_idle_reclaims},
      {"num_event_errors", num_event_errors},
      {"num_graph_allocs", num_graph_allocs},
      {"pin_time_ns", map_time_ns + touch_time_ns + lock_time_ns},
      {"map_time_ns", map_time_ns},
      {"touch_time_ns", touch_time_ns},
      {"lock_time_ns", lock_time_ns},
      {"unpin_time_ns", unpin_time_ns},
  };
}

}  // namespace pinxfer
