#include "runtime/settings.h"

#include "runtime/parse.h"
#include "runtime/topology.h"

#include <c10/util/Exception.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <sstream>
#include <stdexcept>

namespace pinxfer {

StagingMode parse_staging_mode(const std::string& text, const char* what) {
  if (text == "auto") return StagingMode::kAuto;
  if (text == "nt") return StagingMode::kNontemporal;
  if (text == "movsb") return StagingMode::kCached;
  TORCH_CHECK_VALUE(false, what,
                    ": expected 'auto', 'nt' (nontemporal stores) or 'movsb' "
                    "(cached stores), got '",
                    text,
                    "'. Leave it 'auto' to let pinxfer choose "
                    "per chunk.");
}

const char* staging_mode_name(StagingMode mode) {
  switch (mode) {
    case StagingMode::kNontemporal:
      return "nt";
    case StagingMode::kCached:
      return "movsb";
    case StagingMode::kAuto:
      break;
  }
  return "auto";
}

int copy_threads_for(const CpuResources& cpus, std::string* why) {
  std::ostringstream reason;
  int usable = std::max(1, cpus.affinity_cpus);
  reason << cpus.affinity_cpus << " CPUs in the affinity mask";
  if (cpus.quota_cpus > 0 && std::ceil(cpus.quota_cpus) < usable) {
    usable = std::max(1, static_cast<int>(std::ceil(cpus.quota_cpus)));
    reason << ", cgroup quota " << cpus.quota_cpus << " CPUs";
  }
  // A launcher that binds each rank to its own CPUs has already divided the
  // host; one that does not leaves every rank the whole machine, and the
  // ranks' copy threads would then fight over the same cores.
  if (cpus.local_world_size > 1 && cpus.affinity_cpus >= cpus.online_cpus) {
    usable = std::max(1, usable / cpus.local_world_size);
    reason << ", shared by LOCAL_WORLD_SIZE=" << cpus.local_world_size << " ranks";
  }
  // A quarter stays free for Python's main thread, a prefetch producer and
  // CUDA's own threads (on the 16-CPU H200 host 12 copy threads beat 16 at
  // every size). Below 4 CPUs none is kept back: the caller copies too, and
  // a single copy thread would halve a small host's staging bandwidth.
  const int feeders = usable / 4;
  const int threads = std::clamp(usable - feeders, 1, kMaxCopyThreads);
  reason << " -> " << usable << " usable, " << threads
         << " copy threads for the process, split among the NUMA nodes' pools by CPUs";
  if (why) *why = reason.str();
  return threads;
}

int max_copy_threads(const CpuResources& cpus) {
  return std::max(kMaxCopyThreads, cpus.affinity_cpus);
}

NodePoolPlan node_pool_plan(int budget, const std::vector<int>& node_cpus,
                            const std::vector<int>& affinity_cpus, bool budget_from_env) {
  auto sorted_set = [](std::vector<int> v) {
    std::sort(v.begin(), v.end());
    v.erase(std::unique(v.begin(), v.end()), v.end());
    return v;
  };
  const std::vector<int> node = sorted_set(node_cpus);
  const std::vector<int> allowed = affinity_cpus.empty() ? node : sorted_set(affinity_cpus);
  NodePoolPlan plan;
  std::set_intersection(node.begin(), node.end(), allowed.begin(), allowed.end(),
                        std::back_inserter(plan.cpus));
  // Where the workers may run: the node's allowed CPUs, or, unbound, all of them.
  const int64_t usable =
      static_cast<int64_t>(plan.cpus.empty() ? allowed.size() : plan.cpus.size());
  const int64_t total = static_cast<int64_t>(allowed.size());
  int64_t threads = std::max(1, budget);
  if (total > 0) {
    threads = std::max<int64_t>(1, (2 * threads * usable + total) / (2 * total));  // nearest
    if (!budget_from_env) threads = std::min(threads, usable);
  }
  plan.threads = static_cast<int>(threads);
  return plan;
}

namespace {

bool read_text(const std::string& path, std::string* out) { return read_kernel_file(path, out); }

// Quota of one cgroup directory in CPUs; 0 when unlimited or unreadable.
double quota_of_dir(const std::string& dir, bool v2) {
  std::string text;
  if (v2) {
    if (!read_text(dir + "/cpu.max", &text)) return 0;
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
  if (!read_text(dir + "/cpu.cfs_quota_us", &text) ||
      !read_text(dir + "/cpu.cfs_period_us", &period_text)) {
    return 0;
  }
  try {
    const double quota = std::stod(text), period = std::stod(period_text);
    return (quota > 0 && period > 0) ? quota / period : 0;
  } catch (const std::exception&) {
    return 0;
  }
}

// The smallest quota of `path` and its ancestors under `mount` (a parent's
// quota limits its children too; in a container the path is often "/").
double min_quota_up(const std::string& mount, std::string path, bool v2) {
  double best = 0;
  while (true) {
    const double q = quota_of_dir(mount + (path == "/" ? "" : path), v2);
    if (q > 0 && (best == 0 || q < best)) best = q;
    if (path.empty() || path == "/") break;
    const size_t slash = path.find_last_of('/');
    path = slash == 0 || slash == std::string::npos ? "/" : path.substr(0, slash);
  }
  return best;
}

}  // namespace

double cgroup_quota_cpus(const std::string& cgroup_root, const std::string& proc_self_cgroup) {
  std::istringstream lines(proc_self_cgroup);
  std::string line;
  double best = 0;
  while (std::getline(lines, line)) {
    // "hierarchy-id:controllers:path"; v2's line is "0::/path".
    const size_t a = line.find(':'), b = line.find(':', a + 1);
    if (a == std::string::npos || b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1), path = line.substr(b + 1);
    double q = 0;
    if (controllers.empty()) {
      q = min_quota_up(cgroup_root, path, /*v2=*/true);
    } else {
      std::istringstream names(controllers);
      std::string name;
      bool has_cpu = false;
      while (std::getline(names, name, ',')) has_cpu = has_cpu || name == "cpu";
      if (!has_cpu) continue;
      q = min_quota_up(cgroup_root + "/" + controllers, path, /*v2=*/false);
      if (q == 0) q = min_quota_up(cgroup_root + "/cpu", path, /*v2=*/false);
    }
    if (q > 0 && (best == 0 || q < best)) best = q;
  }
  return best;
}

namespace {

[[noreturn]] void bad_env(const char* name, const std::string& value, const char* expected) {
  TORCH_CHECK_VALUE(false, name, ": expected ", expected, ", got '", value,
                    "'. Fix or unset it (pinxfer reads its environment once, at first use).");
}

// An integer in [min, max], or bad_env saying so. Digits only: no sign, no
// spaces, no "1e3", so what doctor shows is exactly the number in force.
int64_t env_int(const char* name, const std::string& value, int64_t min, int64_t max) {
  const bool digits =
      !value.empty() && value.size() <= 18 &&
      std::all_of(value.begin(), value.end(), [](char c) { return c >= '0' && c <= '9'; });
  const int64_t n = digits ? std::stoll(value) : -1;
  if (!digits || n < min || n > max) {
    const std::string expected =
        "an integer from " + std::to_string(min) + " to " + std::to_string(max);
    bad_env(name, value, expected.c_str());
  }
  return n;
}

// A byte size (runtime/parse.h forms), or bad_env naming `examples`.
int64_t env_bytes(const char* name, const std::string& value, const char* examples) {
  try {
    return parse_byte_size(value);
  } catch (const std::exception&) {
    bad_env(name, value, (std::string("a byte size such as ") + examples).c_str());
  }
}

Settings read_settings() {
  Settings s;
  auto add = [&s](const char* name, std::string value, const char* source) {
    s.items.push_back({name, std::move(value), source});
  };
  auto env = [](const char* name) -> const char* {
    const char* v = std::getenv(name);
    return (v && *v) ? v : nullptr;
  };

  if (const char* v = env("PINXFER_SYSFS_ROOT")) s.sysfs_root = v;
  add("PINXFER_SYSFS_ROOT", s.sysfs_root, env("PINXFER_SYSFS_ROOT") ? "env" : "default");

  if (const char* v = env("PINXFER_DISABLE_CUDA")) {
    const std::string t(v);
    if (t != "0" && t != "1") bad_env("PINXFER_DISABLE_CUDA", t, "1 (never touch CUDA) or 0");
    s.disable_cuda = t == "1";
  }
  add("PINXFER_DISABLE_CUDA", s.disable_cuda ? "1" : "0",
      env("PINXFER_DISABLE_CUDA") ? "env" : "default");

  if (const char* v = env("PINXFER_NUMA_NODE")) {
    const std::string t(v);
    if (t == "none" || t == "-1") {
      s.numa_node = -1;
    } else {
      // The same rule as the numa_node argument (memory/placement.h): -1 or a
      // node this machine has.
      std::vector<int> nodes = online_nodes(s.sysfs_root);
      if (nodes.empty()) nodes.push_back(0);
      const int64_t node = env_int("PINXFER_NUMA_NODE", t, 0, nodes.back());
      if (std::find(nodes.begin(), nodes.end(), node) == nodes.end()) {
        bad_env("PINXFER_NUMA_NODE", t, "-1, 'none' or a NUMA node of this machine");
      }
      s.numa_node = static_cast<int>(node);
    }
    add("PINXFER_NUMA_NODE", std::to_string(s.numa_node), "env");
  } else {
    add("PINXFER_NUMA_NODE", "the GPU's node (sysfs)", "default");
  }

  if (const char* v = env("PINXFER_MAX_PINNED_BYTES")) {
    s.max_pinned_bytes = env_bytes("PINXFER_MAX_PINNED_BYTES", v, "8GiB, 512MiB or 1073741824");
    add("PINXFER_MAX_PINNED_BYTES", std::to_string(s.max_pinned_bytes), "env");
  } else {
    add("PINXFER_MAX_PINNED_BYTES", "0 (no cap)", "default");
  }

  s.cpus = current_cpu_resources();
  if (const char* v = env("PINXFER_NUM_THREADS")) {
    s.copy_threads =
        static_cast<int>(env_int("PINXFER_NUM_THREADS", v, 1, max_copy_threads(s.cpus)));
    s.copy_threads_from_env = true;
    add("PINXFER_NUM_THREADS", std::to_string(s.copy_threads), "env");
  } else {
    std::string why;
    s.copy_threads = copy_threads_for(s.cpus, &why);
    add("PINXFER_NUM_THREADS", std::to_string(s.copy_threads) + " (" + why + ")", "derived");
  }

  if (const char* v = env("PINXFER_SPIN_US")) {
    s.spin_us = static_cast<int>(env_int("PINXFER_SPIN_US", v, 0, kMaxSpinUs));
    s.spin_adaptive = false;
    add("PINXFER_SPIN_US", std::to_string(s.spin_us), "env");
  } else {
    add("PINXFER_SPIN_US",
        std::to_string(s.spin_us) + ", or an eighth of the pool's last job if longer (at most " +
            std::to_string(kMaxAdaptiveSpinUs) + ")",
        "default");
  }

  if (const char* v = env("PINXFER_STAGE_COPY")) {
    try {
      s.staging = parse_staging_mode(v, "PINXFER_STAGE_COPY");
    } catch (const c10::ValueError&) {
      bad_env("PINXFER_STAGE_COPY", v,
              "'auto', 'nt' (nontemporal stores) or 'movsb' (cached stores)");
    }
  }
  add("PINXFER_STAGE_COPY", staging_mode_name(s.staging),
      env("PINXFER_STAGE_COPY") ? "env" : "default");

  if (const char* v = env("PINXFER_CACHED_TAIL")) {
    s.cached_tail = env_bytes("PINXFER_CACHED_TAIL", v, "16MiB or 0");
    add("PINXFER_CACHED_TAIL", std::to_string(s.cached_tail), "env");
  } else {
    add("PINXFER_CACHED_TAIL", "16MiB (0 while the copy stream is busy)", "default");
  }
  return s;
}

}  // namespace

CpuResources current_cpu_resources() {
  CpuResources r;
  const long online = sysconf(_SC_NPROCESSORS_ONLN);
  r.online_cpus = online > 0 ? static_cast<int>(online) : 1;
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    r.affinity_cpus = CPU_COUNT(&set);
    for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
      if (CPU_ISSET(cpu, &set)) r.affinity_ids.push_back(cpu);
    }
  } else {
    r.affinity_cpus = r.online_cpus;  // affinity_ids stays empty: unknown
  }
  std::string self;
  if (read_text("/proc/self/cgroup", &self))
    r.quota_cpus = cgroup_quota_cpus("/sys/fs/cgroup", self);
  if (const char* v = std::getenv("LOCAL_WORLD_SIZE")) {
    // torchrun's variable: not ours to reject; a value we cannot read means 1.
    const int n = std::atoi(v);
    if (n > 1) r.local_world_size = n;
  }
  return r;
}

const Settings& settings() {
  // Built once; a malformed variable is reported at every call, never replaced
  // by a default.
  static const auto* result = [] {
    auto* r = new std::pair<Settings, std::string>();  // leaked: used at exit
    try {
      r->first = read_settings();
    } catch (const c10::Error& e) {
      r->second = e.what_without_backtrace();
    }
    return r;
  }();
  TORCH_CHECK_VALUE(result->second.empty(), result->second);
  return result->first;
}

}  // namespace pinxfer
