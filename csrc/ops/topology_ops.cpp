// Kernels for the topology operators (schemas in csrc/module.cpp): the C++
// answers the pool and thread pools act on, exposed so that pinxfer.topology()
// reports exactly what placement uses, and tests can check them against fake
// sysfs trees (every op takes the sysfs root). Also the two text parsers of
// runtime/parse.h, so Python reads CPU lists and byte sizes as C++ does.
#include <torch/library.h>

#include "memory/placement.h"
#include "runtime/cuda_runtime.h"
#include "runtime/parse.h"
#include "runtime/topology.h"

namespace pinxfer::ops {

namespace {

std::vector<int64_t> widen(const std::vector<int>& v) { return {v.begin(), v.end()}; }

std::string sysfs_root_op() { return sysfs_root(); }

std::vector<int64_t> parse_cpulist_op(const std::string& text) {
  return widen(parse_cpulist(text));
}

int64_t parse_byte_size_op(const std::string& text) { return parse_byte_size(text); }

std::vector<int64_t> node_cpus_op(int64_t node, const std::string& root) {
  try {
    return widen(node_cpus(static_cast<int>(node), root));
  } catch (const c10::ValueError& e) {
    // Name the file: the text alone does not say which node's list is broken.
    TORCH_CHECK_VALUE(false, e.what_without_backtrace(), " (in ", root, "/devices/system/node/node",
                      node, "/cpulist)");
  }
}

std::vector<int64_t> online_nodes_op(const std::string& root) { return widen(online_nodes(root)); }

int64_t pci_numa_node_op(const std::string& bus_id, const std::string& root) {
  return pci_numa_node(bus_id, root);
}

std::string cuda_pci_bus_id(int64_t device) {
  const int64_t count = cuda::device_count();
  TORCH_CHECK_INDEX(device >= 0 && device < count, "pinxfer: CUDA device ", device,
                    " does not exist; this process sees ", count, " CUDA device(s).");
  return cuda::pci_bus_id(static_cast<int>(device));
}

int64_t cuda_device_count() { return cuda::device_count(); }

int64_t numa_node_for_device_op(int64_t device) {
  return numa_node_for_device(static_cast<int>(device));
}

}  // namespace

TORCH_LIBRARY_IMPL(pinxfer, CompositeExplicitAutograd, m) {
  m.impl("sysfs_root", &sysfs_root_op);
  m.impl("parse_cpulist", &parse_cpulist_op);
  m.impl("parse_byte_size", &parse_byte_size_op);
  m.impl("node_cpus", &node_cpus_op);
  m.impl("online_nodes", &online_nodes_op);
  m.impl("pci_numa_node", &pci_numa_node_op);
  m.impl("cuda_pci_bus_id", &cuda_pci_bus_id);
  m.impl("cuda_device_count", &cuda_device_count);
  m.impl("numa_node_for_device", &numa_node_for_device_op);
}

}  // namespace pinxfer::ops
