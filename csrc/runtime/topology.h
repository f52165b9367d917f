// Host topology read from sysfs: which NUMA node a PCI device (GPU) sits on,
// and which CPUs belong to a node.
//
// Every function takes the sysfs root as a parameter so tests can build fake
// trees (2- and 4-node machines) under a temporary directory. A missing file
// or a node of -1 means "no binding": callers then neither bind memory nor pin
// threads. Stateless and thread-safe.
#pragma once

#include <string>
#include <vector>

namespace pinxfer {

// "/sys", or PINXFER_SYSFS_ROOT when set (read once, runtime/settings.h).
std::string sysfs_root();

// The text of a small kernel file (sysfs, procfs, cgroupfs): false unless
// `path` is a regular file. Opened non-blocking and read to at most
// kMaxKernelFileBytes, so a FIFO, a device or a huge file where a sysfs file
// should be never blocks or floods the caller.
constexpr size_t kMaxKernelFileBytes = size_t{64} << 10;
bool read_kernel_file(const std::string& path, std::string* out);

// CPUs of NUMA node `node` (<root>/devices/system/node/node<N>/cpulist, read
// with parse_cpulist() of runtime/parse.h); empty if the node or file does not
// exist. Throws c10::ValueError if the file is not a CPU list.
std::vector<int> node_cpus(int node, const std::string& root);

// NUMA nodes present (<root>/devices/system/node/node<N>); empty if none.
std::vector<int> online_nodes(const std::string& root);

// NUMA node of a PCI device, bus id like "0000:1b:00.0" (case-insensitive)
// (<root>/bus/pci/devices/<id>/numa_node); -1 when unknown or missing.
int pci_numa_node(const std::string& pci_bus_id, const std::string& root);

}  // namespace pinxfer
