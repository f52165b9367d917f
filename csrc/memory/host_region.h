// Page-locked host memory straight from the OS: what LockedRegionResource
// (memory/host_resource.h), the pools' upstream, maps and unmaps.
//
// map_locked_region() does, in order:
//   1. mmap anonymous memory (2 MiB-aligned when the region is >= 2 MiB),
//   2. madvise(MADV_HUGEPAGE) for regions >= 2 MiB (fewer faults, faster
//      registration; a no-op where THP is "never"),
//   3. mbind to a NUMA node when one is given, before any page exists,
//   4. first touch spread over the node's persistent thread pool,
//   5. page-lock: cudaHostRegister when a CUDA device is usable, else mlock(2).
// If locking fails (memlock limit, driver error) the region stays pageable and
// one warning per failure kind is printed; mapping itself failing is an error.
//
// Stateless and thread-safe; the caller owns the region and must pass it to
// unmap_region() exactly once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace pinxfer {

enum class LockKind : uint8_t {
  kCudaRegistered,  // cudaHostRegister: DMA-able, torch's is_pinned() is true
  kMlocked,         // mlock(2): resident and locked, CUDA not in use
  kPageable,        // locking failed; ordinary memory (a warning was printed)
};
const char* lock_kind_name(LockKind kind);

struct HostRegion {
  void* ptr = nullptr;
  size_t size = 0;           // bytes usable by the caller
  void* map_base = nullptr;  // what mmap returned (before alignment trimming)
  size_t map_size = 0;
  LockKind kind = LockKind::kPageable;
  int numa_node = -1;
};

struct RegionTimings {
  int64_t map_ns = 0;
  int64_t touch_ns = 0;
  int64_t lock_ns = 0;  // cudaHostRegister or mlock
};

// Throws c10::Error (out of memory) if the OS refuses the mapping.
HostRegion map_locked_region(size_t size, int numa_node, RegionTimings* timings);

// Unlocks and unmaps. Never throws. A region whose cudaHostUnregister fails is warned
// about and left mapped and locked (leaked): see the body for why it is not unmapped.
// Returns nanoseconds spent.
int64_t unmap_region(const HostRegion& region);

constexpr size_t kHugePageSize = size_t{2} << 20;

}  // namespace pinxfer
