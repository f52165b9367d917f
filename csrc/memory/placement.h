// Where pinned memory for a device should live: the NUMA node of the GPU.
//
// Resolution order: PINXFER_NUMA_NODE (a number, or "none"/-1 to disable) >
// the node sysfs reports for the GPU's PCI bus id > -1 (no binding). Results
// per device are cached (PINXFER_NUMA_NODE is read once, at first use).
// Thread-safe, lock-free after the first call per device.
#pragma once

namespace pinxfer {

// NUMA node for CUDA device `device`; -1 if unknown, unbound, or no CUDA.
int numa_node_for_device(int device);

// NUMA node for the current CUDA device (or -1 without CUDA).
int numa_node_for_current_device();

}  // namespace pinxfer
