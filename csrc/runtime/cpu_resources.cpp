#include "runtime/cpu_resources.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <iterator>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "runtime/libgomp.h"
#include "runtime/parse.h"
#include "runtime/topology.h"

namespace pinxfer {

namespace {

// Quota of one cgroup directory in CPUs; 0 when unlimited or unreadable.
double quota_of_dir(const std::string& dir, bool v2) {
  std::string text;
  if (v2) {
    if (!read_kernel_file(dir + "/cpu.max", &text)) return 0;
    std::istringstream in(text);
    std::string quota;
    double period = 0;
    in >> quota >> period;
    if (quota == "max" || period <= 0) return 0;
    try {
      return std::stod(quota) / period;
    } catch (const std::exception&) {
      return 0;
    }
  }
  std::string period_text;
  if (!read_kernel_file(dir + "/cpu.cfs_quota_us", &text) ||
      !read_kernel_file(dir + "/cpu.cfs_period_us", &period_text)) {
    return 0;
  }
  try {
    const double quota = std::stod(text), period = std::stod(period_text);
    return (quota > 0 && period > 0) ? quota / period : 0;
  } catch (const std::exception&) {
    return 0;
  }
}

// A cgroup path and each of its ancestors, as paths under a mount point: "/a/b" gives
// "/a/b", "/a", "" (the mount's root). In a container the path is often "/", or names a
// cgroup the container cannot see (only its own is mounted): the nearest readable one counts.
std::vector<std::string> path_and_ancestors(std::string path) {
  std::vector<std::string> out;
  while (true) {
    out.push_back(path == "/" ? "" : path);
    if (path.empty() || path == "/") break;
    const size_t slash = path.find_last_of('/');
    path = slash == 0 || slash == std::string::npos ? "/" : path.substr(0, slash);
  }
  return out;
}

// The smallest quota of `path` and its ancestors under `mount`.
double min_quota_up(const std::string& mount, const std::string& path, bool v2) {
  double best = 0;
  for (const std::string& dir : path_and_ancestors(path)) {
    const double q = quota_of_dir(mount + dir, v2);
    if (q > 0 && (best == 0 || q < best)) best = q;
  }
  return best;
}

// One line of /proc/self/cgroup: "hierarchy-id:controllers:path"; v2's is "0::/path".
struct CgroupLine {
  std::string controllers;  // comma-separated; empty for the v2 hierarchy
  std::string path;

  bool is_v2() const { return controllers.empty(); }
  bool has_controller(const char* name) const {
    return ("," + controllers + ",").find("," + std::string(name) + ",") != std::string::npos;
  }
};

std::vector<CgroupLine> parse_proc_self_cgroup(const std::string& text) {
  std::istringstream lines(text);
  std::string line;
  std::vector<CgroupLine> out;
  while (std::getline(lines, line)) {
    const size_t a = line.find(':');
    const size_t b = a == std::string::npos ? a : line.find(':', a + 1);
    if (b == std::string::npos) continue;
    out.push_back({line.substr(a + 1, b - a - 1), line.substr(b + 1)});
  }
  return out;
}

}  // namespace

double cgroup_quota_cpus(const std::string& cgroup_root, const std::string& proc_self_cgroup) {
  double best = 0;
  for (const CgroupLine& line : parse_proc_self_cgroup(proc_self_cgroup)) {
    double q = 0;
    if (line.is_v2()) {
      q = min_quota_up(cgroup_root, line.path, /*v2=*/true);
    } else {
      if (!line.has_controller("cpu")) continue;
      q = min_quota_up(cgroup_root + "/" + line.controllers, line.path, /*v2=*/false);
      if (q == 0) q = min_quota_up(cgroup_root + "/cpu", line.path, /*v2=*/false);
    }
    if (q > 0 && (best == 0 || q < best)) best = q;
  }
  return best;
}

int cgroup_cpuset_cpus(const std::string& cgroup_root, const std::string& proc_self_cgroup) {
  return static_cast<int>(cgroup_cpuset_ids(cgroup_root, proc_self_cgroup).size());
}

std::vector<int> cgroup_cpuset_ids(const std::string& cgroup_root,
                                   const std::string& proc_self_cgroup) {
  for (const CgroupLine& line : parse_proc_self_cgroup(proc_self_cgroup)) {
    if (!line.is_v2() && !line.has_controller("cpuset")) continue;
    // The nearest readable cpuset, walking up as min_quota_up does (the leaf alone missed a
    // container's own cgroup mounted at the root: found by review, session 44). An effective
    // list already narrows by every ancestor.
    for (const std::string& dir : path_and_ancestors(line.path)) {
      std::vector<std::string> files;
      if (line.is_v2()) {
        files = {cgroup_root + dir + "/cpuset.cpus.effective"};
      } else {
        files = {cgroup_root + "/cpuset" + dir + "/cpuset.effective_cpus",
                 cgroup_root + "/cpuset" + dir + "/cpuset.cpus"};
      }
      for (const std::string& file : files) {
        std::string text;
        if (!read_kernel_file(file, &text)) continue;
        try {
          std::vector<int> ids = parse_cpulist(text);
          if (!ids.empty()) return ids;
        } catch (const std::exception&) {
          // unreadable: as if absent
        }
      }
    }
  }
  return {};
}

namespace {
// Whether OpenMP bound this process's threads (libgomp binds the initial thread, this one,
// to its first place as torch loads it), and where it says, its places' CPUs. libgomp's own
// answer where torch's OpenMP is libgomp: it read its variables at its load and dropped every
// value it could not parse (pinxfer's reading of them took an unparsable OMP_PLACES or
// OMP_PROC_BIND for a binding). Elsewhere, the variables as libgomp would read them (gomp_word:
// past blanks and case).
OpenmpBinding openmp_binding() {
  OpenmpBinding read = libgomp_binding();
  if (read.known) return read;
  read.binds = [] {
    if (const char* bind = std::getenv("OMP_PROC_BIND")) {
      const std::string word = gomp_word(bind);
      // false: libgomp then ignores OMP_PLACES and GOMP_CPU_AFFINITY and binds nothing.
      if (word.rfind("false", 0) == 0) return false;
      if (!word.empty()) return true;
    }
    // OMP_PLACES of blanks alone is invalid to every libgomp, which then binds nothing. Not so
    // GOMP_CPU_AFFINITY: the libgomp of many GCC releases reads an empty or blank list as CPU 0
    // and binds (newer ones call it invalid). Any value counts.
    if (const char* places = std::getenv("OMP_PLACES")) {
      if (!gomp_word(places).empty()) return true;
    }
    return std::getenv("GOMP_CPU_AFFINITY") != nullptr;
  }();
  return read;
}

// Whether libgomp made its places from the whole mask the process had at its load: one per CPU,
// core, socket, last-level cache or NUMA domain of it (OMP_PLACES unset or one of those words
// alone, no GOMP_CPU_AFFINITY). A list of places or a count of them ("cores(4)") picks some,
// whose union is then only part of the process's CPUs.
bool places_cover_the_load_mask() {
  if (std::getenv("GOMP_CPU_AFFINITY") != nullptr) return false;
  const char* places = std::getenv("OMP_PLACES");
  if (places == nullptr) return true;
  const std::string word = gomp_word(places);
  for (const char* whole : {"threads", "cores", "sockets", "ll_caches", "numa_domains"}) {
    if (word == whole) return true;
  }
  return false;
}

// The machine's online CPUs' ids; empty if unreadable.
std::vector<int> online_cpu_ids() {
  std::string text;
  if (!read_kernel_file("/sys/devices/system/cpu/online", &text)) return {};
  try {
    return parse_cpulist(text);
  } catch (const std::exception&) {
    return {};
  }
}
}  // namespace

CpuResources current_cpu_resources() {
  CpuResources r;
  const long online = sysconf(_SC_NPROCESSORS_ONLN);
  r.online_cpus = online > 0 ? static_cast<int>(online) : 1;
  // A mask sized for the kernel's possible CPUs: a fixed cpu_set_t holds 1024, and past
  // that sched_getaffinity fails with EINVAL (found by review, session 43).
  for (int bits = CPU_SETSIZE; bits <= (1 << 20) && r.affinity_ids.empty(); bits *= 2) {
    cpu_set_t* set = CPU_ALLOC(bits);
    if (set == nullptr) break;
    const size_t bytes = CPU_ALLOC_SIZE(bits);
    const bool read = sched_getaffinity(0, bytes, set) == 0;
    const bool too_small = !read && errno == EINVAL;
    if (read) {
      for (int cpu = 0; cpu < bits; ++cpu) {
        if (CPU_ISSET_S(cpu, bytes, set)) r.affinity_ids.push_back(cpu);
      }
    }
    CPU_FREE(set);
    if (!too_small) break;
  }
  // Unreadable: every online CPU, ids unknown (affinity_ids empty).
  r.affinity_cpus =
      r.affinity_ids.empty() ? r.online_cpus : static_cast<int>(r.affinity_ids.size());
  std::string self;
  std::vector<int> cpuset;
  if (read_kernel_file("/proc/self/cgroup", &self)) {
    r.quota_cpus = cgroup_quota_cpus("/sys/fs/cgroup", self);
    // A container's cpuset is its machine: ranks sharing a 16-CPU container of a 128-CPU
    // host read as already divided by their launcher (affinity 16 < 128) and each started
    // a full set of copy threads (found by review, session 43).
    cpuset = cgroup_cpuset_ids("/sys/fs/cgroup", self);
    const int cpuset_cpus = static_cast<int>(cpuset.size());
    if (cpuset_cpus > 0 && cpuset_cpus < r.online_cpus) r.online_cpus = cpuset_cpus;
  }
  // An OpenMP binding of this thread is not the process's limit: with OMP_PROC_BIND set,
  // pinxfer read one CPU, ran one copy thread, and bound its workers to the caller's core
  // (found by review, session 44).
  const OpenmpBinding binding = openmp_binding();
  if (binding.binds) {
    std::vector<int> process = cpuset.empty() ? online_cpu_ids() : cpuset;
    // Where libgomp's places cover the whole mask the process had before it bound this thread,
    // that mask (a taskset, a launcher's binding) stays the process's limit (found by review,
    // session 50). Places the user listed or counted are only part of it: then the cpuset.
    if (!binding.place_cpus.empty() && places_cover_the_load_mask()) {
      std::vector<int> within;
      std::set_intersection(process.begin(), process.end(), binding.place_cpus.begin(),
                            binding.place_cpus.end(), std::back_inserter(within));
      process = std::move(within);
    }
    if (process.size() > r.affinity_ids.size() && !r.affinity_ids.empty()) {
      r.affinity_ids = std::move(process);
      r.affinity_cpus = static_cast<int>(r.affinity_ids.size());
      r.affinity_from_cpuset = true;
    }
  }
  return r;
}

}  // namespace pinxfer
