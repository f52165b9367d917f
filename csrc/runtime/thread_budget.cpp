#include "runtime/thread_budget.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iterator>
#include <sstream>

namespace pinxfer {

int copy_threads_for(const CpuResources& cpus, std::string* why) {
  std::ostringstream reason;
  int usable = std::max(1, cpus.affinity_cpus);
  reason << cpus.affinity_cpus << " CPUs in the affinity mask";
  if (cpus.affinity_from_cpuset) {
    reason << " (the process's cpuset: OpenMP's binding left this thread fewer)";
  }
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

}  // namespace pinxfer
