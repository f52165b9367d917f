#include "memory/placement.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <sstream>
#include <string>

#include <c10/util/Exception.h>

#include "runtime/cuda_runtime.h"
#include "runtime/settings.h"
#include "runtime/topology.h"

namespace pinxfer {

namespace {

constexpr int kUnknown = -2;  // cache slot not filled yet
constexpr int kMaxCachedDevices = 256;

// PINXFER_NUMA_NODE (runtime/settings.h; kUnknown: not set).
int env_override() {
  static_assert(kUnknown == -2, "Settings::numa_node uses -2 for 'not set'");
  return settings().numa_node;
}

// device -> node, filled on first use; a race fills a slot twice with the same
// answer, which is harmless, so no lock is needed.
std::array<std::atomic<int>, kMaxCachedDevices>& node_cache() {
  static auto* cache = [] {
    auto* c = new std::array<std::atomic<int>, kMaxCachedDevices>();  // leaked: used at exit
    for (auto& slot : *c) slot.store(kUnknown, std::memory_order_relaxed);
    return c;
  }();
  return *cache;
}

bool node_exists(int node);

// The node sysfs gives the device's PCI function, or -1 (unbound) for one that is not a
// node of this machine: a VM's firmware may report any number there, and a pool and a
// thread pool would be built for it (found by review, session 43). Warns once then.
int sysfs_node_of_device(int device) {
  const int node = pci_numa_node(cuda::pci_bus_id(device), sysfs_root());
  if (node < 0 || node_exists(node)) return node;
  static std::atomic<bool> warned{false};
  if (!warned.exchange(true)) {
    TORCH_WARN("pinxfer: sysfs says CUDA device ", device, " is on NUMA node ", node,
               ", which this machine does not have; its pinned memory is not bound to a node.");
  }
  return -1;
}

bool node_exists(int node) {
  const std::vector<int>& nodes = existing_numa_nodes();
  return node >= 0 && std::find(nodes.begin(), nodes.end(), node) != nodes.end();
}

}  // namespace

int numa_node_for_device(int device) {
  const int forced = env_override();
  if (forced != kUnknown) return forced;
  if (device < 0 || !cuda::cuda_usable()) return -1;
  if (device >= kMaxCachedDevices) return sysfs_node_of_device(device);
  std::atomic<int>& slot = node_cache()[device];
  int node = slot.load(std::memory_order_acquire);
  if (node == kUnknown) {
    node = sysfs_node_of_device(device);
    slot.store(node, std::memory_order_release);
  }
  return node;
}

const std::vector<int>& existing_numa_nodes() {
  static const auto* nodes = [] {
    auto* n = new std::vector<int>(online_nodes(sysfs_root()));  // leaked: used at exit
    if (n->empty()) n->push_back(0);
    return n;
  }();
  return *nodes;
}

int resolve_numa_node(std::optional<int64_t> numa_node, const char* what) {
  if (!numa_node.has_value()) return numa_node_for_current_device();
  const int64_t node = *numa_node;
  if (node == -1) return -1;
  if (node < 0 || node > INT32_MAX || !node_exists(static_cast<int>(node))) {
    const std::vector<int>& nodes = existing_numa_nodes();
    std::ostringstream list;
    for (size_t i = 0; i < nodes.size(); ++i) list << (i ? ", " : "") << nodes[i];
    TORCH_CHECK_VALUE(false, what,
                      ": numa_node must be -1 (no binding), None (the current "
                      "GPU's node) or a NUMA node of this machine (",
                      list.str(), "), got ", node, ".");
  }
  return static_cast<int>(node);
}

namespace {
constexpr int kNodesDiffer = -3;  // devices sit on different nodes: ask which is current

// The node every visible device sits on, or kNodesDiffer. Devices and their PCI places
// are fixed for the process, so it is computed once.
int node_of_every_device() {
  static std::atomic<int> common{kUnknown};
  int node = common.load(std::memory_order_acquire);
  if (node != kUnknown) return node;
  const int count = cuda::device_count();
  node = count > 0 ? numa_node_for_device(0) : kNodesDiffer;
  for (int device = 1; device < count && node != kNodesDiffer; ++device) {
    if (numa_node_for_device(device) != node) node = kNodesDiffer;
  }
  common.store(node, std::memory_order_release);
  return node;
}
}  // namespace

int numa_node_for_current_device() {
  const int forced = env_override();
  if (forced != kUnknown) return forced;
  if (!cuda::cuda_usable()) return -1;
  // Every allocation asks this (empty, pin_memory, torch's pinned factory once installed).
  // Where every GPU sits on one node (every single-socket host) the answer needs no
  // cudaGetDevice, 40-60 ns of a 1.1 us call on the H100 (csrc/README.md, "Inside the
  // kernel of a small call").
  if (const int node = node_of_every_device(); node != kNodesDiffer) return node;
  return numa_node_for_device(cuda::current_device());
}

}  // namespace pinxfer
