#include "runtime/step_stamps.h"

#include <atomic>

#include "runtime/steady_time.h"

namespace pinxfer {

namespace {

std::atomic<bool> g_on{false};

// A call's stamps: names are string literals, times on the steady clock.
struct Stamps {
  int64_t entered_ns = 0;
  std::vector<std::pair<const char*, int64_t>> marks;
};
// The call being stamped, and the last published one: publish() swaps them, so neither a
// stamp nor a publish allocates once both have room (the strings are made when read).
thread_local Stamps t_current;
thread_local Stamps t_last;

}  // namespace

void set_step_stamps(bool on) { g_on.store(on, std::memory_order_relaxed); }

StepStampsRecord last_step_stamps() {
  StepStampsRecord record;
  record.entered_ns = t_last.entered_ns;
  for (const auto& [name, ns] : t_last.marks) {
    record.steps.emplace_back(name, static_cast<double>(ns - t_last.entered_ns) / 1e3);
  }
  return record;
}

StepStamps::StepStamps() : on_(g_on.load(std::memory_order_relaxed)) {
  if (on_) {
    t_current.entered_ns = steady_now_ns();
    t_current.marks.clear();  // keeps its room
  }
}

void StepStamps::mark_now(const char* step) { t_current.marks.emplace_back(step, steady_now_ns()); }

void StepStamps::publish() {
  if (on_) std::swap(t_current, t_last);
}

}  // namespace pinxfer
