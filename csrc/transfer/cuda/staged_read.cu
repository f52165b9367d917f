// The kernel of transfer/cuda/staged_read.h. Plain CUDA: no torch header, so nvcc compiles it
// in seconds.
#include "transfer/cuda/staged_read.h"

#include <algorithm>

namespace pinxfer::transfer {

namespace {

// Grid-stride copy in 16-byte words with four loads in flight per thread before their stores:
// the reads cross the bus, and what keeps its rate is how many are outstanding. The bytes after
// the last whole word (fewer than 16) are copied by the grid's first threads.
__global__ void staged_read_kernel(const int4* __restrict__ src, int4* __restrict__ dst,
                                   size_t words, const unsigned char* __restrict__ tail_src,
                                   unsigned char* __restrict__ tail_dst, unsigned tail) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  const size_t first = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  size_t i = first;
  for (; i + 3 * stride < words; i += 4 * stride) {
    const int4 a = src[i], b = src[i + stride], c = src[i + 2 * stride], d = src[i + 3 * stride];
    dst[i] = a;
    dst[i + stride] = b;
    dst[i + 2 * stride] = c;
    dst[i + 3 * stride] = d;
  }
  for (; i < words; i += stride) dst[i] = src[i];
  if (first < tail) tail_dst[first] = tail_src[first];
}

}  // namespace

cudaError_t staged_read_runs_here() {
  cudaFuncAttributes attributes;
  const cudaError_t err = cudaFuncGetAttributes(&attributes, staged_read_kernel);
  if (err != cudaSuccess) (void)cudaGetLastError();  // not sticky: leave no trace of it
  return err;
}

cudaError_t launch_staged_read(void* dst, const void* src, size_t nbytes, int blocks,
                               cudaStream_t stream) {
  constexpr unsigned kThreads = 512;
  size_t words = nbytes / 16;
  const size_t whole = words * 16;
  // No more blocks than a thread per word needs (a short span needs few), and at least one.
  const size_t useful = (words + kThreads - 1) / kThreads;
  const unsigned grid =
      static_cast<unsigned>(std::max<size_t>(1, std::min(useful, static_cast<size_t>(blocks))));
  const int4* words_src = static_cast<const int4*>(src);
  int4* words_dst = static_cast<int4*>(dst);
  const unsigned char* tail_src = static_cast<const unsigned char*>(src) + whole;
  unsigned char* tail_dst = static_cast<unsigned char*>(dst) + whole;
  unsigned tail = static_cast<unsigned>(nbytes - whole);
  void* args[] = {&words_src, &words_dst, &words, &tail_src, &tail_dst, &tail};
  // cudaLaunchKernel returns this launch's own status; cudaGetLastError after a <<<>>> launch
  // would also return (and clear) an error an earlier call on this thread left behind.
  const cudaError_t err = cudaLaunchKernel(reinterpret_cast<const void*>(staged_read_kernel),
                                           dim3(grid), dim3(kThreads), args, 0, stream);
  if (err != cudaSuccess) (void)cudaGetLastError();
  return err;
}

}  // namespace pinxfer::transfer
