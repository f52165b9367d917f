// Pinned sources that a DMA reads directly: can the DMA engine read them, and
// telling their owner that a copy stream does.
//
// A pinned source's memory must not be reused while a copy may still read it.
// Who knows about the copy depends on who owns the memory: pinxfer's pool
// (record_stream on the block), torch's CUDA host allocator (record_event), or
// nobody (memory registered by hand): then the pool of the device's node holds
// the storage in its per-stream event FIFO (PinnedPool::keep_until_done) until
// the copy has completed, the same gate that keeps freed staging blocks.
//
// Thread safety: any thread (the pool's lock guards the kept storages).
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>

namespace pinxfer::transfer {

// True if the DMA engine can read the tensor's memory directly
// (cudaHostRegister'ed or cudaHostAlloc'ed; not memory pinxfer mlocked).
bool is_dma_pinned(const at::Tensor& src);

// Tells whoever owns `src`'s memory that `stream` reads it.
void record_source_use(const at::Tensor& src, const c10::cuda::CUDAStream& stream);

// Drops the storages held by record_source_use for `device` whose copies have finished.
void release_finished_sources(c10::DeviceIndex device);

}  // namespace pinxfer::transfer
