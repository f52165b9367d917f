// PieceClaims: who stages each piece of a single-block transfer, and when its source may be
// let go (the protocol of transfer/cuda/pipeline.cpp's single-block path; ChunkPlan in
// transfer/chunk_plan.h says how a tensor is cut into chunks and pieces). No CUDA here: the
// protocol runs with plain threads under TSan and ASan (piece_claims_self_test,
// tests/test_piece_claims.py), its DMAs replaced by host copies of the same bytes.
//
// Why the caller never waits for a parked helper: right after a torch CPU op, torch's OpenMP
// team spins on every core for milliseconds; woken copy threads then share cores with it, and
// a helper descheduled in the middle of a piece held the whole transfer for a scheduler slice
// (H100, bench_loop: 8 MiB back to back 1.3-2.8 ms median against 0.26 ms with
// OMP_NUM_THREADS=1). So:
//   * helpers only stage pieces: count themselves as readers of the source, claim a piece
//     (kFree -> kClaimed), copy it, leave the source, publish it (kClaimed -> kDone) and
//     count it off its chunk (help());
//   * the caller stages pieces too (claim_and_stage), sends every chunk, in order, as soon as
//     its pieces are all final (chunk_final), and, once no piece is left to claim, waits for
//     the pieces in flight at most `patience`; then it steals the rest (kClaimed or kFree ->
//     kStolen), stages each again into a spare of its own and sends that piece from there
//     (finish_after_own_share). A helper whose piece was stolen finds kStolen when it
//     publishes and does nothing more: its bytes land in a region of the block no DMA reads;
//   * the caller returns only once no helper can read the source any more (close_source):
//     every piece is final or closed (close_free_pieces, on an error), so no helper can claim
//     one, and every helper that claimed one has finished reading it. What a caller may do
//     with a pageable source once to_device returns includes freeing its bytes while the
//     Storage lives on (`resize_`, `untyped_storage().resize_(0)`, `share_memory_()` all swap
//     a storage's memory and free the old), so holding the Storage did not keep a late helper
//     from reading freed, possibly unmapped, memory (session 32: a segfault on the H200). The
//     caller does wait for a parked helper there, after its DMAs are queued; 17 of 2,363 calls
//     traced by diag_midsize stole a piece.
// The owner (pipeline.cpp's SingleBlock) is shared by the caller and the helpers, so the
// staging block outlives the last helper however late it leaves.
//
// Thread safety: help() from any number of helper threads; claim_and_stage from the caller and
// the members of torch's team (nobody steals there); steals, chunk_final, close_free_pieces
// and close_source from the caller alone.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "runtime/thread_pool.h"
#include "transfer/chunk_plan.h"

namespace pinxfer::transfer {

class PieceClaims {
 public:
  enum State : uint8_t { kFree, kClaimed, kDone, kStolen };

  // Every piece of `plan` free. The plan must outlive the claims.
  explicit PieceClaims(const ChunkPlan& plan);
  PieceClaims(const PieceClaims&) = delete;
  PieceClaims& operator=(const PieceClaims&) = delete;

  size_t pieces() const { return plan_.pieces.size(); }
  size_t chunks() const { return plan_.num_chunks(); }
  // The next piece in claim order (pieces in chunk order, front to back); >= pieces(): none
  // left. Every thread takes its candidates from here, so pieces are tried in order.
  size_t take_next() { return next_.fetch_add(1, std::memory_order_relaxed); }
  // Whether no thread has taken a piece yet (a test hook waits for a helper's claim).
  bool none_taken() const { return next_.load(std::memory_order_relaxed) == 0; }
  // Whether piece p is still free (a hint: it may be claimed right after).
  bool is_free(size_t p) const { return state_[p].load(std::memory_order_relaxed) == kFree; }
  State state(size_t p) const {
    return static_cast<State>(state_[p].load(std::memory_order_acquire));
  }
  // The first piece of chunk c (pieces() for c == chunks()).
  size_t first_piece(size_t c) const { return first_piece_[c]; }
  // Whether every piece of chunk c is final (done or stolen and staged again): its bytes,
  // wherever they were staged, are visible to the thread that asks.
  bool chunk_final(size_t c) const { return left_[c].load(std::memory_order_acquire) == 0; }
  // Whether piece p was stolen: its bytes are in the stealer's spare, not in the block.
  bool stolen(size_t p) const { return state(p) == kStolen; }

  // Claims piece p if it is still free, runs stage(p) and publishes it, counting it off its
  // chunk; false if another thread had taken it. For pieces nobody steals from their
  // stager: the caller's own (it is the only thief) and those of torch's team.
  template <class Stage>
  bool claim_and_stage(size_t p, Stage&& stage) {
    uint8_t expected = kFree;
    if (!state_[p].compare_exchange_strong(expected, kClaimed, std::memory_order_acq_rel)) {
      return false;
    }
    stage(p);
    state_[p].store(kDone, std::memory_order_release);
    count_off(p);
    return true;
  }

  // The caller's share: pieces taken in order, each claimed and staged by stage(p) while it is
  // still free, and after_each(when its staging began) after each (the caller sends chunks
  // there). Returns the pieces it staged.
  template <class Stage, class AfterEach>
  size_t stage_own_share(Stage&& stage, AfterEach&& after_each) {
    size_t own = 0;
    for (size_t p = take_next(); p < pieces(); p = take_next()) {
      const auto staging = std::chrono::steady_clock::now();
      if (!claim_and_stage(p, stage)) continue;
      ++own;
      after_each(staging);
    }
    return own;
  }

  // How long the caller, its share done, waits for the pieces in flight before it steals them
  // (finish_after_own_share): a running helper finishes one within about a piece's time, so
  // twice the caller's own time per piece, and at least 20 us.
  static std::chrono::steady_clock::duration patience(std::chrono::steady_clock::duration own_time,
                                                      size_t own_pieces) {
    const auto per_piece = own_time / std::max<size_t>(own_pieces, 1);
    return std::max<std::chrono::steady_clock::duration>(2 * per_piece,
                                                         std::chrono::microseconds(20));
  }

  // A helper's share: pieces claimed in order until none are left; on_claim(p) right after
  // each claim (the trace's first claim, a test's stall), stage(p) copies piece p's bytes
  // from the source into the block. Neither may throw. Returns the pieces it published.
  template <class OnClaim, class Stage>
  int64_t help(OnClaim&& on_claim, Stage&& stage) {
    int64_t published = 0;
    for (;;) {
      const size_t p = take_next();
      if (p >= pieces()) return published;
      // seq_cst with the claim below and close_source's loads: a caller that reads zero
      // readers after the last free piece was taken cannot miss a helper about to read.
      source_readers_.fetch_add(1, std::memory_order_seq_cst);
      uint8_t expected = kFree;
      if (!state_[p].compare_exchange_strong(expected, kClaimed, std::memory_order_seq_cst)) {
        source_readers_.fetch_sub(1, std::memory_order_release);
        continue;  // the caller stole it before this helper started it
      }
      on_claim(p);
      stage(p);
      // release: the caller, reading zero readers, sees this piece's reads of the source done.
      source_readers_.fetch_sub(1, std::memory_order_release);
      expected = kClaimed;
      // acq_rel: the caller, seeing the chunk's count reach zero, sees these bytes.
      if (state_[p].compare_exchange_strong(expected, kDone, std::memory_order_acq_rel)) {
        count_off(p);
        ++published;
      }
    }
  }

  // The caller, its own share done (take_next() past the end): sends chunks as they become
  // final until all are sent, stealing what helpers have not finished within `patience`.
  // send_ready() sends the final chunks that follow those sent (or holds them back) and
  // returns the chunks sent so far, in order; stage_spare(p) stages stolen piece p again into
  // a spare of the caller's own. Returns the pieces stolen. Exceptions pass through: the
  // caller then closes the free pieces and the source.
  template <class SendReady, class StageSpare>
  size_t finish_after_own_share(std::chrono::steady_clock::duration patience,
                                SendReady&& send_ready, StageSpare&& stage_spare) {
    const auto waiting = std::chrono::steady_clock::now();
    size_t stolen_here = 0;
    for (unsigned i = 1;; ++i) {
      const size_t sent = send_ready();
      if (sent == chunks()) return stolen_here;
      cpu_relax();
      if (i % 64 != 0 || std::chrono::steady_clock::now() - waiting < patience) continue;
      // Parked helpers: stage their pieces again, into spares.
      for (size_t p = first_piece(sent); p < pieces(); ++p) {
        uint8_t expected = state_[p].load(std::memory_order_acquire);
        if (expected == kDone || expected == kStolen) continue;
        if (!state_[p].compare_exchange_strong(expected, kStolen, std::memory_order_acq_rel)) {
          continue;  // published meanwhile
        }
        stage_spare(p);
        count_off(p);
        ++stolen_here;
      }
    }
  }

  // On an error, before close_source: pieces still free are closed to helpers (kFree ->
  // kStolen, not staged). On the normal path every piece is final by then: nothing to close.
  void close_free_pieces();

  // Returns once no helper reads the source, now or later (the caller's last step): with no
  // piece free, no helper can claim one; the caller waits for every helper that claimed one
  // to finish reading it. Returns the microseconds it waited.
  double close_source();

 private:
  // acq_rel: whoever sees the chunk's count reach zero sees the piece's bytes.
  void count_off(size_t p) { left_[plan_.pieces[p].chunk].fetch_sub(1, std::memory_order_acq_rel); }

  const ChunkPlan& plan_;
  std::unique_ptr<std::atomic<uint8_t>[]> state_;  // State of each piece
  std::unique_ptr<std::atomic<size_t>[]> left_;    // pieces of each chunk not yet final
  std::vector<size_t> first_piece_;                // of each chunk, and pieces() last
  std::atomic<size_t> next_{0};
  // Helpers that may be reading the source: counted before a claim is tried, so that once
  // no piece is free, zero here means no helper reads the source now or later.
  std::atomic<int> source_readers_{0};
};

// TEST-ONLY (pinxfer._C._piece_claims_self_test): `rounds` single-block transfers of random
// sizes through PieceClaims with a pool of `helpers` copy workers, the DMAs replaced by host
// copies of the chunks in order (block or spare). After a claim, a helper sleeps `stall_us`
// on about one piece in four (a helper the scheduler has parked), so the caller steals. With
// `fail_every` > 0, every fail_every-th round ends in an error after the caller's first piece
// (close_free_pieces, then close_source). After close_source the round frees its source; a
// helper still reading it is counted (and is a heap-use-after-free under ASan). Checks every
// byte sent, every piece final exactly once, no read after close; raises c10::Error on a
// failure. Returns {pieces staged by helpers, pieces stolen, rounds whose close waited}.
std::vector<int64_t> piece_claims_self_test(int64_t seed, int64_t helpers, int64_t rounds,
                                            int64_t stall_us, int64_t fail_every);

}  // namespace pinxfer::transfer
