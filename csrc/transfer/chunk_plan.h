// How one pageable -> device transfer is cut up: chunks (one DMA each),
// pieces (one staging copy by one thread each) and the staging layout.
//
// Chunks: steady ones of at most chunk_bytes in the middle, halving down to
// 256 KiB at both ends, so the first DMA starts after a few microseconds of
// staging and the last one, which overlaps nothing, is short. A tensor that
// fits num_buffers x chunk_bytes (or has no more chunks than buffers) is staged
// in one block, each chunk at its own offset; a larger one in a ring of
// num_buffers slots, chunk c in slot c % ring. Each chunk is cut into about one
// piece per thread, so all threads fill a chunk together and its DMA starts as
// early as possible. Up to kSerialBytes a transfer is one chunk and one piece,
// copied by the calling thread: waking workers costs more than the copy.
//
// Pure arithmetic, no CUDA: stateless and thread-safe; tested on the CPU
// through the test-only op _chunk_plan.
#pragma once

#include <cstddef>
#include <vector>

namespace pinxfer::transfer {

constexpr size_t kKiB = size_t{1} << 10;
constexpr size_t kMiB = size_t{1} << 20;
constexpr size_t kSerialBytes = 256 * kKiB;
// Smallest steady chunk and smallest piece: both keep per-copy and per-claim
// overheads under a few percent.
constexpr size_t kMinChunk = 1 * kMiB;
constexpr size_t kMinPiece = 64 * kKiB;
// First (and last) chunk of a pipelined transfer.
constexpr size_t kFirstChunk = 256 * kKiB;

inline size_t round_up(size_t n, size_t m) { return (n + m - 1) / m * m; }

struct ChunkPlan {
  struct Piece {
    size_t chunk, begin, end;  // bytes [begin, end) of chunk `chunk`
  };
  std::vector<size_t> bounds;  // chunk c is [bounds[c], bounds[c + 1])
  std::vector<Piece> pieces;   // in chunk order: claimed front to back
  size_t ring = 0;             // staging slots; 0: one block for the whole tensor
  size_t slot_bytes = 0;       // capacity of each ring slot (0 without a ring)
  size_t threads = 1;          // threads worth starting (<= pieces)

  size_t num_chunks() const { return bounds.size() - 1; }
  bool serial() const { return threads == 1; }
};

// Whether a transfer of nbytes is staged in one block whatever its chunks: it fits
// num_buffers x chunk_bytes. No thread staging it then waits for a DMA to free a slot.
inline bool fits_one_block(size_t nbytes, size_t chunk_bytes, size_t num_buffers) {
  return nbytes <= chunk_bytes * num_buffers;
}

// chunk_bytes >= 4096 and num_buffers >= 1 (the op checks them).
ChunkPlan plan_chunks(size_t nbytes, size_t chunk_bytes, size_t num_buffers, size_t num_threads);

// The chunk boundaries: 0 = b[0] < b[1] < ... < b[k] = nbytes; every boundary
// but the last is a multiple of 4 KiB.
std::vector<size_t> chunk_bounds(size_t nbytes, size_t steady, size_t first);

// Steady chunk size: at most chunk_bytes, about a sixteenth of the tensor (so
// it is cut into enough chunks to pipeline), but >= 1 MiB so each DMA is long
// next to its launch gap; a multiple of 4 KiB.
size_t steady_chunk(size_t nbytes, size_t chunk_bytes);

// A batch's small leaves (sizes in order, each at most kSerialBytes) are packed into one
// copy, each leaf at an offset rounded up to `align`. Packed into at most kSerialBytes, that
// copy is a current-stream send by the caller; packed into more, it goes through the copy
// stream with helpers (their wake-up, an event hand-over), although no leaf is larger than a
// current-stream send and the helpers can only share the work leaf by leaf. The usual
// collated batch crosses that bound by a few bytes: one leaf of almost kSerialBytes (the
// inputs) and small ones (labels, scalars). When the pack fits without its largest leaf,
// two current-stream sends cost less (issue 22, results/<kind>/loop_batch_apart*): that leaf
// alone, the others packed. Returns the index of the leaf sent alone, or -1 (one pack).
// pinxfer/transfer.py's _leaf_sent_apart is the same rule for the operators' path.
std::ptrdiff_t leaf_sent_apart(const std::vector<size_t>& sizes, size_t align);

}  // namespace pinxfer::transfer
