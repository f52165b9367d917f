// The pool's counters, typed: what pinxfer.memory_stats(), torch's HostStats
// and the out-of-memory report read. Plain data, no locking of its own: a
// PinnedPool guards its PoolStats with its mutex_ and hands out copies.
#pragma once

#include <array>
#include <cstdint>
#include <utility>
#include <vector>

#include "memory/host_region.h"

namespace pinxfer {

// A gauge with its high-water mark since the last reset_peaks(), and what it gained and lost
// since the last reset_accumulated() (torch's HostStats reports them as allocated / freed).
struct StatCounter {
  int64_t current = 0, peak = 0;
  int64_t gained = 0, lost = 0;
  void add(int64_t v) {
    current += v;
    if (v >= 0) {
      gained += v;
    } else {
      lost -= v;
    }
    if (current > peak) peak = current;
  }
};

// Byte figures are exact. Named fields for C++ readers; items() gives the
// names Python sees.
struct PoolStats {
  StatCounter requested_bytes;  // what live tensors asked for
  StatCounter allocated_bytes;  // what live blocks span (rounded)
  StatCounter reserved_bytes;   // mapped and locked by the pool
  StatCounter active_blocks;
  StatCounter pending_blocks;  // freed, waiting on events
  StatCounter segments;
  StatCounter graph_segments;                 // segments owned by a CUDA graph pool (of `segments`)
  StatCounter held_blocks;                    // freed, held for CUDA graphs until released
  std::array<int64_t, 3> reserved_by_kind{};  // indexed by LockKind
  int64_t num_allocs = 0, num_frees = 0, num_cache_hits = 0, num_cache_misses = 0;
  int64_t num_segment_maps = 0, num_segment_unmaps = 0, num_segment_merges = 0;
  int64_t num_ooms = 0, num_event_waits = 0, num_fenced_frees = 0, num_event_errors = 0;
  int64_t num_graph_allocs = 0;   // allocations routed to a CUDA graph pool
  int64_t num_fence_markers = 0;  // events recorded for fence batches (each covers <= 8 frees)
  int64_t num_idle_reclaims = 0;  // FIFOs released at once, their stream found idle (pin_memory)
  int64_t map_time_ns = 0, touch_time_ns = 0, lock_time_ns = 0, unpin_time_ns = 0;

  int64_t cached_bytes() const { return reserved_bytes.current - allocated_bytes.current; }
  // Sums counters; peaks of different pools add up to an upper bound.
  PoolStats& operator+=(const PoolStats& other);
  // Peaks drop to the current values (pinxfer.reset_peak_memory_stats()).
  void reset_peaks();
  // The num_* counters and the timers drop to zero; gauges are kept.
  void reset_accumulated();
  // (name, value) in memory_stats() order, e.g. ("reserved_bytes.current", n).
  std::vector<std::pair<const char*, int64_t>> items() const;
};

}  // namespace pinxfer
