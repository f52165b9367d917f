#include "runtime/topology.h"

#include "runtime/settings.h"

#include <dirent.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <fstream>

#include "runtime/parse.h"

namespace pinxfer {

std::string sysfs_root() { return settings().sysfs_root; }

namespace {
bool read_first_line(const std::string& path, std::string* out) {
  std::ifstream f(path);
  if (!f) return false;
  std::getline(f, *out);
  return true;
}
}  // namespace

std::vector<int> node_cpus(int node, const std::string& root) {
  if (node < 0) return {};
  std::string line;
  if (!read_first_line(root + "/devices/system/node/node" + std::to_string(node) + "/cpulist",
                       &line)) {
    return {};
  }
  return parse_cpulist(line);
}

std::vector<int> online_nodes(const std::string& root) {
  std::vector<int> nodes;
  DIR* dir = opendir((root + "/devices/system/node").c_str());
  if (!dir) return nodes;
  while (dirent* e = readdir(dir)) {
    const std::string name = e->d_name;
    if (name.size() > 4 && name.compare(0, 4, "node") == 0 &&
        std::all_of(name.begin() + 4, name.end(), ::isdigit)) {
      nodes.push_back(std::stoi(name.substr(4)));
    }
  }
  closedir(dir);
  std::sort(nodes.begin(), nodes.end());
  return nodes;
}

int pci_numa_node(const std::string& pci_bus_id, const std::string& root) {
  std::string id = pci_bus_id;
  std::transform(id.begin(), id.end(), id.begin(), ::tolower);
  // CUDA reports "00000000:1B:00.0" (8-digit domain); sysfs uses 4 digits.
  const auto colon = id.find(':');
  if (colon != std::string::npos && colon > 4) id = id.substr(colon - 4);
  std::string line;
  if (!read_first_line(root + "/bus/pci/devices/" + id + "/numa_node", &line)) return -1;
  try {
    const int node = std::stoi(line);
    return node < 0 ? -1 : node;
  } catch (const std::exception&) {
    return -1;
  }
}

}  // namespace pinxfer
