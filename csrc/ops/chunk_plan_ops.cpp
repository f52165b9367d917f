// Kernel of the test-only _chunk_plan operator (schema in csrc/module.cpp):
// the transfer layer's chunk planning (transfer/chunk_plan.h), pure
// arithmetic, so that CPU tests can check every plan's invariants without a GPU.
#include <torch/library.h>

#include <tuple>

#include "transfer/chunk_plan.h"

namespace pinxfer::ops {

namespace {

std::tuple<std::vector<int64_t>, std::vector<int64_t>, int64_t, int64_t, int64_t> chunk_plan_op(
    int64_t nbytes, int64_t chunk_bytes, int64_t num_buffers, int64_t num_threads) {
  TORCH_CHECK_VALUE(nbytes >= 0 && chunk_bytes >= 4096 && num_buffers >= 1 && num_threads >= 1,
                    "pinxfer._chunk_plan: expected nbytes >= 0, chunk_bytes >= 4096, "
                    "num_buffers >= 1, num_threads >= 1; got ",
                    nbytes, ", ", chunk_bytes, ", ", num_buffers, ", ", num_threads);
  const transfer::ChunkPlan plan =
      transfer::plan_chunks(static_cast<size_t>(nbytes), static_cast<size_t>(chunk_bytes),
                            static_cast<size_t>(num_buffers), static_cast<size_t>(num_threads));
  std::vector<int64_t> bounds(plan.bounds.begin(), plan.bounds.end());
  // Pieces flattened as (chunk, begin, end) triples.
  std::vector<int64_t> pieces;
  for (const auto& p : plan.pieces) {
    pieces.insert(pieces.end(), {static_cast<int64_t>(p.chunk), static_cast<int64_t>(p.begin),
                                 static_cast<int64_t>(p.end)});
  }
  return {bounds, pieces, static_cast<int64_t>(plan.ring), static_cast<int64_t>(plan.slot_bytes),
          static_cast<int64_t>(plan.threads)};
}

}  // namespace

TORCH_LIBRARY_IMPL(pinxfer, CompositeExplicitAutograd, m) { m.impl("_chunk_plan", &chunk_plan_op); }

}  // namespace pinxfer::ops
