#include "transfer/chunk_plan.h"

#include <algorithm>

namespace pinxfer::transfer {

std::vector<size_t> chunk_bounds(size_t nbytes, size_t steady, size_t first) {
  const size_t aligned = nbytes / (4 * kKiB) * (4 * kKiB);
  first = std::min(first, steady);
  std::vector<size_t> head, tail;  // chunk sizes from the front, and from the back
  size_t left = aligned, front = first, back = first;
  while (left > 0) {
    head.push_back(std::min(front, left));
    left -= head.back();
    front = std::min(front * 2, steady);
    if (left == 0) break;
    tail.push_back(std::min(back, left));
    left -= tail.back();
    back = std::min(back * 2, steady);
  }
  std::vector<size_t> bounds{0};
  for (size_t len : head) bounds.push_back(bounds.back() + len);
  for (auto it = tail.rbegin(); it != tail.rend(); ++it) bounds.push_back(bounds.back() + *it);
  if (nbytes > aligned) {
    if (bounds.size() == 1) bounds.push_back(nbytes);
    else bounds.back() = nbytes;  // the sub-4 KiB tail joins the last chunk
  }
  return bounds;
}

size_t steady_chunk(size_t nbytes, size_t chunk_bytes) {
  const size_t sixteenth = round_up((nbytes + 15) / 16, 64 * kKiB);
  return std::min(chunk_bytes / (4 * kKiB) * (4 * kKiB), std::max(kMinChunk, sixteenth));
}

ChunkPlan plan_chunks(size_t nbytes, size_t chunk_bytes, size_t num_buffers, size_t num_threads) {
  ChunkPlan plan;
  const bool serial = nbytes <= kSerialBytes;
  plan.bounds = serial ? std::vector<size_t>{0, nbytes}
                       : chunk_bounds(nbytes, steady_chunk(nbytes, chunk_bytes), kFirstChunk);
  const size_t chunks = plan.num_chunks();
  const bool one_block = fits_one_block(nbytes, chunk_bytes, num_buffers) || chunks <= num_buffers;
  plan.ring = one_block ? 0 : num_buffers;
  const size_t threads = serial ? 1 : std::max<size_t>(1, num_threads);
  for (size_t c = 0; c < chunks; ++c) {
    const size_t begin = plan.bounds[c], end = plan.bounds[c + 1];
    const size_t piece =
        std::max(kMinPiece, round_up((end - begin + threads - 1) / threads, 4 * kKiB));
    for (size_t b = begin; b < end; b += piece)
      plan.pieces.push_back({c, b, std::min(end, b + piece)});
    // A slot holds the longest chunk: not always the steady one, since the
    // sub-4 KiB end of the tensor joins the last chunk, and a small chunk_bytes
    // makes the ramp's chunks as long as the steady ones.
    if (plan.ring != 0) plan.slot_bytes = std::max(plan.slot_bytes, end - begin);
  }
  plan.threads = std::min(threads, std::max<size_t>(1, plan.pieces.size()));
  return plan;
}

std::ptrdiff_t leaf_sent_apart(const std::vector<size_t>& sizes, size_t align) {
  // Sizes are at most kSerialBytes each, so these sums of rounded sizes cannot overflow.
  size_t total = 0;
  std::ptrdiff_t largest = -1;
  for (size_t i = 0; i < sizes.size(); ++i) {
    total += round_up(sizes[i], align);
    if (largest < 0 || sizes[i] > sizes[static_cast<size_t>(largest)]) {
      largest = static_cast<std::ptrdiff_t>(i);
    }
  }
  if (sizes.size() < 2 || total <= kSerialBytes) return -1;
  const size_t rest = total - round_up(sizes[static_cast<size_t>(largest)], align);
  return rest <= kSerialBytes ? largest : -1;
}

}  // namespace pinxfer::transfer
