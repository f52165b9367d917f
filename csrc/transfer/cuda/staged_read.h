// Sending staged bytes to the GPU by a kernel that reads them over the bus, not by the copy
// engine (issue 22: the mid-size engine phase).
//
// Why. Pinned staging is mapped into the device's address space (the pool registers it mapped),
// and where the device may use a registered host pointer (cudaDevAttrCanUseHostPointerFor-
// RegisteredMem) that pointer is valid in a kernel. The copy engine keeps few reads in flight
// over PCIe, so its rate falls as soon as host memory answers slowly, and lines the staging
// threads have just written with cached stores answer slowly: they sit dirty in the writers'
// L2 and must be snooped. A kernel of many threads keeps far more reads in flight. Torch only,
// H100, a pinned source the host had just rewritten with cached stores
// (benchmarks/diag_dma_under_load.py, results/h100/dma_under_load_sm_2026-12-07_s57.json): the
// engine read 8 / 32 / 64 MiB at 32.6 / 45.9 / 51.5 GB/s, a kernel over every SM at 50.0 / 51.0
// / 51.1; the same kernel with 4 / 8 / 16 / 32 blocks at 8 MiB 31.6 / 34.4 / 38.9 / 48.4. On
// clean lines the engine is faster (52-55 against 50-51), and the host's own copying slows both
// alike.
//
// So the kernel reads only what the single-block pipeline staged with cached stores
// (transfer/cuda/pipeline.cpp, kernel_read_end; the nontemporal tail, the ring of larger
// transfers, stolen pieces and the small road stay with the engine), and by default only for a
// caller on the device's default stream with nothing pending there as the transfer began (where
// a training loop's steps run, and where their absence can be seen): its blocks take SMs,
// and a compute step running beside a 32 MiB copy took 1.09x as long with the kernel reading
// the cached chunks, 1.20x with it reading all, 0.995x with the engine
// (benchmarks/diag_read_overlap.py). Prefetch's sends from streams of their own (its batch
// sender, its producer thread), which overlap the training step, never use it under auto; a
// batch it sends on the consumer's thread (a pass's first) is a to_device like any other.
// PINXFER_H2D_READ: auto (that), engine, kernel (whatever the caller's stream is doing).
// csrc/README.md, "Session 57", has the rest.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

namespace pinxfer::transfer {

// Whether the kernel can run on the current device: cudaSuccess, or why not (no image for
// this GPU in the build: TORCH_CUDA_ARCH_LIST named other architectures, and no PTX for it).
cudaError_t staged_read_runs_here();

// Queues on `stream` a kernel of `blocks` blocks copying `nbytes` from `src` (pinned host
// memory whose host pointer the device may use) to `dst` (device memory). Both must be 16-byte
// aligned (staged_read_fits); nbytes need not be. Returns the launch's error (cudaSuccess:
// queued).
cudaError_t launch_staged_read(void* dst, const void* src, size_t nbytes, int blocks,
                               cudaStream_t stream);

// Whether launch_staged_read can take these pointers (both 16-byte aligned, nbytes > 0).
inline bool staged_read_fits(const void* dst, const void* src, size_t nbytes) {
  return nbytes > 0 && (reinterpret_cast<size_t>(dst) | reinterpret_cast<size_t>(src)) % 16 == 0;
}

}  // namespace pinxfer::transfer
