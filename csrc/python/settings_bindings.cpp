// pinxfer._C's settings functions (csrc/python/bindings.h): what the process read
// from its environment and derived from its CPUs, for `pinxfer doctor`, and the
// derivations themselves for tests (they take their inputs as arguments, so fake
// cgroup trees and CPU counts can be checked).
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "ops/kernels.h"
#include "python/bindings.h"
#include "runtime/cpu_resources.h"
#include "runtime/cuda_runtime.h"
#include "runtime/libgomp.h"
#include "runtime/serial_jobs.h"
#include "runtime/settings.h"
#include "runtime/share_split.h"
#include "runtime/thread_budget.h"
#include "runtime/thread_pool.h"
#include "runtime/torch_team.h"

namespace pinxfer::python {

namespace {

// One (name, value, source, doc) per row of the settings table, in its order.
std::vector<std::tuple<std::string, std::string, std::string, std::string>> settings_rows() {
  std::vector<std::tuple<std::string, std::string, std::string, std::string>> rows;
  for (const auto& item : settings().items) {
    rows.emplace_back(item.name, item.value, item.source, item.doc);
  }
  return rows;
}

std::tuple<int64_t, std::string> copy_threads(int64_t affinity_cpus, int64_t online_cpus,
                                              double quota_cpus, int64_t local_world_size) {
  constexpr int64_t kMost = int64_t{1} << 20;
  TORCH_CHECK_VALUE(affinity_cpus >= 1 && online_cpus >= 1 && local_world_size >= 1 &&
                        affinity_cpus < kMost && online_cpus < kMost && local_world_size < kMost,
                    "pinxfer.copy_threads_for: expected affinity_cpus, online_cpus and "
                    "local_world_size from 1 to 2**20, got ",
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

std::tuple<int64_t, std::vector<int64_t>> node_pool(int64_t budget,
                                                    const std::vector<int64_t>& node_cpus,
                                                    const std::vector<int64_t>& affinity_cpus,
                                                    bool budget_from_env) {
  constexpr int64_t kMaxId = int64_t{1} << 20;
  TORCH_CHECK_VALUE(budget >= 1 && budget < kMaxId,
                    "pinxfer._node_pool_plan: expected 1 <= budget < 2**20, got ", budget);
  auto ids = [](const std::vector<int64_t>& cpus) {
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

std::optional<std::string> unusable_reason() {
  std::string reason = cuda::cuda_unusable_reason();
  if (reason.empty()) return std::nullopt;
  return reason;
}

}  // namespace

void bind_settings(pybind11::module_& m) {
  // torch's libgomp looked up now, right after torch bound its own calls, before any later
  // load could put another runtime ahead of it (runtime/libgomp.cpp).
  (void)libgomp();
  using torch::wrap_pybind_function_no_gil;
  m.def("settings", wrap_pybind_function_no_gil(&settings_rows),
        "every row of the settings table as read once: (name, value, source, doc), source "
        "being 'env', 'derived' or 'default'; raises ValueError if a variable is malformed");
  m.def("_thread_pool_self_test", wrap_pybind_function_no_gil(&thread_pool_self_test),
        "TEST-ONLY: _thread_pool_self_test(workers, callers, rounds, items) -> claims the "
        "offered workers took: offer/withdraw (the caller never waits) and parallel_for from "
        "several threads on one pool, every item claimed exactly once");
  m.def("_wake_probe",
        torch::wrap_pybind_function(
            [](int64_t workers, int64_t helpers, int64_t gap_us, int64_t rounds, int64_t ahead_us) {
              std::vector<WakeSample> samples;
              {
                pybind11::gil_scoped_release no_gil;
                samples = wake_probe(workers, helpers, gap_us, rounds, ahead_us);
              }
              pybind11::list out;
              for (const WakeSample& s : samples) {
                pybind11::dict d;
                d["offer_us"] = s.offer_us;
                d["arrivals_us"] = s.arrivals_us;
                out.append(d);
              }
              return out;
            }),
        pybind11::arg("workers"), pybind11::arg("helpers"), pybind11::arg("gap_us"),
        pybind11::arg("rounds"), pybind11::arg("ahead_us") = -1,
        "DIAGNOSTIC: _wake_probe(workers, helpers, gap_us, rounds, ahead_us=-1) -> "
        "[{offer_us, arrivals_us}]: per round, after sleeping gap_us (and, with ahead_us >= 0, "
        "waking the helpers ahead and being busy ahead_us), the time the caller spent offering "
        "work to `helpers` of a fresh pool's `workers` copy workers, and when each arrived "
        "(sorted; -1: none within 20 ms); csrc/runtime/thread_pool.h");
  m.def("_set_wake_ahead", &set_wake_ahead_enabled,
        "DIAGNOSTIC: _set_wake_ahead(on): whether to_device wakes its copy helpers as it "
        "starts, after an idle gap (on, the default), or only when it offers them work (off; "
        "for A/B runs in one process)");
  m.def("_thread_running_self_test", wrap_pybind_function_no_gil([](int64_t samples) {
          const ThreadRunningCounts c = thread_running_self_test(samples);
          return std::make_tuple(c.spinner_running, c.sleeper_running,
                                 static_cast<int64_t>(c.gone));
        }),
        pybind11::arg("samples"),
        "TEST-ONLY: _thread_running_self_test(samples) -> (times a spinning thread was seen "
        "running, times a thread waiting on a condition variable was, the answer for a thread "
        "that has ended: -1): PINXFER_TEAM_PROBE=clock's question (runtime/torch_team.h, "
        "thread_running_now) asked of real threads");
  m.def("_set_team_probe", &set_team_probe_enabled,
        "DIAGNOSTIC: _set_team_probe(on): whether host copies ask if torch's intra-op team is "
        "awake (on, the default) or take it for asleep without asking (off, as "
        "PINXFER_TORCH_TEAM=off; for A/B runs in one process: benchmarks/diag_team_probe.py)");
  m.def("_serial_jobs_self_test", wrap_pybind_function_no_gil(&serial_jobs_self_test),
        "TEST-ONLY: _serial_jobs_self_test(seed, jobs, consumers, workers) -> jobs run: "
        "`consumers` threads push `jobs` byte-copying jobs each through one SerialJobs queue of "
        "`workers` threads (the protocol of prefetch's batch sender, runtime/serial_jobs.h), "
        "waiting, settling and leaving some to close(); raises on any job run twice, lost, "
        "done without its bytes, started before one its consumer submitted ahead of it, or "
        "more jobs running at once than workers");
  m.def("_share_split_self_test", wrap_pybind_function_no_gil(&share_split_self_test),
        "TEST-ONLY: _share_split_self_test(units, share, members, rounds) -> pieces members "
        "took from shares not their own: `members` threads (some late) split [0, units) as "
        "host copies on torch's team do (runtime/share_split.h); every unit run exactly once");
  m.def(
      "_libgomp_path", [] { return libgomp().path; },
      "TEST-ONLY: _libgomp_path() -> str: the file of the libgomp whose team and binding pinxfer "
      "uses, the one torch's calls resolve to ('' where torch's OpenMP runtime is not libgomp; "
      "csrc/runtime/libgomp.h)");
  m.def(
      "_torch_team_state",
      [] {
        const TorchTeamState s = torch_team_state();
        return std::make_tuple(static_cast<int64_t>(s.threads), s.awake, s.copies,
                               static_cast<int64_t>(s.region_threads), s.state_reads,
                               s.window_answers);
      },
      "TEST-ONLY: _torch_team_state() -> (threads of torch's intra-op team learned on this "
      "thread, 0: none; whether it is awake now; copies run on a team so far; threads each "
      "region asks for, the members seen spinning and the caller; /proc reads of a member's "
      "state so far, process total; probes answered by the spin window without a read, "
      "process total): the check that "
      "makes pinxfer's host copies "
      "run on that team (csrc/runtime/torch_team.h)");
  m.def("_team_spin_window_us", &team_spin_window_us, pybind11::arg("wait_policy"),
        pybind11::arg("spincount"), pybind11::arg("team_threads"), pybind11::arg("cpus"),
        "TEST-ONLY: _team_spin_window_us(wait_policy, spincount, team_threads, cpus) -> int: "
        "how long after a region the team is taken as spinning without a /proc read "
        "(OMP_WAIT_POLICY and GOMP_SPINCOUNT trimmed and lower-cased, '' unset or blank; "
        "csrc/runtime/torch_team.h)");
  m.def(
      "_last_team_region_trace",
      [] {
        const TeamRegionTrace t = last_team_region_trace();
        pybind11::dict d;
        d["total_us"] = t.total_us;
        d["chunks"] = t.chunks;
        d["arrive_us"] = t.arrive_us;
        d["done_us"] = t.done_us;
        d["member_chunks"] = t.member_chunks;
        return d;
      },
      "DIAGNOSTIC: _last_team_region_trace() -> dict: this thread's last shared-out copy on "
      "torch's team (csrc/runtime/torch_team.h): microseconds from the region's start until "
      "each member (by place in the team) arrived and finished, the pieces each copied, the "
      "pieces (chunks), the whole region; recorded only while _trace_team_regions(True)");
  m.def(
      "_last_pin_call_trace",
      [] {
        const ops::PinCallTrace t = ops::last_pin_call_trace();
        pybind11::dict d;
        d["pinned_check_us"] = t.pinned_check_us;
        d["checks_us"] = t.checks_us;
        d["setup_us"] = t.setup_us;
        d["alloc_us"] = t.alloc_us;
        d["copy_us"] = t.copy_us;
        d["total_us"] = t.total_us;
        d["on_team"] = t.on_team;
        return d;
      },
      "DIAGNOSTIC: _last_pin_call_trace() -> dict: where this thread's last pinxfer.pin_memory "
      "copy spent its time, in microseconds (csrc/ops/kernels.h, PinCallTrace); recorded only "
      "while _trace_team_regions(True)");
  m.def("_trace_team_regions", &set_team_region_tracing, pybind11::arg("on"),
        "DIAGNOSTIC: _trace_team_regions(on) -> None: record _last_team_region_trace() from "
        "now on (off by default: it costs each region clock reads and a copy-out)");
  m.def("copy_threads_for", wrap_pybind_function_no_gil(&copy_threads),
        "copy_threads_for(affinity_cpus, online_cpus, quota_cpus, local_world_size) -> "
        "(threads, why): the copy threads of a process with these CPUs");
  m.def("_node_pool_plan", wrap_pybind_function_no_gil(&node_pool),
        "TEST-ONLY: _node_pool_plan(budget, node_cpus, affinity_cpus, budget_from_env) -> "
        "(threads counting the caller, CPUs its workers are bound to; []: unbound)");
  m.def("cgroup_quota_cpus", wrap_pybind_function_no_gil(&cgroup_quota_cpus),
        "cgroup_quota_cpus(cgroup_root, proc_self_cgroup) -> CPUs of quota (0: none)");
  m.def("cgroup_cpuset_cpus",
        wrap_pybind_function_no_gil([](const std::string& root, const std::string& self) {
          return static_cast<int64_t>(cgroup_cpuset_cpus(root, self));
        }),
        "cgroup_cpuset_cpus(cgroup_root, proc_self_cgroup) -> CPUs of its cpuset (0: none)");
  m.def("cuda_unusable_reason", wrap_pybind_function_no_gil(&unusable_reason),
        "why CUDA is not usable in this process, None when it is");
}

}  // namespace pinxfer::python
