// pinxfer::pin_memory: Tensor.pin_memory(), placed on a NUMA node and copied
// by the node's persistent thread pool (schema in csrc/module.cpp).
//
// Layout, as torch's at::_pin_memory: same sizes and strides, storage offset
// 0, storage of computeStorageNbytes(sizes, strides) bytes. Because strides are
// non-negative, the destination's bytes are exactly the byte span of the
// source view starting at its data pointer, so every layout torch keeps
// (contiguous, transposed, sliced with a step, channels-last) is one flat
// memcpy of that span; gaps between elements are copied too, harmless and
// no larger than what torch allocates.
//
// Two cases need element-wise copies (at::Tensor::copy_ per chunk of dim 0):
//  * conj / neg views: the lazy bit must be resolved, as torch's copy_ does;
//  * internally overlapping views (expand, overlapping as_strided): torch's
//    pin_memory raises there ("more than one element of the written-to tensor
//    refers to a single memory location"); we return a contiguous copy, which
//    a DMA engine can read in one piece and which is safe to write to.
//
// The copy never touches Python and uses torch's intra-op team only where that team is
// awake on the interpreter's main thread (runtime/torch_team.h; copy_plain), so it runs at
// full speed from a DataLoader pin thread that set torch.set_num_threads(1). torch.ops
// releases the GIL around the call.
#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <c10/util/ParallelGuard.h>
#include <torch/library.h>

#include <chrono>
#include <cstring>

#include "memory/graph_pools.h"
#include "memory/pinned_pool.h"
#include "memory/placement.h"
#include "memory/pool_registry.h"
#include "ops/kernels.h"
#include "runtime/settings.h"
#include "runtime/thread_budget.h"
#include "runtime/thread_pool.h"
#include "runtime/torch_team.h"
#include "transfer/chunk_plan.h"

namespace pinxfer::ops {

namespace {

// Copies are split in 64 KiB units, at least 16 per chunk: chunks of >= 1 MiB
// amortise waking a worker, and unit-aligned chunk starts keep memcpy on its
// fast aligned path. On torch's awake team (runtime/torch_team.h) nothing is woken:
// one share for each member, cut as torch's own copy_ cuts the same tensor there
// (torch_share_units).
constexpr size_t kCopyUnit = size_t{64} << 10;
constexpr size_t kUnitsPerChunk = 16;

// The least share, in units, of a member of torch's team copying elements of item_bytes:
// torch's copy_ (at::parallel_for) gives each member at least at::internal::GRAIN_SIZE
// elements, so a 256 KiB float32 tensor goes to two members, 1 MiB to eight, 4 MiB to all
// sixteen. Cut the same way, member k copies the bytes member k wrote in the torch op that
// made the tensor (or read in torch's last pin of it) and finds them in its core's cache;
// 64 KiB shares gave a 256 KiB pin_memory to four members, two of them reading bytes
// cached on other cores (H100, diag_pin_copy: their pieces took 8-11 us against 3).
// Below that many units the copy is one thread's (no team, no probe), as torch's is; and
// up to kSerialBytes too, where torch would still take two members (parallel_memcpy says why).
size_t torch_share_units(size_t item_bytes) {
  return std::max<size_t>(1,
                          static_cast<size_t>(at::internal::GRAIN_SIZE) * item_bytes / kCopyUnit);
}

void check_input(const at::Tensor& self) {
  TORCH_CHECK(self.defined(), "pinxfer.pin_memory: expected a CPU tensor, got an undefined tensor");
  TORCH_CHECK(self.device().is_cpu(), "pinxfer.pin_memory: expected a CPU tensor, got a tensor on ",
              self.device(),
              ". Only host memory can be pinned; a tensor already on a device needs no pinning.");
  TORCH_CHECK(self.layout() == at::kStrided,
              "pinxfer.pin_memory: expected a dense (strided) CPU tensor, got layout ",
              self.layout(),
              ". The Python function pinxfer.pin_memory() hands such tensors "
              "to torch's Tensor.pin_memory(); this op takes dense tensors only.");
  TORCH_CHECK(!self.is_quantized(),
              "pinxfer.pin_memory: quantized tensors are not supported by this op (got ",
              self.toString(),
              "); the Python function pinxfer.pin_memory() hands them to "
              "torch's Tensor.pin_memory().");
  TORCH_CHECK(self.has_storage(), "pinxfer.pin_memory: expected a tensor with storage, got ",
              self.toString(),
              " (a wrapper or nested tensor); the Python function pinxfer.pin_memory() hands "
              "nested tensors to torch's Tensor.pin_memory().");
}

void check_threads(int64_t num_threads) {
  const int most = max_copy_threads(settings().cpus);
  TORCH_CHECK_VALUE(num_threads >= 0 && num_threads <= most,
                    "pinxfer.pin_memory: num_threads must be from 0 (the pool's default) to ", most,
                    " (max(16, the CPUs this process may use)), got ", num_threads);
}

// A copy of the byte span in 64 KiB units: on torch's team if `team` says it is awake, else
// on the pool.
void parallel_memcpy(char* dst, const char* src, size_t nbytes, size_t item_bytes, ThreadPool& pool,
                     int max_threads, TeamAnswer team) {
  const size_t units = (nbytes + kCopyUnit - 1) / kCopyUnit;
  const auto copy_units = [&](size_t begin, size_t end) {
    const size_t lo = begin * kCopyUnit;
    const size_t hi = std::min(nbytes, end * kCopyUnit);
    std::memcpy(dst + lo, src + lo, hi - lo);
  };
  host_parallel_for(pool, units, kUnitsPerChunk, torch_share_units(item_bytes), copy_units,
                    max_threads, team);
}

// Whether torch's copy_ copies this dtype on every torch pinxfer builds against (2.1 on):
// its copy kernel has no case for the sub-byte placeholders (torch.uint1-7, torch.int1-7:
// "copy_kernel not implemented"), and newer shell dtypes (bits, float4, float8_e8m0fnu,
// bcomplex32) came later or not at all. The rest take the byte-span copy, which is exact
// for any dtype.
bool torch_copy_covers(c10::ScalarType dtype) {
  switch (dtype) {
    case c10::ScalarType::Bool:
    case c10::ScalarType::Byte:
    case c10::ScalarType::Char:
    case c10::ScalarType::Short:
    case c10::ScalarType::Int:
    case c10::ScalarType::Long:
    case c10::ScalarType::UInt16:
    case c10::ScalarType::UInt32:
    case c10::ScalarType::UInt64:
    case c10::ScalarType::Half:
    case c10::ScalarType::BFloat16:
    case c10::ScalarType::Float:
    case c10::ScalarType::Double:
    case c10::ScalarType::ComplexHalf:
    case c10::ScalarType::ComplexFloat:
    case c10::ScalarType::ComplexDouble:
    case c10::ScalarType::Float8_e5m2:
    case c10::ScalarType::Float8_e4m3fn:
    case c10::ScalarType::Float8_e5m2fnuz:
    case c10::ScalarType::Float8_e4m3fnuz:
      return true;
    default:
      return false;
  }
}

// A plain copy (no conj or neg bit, no internal overlap) of self's nbytes-byte span into out,
// which has self's sizes and strides; team_awake: what torch_team_awake() answered for this
// copy (pin_memory_copy asks it once, before the allocation).
void copy_plain(at::Tensor& out, const at::Tensor& self, size_t nbytes, ThreadPool& pool,
                int max_threads, bool team_awake) {
  auto* dst = static_cast<char*>(out.data_ptr());
  const auto* src = static_cast<const char*>(self.const_data_ptr());
  // Up to kSerialBytes (the bound below which a transfer's caller also stages alone) the
  // caller copies alone and torch's team is not asked about: the pool's road would not wake a
  // helper for it either (kUnitsPerChunk), and the team's road costs more than the half of
  // the copy it takes off the caller: its probe (a /proc read, 2-4 us) and its region. A
  // 256 KiB float32 pin_memory back to back, synchronized after each call (H200,
  // diag_pin_copy --sync): 25.7 us on the team, 21.4 alone, 22.3 for t.pin_memory().
  if (nbytes <= transfer::kSerialBytes) {
    std::memcpy(dst, src, nbytes);
    return;
  }
  // A contiguous tensor on torch's awake team is copied by torch's own copy_, which runs its
  // parallel_for on that same team, as t.pin_memory() copies it. Our region there (shares cut
  // as torch's, runtime/torch_team.h) cost 3-11 us more than torch's copy_ at 1-8 MiB back to
  // back with a synchronize after each call, besides the probe: pinxfer.empty(n).copy_(t)
  // ran at 0.94-1.12x the speed of t.pin_memory() where pinxfer.pin_memory(t) ran at
  // 0.74-0.84x (H100 and H200, diag_pin_copy --sync,
  // results/<kind>/diag_pin_copy_2026-11-27_s13_sync_team_auto.json). Strided views keep the
  // byte-span copy (one memcpy a unit, gaps included) on the team or the pool, as do dtypes
  // torch's copy_ does not copy (torch_copy_covers).
  if (team_awake && self.is_contiguous() && torch_copy_covers(self.scalar_type())) {
    run_torch_op_on_team([&] {
      at::AutoDispatchBelowADInplaceOrView below_autograd;  // a copy of values, as torch's pin
      out.copy_(self);
    });
    return;
  }
  parallel_memcpy(dst, src, nbytes, self.dtype().itemsize(), pool, max_threads,
                  team_awake ? TeamAnswer::kAwake : TeamAnswer::kAsleep);
}

// Element-wise copy split along dim 0. Each chunk runs torch's copy kernel
// inline (ParallelGuard): no nested use of torch's intra-op pool from our
// workers. A copy of values, as torch's pin: below autograd. The workers run with the
// caller's thread-local state (inference mode, dispatch keys): without it a chunk copy
// into an inference-mode output failed on a worker ("inplace update to inference tensor"),
// and under no_grad the workers recorded autograd history on the output, racing each other
// (found by review, session 44).
void parallel_elementwise_copy(at::Tensor& dst, const at::Tensor& src, ThreadPool& pool,
                               int max_threads) {
  if (dst.dim() == 0 || dst.size(0) <= 1) {
    c10::ParallelGuard guard(true);
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    dst.copy_(src);
    return;
  }
  const at::ThreadLocalState callers_state;
  const int64_t rows = dst.size(0);
  const size_t row_bytes = std::max<size_t>(1, dst.numel() / rows * dst.element_size());
  const size_t grain = std::max<size_t>(1, (kCopyUnit * kUnitsPerChunk) / row_bytes);
  const size_t awake_grain = std::max<size_t>(1, kCopyUnit / row_bytes);
  host_parallel_for(
      pool, static_cast<size_t>(rows), grain, awake_grain,
      [&](size_t begin, size_t end) {
        const at::ThreadLocalStateGuard as_the_caller(callers_state);
        c10::ParallelGuard guard(true);
        at::AutoDispatchBelowADInplaceOrView below_autograd;
        const auto b = static_cast<int64_t>(begin);
        const auto len = static_cast<int64_t>(end - begin);
        dst.narrow(0, b, len).copy_(src.narrow(0, b, len));
      },
      max_threads);
}

// After an idle gap the setup below (the pool allocation: its lock, the event queries of
// blocks freed behind copies; the output tensor) takes tens of microseconds, about what a
// sleeping copy worker takes to rise: the helpers a copy on the pool will use are woken
// first, as the pipeline's muster_copy_crew does for to_device (ThreadPool::wake_ahead, which
// wakes only after a gap; csrc/README.md, "Woken ahead").
void wake_copy_helpers_ahead(ThreadPool& pool, size_t nbytes, int max_threads) {
  const size_t units = (nbytes + kCopyUnit - 1) / kCopyUnit;
  const size_t chunks = (units + kUnitsPerChunk - 1) / kUnitsPerChunk;
  pool.wake_ahead(static_cast<int>(std::min<size_t>(max_threads, chunks)) - 1);
}

thread_local PinCallTrace t_pin_trace;  // last_pin_call_trace()

using TraceClock = std::chrono::steady_clock;

double us_between(TraceClock::time_point from, TraceClock::time_point to) {
  return std::chrono::duration<double, std::micro>(to - from).count();
}

}  // namespace

PinCallTrace last_pin_call_trace() { return t_pin_trace; }

at::Tensor pin_memory_copy(const at::Tensor& self, std::optional<int64_t> numa_node,
                           int64_t num_threads) {
  const bool tracing = team_region_tracing();
  const auto started = tracing ? TraceClock::now() : TraceClock::time_point{};
  const int64_t team_copies = tracing ? torch_team_copies() : 0;
  check_input(self);
  check_threads(num_threads);
  const int node = resolve_numa_node(numa_node, "pinxfer.pin_memory");
  graph_pools::check_capture_allocation("pinxfer.pin_memory");

  const bool overlapping = at::has_internal_overlap(self) == at::MemOverlap::Yes;
  const c10::DimVector strides =
      overlapping ? c10::contiguous_strides(self.sizes()) : c10::DimVector(self.strides());
  const size_t nbytes =
      at::detail::computeStorageNbytes(self.sizes(), strides, self.dtype().itemsize());

  // Built from dtype alone, without the conj/neg bits: the result holds
  // resolved values, as torch's does.
  const auto allocate_out = [&] {
    return tensor_over(pool_for_node(node).allocate(nbytes, PinnedPool::Use::kWrittenNow), nbytes,
                       node, self.sizes(), strides, self.scalar_type());
  };
  if (nbytes == 0 || self.numel() == 0) return allocate_out();
  const auto checked = tracing ? TraceClock::now() : TraceClock::time_point{};
  const bool plain_copy = !overlapping && !self.is_conj() && !self.is_neg();
  ThreadPool& pool = thread_pool_for_node(node);
  // num_threads 0: as many as this copy is worth (ThreadPool::threads_for_copy).
  const int max_threads =
      num_threads > 0 ? static_cast<int>(num_threads) : pool.threads_for_copy(nbytes);
  // Who copies is decided once, before the allocation, as the pipeline's muster_copy_crew
  // decides it for to_device: torch's team if it is awake (one probe, a /proc read outside
  // the team's spin window; only a plain copy over kSerialBytes asks), else the pool, whose
  // helpers are woken now after a gap. The copy used to ask again, so every copy after a gap
  // read /proc twice, and cold: the first read alone took about 20-30 us there (H100 and
  // H200, benchmarks/diag_idle_pin.py: the setup step, which holds it, 30-42 us after 20 ms
  // of sleep with the team's road on, 11 with it off).
  const bool team_awake = plain_copy && nbytes > transfer::kSerialBytes && torch_team_awake();
  if (plain_copy && !team_awake) wake_copy_helpers_ahead(pool, nbytes, max_threads);

  const auto set_up = tracing ? TraceClock::now() : TraceClock::time_point{};
  at::Tensor out = allocate_out();
  const auto allocated = tracing ? TraceClock::now() : TraceClock::time_point{};
  if (plain_copy) {
    copy_plain(out, self, nbytes, pool, max_threads, team_awake);
  } else {
    parallel_elementwise_copy(out, self, pool, max_threads);
  }
  if (tracing) {
    const auto copied = TraceClock::now();
    PinCallTrace& t = t_pin_trace;
    t.checks_us = us_between(started, checked);
    t.setup_us = us_between(checked, set_up);
    t.alloc_us = us_between(set_up, allocated);
    t.copy_us = us_between(allocated, copied);
    t.total_us = us_between(started, copied);
    t.on_team = torch_team_copies() != team_copies;
  }
  return out;
}

bool is_pinned_dense(const at::Tensor& self, bool ask_torch) {
  if (!self.defined() || !self.device().is_cpu() || !self.has_storage()) return false;
  if (const auto kind = PinnedPool::lock_kind_if_pool(self.storage().data_ptr())) {
    return *kind != LockKind::kPageable;  // a block the memlock limit left unlocked
  }
  if (ask_torch && self.is_pinned()) return true;
  return inplace_lock_kind(self).has_value();
}

at::Tensor pin_or_self(const at::Tensor& self, std::optional<int64_t> numa_node,
                       int64_t num_threads, bool ask_torch) {
  const bool tracing = team_region_tracing();
  const auto started = tracing ? TraceClock::now() : TraceClock::time_point{};
  if (is_pinned_dense(self, ask_torch)) return self;
  const double pinned_check_us = tracing ? us_between(started, TraceClock::now()) : 0;
  at::Tensor out = pin_memory_copy(self, numa_node, num_threads);
  if (tracing) t_pin_trace.pinned_check_us = pinned_check_us;
  return out;
}

// CompositeExplicitAutograd rather than CPU: CUDA, sparse and other inputs then
// reach check_input() and get its explanation instead of a dispatcher error.
TORCH_LIBRARY_IMPL(pinxfer, CompositeExplicitAutograd, m) {
  m.impl("pin_memory", &pin_memory_copy);
}

}  // namespace pinxfer::ops
