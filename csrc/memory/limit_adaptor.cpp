#include "memory/limit_adaptor.h"

#include <c10/util/Exception.h>

#include <algorithm>

namespace pinxfer {

LimitingResource::LimitingResource(HostResource& upstream, DefaultCap default_cap)
    : upstream_(upstream), default_cap_(default_cap) {}

void LimitingResource::set_relief(Relief* relief) { relief_.store(relief); }

void LimitingResource::set_cap(int64_t bytes) {
  TORCH_CHECK(bytes >= 0, "pinxfer: the pinned-memory cap must be >= 0 bytes (0 = unlimited), got ",
              bytes);
  cap_.store(bytes);
}

int64_t LimitingResource::cap() {
  const int64_t cap = cap_.load();
  if (cap != kCapNotRead) return cap;
  // A default that throws (malformed environment) leaves the cap unread, so
  // every map reports the same error until set_cap() replaces it.
  int64_t expected = kCapNotRead;
  cap_.compare_exchange_strong(expected, default_cap_());
  return cap_.load();
}

bool LimitingResource::try_reserve(int64_t bytes) {
  const int64_t limit = cap();
  int64_t current = reserved_.load();
  int64_t after = 0;
  do {
    // A request near 2^63 bytes (a size checked_round_up still accepts) would overflow the
    // sum and pass the cap (found by review, session 44): refused here, mmap refuses it too.
    if (__builtin_add_overflow(current, bytes, &after)) return false;
    if (limit > 0 && after > limit) return false;
  } while (!reserved_.compare_exchange_weak(current, after));
  return true;
}

bool LimitingResource::reserve_with_relief(int64_t bytes) {
  if (try_reserve(bytes)) return true;
  // Above the cap on its own: no relief makes room, and relief would unmap every pool's
  // cache and synchronize for nothing.
  if (const int64_t limit = cap(); limit > 0 && bytes > limit) return false;
  Relief* relief = relief_.load();
  if (relief == nullptr) return false;
  relief->release_cached();
  if (try_reserve(bytes)) return true;
  relief->wait_for_events_then_release();
  return try_reserve(bytes);
}

HostRegion LimitingResource::map(size_t bytes, int numa_node, RegionTimings* timings) {
  const auto asked = static_cast<int64_t>(bytes);
  if (!reserve_with_relief(asked)) {
    // Uncapped, only a sum past 2^63 - 1 bytes is refused: no machine has that memory.
    TORCH_CHECK_WITH(OutOfMemoryError, cap() > 0, "pinxfer: out of pinned memory: ", bytes,
                     " bytes more than the ", reserved_.load(),
                     " bytes pinned now is past the largest size pinxfer can count (2^63 - 1 "
                     "bytes)");
    CapReached reached;
    reached.cap = cap();
    reached.reserved = reserved_.load();
    if (Relief* relief = relief_.load()) reached.pools = relief->stats();
    throw reached;
  }
  HostRegion region;
  try {
    region = upstream_.map(bytes, numa_node, timings);
  } catch (...) {
    reserved_.fetch_sub(asked);
    throw;
  }
  // The upstream rounds to whole pages: count what it really mapped.
  reserved_.fetch_add(static_cast<int64_t>(region.size) - asked);
  return region;
}

int64_t LimitingResource::headroom() {
  const int64_t limit = cap();
  return limit > 0 ? std::max<int64_t>(0, limit - reserved_.load()) : INT64_MAX;
}

int64_t LimitingResource::unmap(const HostRegion& region) {
  const int64_t ns = upstream_.unmap(region);
  reserved_.fetch_sub(static_cast<int64_t>(region.size));
  return ns;
}

}  // namespace pinxfer
