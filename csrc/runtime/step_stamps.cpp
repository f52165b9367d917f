#include "runtime/step_stamps.h"

#include <atomic>

#include "runtime/steady_time.h"

namespace pinxfer {

namespace {
std::atomic<bool> g_on{false};
thread_local StepStampsRecord t_last;
}  // namespace

void set_step_stamps(bool on) { g_on.store(on, std::memory_order_relaxed); }

StepStampsRecord last_step_stamps() { return t_last; }

StepStamps::StepStamps() : on_(g_on.load(std::memory_order_relaxed)) {
  if (on_) {
    marks_.reserve(16);
    entered_ns_ = steady_now_ns();
  }
}

void StepStamps::mark_now(const char* step) { marks_.emplace_back(step, steady_now_ns()); }

void StepStamps::publish() {
  if (!on_) return;
  StepStampsRecord record;
  record.entered_ns = entered_ns_;
  for (const auto& [name, ns] : marks_) {
    record.steps.emplace_back(name, static_cast<double>(ns - entered_ns_) / 1e3);
  }
  t_last = std::move(record);
}

}  // namespace pinxfer
