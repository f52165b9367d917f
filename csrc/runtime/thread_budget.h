// How many copy threads the process runs, and how that budget is split among
// the NUMA nodes' thread pools. Pure functions of what the process has
// (runtime/cpu_resources.h): no per-machine constants.
#pragma once

#include <string>
#include <vector>

#include "runtime/cpu_resources.h"

namespace pinxfer {

// Past this many threads a host copy is bound by memory bandwidth, not by
// threads, on any host we know of; more threads only steal CPU from the step.
constexpr int kMaxCopyThreads = 16;

// The copy threads one process runs: its usable CPUs (affinity, capped by the
// cgroup quota, divided among the host's ranks unless the launcher already
// gave each rank its own CPUs), less a quarter (rounded down) left for the
// threads that feed the copies, at least 1 and at most kMaxCopyThreads. The
// one budget of the whole process: node_pool_plan() splits it among the
// NUMA nodes' thread pools.
// `why` (optional) receives the reasoning in one line, for doctor.
int copy_threads_for(const CpuResources& cpus, std::string* why = nullptr);

// The most copy threads a process may ask for (PINXFER_NUM_THREADS, and
// pin_memory's num_threads): the CPUs it may use, but at least
// kMaxCopyThreads, so a test or a small machine can still ask for a few more
// threads than CPUs. More only oversubscribes the host.
int max_copy_threads(const CpuResources& cpus);

// One NUMA node's thread pool: how many threads it runs (counting the caller,
// as ThreadPool's num_threads) and the CPUs its workers are bound to.
struct NodePoolPlan {
  int threads = 1;
  std::vector<int> cpus;  // sorted; empty: no binding (any CPU the process may use)
};
// The pool of a node whose CPUs are `node_cpus` (empty: node -1 or unknown),
// in a process allowed to run on `affinity_cpus` (empty: unknown, taken as the
// node's CPUs) with a copy-thread budget of `budget` (copy_threads_for(), or
// PINXFER_NUM_THREADS when budget_from_env):
//  * cpus: the node's CPUs the process may use; none of them -> no binding;
//  * threads: the node's share of the budget, budget * |cpus| / |affinity|
//    (|affinity| for an unbound pool), rounded, at least 1, and at most |cpus|
//    unless the budget came from the environment.
// The budget is one for the whole process, not one per node: a process
// driving GPUs on two nodes would otherwise run twice the threads its CPUs
// were sized for. It is split by CPUs because each pool's workers can only use
// its node's allowed CPUs; with one node holding every allowed CPU the pool
// gets the whole budget, as before the split. Each share is rounded on its
// own, so the pools together may run up to half a thread per node more than
// the budget (a whole one where a share below 1/2 is raised to 1). A pool
// with no allowed CPU on its node runs on every CPU the process may use, so it
// counts the whole budget (it then shares those CPUs with the other pools).
NodePoolPlan node_pool_plan(int budget, const std::vector<int>& node_cpus,
                            const std::vector<int>& affinity_cpus, bool budget_from_env);

}  // namespace pinxfer
