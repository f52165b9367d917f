#include "transfer/cuda/source_use.h"

#include <ATen/core/CachingHostAllocator.h>

#include <deque>
#include <mutex>
#include <string>
#include <vector>

#include "memory/pinned_pool.h"
#include "runtime/cuda_runtime.h"

namespace pinxfer::transfer {

namespace {
struct KeptStorage {
  cuda::Event event;
  c10::Storage storage;
};
std::mutex g_kept_mutex;
std::deque<KeptStorage>* g_kept = new std::deque<KeptStorage>();  // LOCK: g_kept_mutex. Leaked.
}  // namespace

void release_finished_sources() {
  std::vector<c10::Storage> drop;  // destroyed outside the lock
  std::lock_guard<std::mutex> lock(g_kept_mutex);
  while (!g_kept->empty()) {
    std::string error;
    if (!cuda::event_done(g_kept->front().event, &error)) break;
    if (!error.empty()) break;  // cannot prove the copy finished: keep holding
    cuda::release_event(g_kept->front().event);
    drop.push_back(std::move(g_kept->front().storage));
    g_kept->pop_front();
  }
}

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
  KeptStorage kept{cuda::record_event(stream.unwrap()), src.storage()};
  std::lock_guard<std::mutex> lock(g_kept_mutex);
  g_kept->push_back(std::move(kept));
}

bool is_dma_pinned(const at::Tensor& src) {
  void* ctx = src.storage().data_ptr().get_context();
  if (PinnedPool* pool = PinnedPool::owner_of(ctx)) {
    return pool->lock_kind_of(ctx) == LockKind::kCudaRegistered;
  }
  return cuda::is_cuda_pinned(src.data_ptr());
}

}  // namespace pinxfer::transfer
