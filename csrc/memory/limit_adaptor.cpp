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
  do {
    if (limit > 0 && current + bytes > limit) return false;
  } while (!reserved_.compare_exchange_weak(current, current + bytes));
  return true;
}

bool LimitingResource::reserve_with_relief(int64_t bytes) {
  if (try_reserve(bytes)) return true;
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
