// Kernels shared by two callers: the operators (registered with TORCH_LIBRARY_IMPL
// at the bottom of the file that defines each kernel) and the module pinxfer._C
// (csrc/python/): its eager fast calls reach the same code without the
// dispatcher's per-call Python cost (same behaviour, same errors, either way), and
// its functions that take no tensor (copy_stream_of, ...) are not operators at all.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Storage.h>

#if PINXFER_WITH_CUDA
#include "transfer/cuda/pipeline.h"
#endif

namespace pinxfer::ops {

// Offsets inside to_device_packed's buffer are multiples of this: enough for every
// dtype's alignment and for vectorised kernels reading the views. pinxfer._C exports
// it as pack_align (pinxfer/_ops.py's pack_offsets computes the same offsets).
constexpr size_t kPackAlign = 256;

// A CPU tensor over `data` (pool memory of `nbytes` bytes, from the pool of NUMA node
// `node`) with these sizes and strides, built directly as at::detail::empty_generic does (no
// dispatcher call). The storage is resizable as torch's pinned storages are: resize_ takes
// a larger block from the same node's pool and frees the old one through the pool.
at::Tensor tensor_over(c10::DataPtr data, size_t nbytes, int node, at::IntArrayRef sizes,
                       at::IntArrayRef strides, at::ScalarType dtype);

// pinxfer.empty: contiguous, uninitialised, from the pool of `numa_node`
// (None: the current GPU's node). csrc/ops/memory_ops.cpp
at::Tensor pool_empty(at::IntArrayRef size, at::ScalarType dtype, std::optional<int64_t> numa_node);

// pinxfer.pin_memory's copy: always a new pool tensor. csrc/ops/cpu/pin_memory_cpu.cpp
at::Tensor pin_memory_copy(const at::Tensor& self, std::optional<int64_t> numa_node,
                           int64_t num_threads);

// How pin_ locked self's storage, None if it did not. csrc/ops/cpu/pin_inplace_cpu.cpp
std::optional<std::string> inplace_lock_kind(const at::Tensor& self);

// Unpins (as unpin_ would) every pin_ registration whose storage no tensor
// references any more (all dropped, or moved away by set_()); returns how many.
// pin_ and empty_cache() call it. csrc/ops/cpu/pin_inplace_cpu.cpp
size_t release_orphaned_pins();

// How many pin_ registrations this process holds (test only: none may outlive the
// memory it names). csrc/ops/cpu/pin_inplace_cpu.cpp
size_t inplace_registrations();

// pinxfer.is_pinned for a dense CPU tensor: a pool block that was locked, a
// storage pin_ locked, or (ask_torch) memory torch reports pinned. ask_torch is
// false where torch cannot be asked (a forked child of a CUDA process).
bool is_pinned_dense(const at::Tensor& self, bool ask_torch);

// pin_memory for one dense CPU tensor: self if is_pinned_dense, else a copy.
at::Tensor pin_or_self(const at::Tensor& self, std::optional<int64_t> numa_node,
                       int64_t num_threads, bool ask_torch);

// DIAGNOSTIC (pinxfer._C._last_pin_call_trace): where the calling thread's last pin_or_self
// spent its time, in microseconds, recorded only while _trace_team_regions(True) is on
// (benchmarks/diag_pin_copy.py): the pinned check (is_pinned_dense), the input checks and
// layout, the helpers' wake-up and count, the pool allocation, the copy (with the team probe
// and the region where it ran on torch's team), pin_memory_copy's whole (all but the pinned
// check); and whether the copy ran on torch's team. csrc/ops/cpu/pin_memory_cpu.cpp
struct PinCallTrace {
  double pinned_check_us = 0, checks_us = 0, setup_us = 0, alloc_us = 0, copy_us = 0, total_us = 0;
  bool on_team = false;
};
PinCallTrace last_pin_call_trace();

#if PINXFER_WITH_CUDA
// to_device_packed: CPU tensors packed into one pinned staging block and sent with
// one DMA; the device bytes (uint8), tensor i at a 256-byte aligned offset, padding
// zeroed. With want_views, also each tensor as a view of those bytes (what
// pinxfer._ops.to_device_many returns). csrc/ops/cuda/to_device_cuda.cpp
struct PackedOnDevice {
  at::Tensor packed;
  std::vector<at::Tensor> views;
};

// Where a copy larger than transfer::kCurrentStreamBytes runs (smaller ones always run on the
// caller's current stream). kCopyStream: on the device's copy stream, handed over to the
// current stream, so it overlaps the work queued there (to_device). kCurrentStream: on the
// current stream, no hop and no hand-over: prefetch's BatchSender, whose workers each own a
// stream nothing else uses (two workers' DMAs then never queue in one FIFO, each batch's
// copies end as soon as its own bytes are sent; csrc/README.md, "The sender road").
enum class LargeCopies { kCopyStream, kCurrentStream };

// into_pack: the device bytes to copy into (made beforehand, of the pack's size), instead of
// an allocation on the copy's stream.
PackedOnDevice pack_to_device(at::TensorList tensors, c10::Device device, bool want_views,
                              LargeCopies large = LargeCopies::kCopyStream,
                              const at::Tensor* into_pack = nullptr);

// to_device of one CPU tensor: up to transfer::kCurrentStreamBytes on the
// caller's current stream by the caller, larger by the pipeline (or one DMA from
// pinned memory) on the stream `large` says. into: the output to copy into (made beforehand,
// with self's sizes and dtype on the device), instead of an allocation on the copy's stream.
// csrc/ops/cuda/to_device_cuda.cpp
at::Tensor send_to_device(const at::Tensor& self, c10::Device device,
                          const transfer::StagingOptions& options,
                          LargeCopies large = LargeCopies::kCopyStream,
                          const at::Tensor* into = nullptr);

// How pinxfer.to_device sends a batch's leaves (each a plain dense CPU tensor): those of at
// most transfer::kCurrentStreamBytes packed into one copy when there are two or more (the
// largest alone where the pack fits kCurrentStreamBytes without it:
// transfer::leaf_sent_apart), every other one alone. Eager only: to_device's fast path and
// prefetch's BatchSender; traced code gets the same rule from pinxfer/transfer.py's
// _send_leaves over the operators.
struct BatchLayout {
  std::vector<size_t> alone;    // leaves sent one by one, in sending order
  std::vector<size_t> packed;   // leaves packed into one copy: none, or two or more
  std::vector<size_t> offsets;  // packed[k]'s offset in the pack (kPackAlign-aligned)
  size_t pack_bytes = 0;
};
BatchLayout batch_layout(const std::vector<at::Tensor>& leaves);

// A batch's device outputs made before its copies, on the calling thread's current stream of
// device `index`, which owns them from then on: prefetch's sender makes them when a batch is
// submitted, on the consumer's stream (PINXFER_SENDER_OUTPUTS=consumer; batch_sender.h,
// "Outputs"). outs[i] is leaf i's; a packed leaf's is a slice of `pack`.
struct BatchOutputs {
  BatchLayout layout;
  at::Tensor pack;
  std::vector<at::Tensor> outs;
};
BatchOutputs batch_outputs(const std::vector<at::Tensor>& leaves, c10::DeviceIndex index);

// The leaves of a batch to `device`, as batch_layout says (pack_to_device for the packed ones,
// send_to_device for the others); into: outputs batch_outputs made for these leaves, to copy
// into, instead of allocations on the copies' streams. Returns each leaf's output.
// csrc/ops/cuda/to_device_cuda.cpp
std::vector<at::Tensor> send_batch_leaves(const std::vector<at::Tensor>& leaves, c10::Device device,
                                          const transfer::StagingOptions& options,
                                          LargeCopies large = LargeCopies::kCopyStream,
                                          const BatchOutputs* into = nullptr);
// The op's staging arguments, checked (ranges, the staging mode's name).
transfer::StagingOptions staging_options(int64_t chunk_bytes, int64_t num_buffers,
                                         c10::string_view staging, int64_t cached_tail);

// The stream pinxfer's H2D copies to `device` run on, packed as torch.Stream packs
// itself: (stream_id, device_index, device_type). csrc/ops/cuda/to_device_cuda.cpp
std::vector<int64_t> copy_stream_of(c10::Device device);
// Drops the references pinxfer keeps to pinned sources whose copies to `device`
// have finished (transfer/cuda/source_use.h). csrc/ops/cuda/to_device_cuda.cpp
void release_finished_sources_of(c10::Device device);
#endif

}  // namespace pinxfer::ops
