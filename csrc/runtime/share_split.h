// A range cut into one share per member of a team, each share taken in pieces: member k takes
// its own share first, then what is left of the others'. How host copies on torch's team
// split their bytes (runtime/torch_team.cpp); no OpenMP and no CUDA here, so the protocol is
// tested with plain threads under TSan and ASan (share_split_self_test).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>

namespace pinxfer {

class ShareSplit {
 public:
  // [0, n) in `members` shares of `share` units (members * share >= n), each taken in pieces
  // of a quarter share (at least one unit).
  ShareSplit(size_t n, size_t share, size_t members);

  // Runs fn(begin, end) over the pieces member `me` (< members) takes: its own share's, in
  // order, then what is left of the others' (the next member's first), so a member done
  // early takes over from a late one. A member with no share (fewer shares than members)
  // takes nothing: arriving with nothing to do, it would take the first pieces of members
  // about to start theirs, whose bytes are in their cores' caches (a 256 KiB pin_memory's
  // two shares went to four members, H100, diag_pin_copy). Returns the pieces it ran.
  // Lock-free; every unit is handed out exactly once, whatever the timing, provided every
  // member that has a share calls take().
  size_t take(size_t me, const std::function<void(size_t, size_t)>& fn);

  // Pieces in all.
  size_t pieces() const { return pieces_; }

 private:
  // Where a share stands: [next, end) left, claimed a piece at a time. On a cache line of
  // its own (its owner claims from it at every piece).
  struct alignas(64) Cursor {
    std::atomic<size_t> next{0};
    size_t end = 0;
  };
  std::unique_ptr<Cursor[]> cursors_;
  size_t members_;
  size_t sharing_ = 0;  // members with a share: the first ceil(n / share)
  size_t piece_;
  size_t pieces_ = 0;
};

// TEST-ONLY (pinxfer._C._share_split_self_test): `rounds` times, `members` threads take the
// shares of [0, n) (some of them late, at random); every unit must be run exactly once.
// Returns the pieces members took from shares not their own; throws on a unit run twice or
// never.
int64_t share_split_self_test(int64_t n, int64_t share, int64_t members, int64_t rounds);

}  // namespace pinxfer
