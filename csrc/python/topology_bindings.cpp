// pinxfer._C's topology functions (csrc/python/bindings.h): the answers the pool
// and thread pools act on, so that pinxfer.topology() reports exactly what
// placement uses and tests can check them against fake sysfs trees (each takes
// the sysfs root); and the two text parsers of runtime/parse.h, so Python reads
// CPU lists and byte sizes as C++ does.
#include <cstdint>
#include <string>
#include <vector>

#include "memory/placement.h"
#include "python/bindings.h"
#include "runtime/cuda_runtime.h"
#include "runtime/parse.h"
#include "runtime/topology.h"

namespace pinxfer::python {

namespace {

std::vector<int64_t> widen(const std::vector<int>& v) { return {v.begin(), v.end()}; }

// A node or device number from Python, as the int the C++ side takes: one past int's
// range was cast to another node or device (2**32 answered for 0).
int as_int(int64_t value, const char* what) {
  TORCH_CHECK_VALUE(value >= INT32_MIN && value <= INT32_MAX, "pinxfer: ", what, " ", value,
                    " is out of range");
  return static_cast<int>(value);
}

std::vector<int64_t> cpus_of_node(int64_t node, const std::string& root) {
  try {
    return widen(node_cpus(as_int(node, "NUMA node"), root));
  } catch (const c10::ValueError& e) {
    // Name the file: the text alone does not say which node's list is broken.
    TORCH_CHECK_VALUE(false, e.what_without_backtrace(), " (in ", root, "/devices/system/node/node",
                      node, "/cpulist)");
  }
}

std::string bus_id_of(int64_t device) {
  const int64_t count = cuda::device_count();
  TORCH_CHECK_INDEX(device >= 0 && device < count, "pinxfer: CUDA device ", device,
                    " does not exist; this process sees ", count, " CUDA device(s).");
  return cuda::pci_bus_id(static_cast<int>(device));
}

}  // namespace

void bind_topology(pybind11::module_& m) {
  using torch::wrap_pybind_function_no_gil;
  m.def("sysfs_root", wrap_pybind_function_no_gil([] { return sysfs_root(); }),
        "the sysfs root C++ reads by default: PINXFER_SYSFS_ROOT, else /sys");
  m.def("parse_cpulist", wrap_pybind_function_no_gil([](const std::string& text) {
          return widen(parse_cpulist(text));
        }),
        "CPU ids of a kernel CPU list such as '0-3,8'; raises ValueError when malformed");
  m.def("parse_byte_size",
        wrap_pybind_function_no_gil([](const std::string& text) { return parse_byte_size(text); }),
        "bytes in a size such as '512MiB', '8G', '1073741824' (binary units); raises ValueError");
  m.def("node_cpus", wrap_pybind_function_no_gil(&cpus_of_node),
        "node_cpus(node, sysfs_root): CPUs of a NUMA node; [] if the node or its cpulist is "
        "missing");
  m.def("online_nodes", wrap_pybind_function_no_gil([](const std::string& root) {
          return widen(online_nodes(root));
        }),
        "online_nodes(sysfs_root): NUMA nodes present; [] if none");
  m.def("pci_numa_node",
        wrap_pybind_function_no_gil([](const std::string& bus_id, const std::string& root) {
          return static_cast<int64_t>(pci_numa_node(bus_id, root));
        }),
        "pci_numa_node(pci_bus_id, sysfs_root): NUMA node of a PCI device; -1 if unknown");
  m.def("cuda_pci_bus_id", wrap_pybind_function_no_gil(&bus_id_of),
        "PCI bus id CUDA reports for a device (without creating a context)");
  m.def("cuda_device_count",
        wrap_pybind_function_no_gil([] { return static_cast<int64_t>(cuda::device_count()); }),
        "CUDA devices this process can use (0 without CUDA, in a forked child, or when "
        "disabled)");
  m.def("numa_node_for_device", wrap_pybind_function_no_gil([](int64_t device) {
          return static_cast<int64_t>(numa_node_for_device(as_int(device, "CUDA device")));
        }),
        "NUMA node pinxfer places memory on for a CUDA device (PINXFER_NUMA_NODE, sysfs, or -1)");
}

}  // namespace pinxfer::python
