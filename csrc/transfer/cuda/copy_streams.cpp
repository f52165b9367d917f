#include "transfer/cuda/copy_streams.h"

#include <ATen/cuda/EmptyTensor.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>
#include <nvtx3/nvToolsExt.h>

#include <mutex>
#include <vector>

#include "runtime/cuda_runtime.h"

namespace pinxfer::transfer {

Range::Range(const char* name) : record_(at::RecordScope::USER_SCOPE) {
  if (record_.isActive()) record_.before(name);
  nvtxRangePushA(name);
}

Range::~Range() { nvtxRangePop(); }

c10::cuda::CUDAStream copy_stream_for(c10::DeviceIndex device) {
  static std::mutex mutex;
  static auto* streams = new std::vector<cudaStream_t>();  // LOCK: mutex. Leaked.
  std::lock_guard<std::mutex> lock(mutex);
  if (static_cast<size_t>(device) >= streams->size()) streams->resize(device + 1, nullptr);
  cudaStream_t& slot = (*streams)[device];
  if (slot == nullptr) {
    c10::cuda::CUDAGuard guard(device);
    // Non-blocking: no implicit synchronisation with the legacy default stream.
    C10_CUDA_CHECK(cudaStreamCreateWithFlags(&slot, cudaStreamNonBlocking));
  }
  return c10::cuda::getStreamFromExternal(slot, device);
}

void stream_wait(const c10::cuda::CUDAStream& waiter, const c10::cuda::CUDAStream& signaller) {
  const cuda::Event ev = cuda::record_event(signaller.unwrap());
  const cudaError_t err =
      cudaStreamWaitEvent(waiter.stream(), static_cast<cudaEvent_t>(ev.handle), 0);
  // The wait captured the event's state; the event may be recycled now.
  cuda::release_event(ev);
  C10_CUDA_CHECK(err);
}

bool stream_busy(const c10::cuda::CUDAStream& stream) {
  // stream_idle queries with the thread's capture mode relaxed and clears "not ready" from
  // CUDA's last-error slot (a plain cudaStreamQuery from a sender's thread invalidated
  // another thread's global-mode capture; found by review, session 44). An error reads as
  // busy: this only picks the staging stores, and the copy itself reports the error.
  return !cuda::stream_idle(stream.unwrap());
}

at::Tensor device_empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
  return at::detail::empty_cuda(sizes, options);
}

at::Tensor empty_on_stream(at::IntArrayRef sizes, const at::TensorOptions& options,
                           const c10::cuda::CUDAStream& stream) {
  c10::cuda::CUDAStreamGuard guard(stream);
  return device_empty(sizes, options);
}

void hand_over(const at::Tensor& out, const c10::cuda::CUDAStream& copy,
               const c10::cuda::CUDAStream& cur) {
  stream_wait(cur, copy);
  if (cur != copy) c10::cuda::CUDACachingAllocator::recordStream(out.storage().data_ptr(), cur);
}

}  // namespace pinxfer::transfer
