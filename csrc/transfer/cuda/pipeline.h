// Host -> device copies through pinned staging memory: the chunked pipeline
// for one pageable tensor, one packed copy for many small ones, and the direct
// copy of a pinned one. Tensors are already checked and made dense by the ops
// (csrc/ops/cuda/to_device_cuda.cpp); these functions only move bytes.
//
// The pipeline (ChunkPlan in transfer/chunk_plan.h says how a tensor is cut).
// The host threads of the node's ThreadPool claim pieces in order and copy
// each into staging (transfer/stage_copy.h). Two layouts:
// * one block (the tensor fits num_buffers chunks): helpers only stage; the
//   caller queues the chunks' sends in order once their pieces are final
//   (consecutive staged chunks as one DMA while the engine has enough queued; the chunks
//   staged with cached stores read by a kernel instead where StagingOptions' reader says so:
//   transfer/cuda/staged_read.h) and,
//   when a helper has not finished a claimed piece in time (parked by the
//   scheduler), stages that piece again into a spare block and sends it from
//   there. The block stays alive (shared) until the last helper has left; the
//   call returns once no helper reads the source. The claims, steals and that
//   close are PieceClaims' (transfer/piece_claims.h says why and how).
// * a ring: the thread that finishes the last piece of a chunk queues its
//   cudaMemcpyAsync on the copy stream and records the slot's event. A thread
//   about to write into a ring slot first waits until the slot's previous
//   chunk has been queued, then synchronizes its event: a staging slot is
//   never refilled while its previous copy may still read it. Claims are in
//   order and each claimed piece is finished by its claimer, so the waits only
//   point backwards and cannot deadlock.
//
// Staging memory comes from pinxfer's pool for the device's NUMA node, a fresh
// set of blocks per call (the pool caches them: a second call is a cache hit).
// Before a block goes back to the pool it is marked as used by the copy
// stream, so the pool's event FIFO keeps it from reuse until the DMA has read
// it.
//
// Thread safety: any number of transfers may run at once from any threads;
// each has its own staging blocks, and their pieces share the node's threads.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <vector>

#include "transfer/chunk_plan.h"
#include "transfer/stage_copy.h"

namespace pinxfer {

class StepStamps;  // runtime/step_stamps.h
class ThreadPool;
}  // namespace pinxfer

namespace pinxfer::transfer {

// Who reads a single-block transfer's bytes staged with cached stores onto the device: the copy
// engine, or a kernel over every SM (transfer/cuda/staged_read.h says why and what was
// measured). PINXFER_H2D_READ, in kStagedReaderNames' order (runtime/settings.h).
enum class StagedReader {
  kKernelIfIdle,  // "auto": the kernel when `caller` is the device's default stream and has
                  // no work pending as the staging begins (pipeline.cpp, kernel_read_end)
  kEngine,        // "engine": always the copy engine
  kKernel,        // "kernel": always the kernel
};
// The setting's reader (PINXFER_H2D_READ).
StagedReader staged_reader_setting();

// How one transfer stages its bytes (the op's arguments) and who reads them.
struct StagingOptions {
  size_t chunk_bytes = 0;  // steady chunk at most this (>= 4096)
  size_t num_buffers = 0;  // ring slots for tensors larger than num_buffers chunks (>= 1)
  StagingMode mode = StagingMode::kAuto;
  int64_t cached_tail = -1;  // < 0: auto
  // The op sets these for a copy on the device's copy stream beside the caller's work; a copy
  // on the caller's own stream (prefetch's batch sender, whose batches overlap the training
  // step on another stream) keeps the engine: a kernel there would take SMs from that step.
  StagedReader reader = StagedReader::kEngine;
  std::optional<c10::cuda::CUDAStream> caller;  // the caller's current stream (kKernelIfIdle)
};

// Who stages one pipelined transfer, chosen as soon as the op knows it will need a
// pipeline, before its slow steps (the output's allocation, the stream hand-over, the
// staging block: after an idle gap each CUDA call among them costs tens of microseconds,
// about what a sleeping copy worker takes to rise). Then the helpers it will offer work
// to are woken ahead (ThreadPool::wake_ahead), so they rise while the caller prepares.
struct CopyCrew {
  int node = -1;               // the device's NUMA node: whose pools stage
  ThreadPool* pool = nullptr;  // that node's copy threads (thread_pool_for_node)
  int threads = 1;             // threads that stage, the caller included (threads_for_copy)
  bool on_torch_team = false;  // torch's intra-op team is awake and stages instead
  std::chrono::steady_clock::time_point mustered;  // for the trace's setup_us
  std::chrono::steady_clock::time_point entered;   // pipelined_copy's entry (its entry_us)
  // The op's steps between the muster and that entry (the trace's *_us from the muster):
  std::chrono::steady_clock::time_point probed;         // the muster's end (team probe, wake-ups)
  std::chrono::steady_clock::time_point checked;        // capture check, finished sources swept
  std::chrono::steady_clock::time_point streams_found;  // current and copy stream looked up
  std::chrono::steady_clock::time_point output_made;    // the output allocated (copy stream)
};
CopyCrew muster_copy_crew(c10::DeviceIndex device, size_t nbytes);

// Copies a pageable tensor's bytes to `dst` (device memory of out's size) on
// `stream`, staged through pinned chunks by `crew`.
void pipelined_copy(const at::Tensor& src, at::Tensor& out, c10::DeviceIndex device,
                    const c10::cuda::CUDAStream& stream, const StagingOptions& options,
                    const CopyCrew& crew);

// Up to this many bytes a transfer is sent by the calling thread alone on the
// caller's current stream (caller_staged_copy / direct_copy on `cur`): the copy
// is shorter than the copy-stream hand-over it would need (an event record, a
// stream wait and a recordStream: several µs), and nothing it could overlap
// is worth that. The same bound below which the pipeline stages serially.
constexpr size_t kCurrentStreamBytes = kSerialBytes;

// A small pageable source (<= kCurrentStreamBytes): the calling thread copies
// it into one pinned block from the pool and queues one DMA on `stream`, the
// caller's current stream. No copy threads are woken, no cross-stream event.
// The block goes back to the pool marked as read by `stream`, so it is reused
// only after the DMA.
// Its stores: small_copy_kind of the op's staging mode and cached tail (transfer/stage_copy.h).
// Marks its steps block, staged, queued and returned in `stamps` (a diagnostic, off by default).
void caller_staged_copy(const at::Tensor& src, at::Tensor& out, c10::DeviceIndex device,
                        const c10::cuda::CUDAStream& stream, const StagingOptions& options,
                        StepStamps& stamps);

// What the calling thread's last single-block transfer did (a diagnostic for
// benchmarks/diag_midsize.py; thread-local, so a reader sees its own thread's last call).
// Times are microseconds from the call's start; helper figures are as the caller left.
struct SingleBlockTrace {
  bool on_torch_team = false;  // staged on torch's awake intra-op team (runtime/torch_team.h)
  int64_t nbytes = 0, pieces = 0;
  int64_t helpers_offered = 0;  // helpers the plan asked for (ThreadPool::offer caps them)
  int64_t own_pieces = 0, helper_pieces = 0, stolen = 0;
  int64_t dma_spans = 0;     // spans the chunks were sent in (pipeline.cpp's SpanGate), by
                             // the engine or, for chunks staged cached, the staged-read kernel
  int64_t kernel_reads = 0;  // of their sends, those made by the staged-read kernel
  double setup_us = 0;       // from the crew's muster (helpers woken ahead) to the call's start
  double alloc_us = 0, own_done_us = 0, total_us = 0;
  double offered_us = 0;        // when the helpers' job was posted (or the team was called)
  double first_queued_us = -1;  // when the first DMA span was queued; -1: none
  double last_queued_us = -1;   // when the last one was
  double first_helper_us = -1;  // when the first helper claimed a piece; -1: none had
  int64_t mustered_ns = 0;      // the muster on the steady clock (CLOCK_MONOTONIC: Python's
                                // time.perf_counter_ns), so a reader can time the steps before it
  // Where the setup and the caller's time go (issue 22, diag_chunk_timeline's host steps):
  double entry_us = 0;  // from the muster to pipelined_copy's entry (checks, streams,
                        // the output's allocation); setup_us - entry_us: the plan
  double probed_us = 0, checked_us = 0, streams_us = 0, output_us = 0;  // CopyCrew's steps,
                                                                        // from the muster
  double first_own_done_us = -1;  // when the caller had staged its first piece
  double own_stage_us = 0;        // the caller's time staging its own pieces
  double gate_us = 0;             // ... asking the SpanGate (event queries)
  int64_t gate_queries = 0;       // event queries the gate made
  double queue_us = 0;            // ... queueing spans (cudaMemcpyAsync, the span's event)
  double reader_wait_us = 0;      // ... waiting, at the end, for helpers still reading the
                                  // source (parked mid-piece; their pieces were stolen)
};
SingleBlockTrace last_single_block_trace();

// DIAGNOSTIC (benchmarks/diag_chunk_timeline.py): when on, each single-block transfer of
// the calling thread records a timing event on its stream before its first DMA and one after
// each span's DMA (consecutive staged chunks sent together), with the host time each span
// was queued, so a reader can tell a DMA engine left waiting for staged bytes from one that
// reads staged bytes slowly. Off by default: the events cost a few microseconds per span.
struct ChunkTimelineEntry {
  int64_t begin = 0, end = 0;  // the span's bytes: whole chunks
  double queued_us = 0;        // host: when its last DMA call returned, from the call's start
  double dma_done_us = 0;      // GPU: when its DMA had finished, from the start event
};
void set_chunk_timeline(bool on);
// The calling thread's last recorded transfer (waits for its events; empty if none).
std::vector<ChunkTimelineEntry> last_chunk_timeline();

// Pieces the single-block path's caller staged again because their helper had not
// finished them in time (a diagnostic: process total since start).
uint64_t stolen_pieces();
// TEST-ONLY: each copy helper of the single-block path sleeps `us` microseconds after it
// claims a piece, as a helper the scheduler has parked would (0: off).
void set_helper_stall_us(int64_t us);

// Copies a DMA-readable (pinned) source with one DMA, and tells its owner.
void direct_copy(const at::Tensor& src, at::Tensor& out, const c10::cuda::CUDAStream& stream);

// The steps of one packed copy (pack_to_device: a batch's small leaves), stamped as they
// end, for PackTrace. The op stamps its own; packed_copy stamps the staging's.
struct PackSteps {
  std::chrono::steady_clock::time_point entered;      // the op's entry
  std::chrono::steady_clock::time_point checked;      // device, capture check, sources, streams
  std::chrono::steady_clock::time_point output_made;  // the device output allocated
  std::chrono::steady_clock::time_point block_taken;  // the pinned block from the pool
  std::chrono::steady_clock::time_point staged;       // every tensor copied in (serial packs)
  std::chrono::steady_clock::time_point queued;       // the DMAs queued
  std::chrono::steady_clock::time_point returned;     // the block handed back to the pool
};

// Copies each src to packed[offsets[i]:] with one staging block and one DMA; the
// padding between tensors (up to the next offset, or total) is zero, so the
// packed bytes are a function of the inputs alone. Stamps `steps`' staging steps.
void packed_copy(const std::vector<at::Tensor>& srcs, const std::vector<size_t>& offsets,
                 size_t total, at::Tensor& packed, c10::DeviceIndex device,
                 const c10::cuda::CUDAStream& stream, PackSteps& steps);

// What the calling thread's last packed copy did (a diagnostic for benchmarks/diag_midsize.py
// --batch-parts: where a batch's pack of small leaves spends its time, as the single-block
// trace does for its large leaf). Times are microseconds from the op's entry.
struct PackTrace {
  int64_t nbytes = 0, tensors = 0;
  int64_t entered_ns = 0;  // the op's entry on the steady clock (time.perf_counter_ns)
  double checked_us = 0, output_us = 0, block_us = 0, staged_us = -1, queued_us = 0,
         returned_us = 0;
  double total_us = 0;  // the op's end (views made)
};
void record_pack_trace(const PackSteps& steps, size_t nbytes, size_t tensors);
PackTrace last_pack_trace();

}  // namespace pinxfer::transfer
