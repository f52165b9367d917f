// pinxfer._C._call_breakdown(iterations): where the time of one small call
// goes, piece by piece, in nanoseconds per call (median of 5 rounds of
// `iterations` calls). For benchmarks/diag_latency.py and the design note's
// per-call budget ("Where the time of one transfer goes"); not an API.
//
// Each piece is timed alone, in a loop, in this process, on the current
// device: the CUDA runtime queries a small call makes (current device, the
// current stream, whether it is capturing, the primary-context check), the
// pool's cache hit, an event record + release, and the whole empty() and
// to_device() of small tensors as the fast calls run them.
#include <torch/extension.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "memory/graph_pools.h"
#include "memory/pinned_pool.h"
#include "memory/placement.h"
#include "memory/pool_registry.h"
#include "ops/kernels.h"
#include "python/call_breakdown.h"
#include "runtime/cuda_runtime.h"
#include "runtime/step_stamps.h"

#if PINXFER_WITH_CUDA
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include "transfer/cuda/copy_streams.h"
#include "transfer/cuda/pipeline.h"
#include "transfer/cuda/source_use.h"
#endif

namespace pinxfer::diag {
namespace {

double ns_per_call(
    int64_t iterations, const std::function<void()>& fn,
    const std::function<void()>& after_round = [] {}) {
  std::vector<double> rounds;
  fn();  // warm: first-use costs (event pools, cached blocks) are not a call's
  after_round();
  for (int r = 0; r < 5; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < iterations; ++i) fn();
    after_round();
    const auto t1 = std::chrono::steady_clock::now();
    rounds.push_back(std::chrono::duration<double, std::nano>(t1 - t0).count() /
                     static_cast<double>(iterations));
  }
  std::sort(rounds.begin(), rounds.end());
  return rounds[rounds.size() / 2];
}

}  // namespace

std::map<std::string, double> call_breakdown(int64_t iterations) {
  TORCH_CHECK_VALUE(iterations > 0 && iterations <= 10'000'000,
                    "pinxfer._C._call_breakdown: iterations must be from 1 to 10^7, got ",
                    iterations);
  std::map<std::string, double> out;
  const std::vector<int64_t> size16k{16384};
  out["pool_empty_64KiB"] =
      ns_per_call(iterations, [&] { (void)ops::pool_empty(size16k, at::kFloat, std::nullopt); });
  out["resolve_numa_node_current"] =
      ns_per_call(iterations, [] { (void)resolve_numa_node(std::nullopt, "diag"); });
  out["check_capture_allocation"] =
      ns_per_call(iterations, [] { graph_pools::check_capture_allocation("diag"); });
  out["pool_for_current_stream"] =
      ns_per_call(iterations, [] { (void)graph_pools::pool_for_current_stream(); });
  PinnedPool& pool = pool_for_node(resolve_numa_node(std::nullopt, "diag"));
  out["pool_allocate_free_64KiB"] =
      ns_per_call(iterations, [&] { (void)pool.allocate(size_t{64} << 10); });
#if PINXFER_WITH_CUDA
  if (cuda::cuda_usable()) {
    out["cudaGetDevice"] = ns_per_call(iterations, [] {
      int d = -1;
      (void)cudaGetDevice(&d);
    });
    const auto device = static_cast<c10::DeviceIndex>(cuda::current_device());
    out["hasPrimaryContext"] = ns_per_call(iterations, [device] {
      (void)at::detail::getCUDAHooks().hasPrimaryContext(device);
    });
    out["getCurrentCUDAStream"] =
        ns_per_call(iterations, [device] { (void)c10::cuda::getCurrentCUDAStream(device); });
    const cudaStream_t raw = c10::cuda::getCurrentCUDAStream(device).stream();
    out["cudaStreamIsCapturing"] = ns_per_call(iterations, [raw] {
      cudaStreamCaptureStatus status;
      (void)cudaStreamIsCapturing(raw, &status);
    });
    out["current_stream_is_capturing"] =
        ns_per_call(iterations, [] { (void)cuda::current_stream_is_capturing(); });
    const c10::Stream stream = c10::cuda::getCurrentCUDAStream(device).unwrap();
    out["event_record_release"] = ns_per_call(
        iterations, [&] { cuda::release_event(cuda::record_event(stream)); },
        [] { C10_CUDA_CHECK(cudaDeviceSynchronize()); });
    const c10::Device cuda_device(c10::DeviceType::CUDA, device);
    const auto opts = at::TensorOptions().device(cuda_device).dtype(at::kByte);
    out["cuda_empty_4KiB"] = ns_per_call(iterations, [&] { (void)at::empty({4096}, opts); });
    out["device_empty_4KiB"] =
        ns_per_call(iterations, [&] { (void)transfer::device_empty({4096}, opts); });
    at::Tensor dst = at::empty({4096}, opts);
    at::Tensor pinned = ops::pool_empty({4096}, at::kByte, std::nullopt);
    // One cudaMemcpyAsync of 4 KiB from `src` into dst on the raw current stream.
    const auto memcpy_4KiB_from = [&](const void* src) {
      return ns_per_call(
          iterations,
          [&dst, src, raw] {
            C10_CUDA_CHECK(cudaMemcpyAsync(dst.data_ptr(), src, 4096, cudaMemcpyHostToDevice, raw));
          },
          [] { C10_CUDA_CHECK(cudaDeviceSynchronize()); });
    };
    out["cudaMemcpyAsync_pinned_4KiB"] = memcpy_4KiB_from(pinned.data_ptr());
    const at::Tensor pageable = at::zeros({4096}, at::kByte);
    // The pieces of send_to_device's small pageable path that are not timed above.
    out["is_dma_pinned_pageable"] =
        ns_per_call(iterations, [&] { (void)transfer::is_dma_pinned(pageable); });
    // pin_memory's first step (is_pinned_dense, which asks torch's is_pinned: the dispatcher,
    // CUDAHooks' primary-context search and device guard, then the same driver query as
    // is_dma_pinned), and torch's is_pinned alone: what the dispatcher and the guard add.
    out["pin_memory_pinned_check_pageable"] =
        ns_per_call(iterations, [&] { (void)ops::is_pinned_dense(pageable, true); });
    out["torch_is_pinned_pageable"] = ns_per_call(iterations, [&] { (void)pageable.is_pinned(); });
    out["release_finished_sources"] =
        ns_per_call(iterations, [device] { transfer::release_finished_sources(device); });
    const c10::cuda::CUDAStream cur = c10::cuda::getCurrentCUDAStream(device);
    const auto staging = ops::staging_options(int64_t{16} << 20, 4, "auto", -1);
    out["caller_staged_copy_4KiB"] = ns_per_call(
        iterations,
        [&] {
          StepStamps unpublished;  // stamps (if on) that no record will show
          transfer::caller_staged_copy(pageable, dst, device, cur, staging, unpublished);
        },
        [] { C10_CUDA_CHECK(cudaDeviceSynchronize()); });
    // The driver's own pageable road for the same bytes (what `t.to(dev, non_blocking=True)`
    // ends in), beside the caller's pool-block road above, in one process: a measure only.
    // pinxfer does not take it: the CUDA documentation does not promise that the call has read
    // a pageable source when it returns (csrc/README.md, "Session 52").
    out["cudaMemcpyAsync_pageable_4KiB"] = memcpy_4KiB_from(pageable.const_data_ptr());
    out["send_to_device_4KiB"] = ns_per_call(
        iterations, [&] { (void)ops::send_to_device(pageable, cuda_device, staging); },
        [] { C10_CUDA_CHECK(cudaDeviceSynchronize()); });
  }
#endif
  return out;
}

}  // namespace pinxfer::diag
