// pinxfer::pin_ / unpin_: page-lock an existing CPU tensor's memory in place
// (schemas in csrc/module.cpp; PyTorch issue #32167 asks for this).
//
// What is registered is the tensor's whole storage, [data, data + nbytes): a
// storage is one contiguous byte range, so every view of it is pinned too.
// With a usable CUDA device the range is cudaHostRegister'ed (portable), so
// torch's is_pinned() sees it and copies from it are DMA transfers; without
// CUDA it is mlock'ed (resident, not DMA-registered).
//
// The registry remembers exactly what pin_ did (range, kind, mlocked pages)
// so unpin_ undoes exactly that. While registered it holds a reference to the
// storage and marks it non-resizable: the memory can neither be freed nor
// reallocated (resize_) under CUDA's or the kernel's feet. unpin_ restores
// both.
//
// Some torch calls swap a storage's memory whatever its resizable flag:
// share_memory_() copies the bytes into new shared memory and frees the old, and so
// do multiprocessing's reductions (found by review, session 42: the freed range
// stayed registered with CUDA, the registry kept naming it, and a DMA from memory
// mapped there later could read the old pinned pages). So pin_ also puts its own
// deleter around the storage's memory (InPlaceMemory): if the storage lets the
// memory go while it is registered, the deleter unregisters it first, drops the
// registration and only then frees it; the storage keeps its new memory, unpinned.
// (cudaHostUnregister waits for the copies still reading the range, which CUDA does
// not document: tests/test_pin_memory.py's test_gpu_share_memory_of_a_pinned_* checks
// it with a copy queued behind a sleep.) A storage already in shared memory that torch
// recognises (ATen's MapAllocator, the file-descriptor strategy's) is not wrapped:
// share_memory_() leaves it as it is. Costs of the wrapper, seen from torch: a
// file_system-strategy (libshm) storage reads as not shared while pinned, so sharing it
// again copies it (ending the pin); lazy-cloning a pinned tensor fails (torch clones
// lazily only a plain DataPtr, as with a numpy-backed tensor); pin_ of a lazy clone
// copies its shared bytes first (its own memory is what gets pinned).
//
// mlock does not count: unlocking a page unlocks it for every range on it. Two
// small tensors from malloc may share a page, so unpin_ leaves locked the
// first/last page when another registration still uses it.
//
// After fork() the child inherits neither mlock nor CUDA registrations, so it
// starts with an empty registry of its own (the parent's is abandoned: another
// thread may have been changing it at the fork): there the parent's pinned
// tensors read as "not pinned", unpin_ refuses them (code that unpins in a worker
// must expect that), and pin_ may register them. The abandoned map's references keep
// the storages the parent had pinned at the fork alive in the child for good.
//
// Thread safety: one mutex guards the registry; CUDA and mlock calls run under
// it too (rare, and it keeps check-then-register atomic).
#include <ATen/ATen.h>
#include <ATen/MapAllocator.h>
#include <torch/library.h>

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include <c10/util/Exception.h>

#include "memory/graph_pools.h"
#include "memory/host_region.h"
#include "memory/pinned_pool.h"
#include "memory/pool_registry.h"
#include "ops/kernels.h"
#include "runtime/cuda_runtime.h"
#include "runtime/fork.h"

namespace pinxfer::ops {

namespace {

// The context of the DataPtr pin_ puts on a registered storage: the storage's own
// memory (with its own deleter) inside pinxfer's. Owned by that DataPtr.
struct InPlaceMemory {
  c10::DataPtr original;
  uintptr_t key = 0;       // the registration's address
  bool unwrapped = false;  // unpin_ or the sweep gave `original` back to the storage
};

struct Registration {
  size_t size = 0;
  LockKind kind = LockKind::kPageable;
  uintptr_t locked_lo = 0, locked_hi = 0;  // page range mlock'ed (kMlocked only)
  c10::Storage storage;                    // kept alive while registered
  InPlaceMemory* wrapper = nullptr;        // on the storage's DataPtr (null: not wrapped, or
                                           // the storage let the memory go)
  c10::DataPtr detached;  // memory the storage let go that could not be unregistered yet (a
                          // capture was open, or the unregister failed): kept, not freed
  bool was_resizable = false;
  bool warned = false;  // a sweep's failed unregister was reported
};

std::mutex g_mutex;
// Start address -> registration. Leaked on purpose (safe at exit).
// LOCK: g_mutex
std::map<uintptr_t, Registration>* g_registry = new std::map<uintptr_t, Registration>();

void child_after_fork() {
  // The mutex may have been held by a thread that does not exist in the child, and the
  // map may have been half-changed by it: both are abandoned (the map leaked, with the
  // storage references in it).
  new (&g_mutex) std::mutex();
  g_registry = new std::map<uintptr_t, Registration>();
}
struct ForkHandlerInstaller {
  ForkHandlerInstaller() {
    register_fork_child_handler(ForkChildStep::kPinInplace, &child_after_fork);
  }
} g_fork_handler_installer;

uintptr_t page_size() {
  static const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  return page;
}

// The registration overlapping [lo, hi), if any. LOCK: g_mutex held.
std::map<uintptr_t, Registration>::iterator find_overlap_locked(uintptr_t lo, uintptr_t hi) {
  auto it = g_registry->upper_bound(lo);
  if (it != g_registry->begin()) {
    auto prev = std::prev(it);
    if (prev->first + prev->second.size > lo) return prev;
  }
  return it != g_registry->end() && it->first < hi ? it : g_registry->end();
}

// True if an mlock registration other than `self_key` locks `page`.
// LOCK: g_mutex held.
bool page_locked_by_other_locked(uintptr_t page, uintptr_t self_key) {
  for (const auto& [key, r] : *g_registry) {
    if (key == self_key || r.kind != LockKind::kMlocked) continue;
    if (r.locked_lo <= page && page < r.locked_hi) return true;
  }
  return false;
}

// Undoes what pin_ did for one registration (cudaHostUnregister, or
// munlock of the pages no other registration locks). Returns what failed, empty
// on success; on a failure the memory stays registered (and must not be freed).
// LOCK: g_mutex held.
std::string try_unlock_registration_locked(uintptr_t key, const Registration& r) {
  if (r.kind == LockKind::kCudaRegistered) {
    const std::string err = cuda::host_unregister(reinterpret_cast<void*>(key));
    return err.empty() ? err : "cudaHostUnregister failed: " + err;
  }
  uintptr_t lo = r.locked_lo, hi = r.locked_hi;
  const uintptr_t page = page_size();
  if (lo < hi && page_locked_by_other_locked(lo, key)) lo += page;
  if (lo < hi && page_locked_by_other_locked(hi - page, key)) hi -= page;
  if (lo < hi && munlock(reinterpret_cast<void*>(lo), hi - lo) != 0) {
    const int err = errno;
    return std::string("munlock failed: ") + std::strerror(err);
  }
  return {};
}

void unlock_registration_locked(uintptr_t key, const Registration& r) {
  const std::string err = try_unlock_registration_locked(key, r);
  TORCH_CHECK(err.empty(), "pinxfer.unpin_: ", err, ". The memory stays registered.");
}

void memory_left_while_pinned(void* ctx) noexcept;

// Gives the storage its own DataPtr back (pin_'s wrapper off); returns the wrapper's
// DataPtr, to be destroyed after g_mutex is released (its deleter then does nothing).
// If the registered storage no longer carries the wrapper (a swap of DataPtrs between
// storages moved it), it is left where it is: its deleter finds no registration and
// frees the memory as that storage's own. LOCK: g_mutex held.
c10::DataPtr unwrap_locked(Registration& r) {
  InPlaceMemory* wrapper = std::exchange(r.wrapper, nullptr);
  if (wrapper == nullptr) return {};
  c10::StorageImpl* impl = r.storage.unsafeGetStorageImpl();
  const c10::DataPtr& current = impl->data_ptr();
  if (current.get_context() != wrapper || current.get_deleter() != &memory_left_while_pinned) {
    return {};
  }
  wrapper->unwrapped = true;
  return impl->set_data_ptr(std::move(wrapper->original));
}

// The deleter of pin_'s wrapper. Runs when the storage's DataPtr is destroyed: after
// the storage let its memory go while pin_ still has it registered (share_memory_()
// swapped it: see the top of this file), and, doing nothing, after unpin_ or the sweep
// took the wrapper off. Never throws (it runs in a destructor): memory that could not be
// unregistered is kept, never freed.
void memory_left_while_pinned(void* ctx) noexcept {
  std::unique_ptr<InPlaceMemory> wrapper(static_cast<InPlaceMemory*>(ctx));
  if (wrapper->unwrapped) return;
  c10::DataPtr to_free;      // freed after the lock is released
  c10::Storage storage_ref;  // the registry's reference, dropped after it too
  std::string failure;
  try {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_registry->find(wrapper->key);
    if (it == g_registry->end() || it->second.wrapper != wrapper.get()) {
      // Not registered in this process: a forked child (its registry starts empty) or a
      // wrapper unwrap_locked could not take off. Freed as the storage's own memory.
      to_free = std::move(wrapper->original);
    } else {
      Registration& r = it->second;
      r.wrapper = nullptr;
      const auto unpinning = graph_pools::hold_off_captures_to_unmap();
      if (!unpinning.owns_lock()) {
        // A capture is open: no unregistering now. The registry keeps the memory
        // until a sweep after the capture (take_orphans_locked).
        r.detached = std::move(wrapper->original);
      } else {
        failure = try_unlock_registration_locked(it->first, r);
        if (failure.empty()) {
          to_free = std::move(wrapper->original);
          storage_ref = std::move(r.storage);
          g_registry->erase(it);
        } else {
          r.detached = std::move(wrapper->original);  // stays registered: kept, not freed
          r.warned = true;                            // warned below; the sweep retries
        }
      }
    }
  } catch (...) {
    (void)wrapper->original.release_context();  // leaked: it may still be registered
    failure = "an unexpected error";
  }
  if (!failure.empty()) {
    try {
      TORCH_WARN("pinxfer: torch moved a pin_'ed tensor's storage to new memory (share_memory_ ",
                 "or similar) and undoing the pin of the old memory failed (", failure,
                 "); that memory stays allocated and registered.");
    } catch (...) {
    }
  }
}

// What a sweep takes out of the registry. Declared by the caller before it takes
// g_mutex, so that all of it is destroyed after the lock is released (a storage's last
// reference may call into Python), in this order: the wrappers (their deleters do
// nothing), the storages, the memory.
struct Orphans {
  std::vector<c10::DataPtr> memory;
  std::vector<c10::Storage> storages;
  std::vector<c10::DataPtr> wrappers;
  size_t count = 0;
};

// Moves into `out` the registrations nobody can unpin any more: those whose storage
// only the registry still references (every tensor of it is gone, or was moved to
// other memory by set_()), and memory a storage let go that could not be unregistered
// then (memory_left_while_pinned). Each is unlocked first; one whose unlock fails stays,
// registered and allocated, with one warning, for the next sweep to try again. None while
// a CUDA graph capture pinxfer knows of is open, and none begins meanwhile
// (graph_pools::hold_off_captures_to_unmap: the pool unmaps nothing then either); the
// next sweep after it takes them. LOCK: g_mutex held.
void take_orphans_locked(Orphans& out) {
  const auto unpinning = graph_pools::hold_off_captures_to_unmap();
  if (!unpinning.owns_lock()) return;
  for (auto it = g_registry->begin(); it != g_registry->end();) {
    Registration& r = it->second;
    const bool let_go = r.wrapper == nullptr && r.detached;
    if (!let_go && r.storage.use_count() > 1) {
      ++it;
      continue;
    }
    const std::string failure = try_unlock_registration_locked(it->first, r);
    if (!failure.empty()) {
      if (!std::exchange(r.warned, true)) {
        TORCH_WARN("pinxfer: unpinning a ", r.size, "-byte pin_ registration nobody can reach ",
                   "any more failed (", failure, "); it stays registered and allocated, and ",
                   "the next pin_ or empty_cache() tries again.");
      }
      ++it;
      continue;
    }
    out.wrappers.push_back(unwrap_locked(r));
    if (!let_go && r.was_resizable) r.storage.unsafeGetStorageImpl()->set_resizable(true);
    out.memory.push_back(std::move(r.detached));
    out.storages.push_back(std::move(r.storage));
    ++out.count;
    it = g_registry->erase(it);
  }
}

struct Range {
  uintptr_t lo = 0, hi = 0;
};

// The tensor's storage's byte range. for_pinning: its mutable memory (pin_ may
// have writes go through it, so a lazy clone's shared bytes are copied first).
Range storage_range(const at::Tensor& self, const char* op, bool for_pinning = false) {
  TORCH_CHECK(self.defined(), "pinxfer.", op, ": expected a CPU tensor, got an undefined tensor");
  TORCH_CHECK(self.device().is_cpu(), "pinxfer.", op, ": expected a CPU tensor, got a tensor on ",
              self.device(), ". Only host memory can be page-locked.");
  TORCH_CHECK(self.layout() == at::kStrided && self.has_storage(), "pinxfer.", op,
              ": expected a dense CPU tensor with its own storage, got layout ", self.layout(),
              ". Pin the dense component tensors instead.");
  TORCH_CHECK(!self.is_quantized(), "pinxfer.", op,
              ": quantized tensors are not supported "
              "(is_pinned could not see the lock through the quantizer). Pin the integer "
              "representation (t.int_repr()) and quantize on the device instead.");
  const c10::Storage& storage = self.storage();
  const auto lo =
      reinterpret_cast<uintptr_t>(for_pinning ? storage.mutable_data() : storage.data());
  TORCH_CHECK(lo != 0 && storage.nbytes() > 0, "pinxfer.", op,
              ": the tensor's storage is empty (0 bytes); there is no memory to pin.");
  return {lo, lo + storage.nbytes()};
}

void pin_(const at::Tensor& self) {
  const Range range = storage_range(self, "pin_", /*for_pinning=*/true);
  const size_t size = range.hi - range.lo;
  TORCH_CHECK(PinnedPool::owner_of(self.storage().data_ptr().get_context()) == nullptr,
              "pinxfer.pin_: refused, the tensor already lives in pinxfer's pinned pool "
              "(from pinxfer.empty / pinxfer.pin_memory); it needs no pin_.");
  // The same memory reached through another storage (torch.from_numpy(p.numpy()) of a pool
  // tensor): its unpin_ would unlock the pool's pages under the pool's live blocks (found by
  // review, session 44).
  for (PinnedPool* pool : all_pools()) {
    TORCH_CHECK(!pool->overlaps_segments(range.lo, range.hi),
                "pinxfer.pin_: refused, the tensor's memory lies in pinxfer's pinned pool "
                "(reached through another storage, e.g. torch.from_numpy of a pool tensor); "
                "it is pinned already and needs no pin_.");
  }

  Orphans orphans;  // destroyed after the lock is released
  std::lock_guard<std::mutex> lock(g_mutex);
  take_orphans_locked(orphans);
  auto hit = find_overlap_locked(range.lo, range.hi);
  TORCH_CHECK(hit == g_registry->end(),
              "pinxfer.pin_: refused, this memory is already pinned by pinxfer.pin_ (a ",
              hit->second.size, "-byte range starting at ", reinterpret_cast<void*>(hit->first),
              ", this tensor's storage or one overlapping it). Call pinxfer.unpin_ on that "
              "tensor first.");
  Registration reg;
  reg.size = size;
  if (cuda::cuda_usable()) {
    TORCH_CHECK(!cuda::is_cuda_pinned(reinterpret_cast<void*>(range.lo)),
                "pinxfer.pin_: refused, this memory is already page-locked for CUDA (by torch's "
                "pin_memory / cudaHostAlloc / cudaHostRegister of another library). It is "
                "already DMA-able; nothing to do.");
    bool already = false;
    const std::string err =
        cuda::host_register_user(reinterpret_cast<void*>(range.lo), size, &already);
    TORCH_CHECK(!already, "pinxfer.pin_: refused, CUDA reports part of this ", size,
                "-byte range as already registered (", err,
                "). Another registration covers "
                "some of its pages: torch, another library, or a pin_ of a tensor that shares "
                "a page with this one. Unpin that memory first, or copy the tensor "
                "(pinxfer.pin_memory) instead of pinning it in place.");
    TORCH_CHECK(err.empty(), "pinxfer.pin_: cudaHostRegister of ", size, " bytes failed: ", err,
                ". Check `ulimit -l` and free host memory; or use "
                "pinxfer.pin_memory, which copies into pinxfer's pool.");
    reg.kind = LockKind::kCudaRegistered;
  } else {
    const uintptr_t page = page_size();
    const uintptr_t lo = range.lo & ~(page - 1);
    const uintptr_t hi = (range.hi + page - 1) & ~(page - 1);
    if (mlock(reinterpret_cast<void*>(lo), hi - lo) != 0) {
      const int err = errno;
      TORCH_CHECK(false, "pinxfer.pin_: mlock of ", hi - lo, " bytes failed: ", std::strerror(err),
                  ". The memlock limit (`ulimit -l`, LimitMEMLOCK, docker "
                  "--ulimit memlock=-1) is probably too low for this tensor.");
    }
    reg.kind = LockKind::kMlocked;
    reg.locked_lo = lo;
    reg.locked_hi = hi;
  }
  reg.storage = self.storage();
  c10::StorageImpl* impl = reg.storage.unsafeGetStorageImpl();
  // resize_ would free the registered memory. A storage without an allocator
  // (share_memory_(), from_blob) cannot be resized anyway, and torch asserts
  // that a resizable storage has one, so such a storage is left as it is.
  reg.was_resizable = impl->resizable() && impl->allocator() != nullptr;
  if (reg.was_resizable) impl->set_resizable(false);
  // Memory in shared memory that torch recognises stays as it is: share_memory_() keeps it.
  const bool shared = at::MapAllocator::fromDataPtr(impl->data_ptr()) != nullptr ||
                      at::RefcountedMapAllocator::fromDataPtr(impl->data_ptr()) != nullptr;
  std::unique_ptr<InPlaceMemory> wrapper;
  if (!shared) {
    wrapper = std::make_unique<InPlaceMemory>();
    wrapper->key = range.lo;
    reg.wrapper = wrapper.get();
  }
  const c10::Device device = impl->device();
  g_registry->emplace(range.lo, std::move(reg));
  // Last, as nothing after it may throw: the storage's memory goes inside pin_'s deleter.
  if (wrapper) {
    InPlaceMemory* context = wrapper.release();  // owned by the DataPtr from here
    context->original = impl->set_data_ptr(c10::DataPtr(reinterpret_cast<void*>(range.lo), context,
                                                        &memory_left_while_pinned, device));
  }
}

void unpin_(const at::Tensor& self) {
  const Range range = storage_range(self, "unpin_");
  Registration reg;
  c10::DataPtr wrapped;  // pin_'s wrapper, destroyed after the lock is released
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_registry->find(range.lo);
    if (it == g_registry->end() || it->second.size != range.hi - range.lo) {
      const bool pool = PinnedPool::owner_of(self.storage().data_ptr().get_context()) != nullptr;
      TORCH_CHECK(!pool,
                  "pinxfer.unpin_: refused, the tensor lives in pinxfer's pinned pool; "
                  "pool memory stays pinned and returns to the pool when the tensor is freed.");
      TORCH_CHECK(!cuda::is_cuda_pinned(reinterpret_cast<void*>(range.lo)),
                  "pinxfer.unpin_: refused, this memory is page-locked, but not by "
                  "pinxfer.pin_ (torch's pin_memory or another library did it); only memory "
                  "pinned with pinxfer.pin_ can be unpinned here.");
      TORCH_CHECK(false, "pinxfer.unpin_: refused, the tensor's memory is not pinned by "
                         "pinxfer.pin_ (nothing to undo).");
    }
    // cudaHostUnregister synchronizes the device, which an open capture forbids (CUDA
    // refuses it, or the capture is invalidated): as the deleter and the sweep, never during
    // one (found by review, session 44). Held to the unregister, so none begins meanwhile.
    const auto unpinning = graph_pools::hold_off_captures_to_unmap();
    TORCH_CHECK(unpinning.owns_lock(),
                "pinxfer.unpin_: refused while a CUDA graph capture is open (unpinning "
                "synchronizes the device, which would break the capture); call it after the "
                "capture ends. The tensor stays pinned.");
    unlock_registration_locked(it->first, it->second);
    wrapped = unwrap_locked(it->second);
    reg = std::move(it->second);
    g_registry->erase(it);
    // Under the lock: a pin_ of the same storage right after must read resizable() as this
    // unpin_ leaves it (found by review, session 42: set after the lock, a pin_ in between
    // recorded "not resizable" and the storage became resizable while registered).
    if (reg.was_resizable) reg.storage.unsafeGetStorageImpl()->set_resizable(true);
  }
  // Outside the lock: dropping the last reference (reg, here) may free the storage.
}

}  // namespace

size_t release_orphaned_pins() {
  Orphans orphans;  // freed after the lock is released
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    take_orphans_locked(orphans);
  }
  return orphans.count;
}

size_t inplace_registrations() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_registry->size();
}

// How pin_ locked the tensor's storage ("cuda_registered" / "mlocked"), or
// None if pin_ did not (pool tensors included: see pinxfer.lock_kind).
std::optional<std::string> inplace_lock_kind(const at::Tensor& self) {
  if (!self.defined() || !self.device().is_cpu() || !self.has_storage() ||
      self.storage().nbytes() == 0) {
    return std::nullopt;
  }
  const auto lo = reinterpret_cast<uintptr_t>(self.storage().data());
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = find_overlap_locked(lo, lo + 1);
  if (it == g_registry->end()) return std::nullopt;
  return std::string(lock_kind_name(it->second.kind));
}

TORCH_LIBRARY_IMPL(pinxfer, CompositeExplicitAutograd, m) {
  m.impl("pin_", &pin_);
  m.impl("unpin_", &unpin_);
  m.impl("inplace_lock_kind", &inplace_lock_kind);
}

// These act on the storage, not on the values: a conj or neg view must reach
// them as it is. Without the fallthrough, torch's Conjugate / Negative
// fallbacks hand the kernel a resolved copy, and pin_ would lock a hidden
// temporary (is_pinned False afterwards, 8 MiB locked until exit).
TORCH_LIBRARY_IMPL(pinxfer, Conjugate, m) {
  m.impl("pin_", torch::CppFunction::makeFallthrough());
  m.impl("unpin_", torch::CppFunction::makeFallthrough());
  m.impl("inplace_lock_kind", torch::CppFunction::makeFallthrough());
}
TORCH_LIBRARY_IMPL(pinxfer, Negative, m) {
  m.impl("pin_", torch::CppFunction::makeFallthrough());
  m.impl("unpin_", torch::CppFunction::makeFallthrough());
  m.impl("inplace_lock_kind", torch::CppFunction::makeFallthrough());
}

}  // namespace pinxfer::ops
