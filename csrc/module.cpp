// Every operator pinxfer exposes, declared in one place. Kernels live in
// csrc/ops/ and register themselves at the bottom of their files; Python calls
// them as torch.ops.pinxfer.<name> through the typed wrappers in pinxfer/_ops.py.
//
// Streams cross the op boundary as (stream_id, device_index, device_type), the
// triple torch.Stream packs itself into; c10::Stream::unpack3 rebuilds it.
#include <Python.h>
#include <torch/library.h>

extern "C" {
// An empty module: importing pinxfer._C loads the library, whose static
// initialisers run the TORCH_LIBRARY registrations below.
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}

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
  // Counters of one pool (numa_node) or the sum of all (None): names, values.
  m.def("memory_stats(int? numa_node=None) -> (str[], int[])");
  m.def("reset_peak_stats() -> ()");
  m.def("reset_accumulated_stats() -> ()");
  // Unmaps every fully free cached segment; returns the bytes released.
  m.def("empty_cache() -> int");
  m.def("set_max_pinned_bytes(int bytes) -> ()");
  m.def("max_pinned_bytes() -> int");
  // Makes the pool torch's CUDA host allocator (True) or restores torch's (False).
  m.def("install_host_allocator(bool enable) -> bool");
  m.def("host_allocator_installed() -> bool");
  // Build and runtime facts: built with CUDA, toolkit version, CUDA usable now.
  m.def("build_info() -> (bool, str, bool)");
  // NUMA node of each page of a CPU tensor (negative errno if not present).
  m.def("page_nodes(Tensor self) -> int[]");
}
