// Process-wide settings: the one place pinxfer reads its environment.
//
// Every PINXFER_* variable (and torchrun's LOCAL_WORLD_SIZE) is read once, at
// the first call of settings(), into an immutable Settings object; nothing else
// in csrc/ calls getenv. Values that are not set are derived from what the
// process has (CPU affinity, cgroup CPU quota, ranks on the host) or take
// their documented default. Knobs that vary per call (the staging copy kind of
// a transfer) are op arguments; their environment variable, when set, is only
// an override of the argument's "auto".
//
// A malformed value does not silently fall back: settings() throws, at every
// call, a c10::Error naming the variable, what was expected and what to do.
//
// Thread safety: settings() may be called from any thread; the object is
// built once (a function-local static) and never changes. Fork: the child
// inherits the parent's settings, as it inherits its environment.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace pinxfer {

// How pageable bytes are copied into pinned staging memory (transfer/stage_copy.h).
enum class StagingMode {
  kAuto,         // per chunk: cached stores, nontemporal for the transfer's tail
  kNontemporal,  // every chunk nontemporal ("nt")
  kCached,       // every chunk with cached stores ("movsb")
};
// "auto", "nt", "movsb" -> mode; throws c10::Error naming `what` otherwise.
StagingMode parse_staging_mode(const std::string& text, const char* what);
const char* staging_mode_name(StagingMode mode);

// What the process may use of the host's CPUs, the inputs of copy_threads_for().
struct CpuResources {
  int affinity_cpus = 1;          // CPUs in sched_getaffinity
  int online_cpus = 1;            // CPUs of the machine
  double quota_cpus = 0;          // cgroup CPU quota in CPUs (cpu.max), 0: none
  int local_world_size = 1;       // processes of the job on this host (torchrun)
  std::vector<int> affinity_ids;  // the CPU ids in sched_getaffinity, sorted; empty: unknown
};
// The copy threads one process runs: its usable CPUs (affinity, capped by the
// cgroup quota, divided among the host's ranks unless the launcher already
// gave each rank its own CPUs), less a quarter (rounded down) left for the
// threads that feed the copies, at least 1 and at most kMaxCopyThreads. The
// one budget of the whole process: node_pool_plan() splits it among the
// NUMA nodes' thread pools.
// `why` (optional) receives the reasoning in one line, for doctor.
int copy_threads_for(const CpuResources& cpus, std::string* why = nullptr);
// Past this many threads a host copy is bound by memory bandwidth, not by
// threads, on any host we know of; more threads only steal CPU from the step.
constexpr int kMaxCopyThreads = 16;
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
// Pure function.
NodePoolPlan node_pool_plan(int budget, const std::vector<int>& node_cpus,
                            const std::vector<int>& affinity_cpus, bool budget_from_env);

// The cgroup v2 (cpu.max) or v1 (cpu.cfs_quota_us / cpu.cfs_period_us) CPU
// quota of the cgroup named in `proc_self_cgroup` (the text of
// /proc/self/cgroup), with cgroup filesystems mounted under `cgroup_root`
// (/sys/fs/cgroup). 0 when there is none or it cannot be read.
double cgroup_quota_cpus(const std::string& cgroup_root, const std::string& proc_self_cgroup);
// This process's CpuResources, read from the kernel (and LOCAL_WORLD_SIZE).
CpuResources current_cpu_resources();

// Longest spin of an idle copy thread when PINXFER_SPIN_US is unset (microseconds).
constexpr int kMaxAdaptiveSpinUs = 1000;
// Longest PINXFER_SPIN_US accepted: one second of spinning per idle thread is
// already a busy loop, not a latency trade.
constexpr int kMaxSpinUs = 1000000;

struct Settings {
  std::string sysfs_root = "/sys";  // PINXFER_SYSFS_ROOT
  bool disable_cuda = false;        // PINXFER_DISABLE_CUDA=1
  int numa_node = -2;               // PINXFER_NUMA_NODE; -1: no binding; -2: not set (per GPU)
  int64_t max_pinned_bytes = 0;     // PINXFER_MAX_PINNED_BYTES; 0: no cap
  int copy_threads = 1;             // PINXFER_NUM_THREADS, else copy_threads_for(cpus)
  bool copy_threads_from_env = false;
  int spin_us = 100;                         // PINXFER_SPIN_US: how long idle copy threads spin
  bool spin_adaptive = true;                 // unset PINXFER_SPIN_US: spin longer after long jobs
  StagingMode staging = StagingMode::kAuto;  // PINXFER_STAGE_COPY: overrides "auto"
  int64_t cached_tail = -1;                  // PINXFER_CACHED_TAIL; -1: not set (16 MiB)
  CpuResources cpus;                         // what copy_threads was derived from

  // (name, value, source) for doctor: source is "env", "derived" or "default".
  struct Item {
    std::string name, value, source;
  };
  std::vector<Item> items;
};

// The settings of this process, read on first call. Throws (every call) if an
// environment variable is malformed.
const Settings& settings();

}  // namespace pinxfer
