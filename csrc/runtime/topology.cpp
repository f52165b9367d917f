#include "runtime/topology.h"

#include "runtime/settings.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <fstream>

#include "runtime/parse.h"

namespace pinxfer {

std::string sysfs_root() { return settings().sysfs_root; }

bool read_kernel_file(const std::string& path, std::string* out) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return false;
  struct stat st{};
  bool ok = ::fstat(fd, &st) == 0 && S_ISREG(st.st_mode);
  out->clear();
  char buf[4096];
  while (ok && out->size() < kMaxKernelFileBytes) {
    const ssize_t n = ::read(fd, buf, std::min(sizeof(buf), kMaxKernelFileBytes - out->size()));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) ok = false;
    if (n <= 0) break;
    out->append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  return ok;
}

namespace {
bool read_first_line(const std::string& path, std::string* out) {
  if (!read_kernel_file(path, out)) return false;
  out->resize(std::min(out->size(), out->find('\n')));
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
    // At most 9 digits: a node id is an int, and a stray "node99999999999"
    // directory is not a node (std::stoi would throw out_of_range).
    if (name.size() > 4 && name.size() <= 4 + 9 && name.compare(0, 4, "node") == 0 &&
        std::all_of(name.begin() + 4, name.end(), ::isdigit)) {
      nodes.push_back(std::stoi(name.substr(4)));
    }
  }
  closedir(dir);
  std::sort(nodes.begin(), nodes.end());
  return nodes;
}

int pci_numa_node(const std::string& pci_bus_id, const std::string& root) {
  std::string id = lower_case(pci_bus_id);
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
