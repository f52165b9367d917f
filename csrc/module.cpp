// Every operator pinxfer exposes, declared in one place: the functions that take or
// return a tensor, so that the dispatcher, autograd, fake tensors, tracing and opcheck
// see them. Kernels live in csrc/ops/ and register themselves at the bottom of their
// files; Python calls them as torch.ops.pinxfer.<name> through the typed wrappers in
// pinxfer/_ops.py. Everything else (stats, settings, topology, test hooks) is a plain
// function of the module pinxfer._C (csrc/python/bindings.h).
//
// Streams cross the op boundary as (stream_id, device_index, device_type), the
// triple torch.Stream packs itself into; c10::Stream::unpack3 rebuilds it.
#include <torch/library.h>

TORCH_LIBRARY(pinxfer, m) {
  // ---- the pinned pool (csrc/ops/memory_ops.cpp) ----
  // A CPU tensor whose memory comes from the pinned pool of a NUMA node
  // (None: the current GPU's node; -1: unbound).
  m.def("empty(int[] size, ScalarType dtype, int? numa_node=None) -> Tensor");
  // Marks that a CUDA stream uses a pool tensor: its block is not reused
  // before the work queued on that stream so far has completed.
  m.def("record_stream(Tensor self, int stream_id, int device_index, int device_type) -> ()");
  // True if the tensor's storage is a live block of a pinxfer pool.
  m.def("is_pool_tensor(Tensor self) -> bool");
  // How the tensor's pool block is locked: cuda_registered, mlocked, pageable.
  m.def("lock_kind(Tensor self) -> str");
  // NUMA node of each page of a CPU tensor (negative errno if not present).
  m.def("page_nodes(Tensor self) -> int[]");

  // ---- pin_memory and in-place pinning (csrc/ops/cpu/pin_memory_cpu.cpp,
  //      pin_inplace_cpu.cpp) ----
  // Tensor.pin_memory() into the pool of a NUMA node (None: the current GPU's), same sizes and
  // strides, copied by the node's thread pool with at most num_threads threads (0: all).
  m.def("pin_memory(Tensor self, int? numa_node=None, int num_threads=0) -> Tensor");
  // Page-locks a CPU tensor's whole storage in place (cudaHostRegister, else mlock).
  m.def("pin_(Tensor self) -> ()");
  // Undoes exactly what pin_ did to the tensor's storage.
  m.def("unpin_(Tensor self) -> ()");
  // How pin_ locked the tensor's storage (cuda_registered, mlocked), None if it did not.
  m.def("inplace_lock_kind(Tensor self) -> str?");

  // ---- transfers (csrc/ops/cuda/to_device_cuda.cpp, CUDA builds only; csrc/transfer/) ----
  // CPU tensor -> CUDA: pinned sources in one DMA, pageable ones through pinned staging chunks.
  // staging: "auto", "nt" or "movsb" (how chunks are staged); cached_tail: bytes at the end
  // staged nontemporal under "auto" (-1: auto).
  m.def("to_device(Tensor self, Device device, int chunk_bytes, int num_buffers, "
        "str staging=\"auto\", int cached_tail=-1) -> Tensor");
  // CPU tensors -> CUDA packed in one pinned buffer and one copy: the packed device bytes
  // (uint8), tensor i at its offset (pinxfer._ops.pack_offsets), padding zeroed. One
  // output, no aliasing between outputs (torch >= 2.12 rejects ops whose outputs alias);
  // pinxfer._ops.to_device_many cuts the views.
  m.def("to_device_packed(Tensor[] tensors, Device device) -> Tensor");
}
