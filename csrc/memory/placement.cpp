#include "memory/placement.h"

#include <cstdlib>
#include <map>
#include <mutex>
#include <string>

#include "runtime/cuda_runtime.h"
#include "runtime/topology.h"

namespace pinxfer {

namespace {
bool env_override(int* node) {
  const char* env = std::getenv("PINXFER_NUMA_NODE");
  if (!env || !*env) return false;
  const std::string v(env);
  *node = (v == "none" || v == "-1") ? -1 : std::atoi(env);
  return true;
}
}  // namespace

int numa_node_for_device(int device) {
  int node = -1;
  if (env_override(&node)) return node;
  if (device < 0 || !cuda::cuda_usable()) return -1;
  static std::mutex mutex;
  static std::map<int, int>* cache = new std::map<int, int>();  // LOCK: mutex
  std::lock_guard<std::mutex> lock(mutex);
  auto it = cache->find(device);
  if (it != cache->end()) return it->second;
  node = pci_numa_node(cuda::pci_bus_id(device), sysfs_root());
  cache->emplace(device, node);
  return node;
}

int numa_node_for_current_device() {
  int node = -1;
  if (env_override(&node)) return node;
  return numa_node_for_device(cuda::current_device());
}

}  // namespace pinxfer
