// Process-wide settings: the one place pinxfer reads its environment.
//
// Every variable pinxfer reads (PINXFER_*, torchrun's LOCAL_WORLD_SIZE, libgomp's
// OMP_WAIT_POLICY and GOMP_SPINCOUNT) is
// one row of the table in settings.cpp: its name, its parser, what applies when
// it is unset, and one line of documentation. The rows are read once, at the
// first call of settings(), into an immutable Settings object; nothing else in
// csrc/ calls getenv. The same rows feed `pinxfer doctor` (Settings::items:
// name, the value in force, where it came from, the doc line). Values that are
// not set are derived from what the process has (runtime/cpu_resources.h and
// runtime/thread_budget.h) or take their documented default. Knobs that vary
// per call (the staging copy kind of a transfer) are op arguments; their
// environment variable, when set, only overrides the argument's "auto".
//
// A malformed value does not silently fall back: settings() throws, at every
// call, a c10::ValueError naming the variable, what was expected and what to do.
//
// Thread safety: settings() may be called from any thread; the object is
// built once (a function-local static) and never changes. Fork: the child
// inherits the parent's settings, as it inherits its environment.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "runtime/cpu_resources.h"

namespace pinxfer {

// Longest spin of an idle copy thread when PINXFER_SPIN_US is unset (microseconds).
constexpr int kMaxAdaptiveSpinUs = 1000;
// Longest PINXFER_SPIN_US accepted: one second of spinning per idle thread is
// already a busy loop, not a latency trade.
constexpr int kMaxSpinUs = 1000000;
// The values PINXFER_STAGE_COPY accepts, the names of transfer/stage_copy.h's
// StagingMode (the transfer layer parses the text; the settings only check it).
inline constexpr const char* kStagingModeNames[] = {"auto", "nt", "movsb"};
// Most PINXFER_SENDER_WORKERS accepted: each worker sends a batch of its own at once.
constexpr int kMaxSenderWorkers = 4;
// The values PINXFER_TEAM_PROBE accepts: how torch_team_awake() reads a team member's state
// (runtime/torch_team.h).
inline constexpr const char* kTeamProbeNames[] = {"proc", "clock"};
// The values PINXFER_SENDER_LANDING accepts (ops/cuda/batch_sender.h's LandingMode).
inline constexpr const char* kSenderLandingNames[] = {"auto", "flag", "event"};
// The values PINXFER_SENDER_OUTPUTS accepts: on whose stream prefetch's batch sender makes a
// batch's device memory (ops/cuda/batch_sender.h, "Outputs").
inline constexpr const char* kSenderOutputsNames[] = {"worker", "consumer", "auto"};
// The values PINXFER_H2D_READ accepts: who reads a transfer's bytes staged with cached stores
// (transfer/cuda/staged_read.h; transfer::StagedReader, in this order).
inline constexpr const char* kStagedReaderNames[] = {"auto", "engine", "kernel"};

// The position of `text` in one of the name lists above, or -1: the one mapping from a
// setting's name to its enum, whose values are in the list's order.
template <size_t N>
int name_index(const char* const (&names)[N], const std::string& text) {
  for (size_t i = 0; i < N; ++i) {
    if (text == names[i]) return static_cast<int>(i);
  }
  return -1;
}

struct Settings {
  std::string sysfs_root = "/sys";  // PINXFER_SYSFS_ROOT
  bool disable_cuda = false;        // PINXFER_DISABLE_CUDA=1
  int numa_node = -2;               // PINXFER_NUMA_NODE; -1: no binding; -2: not set (per GPU)
  int64_t max_pinned_bytes = 0;     // PINXFER_MAX_PINNED_BYTES; 0: no cap
  int copy_threads = 1;             // PINXFER_NUM_THREADS, else copy_threads_for(cpus)
  bool copy_threads_from_env = false;
  int spin_us = 100;                // PINXFER_SPIN_US: how long idle copy threads spin
  bool spin_adaptive = true;        // unset PINXFER_SPIN_US: spin longer after long jobs
  std::string stage_copy = "auto";  // PINXFER_STAGE_COPY, one of kStagingModeNames
  int64_t cached_tail = -1;         // PINXFER_CACHED_TAIL; -1: not set (16 MiB)
  bool torch_team = true;           // PINXFER_TORCH_TEAM: copies may run on torch's awake team
  bool team_probe_clock = false;    // PINXFER_TEAM_PROBE=clock: a member's CPU clock, not /proc
  bool idle_reclaim = true;  // PINXFER_IDLE_RECLAIM: pin_memory takes fenced blocks back when idle
  std::string sender_landing = "auto";  // PINXFER_SENDER_LANDING, one of kSenderLandingNames
  int sender_workers = 2;               // PINXFER_SENDER_WORKERS: batches in flight at a sender
  std::string sender_outputs = "auto";  // PINXFER_SENDER_OUTPUTS, one of kSenderOutputsNames
  std::string h2d_read = "auto";        // PINXFER_H2D_READ, one of kStagedReaderNames
  // libgomp's own variables, read (never set) to know whether torch's team keeps spinning
  // after a region (runtime/torch_team.h, team_spin_window_us): as gomp_word reads them (trimmed,
  // lower-cased), "" if unset or blank.
  std::string omp_wait_policy;  // OMP_WAIT_POLICY
  std::string gomp_spincount;   // GOMP_SPINCOUNT
  CpuResources cpus;            // what copy_threads was derived from (with LOCAL_WORLD_SIZE)

  // One per table row, in the table's order, for doctor: the value in force, its source
  // ("env", "derived" or "default") and the row's documentation.
  struct Item {
    std::string name, value, source, doc;
  };
  std::vector<Item> items;
};

// The settings of this process, read on first call. Throws (every call) if an
// environment variable is malformed.
const Settings& settings();

}  // namespace pinxfer
