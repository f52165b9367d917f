// Every operator pinxfer exposes, declared in one place (the Python module
// itself, with its eager fast calls, is csrc/python/fast_calls.cpp). Kernels live in
// csrc/ops/ and register themselves at the bottom of their files; Python calls
// them as torch.ops.pinxfer.<name> through the typed wrappers in pinxfer/_ops.py.
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
  // Counters of one pool (numa_node) or the sum of all (None): names, values.
  m.def("memory_stats(int? numa_node=None) -> (str[], int[])");
  // Sets every .peak counter to its .current value, in every pool.
  m.def("reset_peak_memory_stats() -> ()");
  // Zeroes the num_* counters and the timers, in every pool.
  m.def("reset_accumulated_memory_stats() -> ()");
  // Unmaps every fully free cached segment; returns the bytes released.
  m.def("empty_cache() -> int");
  // Hard cap on the bytes reserved by all pools (0: no cap), and its current value.
  m.def("set_max_pinned_bytes(int bytes) -> ()");
  m.def("get_max_pinned_bytes() -> int");
  // Makes the pool torch's CUDA host allocator; raises in a build without CUDA.
  m.def("install() -> ()");
  // Gives torch its own CUDA host allocator back.
  m.def("uninstall() -> ()");
  // True while the pool is torch's CUDA host allocator.
  m.def("is_installed() -> bool");
  // Build and runtime facts: built with CUDA, toolkit version, CUDA usable now.
  m.def("build_info() -> (bool, str, bool)");
  // NUMA node of each page of a CPU tensor (negative errno if not present).
  m.def("page_nodes(Tensor self) -> int[]");
  // Test-only: allocate/free sleep this many microseconds between their critical sections.
  m.def("_set_debug_pause_us(int us) -> ()");
  // TEST-ONLY fault injection, not an API: the next n cudaHostRegister calls of the pool's
  // segment mapping fail (as cudaErrorMemoryAllocation), so tests can check the documented
  // fallback (mlock, one warning). Returns the injected failures still pending before the call.
  m.def("_inject_host_register_failures(int n) -> int");

  // ---- pin_memory and topology (csrc/ops/cpu/pin_memory_cpu.cpp, pin_inplace_cpu.cpp,
  //      csrc/ops/topology_ops.cpp) ----
  // Tensor.pin_memory() into the pool of a NUMA node (None: the current GPU's), same sizes and
  // strides, copied by the node's thread pool with at most num_threads threads (0: all).
  m.def("pin_memory(Tensor self, int? numa_node=None, int num_threads=0) -> Tensor");
  // Page-locks a CPU tensor's whole storage in place (cudaHostRegister, else mlock).
  m.def("pin_(Tensor self) -> ()");
  // Undoes exactly what pin_ did to the tensor's storage.
  m.def("unpin_(Tensor self) -> ()");
  // How pin_ locked the tensor's storage (cuda_registered, mlocked), None if it did not.
  m.def("inplace_lock_kind(Tensor self) -> str?");
  // The sysfs root C++ reads by default: PINXFER_SYSFS_ROOT, else /sys.
  m.def("sysfs_root() -> str");
  // CPU ids of a kernel CPU list such as "0-3,8"; raises ValueError when malformed.
  m.def("parse_cpulist(str text) -> int[]");
  // Bytes in a size such as "512MiB", "8G", "1073741824" (binary units); raises ValueError.
  m.def("parse_byte_size(str text) -> int");
  // CPUs of a NUMA node under a sysfs root; [] if the node or its cpulist is missing.
  m.def("node_cpus(int node, str sysfs_root) -> int[]");
  // NUMA nodes present under a sysfs root; [] if none.
  m.def("online_nodes(str sysfs_root) -> int[]");
  // NUMA node of a PCI device ("0000:1b:00.0") under a sysfs root; -1 if unknown.
  m.def("pci_numa_node(str pci_bus_id, str sysfs_root) -> int");
  // PCI bus id CUDA reports for a device (without creating a context).
  m.def("cuda_pci_bus_id(int device) -> str");
  // CUDA devices this process can use (0 without CUDA, in a forked child, or when disabled).
  m.def("cuda_device_count() -> int");
  // NUMA node pinxfer places memory on for a CUDA device (PINXFER_NUMA_NODE, sysfs, or -1).
  m.def("numa_node_for_device(int device) -> int");

  // ---- settings (csrc/ops/settings_ops.cpp; csrc/runtime/settings.h) ----
  // Every setting as read once from the environment or derived: names, values, sources
  // ("env", "derived", "default").
  m.def("settings() -> (str[], str[], str[])");
  // Copy threads for a process with these CPUs (affinity, online, cgroup quota in CPUs or 0,
  // ranks on the host), and the reasoning in one line.
  m.def("copy_threads_for(int affinity_cpus, int online_cpus, float quota_cpus, "
        "int local_world_size) -> (int, str)");
  // TEST-ONLY: the thread pool of a NUMA node whose CPUs are node_cpus, in a process allowed
  // on affinity_cpus with this copy-thread budget (from PINXFER_NUM_THREADS or derived):
  // threads (counting the caller) and the CPUs its workers are bound to ([]: unbound).
  m.def("_node_pool_plan(int budget, int[] node_cpus, int[] affinity_cpus, "
        "bool budget_from_env) -> (int, int[])");
  // CPU quota (in CPUs, 0: none) of the cgroup named by /proc/self/cgroup's text, with the
  // cgroup filesystems mounted under cgroup_root.
  m.def("cgroup_quota_cpus(str cgroup_root, str proc_self_cgroup) -> float");
  // Why CUDA is not usable in this process, None when it is.
  m.def("cuda_unusable_reason() -> str?");

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
  // The stream pinxfer's H2D copies to a device run on: (stream_id, device_index, device_type).
  m.def("copy_stream(Device device) -> int[]");
  // Drops pinxfer's references to pinned sources whose copies to `device` have finished
  // (each transfer does this first; an owner about to free pinned memory, such as the
  // slot ring, calls it after waiting for its copies so that nothing keeps the memory).
  m.def("release_finished_sources(Device device) -> ()");
  // TEST-ONLY: how to_device would cut a transfer (csrc/ops/chunk_plan_ops.cpp): chunk
  // bounds, pieces as (chunk, begin, end) triples, ring slots (0: one block), slot bytes,
  // threads.
  m.def("_chunk_plan(int nbytes, int chunk_bytes, int num_buffers, int num_threads) -> "
        "(int[], int[], int, int, int)");
}
