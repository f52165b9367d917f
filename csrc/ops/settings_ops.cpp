// Kernels for the settings operators (schemas in csrc/module.cpp): what the
// process read from its environment and derived from its CPUs, exposed for
// `pinxfer doctor` and for tests of the derivations (which take their inputs
// as arguments, so fake cgroup trees and CPU counts can be checked).
#include <torch/library.h>

#include <tuple>

#include "runtime/cuda_runtime.h"
#include "runtime/settings.h"

namespace pinxfer::ops {

namespace {

std::tuple<std::vector<std::string>, std::vector<std::string>, std::vector<std::string>>
settings_op() {
  std::vector<std::string> names, values, sources;
  for (const auto& item : settings().items) {
    names.push_back(item.name);
    values.push_back(item.value);
    sources.push_back(item.source);
  }
  return {names, values, sources};
}

std::tuple<int64_t, std::string> copy_threads_for_op(int64_t affinity_cpus, int64_t online_cpus,
                                                     double quota_cpus, int64_t local_world_size) {
  TORCH_CHECK_VALUE(affinity_cpus >= 1 && online_cpus >= 1 && local_world_size >= 1,
                    "pinxfer.copy_threads_for: expected affinity_cpus, online_cpus and "
                    "local_world_size >= 1, got ",
                    affinity_cpus, ", ", online_cpus, ", ", local_world_size);
  CpuResources cpus;
  cpus.affinity_cpus = static_cast<int>(affinity_cpus);
  cpus.online_cpus = static_cast<int>(online_cpus);
  cpus.quota_cpus = quota_cpus;
  cpus.local_world_size = static_cast<int>(local_world_size);
  std::string why;
  const int threads = copy_threads_for(cpus, &why);
  return {threads, why};
}

// Test-only (schema comment in csrc/module.cpp): runtime/settings.h's node_pool_plan.
std::tuple<int64_t, std::vector<int64_t>> node_pool_plan_op(int64_t budget,
                                                            c10::IntArrayRef node_cpus,
                                                            c10::IntArrayRef affinity_cpus,
                                                            bool budget_from_env) {
  constexpr int64_t kMaxId = int64_t{1} << 20;
  TORCH_CHECK_VALUE(budget >= 1 && budget < kMaxId,
                    "pinxfer._node_pool_plan: expected 1 <= budget < 2**20, got ", budget);
  auto ids = [](c10::IntArrayRef cpus) {
    std::vector<int> out;
    for (int64_t cpu : cpus) {
      TORCH_CHECK_VALUE(cpu >= 0 && cpu < kMaxId,
                        "pinxfer._node_pool_plan: expected CPU ids in [0, 2**20), got ", cpu);
      out.push_back(static_cast<int>(cpu));
    }
    return out;
  };
  const NodePoolPlan plan =
      node_pool_plan(static_cast<int>(budget), ids(node_cpus), ids(affinity_cpus), budget_from_env);
  return {plan.threads, std::vector<int64_t>(plan.cpus.begin(), plan.cpus.end())};
}

double cgroup_quota_cpus_op(const std::string& cgroup_root, const std::string& proc_self_cgroup) {
  return cgroup_quota_cpus(cgroup_root, proc_self_cgroup);
}

std::optional<std::string> cuda_unusable_reason_op() {
  std::string reason = cuda::cuda_unusable_reason();
  if (reason.empty()) return std::nullopt;
  return reason;
}

}  // namespace

TORCH_LIBRARY_IMPL(pinxfer, CompositeExplicitAutograd, m) {
  m.impl("settings", &settings_op);
  m.impl("copy_threads_for", &copy_threads_for_op);
  m.impl("cgroup_quota_cpus", &cgroup_quota_cpus_op);
  m.impl("_node_pool_plan", &node_pool_plan_op);
  m.impl("cuda_unusable_reason", &cuda_unusable_reason_op);
}

}  // namespace pinxfer::ops
