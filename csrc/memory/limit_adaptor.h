// The cap on pinned bytes, as an adaptor over an upstream HostResource (rmm's
// limiting_resource_adaptor, with relief). Every pool of the process maps
// through one LimitingResource (memory/pool_registry.cpp composes them), so it
// alone counts the bytes reserved by all pools and enforces the cap.
//
// map(): reserves the bytes against the cap before the upstream maps them, so
// concurrent callers can never pass the cap together. When the bytes do not
// fit it asks its Relief (the registry: the pools above it) to give memory
// back, retrying after each step:
//   1. release_cached():             unmap fully free segments of every pool;
//   2. wait_for_events_then_release(): wait for blocks whose copies are still
//      in flight, then unmap again;
// and then throws CapReached with the figures of the refusal. The caller (a
// pool) turns that into c10::OutOfMemoryError.
//
// Thread safety: lock-free (atomics only); map() calls the relief and the
// upstream without holding anything. Lifetime: built once and leaked, like the
// pools. In a forked child the registry calls forget_reserved_after_fork():
// the parent's segments are abandoned, not unmapped through this adaptor.
#pragma once

#include <atomic>
#include <cstdint>

#include "memory/host_resource.h"

namespace pinxfer {

class LimitingResource final : public HostResource {
 public:
  // What the limit may ask of the pools above it. Called without any lock
  // held by the limit; implementations may block (waiting on CUDA events).
  class Relief {
   public:
    virtual ~Relief() = default;
    virtual void release_cached() = 0;
    virtual void wait_for_events_then_release() = 0;
    // Totals over the pools, for the report when the cap is reached.
    virtual PoolStats stats() = 0;
  };
  // The cap used until set_cap() is called, read on first need (0: no cap).
  using DefaultCap = int64_t (*)();

  LimitingResource(HostResource& upstream, DefaultCap default_cap);

  // Installs the relief (once, before the first map; the registry does).
  void set_relief(Relief* relief);

  HostRegion map(size_t bytes, int numa_node, RegionTimings* timings) override;
  int64_t unmap(const HostRegion& region) override;
  int64_t headroom() override;  // the cap less what is reserved (INT64_MAX: no cap)

  // Cap in bytes; 0 = unlimited. Throws c10::Error for a negative cap. A cap
  // below what is reserved now frees nothing by itself: the next map relieves.
  void set_cap(int64_t bytes);
  int64_t cap();
  // Bytes mapped through this resource and not yet unmapped.
  int64_t reserved() const { return reserved_.load(); }

  // Forked child only: the parent's regions stay mapped but belong to pools
  // that are abandoned; the child starts counting from zero.
  void forget_reserved_after_fork() { reserved_.store(0); }

 private:
  // Adds `bytes` to reserved_ if the cap allows; false (nothing added) if not.
  bool try_reserve(int64_t bytes);
  // try_reserve(), with the relief steps between the attempts.
  bool reserve_with_relief(int64_t bytes);

  static constexpr int64_t kCapNotRead = -1;

  HostResource& upstream_;
  const DefaultCap default_cap_;
  std::atomic<int64_t> reserved_{0};
  std::atomic<int64_t> cap_{kCapNotRead};
  std::atomic<Relief*> relief_{nullptr};
};

}  // namespace pinxfer
