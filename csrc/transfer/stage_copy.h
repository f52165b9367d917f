// Copying pageable bytes into pinned staging memory, and choosing how.
//
// Two kinds of stores, measured on the H200 host (16 vCPUs, 2 MiB L2 per core,
// 300 MiB L3; benchmarks/sweep_to_device.py, benchmarks/results/h200/sweep.json):
//  * nontemporal stores: lines go straight to DRAM and the DMA engine reads
//    them there at once. Lowest latency (8 MiB: 31 GB/s against 15 for cached
//    stores), but with the DMA reading DRAM too they top out near 43 GB/s.
//  * cached stores (rep movsb): faster for long streams (1 GiB: 53 GB/s), but a
//    DMA read of a line still dirty in a core's L2 is slow, and the last lines
//    staged are read at once: that final drain is on the critical path.
// So by default (StagingMode::kAuto) a chunk is staged with cached stores if at
// least `cached_tail` bytes (16 MiB) are staged after it, nontemporal
// otherwise: an 8 MiB tensor is all nontemporal, 1 GiB almost all cached. When
// the copy stream is still busy with earlier transfers (batches sent back to
// back, as by prefetch), the next transfer's staging hides the drain, so a
// tensor of >= 32 MiB is then staged all cached. A transfer the caller stages
// alone into one block (the small road) is the exception: cached above one page
// (small_copy_kind, session 50).
//
// Pure CPU code, no CUDA: stateless and thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

namespace pinxfer {

// How pageable bytes are copied into pinned staging memory: an op argument
// ("staging"), which PINXFER_STAGE_COPY overrides when the argument is "auto".
// The names are runtime/settings.h's kStagingModeNames, in this order.
enum class StagingMode {
  kAuto,         // "auto": per chunk, cached stores, nontemporal for the transfer's tail
  kNontemporal,  // "nt": every chunk nontemporal
  kCached,       // "movsb": every chunk with cached stores
};
// "auto", "nt", "movsb" -> mode; throws c10::ValueError naming `what` otherwise.
StagingMode parse_staging_mode(const std::string& text, const char* what);
const char* staging_mode_name(StagingMode mode);

}  // namespace pinxfer

namespace pinxfer::transfer {

enum class StageCopy { kNontemporal, kCached };

struct StagePolicy {
  size_t cached_tail = 16 << 20;  // SIZE_MAX: never cached; 0: always
  // The store kind for a chunk ending at `end` of a transfer of `nbytes`.
  StageCopy kind_for(size_t end, size_t nbytes) const {
    return nbytes - end >= cached_tail ? StageCopy::kCached : StageCopy::kNontemporal;
  }
};

// The policy for one transfer. `mode` is the caller's argument; kAuto defers
// to PINXFER_STAGE_COPY when that is set (an override for benchmarks), else
// chooses per chunk. cached_tail < 0 means "auto": PINXFER_CACHED_TAIL, else
// 16 MiB, or 0 when nbytes >= 32 MiB and copy_stream_busy() (called only then:
// it queries the stream).
StagePolicy stage_policy(StagingMode mode, int64_t cached_tail, size_t nbytes,
                         const std::function<bool()>& copy_stream_busy);

// The store kind for the caller's own copy of a short transfer into one pool block (the small
// road: transfer/cuda/pipeline.h, caller_staged_copy). Under "auto" with no cached tail given:
// cached stores above one page, nontemporal at a page (below a page stage_copy stores with
// memcpy whatever the kind). A loop's other work evicts the source between two steps, and in
// this road on session 50's H100 host rep movsb copied a cold source about twice as fast as the
// nontemporal loop (256 KiB: 19-23 us against 37-41), far more than the DMA's slower read of the
// lines left dirty in the core's cache costs (4-5 us at 256 KiB); on session 51's host it was
// lower after a GPU kernel (31 and 19 us against 34) and equal after a sleep, while the CPU alone
// reads a cold source into a flushed destination faster with the nontemporal loop
// (benchmarks/diag_stage_reads.cpp). A destination movsb rewrote just before is still in cache,
// and movsb into it is fast (benchmarks/diag_stage_dest.py); whether that survives the DMA read
// is not yet measured (csrc/README.md, "Session 51"). At a page the copy takes under a
// microsecond and that read is what is left. A mode other than auto (the argument, else
// PINXFER_STAGE_COPY) or a cached tail given (the argument, else PINXFER_CACHED_TAIL) decides as
// stage_policy does.
StageCopy small_copy_kind(StagingMode mode, int64_t cached_tail, size_t nbytes);

// Diagnostics' ways to put a copy's source or destination where a cell needs it
// (benchmarks/diag_stage_dest.py): flush_cache_lines writes n bytes from p's cache lines back to
// memory and drops them from every cache (clflush; nothing where the CPU is not x86);
// read_cache_lines reads one byte of each line, into the calling thread's caches.
void flush_cache_lines(const void* p, size_t n);
void read_cache_lines(const void* p, size_t n);

// Copies n bytes; after nontemporal stores an sfence makes them visible before
// the caller publishes "piece done" to the thread that queues the DMA.
void stage_copy(char* dst, const char* src, size_t n, StageCopy kind);

}  // namespace pinxfer::transfer
