// Host -> device transfer ops: to_device (one tensor), to_device_packed (many
// small tensors, one packed copy); and copy_stream / release_finished_sources,
// which pinxfer._C exposes (csrc/python/transfer_bindings.cpp). Schemas in
// csrc/module.cpp, section "transfers"; Python in pinxfer/transfer.py. These functions only
// check and adapt tensors; streams, staging and the pipeline are the transfer
// layer's (csrc/transfer/, see its headers for the stream and staging rules).
#include <c10/core/TensorImpl.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <chrono>
#include <vector>

#include "ops/kernels.h"
#include "runtime/checked_size.h"
#include "runtime/cuda_runtime.h"
#include "runtime/step_stamps.h"
#include "transfer/chunk_plan.h"
#include "transfer/cuda/copy_streams.h"
#include "transfer/cuda/pipeline.h"
#include "transfer/cuda/source_use.h"

namespace pinxfer::ops {

namespace {

using transfer::copy_stream_for;

// A contiguous tensor of `like`'s dtype and sizes over bytes [offset, offset + nbytes) of
// `packed`'s storage, made directly: narrow + view(dtype) + view(sizes) are three dispatched
// ops, about 2 µs a leaf on the H100 host, the largest part of a small batch's cost over one
// tensor's (benchmarks/diag_batch.py). The result shares the storage (its device memory lives
// while any slice does) but is not an autograd view of `packed`: these are fresh copies that
// need no grad, and `packed` is never handed out. offset is a multiple of kPackAlign, so of
// every item size.
at::Tensor slice_as(const at::Tensor& packed, size_t offset, const at::Tensor& like) {
  const auto itemsize = static_cast<size_t>(like.element_size());
  TORCH_INTERNAL_ASSERT(offset % itemsize == 0, "pinxfer: packed offset ", offset,
                        " not a multiple of the item size ", itemsize);
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(packed.storage()), packed.key_set(),
                                                   like.dtype());
  impl->set_sizes_contiguous(like.sizes());
  impl->set_storage_offset(static_cast<int64_t>(offset / itemsize));
  return at::Tensor(std::move(impl));
}

// Each of a pack's tensors (their byte sizes, in order) at an offset rounded up to kPackAlign,
// into `offsets`; returns the pack's size. pack_to_device and batch_layout place them alike.
size_t pack_offsets(const std::vector<size_t>& sizes, std::vector<size_t>& offsets,
                    const char* op) {
  offsets.clear();
  offsets.reserve(sizes.size());
  size_t total = 0;
  for (const size_t nbytes : sizes) {
    offsets.push_back(total);
    total = checked_round_up(checked_add(total, nbytes, op), kPackAlign, op);
  }
  return total;
}

// A pack's device bytes.
at::TensorOptions pack_options(c10::DeviceIndex index) {
  return at::TensorOptions().device(c10::Device(c10::kCUDA, index)).dtype(at::kByte);
}

void check_cuda_usable(const char* op) {
  TORCH_CHECK(cuda::cuda_usable(), "pinxfer.", op, ": expected a usable CUDA device, but ",
              cuda::cuda_unusable_reason(),
              ". Call it from the main process of a machine with a GPU.");
}

c10::DeviceIndex resolve_device(const c10::Device& device, const char* op) {
  TORCH_CHECK(device.is_cuda(), "pinxfer.", op, ": expected a CUDA device, got ", device,
              ". For a CPU target use tensor.to('cpu').");
  const c10::DeviceIndex index = device.has_index() ? device.index() : c10::cuda::current_device();
  TORCH_CHECK(index >= 0 && index < c10::cuda::device_count(), "pinxfer.", op, ": device index ",
              static_cast<int>(index), " is out of range: this process sees ",
              static_cast<int>(c10::cuda::device_count()), " CUDA device(s)");
  return index;
}

// pinxfer's transfers run host threads and a copy stream of their own, outside
// any capture: a graph would replay none of the staging, and the copy stream's
// events cannot join the capturing stream. So they refuse to be captured.
void check_not_capturing(const char* op, c10::DeviceIndex index) {
  cuda::check_stream_not_capturing(
      c10::cuda::getCurrentCUDAStream(index).unwrap(), index, op,
      "pinxfer's transfers cannot be captured (host threads stage the bytes and a copy stream "
      "of pinxfer's own sends them; a replay would repeat neither). Transfer before the capture "
      "or between replays into the graph's static input, e.g. "
      "`static_x.copy_(pinxfer.to_device(x))` outside the graph, or feed the graph with "
      "pinxfer.prefetch() and copy each batch into the static inputs before replay(). Inside a "
      "capture, copy from a pinned host tensor that lives as long as the graph: "
      "`static_x.copy_(pinned, non_blocking=True)`.");
}

// A CPU tensor whose bytes are the values: conjugate/negative views resolved,
// contiguous. Non-contiguous inputs therefore cost one extra host pass here;
// the result on the device is contiguous.
at::Tensor dense_source(const at::Tensor& t, const char* op) {
  TORCH_CHECK(t.device().is_cpu(), "pinxfer.", op, ": expected CPU tensors, got one on ",
              t.device(), ". Tensors already on a GPU need no staging: use tensor.to(device).");
  TORCH_CHECK(t.layout() == at::kStrided && !t.is_quantized() && !t.is_nested(), "pinxfer.", op,
              ": expected dense (strided, non-quantized, non-nested) tensors, got layout ",
              t.layout(), " dtype ", t.scalar_type(), t.is_nested() ? " (nested)" : "",
              ". Use tensor.to(device) for these.");
  // resolve_conj / resolve_neg are dispatched ops even when they return `t` itself (about
  // 0.5 µs each on the H100 host, per leaf of a batch): called only where a bit is set.
  // contiguous() returns `t` without a dispatch when it already is.
  at::Tensor out = t;
  if (out.is_conj()) out = out.resolve_conj();
  if (out.is_neg()) out = out.resolve_neg();
  return out.contiguous();
}

at::Tensor to_device(const at::Tensor& self, c10::Device device, int64_t chunk_bytes,
                     int64_t num_buffers, c10::string_view staging, int64_t cached_tail) {
  return send_to_device(self, device,
                        staging_options(chunk_bytes, num_buffers, staging, cached_tail));
}

}  // namespace

transfer::StagingOptions staging_options(int64_t chunk_bytes, int64_t num_buffers,
                                         c10::string_view staging, int64_t cached_tail) {
  TORCH_CHECK_VALUE(chunk_bytes >= 4096 && chunk_bytes <= int64_t{1} << 40,
                    "pinxfer.to_device: chunk_bytes must be from 4096 to 2^40, got ", chunk_bytes);
  TORCH_CHECK_VALUE(num_buffers >= 1 && num_buffers <= 1024,
                    "pinxfer.to_device: num_buffers must be from 1 to 1024, got ", num_buffers);
  transfer::StagingOptions options;
  options.chunk_bytes = static_cast<size_t>(chunk_bytes);
  options.num_buffers = static_cast<size_t>(num_buffers);
  options.mode = parse_staging_mode(std::string(staging), "pinxfer.to_device: staging");
  options.cached_tail = cached_tail;
  return options;
}

at::Tensor send_to_device(const at::Tensor& self, c10::Device device,
                          const transfer::StagingOptions& options, LargeCopies large,
                          const at::Tensor* into) {
  StepStamps stamps;  // a diagnostic, off by default (runtime/step_stamps.h)
  check_cuda_usable("to_device");
  stamps.mark("usable");
  const c10::DeviceIndex index = resolve_device(device, "to_device");
  c10::cuda::CUDAGuard guard(index);
  stamps.mark("device");
  const at::Tensor src = dense_source(self, "to_device");
  const size_t nbytes = src.nbytes();
  stamps.mark("source");
  const bool pinned = nbytes > 0 && transfer::is_dma_pinned(src);
  stamps.mark("pinned_check");
  // A pipelined copy's helpers are woken first, so that they rise during the steps below
  // (pipeline.h, CopyCrew).
  const bool pipelined = nbytes > transfer::kCurrentStreamBytes && !pinned;
  transfer::CopyCrew crew =
      pipelined ? transfer::muster_copy_crew(index, nbytes) : transfer::CopyCrew{};
  if (pipelined) stamps.mark("mustered");
  check_not_capturing("to_device", index);
  stamps.mark("capture_check");
  transfer::release_finished_sources(index);
  stamps.mark("sources_released");
  if (pipelined) crew.checked = std::chrono::steady_clock::now();  // the trace's steps

  const c10::cuda::CUDAStream cur = c10::cuda::getCurrentCUDAStream(index);
  const at::TensorOptions on_device = src.options().device(c10::Device(c10::kCUDA, index));
  TORCH_INTERNAL_ASSERT(into == nullptr ||
                            (into->sizes() == src.sizes() && into->dtype() == src.dtype() &&
                             into->device() == on_device.device()),
                        "pinxfer: a transfer's given output does not match its source");
  if (nbytes <= transfer::kCurrentStreamBytes) {
    // Small: on the caller's stream, by the caller (pipeline.h says why).
    stamps.mark("stream");
    at::Tensor out = into != nullptr ? *into : transfer::device_empty(src.sizes(), on_device);
    stamps.mark("output");
    if (nbytes == 0) return out;
    if (pinned) {
      transfer::direct_copy(src, out, cur);
      stamps.mark("queued");
    } else {
      transfer::caller_staged_copy(src, out, index, cur, options, stamps);
    }
    stamps.publish();
    return out;
  }
  const bool on_current = large == LargeCopies::kCurrentStream;
  const c10::cuda::CUDAStream copy = on_current ? cur : copy_stream_for(index);
  if (pipelined) crew.streams_found = std::chrono::steady_clock::now();
  stamps.mark("stream");
  at::Tensor out =
      into != nullptr ? *into : transfer::empty_on_stream(src.sizes(), on_device, copy);
  stamps.mark("output");
  if (pipelined) {
    crew.output_made = std::chrono::steady_clock::now();
    transfer::StagingOptions staging = options;
    if (!on_current) {  // beside the caller's work: a kernel may read (pipeline.h, StagingOptions)
      staging.reader = transfer::staged_reader_setting();
      staging.caller = cur;
    }
    transfer::pipelined_copy(src, out, index, copy, staging, crew);
    stamps.mark("pipelined");
  } else {
    transfer::direct_copy(src, out, copy);
    stamps.mark("queued");
  }
  if (!on_current) {
    transfer::hand_over(out, copy, cur);
    stamps.mark("handed_over");
  }
  stamps.publish();
  return out;
}

namespace {

at::Tensor to_device_packed(at::TensorList tensors, c10::Device device) {
  return pack_to_device(tensors, device, /*want_views=*/false).packed;
}

}  // namespace

std::vector<int64_t> copy_stream_of(c10::Device device) {
  check_cuda_usable("copy_stream");
  const c10::Stream s = copy_stream_for(resolve_device(device, "copy_stream")).unwrap();
  return {s.id(), static_cast<int64_t>(s.device_index()), static_cast<int64_t>(s.device_type())};
}

void release_finished_sources_of(c10::Device device) {
  check_cuda_usable("release_finished_sources");
  transfer::release_finished_sources(resolve_device(device, "release_finished_sources"));
}

PackedOnDevice pack_to_device(at::TensorList tensors, c10::Device device, bool want_views,
                              LargeCopies large, const at::Tensor* into_pack) {
  // With views this is pinxfer.to_device of a batch (the fast call), into a given pack
  // prefetch's sender: errors name that.
  const char* op = into_pack != nullptr ? "prefetch"
                   : want_views         ? "to_device"
                                        : "to_device_packed";
  transfer::PackSteps steps;  // for the diagnostic trace (transfer::last_pack_trace)
  steps.entered = std::chrono::steady_clock::now();
  check_cuda_usable(op);
  const c10::DeviceIndex index = resolve_device(device, op);
  c10::cuda::CUDAGuard guard(index);
  check_not_capturing(op, index);

  std::vector<at::Tensor> srcs;
  std::vector<size_t> sizes;
  srcs.reserve(tensors.size());
  sizes.reserve(tensors.size());
  for (const auto& t : tensors) {
    srcs.push_back(dense_source(t, op));
    sizes.push_back(srcs.back().nbytes());
  }
  std::vector<size_t> offsets;
  const size_t total = pack_offsets(sizes, offsets, op);
  const c10::cuda::CUDAStream cur = c10::cuda::getCurrentCUDAStream(index);
  // Small: on the caller's stream (pipeline.h, kCurrentStreamBytes, says why); larger where
  // `large` says.
  const bool on_current =
      total <= transfer::kCurrentStreamBytes || large == LargeCopies::kCurrentStream;
  const c10::cuda::CUDAStream copy = on_current ? cur : copy_stream_for(index);
  steps.checked = std::chrono::steady_clock::now();
  PackedOnDevice result;
  if (into_pack != nullptr) {
    TORCH_INTERNAL_ASSERT(into_pack->nbytes() == total && into_pack->device().index() == index,
                          "pinxfer: a pack's given output does not match its leaves");
    result.packed = *into_pack;
  } else {
    result.packed =
        transfer::empty_on_stream({static_cast<int64_t>(total)}, pack_options(index), copy);
  }
  steps.output_made = std::chrono::steady_clock::now();
  if (total > 0) {
    transfer::packed_copy(srcs, offsets, total, result.packed, index, copy, steps);
    if (!on_current) transfer::hand_over(result.packed, copy, cur);
  }
  if (want_views) {
    // Aligned byte slices reinterpreted as each dtype (as pinxfer._ops.to_device_many).
    result.views.reserve(srcs.size());
    for (size_t i = 0; i < srcs.size(); ++i) {
      result.views.push_back(slice_as(result.packed, offsets[i], srcs[i]));
    }
  }
  transfer::record_pack_trace(steps, total, srcs.size());
  return result;
}

BatchLayout batch_layout(const std::vector<at::Tensor>& leaves) {
  // The small leaves packed: one copy, one device allocation, instead of one each (but the
  // largest alone where that keeps both sends on the current stream: leaf_sent_apart).
  BatchLayout layout;
  std::vector<size_t> small;
  for (size_t i = 0; i < leaves.size(); ++i) {
    (leaves[i].nbytes() <= transfer::kCurrentStreamBytes ? small : layout.alone).push_back(i);
  }
  std::vector<size_t> sizes;
  sizes.reserve(small.size());
  for (size_t i : small) sizes.push_back(leaves[i].nbytes());
  if (small.size() >= 2) {
    if (const std::ptrdiff_t apart = transfer::leaf_sent_apart(sizes, kPackAlign); apart >= 0) {
      layout.alone.push_back(small[static_cast<size_t>(apart)]);
      small.erase(small.begin() + apart);
      sizes.erase(sizes.begin() + apart);
    }
  }
  if (small.size() == 1) {
    layout.alone.push_back(small[0]);
  } else if (!small.empty()) {
    layout.pack_bytes = pack_offsets(sizes, layout.offsets, "to_device");
    layout.packed = std::move(small);
  }
  return layout;
}

BatchOutputs batch_outputs(const std::vector<at::Tensor>& leaves, c10::DeviceIndex index) {
  BatchOutputs made;
  made.layout = batch_layout(leaves);
  made.outs.resize(leaves.size());
  const c10::Device device(c10::kCUDA, index);
  for (size_t i : made.layout.alone) {
    made.outs[i] = transfer::device_empty(leaves[i].sizes(), leaves[i].options().device(device));
  }
  if (!made.layout.packed.empty()) {
    made.pack =
        transfer::device_empty({static_cast<int64_t>(made.layout.pack_bytes)}, pack_options(index));
    for (size_t k = 0; k < made.layout.packed.size(); ++k) {
      const size_t i = made.layout.packed[k];
      made.outs[i] = slice_as(made.pack, made.layout.offsets[k], leaves[i]);
    }
  }
  return made;
}

std::vector<at::Tensor> send_batch_leaves(const std::vector<at::Tensor>& leaves, c10::Device device,
                                          const transfer::StagingOptions& options,
                                          LargeCopies large, const BatchOutputs* into) {
  BatchLayout own;  // both branches below lvalues: `into`'s layout is not copied
  if (into == nullptr) own = batch_layout(leaves);
  const BatchLayout& layout = into != nullptr ? into->layout : own;
  std::vector<at::Tensor> out(leaves.size());
  for (size_t i : layout.alone) {
    out[i] = send_to_device(leaves[i], device, options, large,
                            into != nullptr ? &into->outs[i] : nullptr);
  }
  if (layout.packed.empty()) return out;
  std::vector<at::Tensor> packed_leaves;
  packed_leaves.reserve(layout.packed.size());
  for (size_t i : layout.packed) packed_leaves.push_back(leaves[i]);
  if (into != nullptr) {
    pack_to_device(packed_leaves, device, /*want_views=*/false, large, &into->pack);
    for (size_t i : layout.packed) out[i] = into->outs[i];
  } else {
    PackedOnDevice packed = pack_to_device(packed_leaves, device, /*want_views=*/true, large);
    for (size_t k = 0; k < layout.packed.size(); ++k) {
      out[layout.packed[k]] = std::move(packed.views[k]);
    }
  }
  return out;
}

// Both transfer ops take CPU tensors, so they dispatch on the CPU key; the
// kernels exist only in CUDA builds (pinxfer/transfer.py says so in CPU-only builds).
TORCH_LIBRARY_IMPL(pinxfer, CPU, m) {
  m.impl("to_device", &to_device);
  m.impl("to_device_packed", &to_device_packed);
}

}  // namespace pinxfer::ops
