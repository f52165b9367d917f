// The steady clock as a count of nanoseconds: a plain integer an atomic can hold and a
// trace can subtract, for the gaps, spin windows and timings pinxfer compares across calls
// and threads. One definition (it was written out in four files).
#pragma once

#include <chrono>
#include <cstdint>

namespace pinxfer {

inline int64_t steady_now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace pinxfer
