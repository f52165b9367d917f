// What the process may use of the host's CPUs: the affinity mask, the cgroup
// CPU quota, the ranks of its job on this host. Read from the kernel once, by
// runtime/settings.cpp; the inputs of the thread budget (runtime/thread_budget.h).
//
// The readers take their roots as parameters, so tests can check them against
// cgroup trees built in a temporary directory. Stateless and thread-safe.
#pragma once

#include <string>
#include <vector>

namespace pinxfer {

struct CpuResources {
  int affinity_cpus = 1;          // CPUs in sched_getaffinity
  int online_cpus = 1;            // CPUs of the machine, or of its cgroup's cpuset if fewer
  double quota_cpus = 0;          // cgroup CPU quota in CPUs (cpu.max), 0: none
  int local_world_size = 1;       // processes of the job on this host (torchrun)
  std::vector<int> affinity_ids;  // the CPU ids in sched_getaffinity, sorted; empty: unknown
  // The calling thread's mask was OpenMP's binding of it (OMP_PROC_BIND, OMP_PLACES,
  // GOMP_CPU_AFFINITY: libgomp binds the initial thread as torch loads it), narrower than
  // what the process may use: affinity_* are then the cgroup cpuset's CPUs (else the online
  // ones), and the copy pools bind their workers there rather than to that one thread's CPUs.
  bool affinity_from_cpuset = false;
};

// The cgroup v2 (cpu.max) or v1 (cpu.cfs_quota_us / cpu.cfs_period_us) CPU
// quota of the cgroup named in `proc_self_cgroup` (the text of
// /proc/self/cgroup), with cgroup filesystems mounted under `cgroup_root`
// (/sys/fs/cgroup): the smallest quota on the cgroup's path, since a parent's
// quota limits its children too. 0 when there is none or it cannot be read.
double cgroup_quota_cpus(const std::string& cgroup_root, const std::string& proc_self_cgroup);

// The CPUs the cpuset of that cgroup allows (v2 cpuset.cpus.effective, v1
// cpuset.effective_cpus or cpuset.cpus): a container's share of the host. 0 when there is
// no cpuset or it cannot be read.
int cgroup_cpuset_cpus(const std::string& cgroup_root, const std::string& proc_self_cgroup);
// The same CPUs' ids, sorted; empty as above.
std::vector<int> cgroup_cpuset_ids(const std::string& cgroup_root,
                                   const std::string& proc_self_cgroup);

// This process's CpuResources as the kernel reports them. local_world_size is left
// at 1: it is torchrun's LOCAL_WORLD_SIZE, which the settings table reads.
CpuResources current_cpu_resources();

}  // namespace pinxfer
