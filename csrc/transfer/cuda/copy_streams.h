// The streams of a transfer: each device's dedicated copy stream, and handing
// a transfer's output over from it to the caller's current stream.
//
// Every copy runs on the device's copy stream (created once, non-blocking; not
// from c10's pool, whose streams torch.cuda.Stream() also hands out, so a
// user's compute stream could turn out to be ours), never on the caller's
// current stream `cur`, so H2D overlaps the kernels queued on `cur`:
//   1. the output is allocated by the caching allocator *on the copy stream*
//      (empty_on_stream): its memory was last used by work ordered on that
//      stream, so the copy never waits for `cur` (which may be busy);
//   2. at the end `cur` waits on an event recorded after the last copy
//      (hand_over), so any later use of the result on `cur` is ordered after
//      the copy: non_blocking results are safe without further syncs;
//   3. the output is record_stream'ed on `cur`: when it is freed, the caching
//      allocator hands its memory to the next copy only after `cur` has passed
//      the work queued on it so far.
// If a transfer throws after queueing copies, its output is simply dropped:
// the memory goes back to the copy stream's pool, where any later use is
// stream-ordered after the copies already queued.
//
// Thread safety: all functions may be called from any thread; the stream
// registry has its own leaf lock. Streams are leaked (they outlive every
// caller, including at exit).
#pragma once

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <c10/cuda/CUDAStream.h>

namespace pinxfer::transfer {

// The dedicated H2D stream of a device, created on first use.
c10::cuda::CUDAStream copy_stream_for(c10::DeviceIndex device);

// Makes `waiter` wait for the work queued on `signaller` so far.
void stream_wait(const c10::cuda::CUDAStream& waiter, const c10::cuda::CUDAStream& signaller);

// True while work queued on `stream` has not finished.
bool stream_busy(const c10::cuda::CUDAStream& stream);

// An uninitialised contiguous tensor on options' CUDA device from the caching allocator, for
// the current stream: at::empty without the dispatcher (about 1 µs of a 4 KiB transfer's 10 on
// the H100 host) and without the deterministic-mode fill (a transfer writes every byte).
at::Tensor device_empty(at::IntArrayRef sizes, const at::TensorOptions& options);

// The output of a transfer, allocated on the copy stream (see 1. above).
at::Tensor empty_on_stream(at::IntArrayRef sizes, const at::TensorOptions& options,
                           const c10::cuda::CUDAStream& stream);

// Makes `cur` wait for the copies and keeps `out`'s memory from the next copy
// until `cur` is done with it (2. and 3. above).
void hand_over(const at::Tensor& out, const c10::cuda::CUDAStream& copy,
               const c10::cuda::CUDAStream& cur);

// A profiler range (torch.profiler, on the calling thread) and an NVTX range
// (nsys, on every thread) with one name.
class Range {
 public:
  explicit Range(const char* name);
  ~Range();
  Range(const Range&) = delete;
  Range& operator=(const Range&) = delete;

 private:
  at::RecordFunction record_;
};

}  // namespace pinxfer::transfer
