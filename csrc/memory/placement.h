// Where pinned memory for a device should live: the NUMA node of the GPU.
//
// Resolution order: PINXFER_NUMA_NODE (a number, or "none"/-1 to disable) >
// the node sysfs reports for the GPU's PCI bus id > -1 (no binding). Results
// per device are cached (PINXFER_NUMA_NODE is read once, at first use).
// Thread-safe, lock-free after the first call per device.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

namespace pinxfer {

// The NUMA nodes a caller may name: the node<N> directories under sysfs
// (read once), or {0} on a machine whose sysfs lists none.
const std::vector<int>& existing_numa_nodes();

// A caller's numa_node argument, checked: None -> the current GPU's node;
// -1 -> no binding; otherwise one of existing_numa_nodes(). Anything else
// raises a ValueError that names `what`, the value and the nodes there are,
// so no pool or thread pool is ever built for a node that does not exist.
int resolve_numa_node(std::optional<int64_t> numa_node, const char* what);

// NUMA node for CUDA device `device`; -1 if unknown, unbound, or no CUDA.
int numa_node_for_device(int device);

// NUMA node for the current CUDA device (or -1 without CUDA).
int numa_node_for_current_device();

}  // namespace pinxfer
