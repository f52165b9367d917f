// Where a pool's segments come from: the upstream resource of RAPIDS rmm's
// composition (upstream resource -> pool -> adaptors), for page-locked host
// memory. A PinnedPool takes any HostResource; the one that talks to the OS is
// LockedRegionResource, and LimitingResource (memory/limit_adaptor.h) puts a
// cap in front of another resource. A shared-memory slot ring, say, would be
// one more implementation.
//
// Calls to map() and unmap() are rare (a pool miss, empty_cache), so they are
// virtual; a pool's cache hit never reaches its resource.
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>

#include "memory/host_region.h"
#include "memory/pool_stats.h"

namespace pinxfer {

// Thrown by HostResource::map() when a limit declines the bytes, after the
// relief the limit tried (memory/limit_adaptor.h). It is not a failure of the
// caller's: a pool catches it, looks at its free set once more, and raises
// c10::OutOfMemoryError from these figures. (A std::exception, so that one
// escaping a caller that does not expect it still reaches Python as an error.)
struct CapReached : std::exception {
  int64_t cap = 0;       // the limit, in bytes
  int64_t reserved = 0;  // bytes reserved under the limit when it declined
  PoolStats pools;       // what every pool under the limit held then
  const char* what() const noexcept override {
    return "pinxfer: the pinned-memory cap declined a new segment";
  }
};

// Thread safety: every implementation may be called from any thread, and is
// called without any pool lock held (a map can take seconds). Ownership: the
// caller owns each region it maps and gives it back with unmap() exactly once.
class HostResource {
 public:
  virtual ~HostResource() = default;
  // A region of at least `bytes` (rounded up to whole pages) of locked memory,
  // bound to `numa_node` (-1: unbound). Adds the time spent to *timings.
  // Throws CapReached when a limit declines, c10::OutOfMemoryError when the OS
  // refuses the mapping.
  virtual HostRegion map(size_t bytes, int numa_node, RegionTimings* timings) = 0;
  // Gives a region back. Never throws. Returns nanoseconds spent.
  virtual int64_t unmap(const HostRegion& region) = 0;
  // Bytes a map() could take now without a limit declining or relieving pressure
  // (INT64_MAX: no limit). A hint, read without a lock: other maps may take it first.
  virtual int64_t headroom() { return INT64_MAX; }
};

// Memory straight from the OS: map_locked_region() / unmap_region() of
// memory/host_region.h (mmap, huge pages, NUMA bind, parallel first touch,
// cudaHostRegister or mlock). Stateless.
class LockedRegionResource final : public HostResource {
 public:
  HostRegion map(size_t bytes, int numa_node, RegionTimings* timings) override {
    return map_locked_region(bytes, numa_node, timings);
  }
  int64_t unmap(const HostRegion& region) override { return unmap_region(region); }
};

}  // namespace pinxfer
