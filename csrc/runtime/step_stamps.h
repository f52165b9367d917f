// DIAGNOSTIC: named host steps of one call, for finding where a call's time goes after an idle
// gap (issue 22, benchmarks/diag_small_steps.py). Off by default: a call reads one relaxed flag
// (when its StepStamps is made) and branches on a member at each step. While on
// (set_step_stamps), a call that holds a StepStamps stamps each step's end on the steady clock
// (CLOCK_MONOTONIC, as Python's time.perf_counter_ns) into a buffer of its thread, which keeps its
// room from call to call, and a call that publishes leaves them as the thread's last
// (last_step_stamps): stamping allocates nothing once the thread's buffers have grown.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace pinxfer {

void set_step_stamps(bool on);

// The calling thread's last published call: its entry on the steady clock, then each step's
// name and its end in microseconds from that entry, in order. Empty steps: none published.
struct StepStampsRecord {
  int64_t entered_ns = 0;
  std::vector<std::pair<std::string, double>> steps;
};
StepStampsRecord last_step_stamps();

// One call's stamps, on its stack: the entry is stamped at construction. One at a time on a
// thread (a second one made while another lives would share its buffer).
class StepStamps {
 public:
  StepStamps();
  StepStamps(const StepStamps&) = delete;
  StepStamps& operator=(const StepStamps&) = delete;

  void mark(const char* step) {
    if (on_) mark_now(step);
  }
  // Leaves this call's steps as the thread's last (nothing while off).
  void publish();

 private:
  void mark_now(const char* step);

  bool on_;
};

}  // namespace pinxfer
