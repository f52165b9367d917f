#include "runtime/share_split.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <exception>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

namespace pinxfer {

ShareSplit::ShareSplit(size_t n, size_t share, size_t members)
    : cursors_(new Cursor[std::max<size_t>(1, members)]),
      members_(std::max<size_t>(1, members)),
      piece_(std::max<size_t>(1, (std::max<size_t>(1, share) + 3) / 4)) {
  share = std::max<size_t>(1, share);
  for (size_t k = 0; k < members_; ++k) {
    const size_t begin = std::min(n, k * share);
    cursors_[k].next.store(begin, std::memory_order_relaxed);
    cursors_[k].end = std::min(n, begin + share);
    pieces_ += (cursors_[k].end - begin + piece_ - 1) / piece_;
    if (begin < cursors_[k].end) sharing_ = k + 1;
  }
}

size_t ShareSplit::take(size_t me, const std::function<void(size_t, size_t)>& fn) {
  size_t ran = 0;
  if (me >= sharing_) return ran;  // no share of its own: it leaves the shares to their owners
  for (size_t i = 0; i < members_; ++i) {
    Cursor& c = cursors_[(me + i) % members_];
    if (c.next.load(std::memory_order_relaxed) >= c.end) continue;
    for (;;) {
      const size_t begin = c.next.fetch_add(piece_, std::memory_order_relaxed);
      if (begin >= c.end) break;
      fn(begin, std::min(c.end, begin + piece_));
      ++ran;
    }
  }
  return ran;
}

int64_t share_split_self_test(int64_t n, int64_t share, int64_t members, int64_t rounds) {
  TORCH_CHECK_VALUE(n >= 1 && n <= (int64_t{1} << 20) && share >= 1 && members >= 1 &&
                        members <= 64 && share * members >= n && rounds >= 1,
                    "pinxfer._share_split_self_test: expected 1..2^20 units, 1..64 members, "
                    "share * members >= units and rounds >= 1; got ",
                    n, " units, share ", share, ", ", members, " members, ", rounds, " rounds");
  const auto units = static_cast<size_t>(n);
  const auto team = static_cast<size_t>(members);
  std::atomic<int64_t> helped{0};
  for (int64_t r = 0; r < rounds; ++r) {
    ShareSplit split(units, static_cast<size_t>(share), team);
    std::vector<std::atomic<int>> hits(units);
    std::mutex error_mutex;
    std::exception_ptr error;
    std::vector<std::thread> threads;
    for (size_t me = 0; me < team; ++me) {
      threads.emplace_back([&, me] {
        try {
          // Some members late, by up to 200 us, so that others take over their shares (members
          // without a share take nothing: the owners, late or not, run every unit).
          std::mt19937 rng(static_cast<uint32_t>(r * 131 + static_cast<int64_t>(me)));
          if (rng() % 3 == 0) std::this_thread::sleep_for(std::chrono::microseconds(rng() % 200));
          const size_t own_begin = std::min(units, me * static_cast<size_t>(share));
          const size_t own_end = std::min(units, own_begin + static_cast<size_t>(share));
          const size_t ran = split.take(me, [&](size_t begin, size_t end) {
            TORCH_CHECK(begin < end && end <= units, "piece [", begin, ", ", end, ") out of range");
            if (begin < own_begin || begin >= own_end) helped.fetch_add(1);
            for (size_t u = begin; u < end; ++u) hits[u].fetch_add(1, std::memory_order_relaxed);
          });
          TORCH_CHECK(own_begin < own_end || ran == 0, "member ", me, " has no share but took ",
                      ran, " pieces");
        } catch (...) {
          std::lock_guard<std::mutex> lock(error_mutex);
          if (!error) error = std::current_exception();
        }
      });
    }
    for (auto& t : threads) t.join();
    if (error) std::rethrow_exception(error);
    for (size_t u = 0; u < units; ++u) {
      const int h = hits[u].load(std::memory_order_relaxed);
      TORCH_CHECK(h == 1, "pinxfer._share_split_self_test: unit ", u, " run ", h, " times");
    }
  }
  return helped.load();
}

}  // namespace pinxfer
