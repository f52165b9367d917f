#include "transfer/cuda/source_use.h"

#include <ATen/core/CachingHostAllocator.h>

#include "memory/pinned_pool.h"
#include "memory/placement.h"
#include "memory/pool_registry.h"
#include "runtime/cuda_runtime.h"

namespace pinxfer::transfer {

namespace {
// Kept storages wait in the pool of the copy's device: its event FIFOs gate
// them exactly as they gate freed blocks.
PinnedPool& keeper_for(c10::DeviceIndex device) {
  return pool_for_node(numa_node_for_device(device));
}
}  // namespace

void release_finished_sources(c10::DeviceIndex device) { keeper_for(device).release_finished(); }

void record_source_use(const at::Tensor& src, const c10::cuda::CUDAStream& stream) {
  const c10::DataPtr& data = src.storage().data_ptr();
  if (PinnedPool* pool = PinnedPool::owner_of(data.get_context())) {
    pool->record_stream(data.get_context(), stream.unwrap());
    return;
  }
  if (at::getHostAllocator(at::kCUDA)->record_event(data.get(), data.get_context(),
                                                    stream.unwrap())) {
    return;
  }
  keeper_for(stream.device_index()).keep_until_done(src.storage(), stream.unwrap());
}

bool is_dma_pinned(const at::Tensor& src) {
  void* ctx = src.storage().data_ptr().get_context();
  if (PinnedPool* pool = PinnedPool::owner_of(ctx)) {
    return pool->lock_kind_of(ctx) == LockKind::kCudaRegistered;
  }
  return cuda::is_cuda_pinned(src.data_ptr());
}

}  // namespace pinxfer::transfer
