// Overflow-checked byte arithmetic: the one place where a size that cannot be
// is caught. Every size computed from a caller's numbers (element count x item
// size, rounding up to a size class, a segment's size, offsets in a packed
// block) goes through these, so an impossible size raises a c10::ValueError
// naming the value and the limit before anything is allocated, instead of
// wrapping to a small number and handing out memory that aliases a live block.
//
// The limit is what a torch storage can describe: its byte count is an int64.
// A size under the limit may still be more than the machine has; that is the
// allocator's out-of-memory error, not this one.
#pragma once

#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <cstddef>
#include <cstdint>
#include <limits>

namespace pinxfer {

constexpr size_t kMaxBytes = static_cast<size_t>(std::numeric_limits<int64_t>::max());

// a * b, or a ValueError naming `what` and the limit.
inline size_t checked_mul(size_t a, size_t b, const char* what) {
  size_t out = 0;
  TORCH_CHECK_VALUE(!__builtin_mul_overflow(a, b, &out) && out <= kMaxBytes, what, ": ", a, " x ",
                    b, " bytes is more than the largest size pinxfer can handle (", kMaxBytes,
                    " bytes, 2^63 - 1)");
  return out;
}

// a + b, or a ValueError naming `what` and the limit.
inline size_t checked_add(size_t a, size_t b, const char* what) {
  size_t out = 0;
  TORCH_CHECK_VALUE(!__builtin_add_overflow(a, b, &out) && out <= kMaxBytes, what, ": ", a, " + ",
                    b, " bytes is more than the largest size pinxfer can handle (", kMaxBytes,
                    " bytes, 2^63 - 1)");
  return out;
}

// n rounded up to a multiple of `to` (> 0), or a ValueError naming `what`.
inline size_t checked_round_up(size_t n, size_t to, const char* what) {
  TORCH_CHECK_VALUE(n <= kMaxBytes - (to - 1), what, ": ", n,
                    " bytes cannot be rounded up to a multiple of ", to,
                    " within the largest size pinxfer can handle (", kMaxBytes,
                    " bytes, 2^63 - 1)");
  return (n + to - 1) / to * to;
}

// Bytes of a contiguous tensor of these sizes and item size: every dimension
// non-negative, the product and the byte count within kMaxBytes.
inline size_t checked_tensor_bytes(c10::IntArrayRef sizes, size_t itemsize, const char* what) {
  size_t numel = 1;
  for (int64_t d : sizes) {
    TORCH_CHECK_VALUE(d >= 0, what, ": sizes must be non-negative, got ", sizes);
  }
  for (int64_t d : sizes) {
    size_t next = 0;
    TORCH_CHECK_VALUE(!__builtin_mul_overflow(numel, static_cast<size_t>(d), &next) &&
                          next <= kMaxBytes,
                      what, ": a tensor of sizes ", sizes,
                      " has more elements than pinxfer can handle (at most 2^63 - 1 bytes)");
    numel = next;
  }
  size_t out = 0;
  TORCH_CHECK_VALUE(!__builtin_mul_overflow(numel, itemsize, &out) && out <= kMaxBytes, what,
                    ": a tensor of sizes ", sizes, " with ", itemsize, "-byte elements needs ",
                    "more than 2^63 - 1 bytes, the largest size pinxfer can handle");
  return out;
}

}  // namespace pinxfer
