#include "transfer/piece_claims.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <random>

namespace pinxfer::transfer {

PieceClaims::PieceClaims(const ChunkPlan& plan)
    : plan_(plan),
      state_(new std::atomic<uint8_t>[plan.pieces.size()]),
      left_(new std::atomic<size_t>[plan.num_chunks()]),
      first_piece_(plan.num_chunks() + 1, plan.pieces.size()) {
  for (size_t p = 0; p < pieces(); ++p) state_[p].store(kFree, std::memory_order_relaxed);
  for (size_t c = 0; c < chunks(); ++c) left_[c].store(0, std::memory_order_relaxed);
  for (size_t p = pieces(); p-- > 0;) {
    left_[plan.pieces[p].chunk].fetch_add(1, std::memory_order_relaxed);
    first_piece_[plan.pieces[p].chunk] = p;
  }
}

void PieceClaims::close_free_pieces() {
  for (size_t p = 0; p < pieces(); ++p) {
    uint8_t expected = kFree;
    state_[p].compare_exchange_strong(expected, kStolen, std::memory_order_seq_cst);
  }
}

double PieceClaims::close_source() {
  if (source_readers_.load(std::memory_order_seq_cst) == 0) return 0;
  // A reader is a helper inside a piece: a running one leaves within a piece's copy, a
  // parked one when the scheduler runs it again, so spin briefly, then yield the core.
  const auto waiting = std::chrono::steady_clock::now();
  for (unsigned i = 1; source_readers_.load(std::memory_order_acquire) != 0; ++i) {
    if (i < 256) {
      cpu_relax();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(10));
    }
  }
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - waiting)
      .count();
}

namespace {

constexpr const char* kSelfTest = "pinxfer._piece_claims_self_test: ";

// 64-bit mixer (splitmix64's finaliser): round r's source bytes, and which claims stall.
uint64_t mix(uint64_t seed, uint64_t round, uint64_t i) {
  uint64_t x = (seed * 0x9E3779B97F4A7C15ULL) ^ (round * 0xBF58476D1CE4E5B9ULL) ^ i;
  x ^= x >> 31;
  x *= 0x94D049BB133111EBULL;
  return x ^ (x >> 29);
}

// Whether a helper stalls after claiming piece p of round r (about one piece in four).
bool stalls_on(uint64_t seed, uint64_t round, size_t p) {
  return (mix(seed + 1, round, p) & 3) == 0;
}

// One transfer's state, shared by the caller and the helpers as pipeline.cpp's SingleBlock
// is: whoever leaves last frees it. The source is owned by the caller and freed as soon as
// close_source returns (`let_go` set first).
struct Round {
  Round(ChunkPlan p, const char* source) : plan(std::move(p)), claims(plan), src(source) {
    block.reset(new char[plan.bounds.back()]);
  }
  ChunkPlan plan;
  PieceClaims claims;
  const char* src;
  std::unique_ptr<char[]> block;
  std::atomic<bool> let_go{false};  // the caller has closed and freed the source

  void stage(size_t p, char* into) const {
    const auto& piece = plan.pieces[p];
    std::memcpy(into, src + piece.begin, piece.end - piece.begin);
  }
  void stage_in_block(size_t p) const { stage(p, block.get() + plan.pieces[p].begin); }
};

}  // namespace

std::vector<int64_t> piece_claims_self_test(int64_t seed, int64_t helpers, int64_t rounds,
                                            int64_t stall_us, int64_t fail_every) {
  TORCH_CHECK_VALUE(helpers >= 0 && helpers <= 16 && rounds >= 1 && rounds <= 100000 &&
                        stall_us >= 0 && stall_us <= 100000 && fail_every >= 0,
                    kSelfTest,
                    "expected 0..16 helpers, 1..100000 rounds, a stall of 0..100000 us and "
                    "fail_every >= 0; got ",
                    helpers, " helpers, ", rounds, " rounds, stall ", stall_us, " us, fail_every ",
                    fail_every);
  std::mt19937_64 rng(static_cast<uint64_t>(seed));
  const auto useed = static_cast<uint64_t>(seed);
  int64_t stolen = 0, waited_rounds = 0;
  // Across rounds, read once every helper has been joined (a late helper of one round may
  // still run in the next): pieces helpers published, and helper copies of a source begun or
  // ended after its round let it go.
  auto helper_pieces = std::make_shared<std::atomic<int64_t>>(0);
  auto late_reads = std::make_shared<std::atomic<int64_t>>(0);
  {
    ThreadPool pool(static_cast<int>(helpers) + 1, {});
    for (int64_t r = 0; r < rounds; ++r) {
      const auto ur = static_cast<uint64_t>(r);
      // Sizes that the pipeline sends in one block: 256 KiB - 4 MiB, pieces of >= 64 KiB.
      const size_t nbytes = 256 * kKiB + rng() % (4 * kMiB - 256 * kKiB);
      const size_t chunk_bytes = kMinChunk << (rng() % 3);
      const size_t threads = static_cast<size_t>(helpers) + 1;
      ChunkPlan plan = plan_chunks(nbytes, chunk_bytes, /*num_buffers=*/1024, threads);
      TORCH_CHECK(plan.ring == 0, kSelfTest, "expected a one-block plan for ", nbytes, " bytes");
      // The bytes to send, kept apart from the source, which is freed before they are checked.
      std::vector<uint64_t> expected((nbytes + 7) / 8);
      for (size_t j = 0; j < expected.size(); ++j) expected[j] = mix(useed, ur, j);
      std::unique_ptr<char[]> source(new char[nbytes]);
      std::memcpy(source.get(), expected.data(), nbytes);
      auto round = std::make_shared<Round>(std::move(plan), source.get());
      PieceClaims& claims = round->claims;
      const bool fails = fail_every > 0 && (r + 1) % fail_every == 0;

      // A helper: parked after some claims, and counting a copy that begins or ends after
      // its round let the source go.
      const ThreadPool::Offer offer = pool.offer(static_cast<int>(helpers), [=](size_t, size_t) {
        Round& rd = *round;
        const auto park_sometimes = [&](size_t p) {
          if (stall_us > 0 && stalls_on(useed, ur, p)) {
            std::this_thread::sleep_for(std::chrono::microseconds(stall_us));
          }
        };
        const auto stage_counting_late_reads = [&](size_t p) {
          if (rd.let_go.load(std::memory_order_acquire)) late_reads->fetch_add(1);
          rd.stage_in_block(p);
          if (rd.let_go.load(std::memory_order_acquire)) late_reads->fetch_add(1);
        };
        helper_pieces->fetch_add(rd.claims.help(park_sometimes, stage_counting_late_reads));
      });

      // The caller: its own share, chunks "sent" in order (copied from the block, or a stolen
      // piece from its spare, into dst), then the steals.
      const size_t chunks = claims.chunks();
      std::vector<char> dst(nbytes);
      std::vector<std::unique_ptr<char[]>> spares(claims.pieces());
      size_t sent = 0;
      auto send_ready = [&] {
        while (sent < chunks && claims.chunk_final(sent)) {
          for (size_t p = claims.first_piece(sent); p < claims.first_piece(sent + 1); ++p) {
            const auto& piece = round->plan.pieces[p];
            const char* from =
                claims.stolen(p) ? spares[p].get() : round->block.get() + piece.begin;
            std::memcpy(dst.data() + piece.begin, from, piece.end - piece.begin);
          }
          ++sent;
        }
        return sent;
      };
      bool failed = false;
      try {
        const auto own_started = std::chrono::steady_clock::now();
        const size_t own =
            claims.stage_own_share([&](size_t p) { round->stage_in_block(p); },
                                   [&](std::chrono::steady_clock::time_point) {
                                     if (fails)
                                       throw std::runtime_error("a round failed on purpose");
                                     send_ready();
                                   });
        const auto patience =
            PieceClaims::patience(std::chrono::steady_clock::now() - own_started, own);
        stolen +=
            static_cast<int64_t>(claims.finish_after_own_share(patience, send_ready, [&](size_t p) {
              const auto& piece = round->plan.pieces[p];
              spares[p].reset(new char[piece.end - piece.begin]);
              round->stage(p, spares[p].get());
            }));
      } catch (const std::runtime_error&) {
        failed = true;
        claims.close_free_pieces();
      }
      pool.withdraw(offer);
      if (claims.close_source() > 0) ++waited_rounds;
      round->let_go.store(true, std::memory_order_release);
      source.reset();  // a helper reading it from here on is a use-after-free

      if (failed) continue;
      for (size_t p = 0; p < claims.pieces(); ++p) {
        const auto s = claims.state(p);
        TORCH_CHECK(s == PieceClaims::kDone || s == PieceClaims::kStolen, kSelfTest, "round ", r,
                    ": piece ", p, " of ", claims.pieces(), " ended in state ",
                    static_cast<int>(s));
      }
      const char* want = reinterpret_cast<const char*>(expected.data());
      if (std::memcmp(dst.data(), want, nbytes) != 0) {
        size_t i = 0;
        while (dst[i] == want[i]) ++i;
        TORCH_CHECK(false, kSelfTest, "round ", r, ": byte ", i, " of ", nbytes, " sent wrong");
      }
    }
  }  // the pool joins its workers: every helper has left
  TORCH_CHECK(late_reads->load() == 0, kSelfTest, late_reads->load(),
              " helper copies read a source after its round's close_source");
  return {helper_pieces->load(), stolen, waited_rounds};
}

}  // namespace pinxfer::transfer
