#include "memory/host_region.h"

#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>

#include <c10/util/Exception.h>
#include <c10/util/Logging.h>

#include "runtime/cuda_runtime.h"
#include "runtime/numa.h"
#include "runtime/steady_time.h"
#include "runtime/thread_pool.h"

namespace pinxfer {

const char* lock_kind_name(LockKind kind) {
  switch (kind) {
    case LockKind::kCudaRegistered:
      return "cuda_registered";
    case LockKind::kMlocked:
      return "mlocked";
    case LockKind::kPageable:
      return "pageable";
  }
  return "unknown";
}

namespace {

std::atomic<bool> g_warned_register{false};
std::atomic<bool> g_warned_mlock{false};
std::atomic<bool> g_warned_mbind{false};

void warn_once(std::atomic<bool>& flag, const std::string& text) {
  if (!flag.exchange(true)) TORCH_WARN(text);
}

size_t page_size() {
  static const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return page;
}

void touch_pages(char* base, size_t size, int numa_node) {
  const size_t page = page_size();
  // One fault per 2 MiB chunk with huge pages, one per 4 KiB without; spread
  // chunks over threads so the kernel zeroes pages on many cores at once.
  const size_t chunks = (size + kHugePageSize - 1) / kHugePageSize;
  auto touch = [&](size_t begin, size_t end) {
    for (size_t c = begin; c < end; ++c) {
      char* lo = base + c * kHugePageSize;
      char* hi = base + std::min(size, (c + 1) * kHugePageSize);
      for (char* p = lo; p < hi; p += page) {
        *reinterpret_cast<volatile char*>(p) = 0;
      }
    }
  };
  if (size < (size_t{8} << 20)) {
    touch(0, chunks);  // waking threads costs more than touching a few MiB
  } else {
    thread_pool_for_node(numa_node).parallel_for(chunks, 1, touch);
  }
}
}  // namespace

HostRegion map_locked_region(size_t size, int numa_node, RegionTimings* timings) {
  TORCH_CHECK(size > 0, "pinxfer: internal error, mapping an empty region");
  HostRegion region;
  region.numa_node = numa_node;
  const bool huge = size >= kHugePageSize;
  const size_t page = page_size();
  const size_t rounded = (size + page - 1) / page * page;
  // Over-map by one huge page so the region can start on a 2 MiB boundary.
  const size_t map_size = huge ? rounded + kHugePageSize : rounded;

  int64_t t0 = steady_now_ns();
  void* base = mmap(nullptr, map_size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (base == MAP_FAILED) {
    const int err = errno;
    TORCH_CHECK_WITH(OutOfMemoryError, false, "pinxfer: mmap of ", map_size,
                     " bytes of host memory failed: ", std::strerror(err),
                     ". Free memory, lower the pinned cap (PINXFER_MAX_PINNED_BYTES) or call "
                     "pinxfer.empty_cache().");
  }
  char* start = static_cast<char*>(base);
  if (huge) {
    const auto addr = reinterpret_cast<uintptr_t>(base);
    const uintptr_t aligned = (addr + kHugePageSize - 1) & ~(kHugePageSize - 1);
    start = reinterpret_cast<char*>(aligned);
    // Give the unaligned head and tail back so only `rounded` bytes stay mapped.
    if (aligned > addr) munmap(base, aligned - addr);
    const uintptr_t tail = aligned + rounded;
    const uintptr_t map_end = addr + map_size;
    if (map_end > tail) munmap(reinterpret_cast<void*>(tail), map_end - tail);
    madvise(start, rounded, MADV_HUGEPAGE);  // advisory: ignore EINVAL where THP is off
  }
  region.ptr = start;
  region.size = rounded;
  region.map_base = start;
  region.map_size = rounded;
  if (numa_node >= 0 && !bind_to_node(start, rounded, numa_node)) {
    const int err = errno;  // before the message's allocations
    warn_once(g_warned_mbind, "pinxfer: mbind to NUMA node " + std::to_string(numa_node) +
                                  " failed (" + std::strerror(err) +
                                  "); pinned memory is placed by the default policy.");
    region.numa_node = -1;
  }
  int64_t t1 = steady_now_ns();
  touch_pages(start, rounded, numa_node);
  int64_t t2 = steady_now_ns();

  if (cuda::cuda_usable()) {
    const std::string err = cuda::host_register(start, rounded);
    if (err.empty()) {
      region.kind = LockKind::kCudaRegistered;
    } else {
      warn_once(g_warned_register, "pinxfer: cudaHostRegister of " + std::to_string(rounded) +
                                       " bytes failed (" + err +
                                       "); falling back to mlock. Copies from this memory are not "
                                       "DMA-pinned for CUDA. Check `ulimit -l` and the driver.");
    }
  }
  if (region.kind != LockKind::kCudaRegistered) {
    if (mlock(start, rounded) == 0) {
      region.kind = LockKind::kMlocked;
    } else {
      const int err = errno;
      warn_once(g_warned_mlock,
                "pinxfer: mlock of " + std::to_string(rounded) + " bytes failed (" +
                    std::strerror(err) +
                    "); this memory stays pageable. Raise the memlock limit (`ulimit -l`, "
                    "LimitMEMLOCK, docker --ulimit memlock=-1) or lower PINXFER_MAX_PINNED_BYTES.");
      region.kind = LockKind::kPageable;
    }
  }
  int64_t t3 = steady_now_ns();
  if (timings) {
    timings->map_ns += t1 - t0;
    timings->touch_ns += t2 - t1;
    timings->lock_ns += t3 - t2;
  }
  return region;
}

int64_t unmap_region(const HostRegion& region) {
  const int64_t t0 = steady_now_ns();
  if (region.kind == LockKind::kCudaRegistered) {
    const std::string err = cuda::host_unregister(region.ptr);
    if (!err.empty()) {
      // CUDA still maps these addresses to these pages (refused, for instance, because
      // another thread captures a CUDA graph in global mode). Unmapped, the addresses could
      // come back from a later mmap over new pages while CUDA's registration still names
      // the old ones: a copy from there would move the old pages' bytes. So the region stays
      // mapped and locked, out of every pool: leaked, not reused.
      TORCH_WARN("pinxfer: cudaHostUnregister of a ", region.size, "-byte pinned segment failed (",
                 err,
                 "); the segment stays mapped and page-locked until the process exits (not "
                 "counted by the cap any more). Release pinned memory "
                 "(pinxfer.empty_cache()) outside CUDA graph captures.");
      return steady_now_ns() - t0;
    }
  }
  // munmap also drops mlock; nothing else to undo.
  munmap(region.map_base, region.map_size);
  return steady_now_ns() - t0;
}

}  // namespace pinxfer
