// The Python module pinxfer._C: importing it loads this library, whose static
// initialisers run the TORCH_LIBRARY registrations (csrc/module.cpp and the
// TORCH_LIBRARY_IMPL blocks in csrc/ops/). Its functions that take no tensor
// (stats, settings, topology, test hooks) are bound by csrc/python/*_bindings.cpp.
//
// It also carries the eager fast calls, reaching the same kernels as the operators
// (csrc/ops/kernels.h) without the dispatcher: a torch.ops call costs about 3 µs of
// Python-side dispatch, several times the work of pinning a 64 KiB tensor. Here, through
// pybind11: pin_memory of a batch's leaves, is_pinned, to_device with any staging
// settings, and to_device_many (CUDA builds), whose outputs are views of one buffer,
// which operators may not return. The three hottest (pin_memory and to_device of one
// tensor, empty) are bare CPython functions that make their own checks
// (csrc/python/plain_calls.cpp). pinxfer/_ops.py decides when these may be used (plain
// CPU tensors, no autograd, no torch.compile tracing, no __torch_function__ /
// __torch_dispatch__ mode): everything else goes through torch.ops, so fake tensors,
// tracing and opcheck see the operators.
//
// Errors and warnings reach Python as they would through torch.ops
// (wrap_pybind_function_no_gil: torch's translation of c10 errors), and the GIL
// is released for the duration of each call.
#include <torch/extension.h>

#include <algorithm>
#include <optional>
#include <vector>

#include "ops/kernels.h"
#include "python/bindings.h"
#include "python/call_breakdown.h"
#include "transfer/chunk_plan.h"

// What this library was built against, from setup.py's defines (a build that did not
// define them is not one setup.py made: it says "unknown" rather than fail).
#ifndef PINXFER_TORCH_VERSION_STR
#define PINXFER_TORCH_VERSION_STR "unknown"
#endif
#ifndef PINXFER_TORCH_CUDA_VERSION_STR
#define PINXFER_TORCH_CUDA_VERSION_STR "unknown"
#endif

// The build stamp, as plain bytes in the library's read-only data. pinxfer/_build_check.py
// finds it by reading the .so file, so a _C built against another torch is refused before
// it is loaded: loading alone runs this library's static initialisers (the TORCH_LIBRARY
// registrations) against whatever torch is in the process, and install() would override
// at::HostAllocator, whose virtuals change between torch releases. "used" and external
// linkage keep the linker from dropping it. Format (one line, parsed by _build_check.py):
//   PINXFER_BUILD_STAMP{torch=<torch.__version__>;cuda=<torch.version.cuda or none>}
extern "C" __attribute__((used, visibility("default"))) const char pinxfer_build_stamp[] =
    "PINXFER_BUILD_STAMP{torch=" PINXFER_TORCH_VERSION_STR ";cuda=" PINXFER_TORCH_CUDA_VERSION_STR
    "}";

namespace pinxfer::ops {
namespace {

std::vector<at::Tensor> pin_many(const std::vector<at::Tensor>& tensors,
                                 std::optional<int64_t> numa_node, int64_t num_threads,
                                 bool ask_torch) {
  std::vector<at::Tensor> out;
  out.reserve(tensors.size());
  for (const at::Tensor& t : tensors)
    out.push_back(pin_or_self(t, numa_node, num_threads, ask_torch));
  return out;
}

#if PINXFER_WITH_CUDA
at::Tensor to_device_fast(const at::Tensor& tensor, c10::Device device, int64_t chunk_bytes,
                          int64_t num_buffers, const std::string& staging) {
  return send_to_device(tensor, device, staging_options(chunk_bytes, num_buffers, staging, -1));
}

std::vector<at::Tensor> send_batch_leaves_fast(const std::vector<at::Tensor>& leaves,
                                               c10::Device device, int64_t chunk_bytes,
                                               int64_t num_buffers, const std::string& staging) {
  return send_batch_leaves(leaves, device, staging_options(chunk_bytes, num_buffers, staging, -1));
}

std::vector<at::Tensor> to_device_many_fast(const std::vector<at::Tensor>& tensors,
                                            c10::Device device) {
  return pack_to_device(tensors, device, /*want_views=*/true).views;
}
#endif

// pinxfer/_ops.py's plain_dense_cpu over a batch's leaves at once: the largest leaf's bytes
// if every object is exactly a torch.Tensor (no subclass, no Parameter) on the CPU that
// needs no grad, strided, not nested and not quantized; -1 if one is not. The Python
// predicate stays the definition (traced code runs it); this is its eager accelerator for
// batches (H100: the Python checks cost a 64-leaf batch about 30 us, diag_many_small), and
// tests/test_fast_calls.py checks that both agree. Holds the GIL: it reads Python objects.
int64_t plain_leaves_max_bytes(const pybind11::list& leaves) {
  int64_t largest = 0;
  for (const pybind11::handle leaf : leaves) {
    const at::Tensor* t = python::plain_dense_cpu(leaf.ptr());
    if (t == nullptr) return -1;
    largest = std::max(largest, static_cast<int64_t>(t->nbytes()));
  }
  return largest;
}

}  // namespace
}  // namespace pinxfer::ops

PYBIND11_MODULE(_C, m) {
  m.doc() = "pinxfer's native module: eager fast calls into the operators' kernels, and the "
            "functions that take no tensor; see pinxfer/_ops.py";
  // The torch (torch.__version__) and its CUDA (torch.version.cuda, "none" for a CPU build)
  // this library was compiled against; pinxfer/__init__.py compares them with the running
  // torch (first from the file's build stamp above, before loading; then these, after).
  m.attr("built_with_torch") = PINXFER_TORCH_VERSION_STR;
  m.attr("built_with_torch_cuda") = PINXFER_TORCH_CUDA_VERSION_STR;
  m.attr("build_stamp") = pinxfer_build_stamp;
  m.attr("pack_align") = pinxfer::ops::kPackAlign;
  // A batch's leaves of at most this many bytes are packed into one copy
  // (ops::send_batch_leaves; pinxfer/transfer.py's SMALL_TENSOR_BYTES).
  m.attr("small_leaf_bytes") = pinxfer::transfer::kSerialBytes;
  m.def("pin_memory_many", torch::wrap_pybind_function_no_gil(&pinxfer::ops::pin_many),
        "pin_memory over a list of dense CPU tensors, one call for a batch");
  m.def("is_pinned", torch::wrap_pybind_function_no_gil(&pinxfer::ops::is_pinned_dense),
        "is_pinned(tensor, ask_torch) for a dense CPU tensor");
  m.def("plain_leaves_max_bytes", &pinxfer::ops::plain_leaves_max_bytes,
        "plain_leaves_max_bytes(leaves: list) -> int: the largest leaf's bytes if every leaf "
        "is a plain dense CPU tensor (pinxfer._ops.plain_dense_cpu), else -1");
#if PINXFER_WITH_CUDA
  m.def("to_device", torch::wrap_pybind_function_no_gil(&pinxfer::ops::to_device_fast),
        "to_device(tensor, device, chunk_bytes, num_buffers, staging): the op's kernel, "
        "without the dispatcher (a 4 KiB transfer costs a few µs; dispatch is 3 of them)");
  // Not an operator either: the small leaves' results are views of one buffer.
  m.def("send_batch_leaves",
        torch::wrap_pybind_function_no_gil(&pinxfer::ops::send_batch_leaves_fast),
        "send_batch_leaves(leaves, device, chunk_bytes, num_buffers, staging): a batch's "
        "leaves (plain dense CPU tensors, checked by the caller) as to_device sends a batch");
  // Not an operator: its outputs are views of one buffer, which torch >= 2.12 forbids
  // for operators (torch.ops.pinxfer.to_device_packed returns the buffer instead).
  m.def("to_device_many", torch::wrap_pybind_function_no_gil(&pinxfer::ops::to_device_many_fast),
        "to_device_many(tensors, device): CPU tensors packed into one copy; views of the "
        "device buffer");
#endif
  // The functions that take no tensor (csrc/python/bindings.h).
  pinxfer::python::bind_memory(m);
  pinxfer::python::bind_settings(m);
  pinxfer::python::bind_topology(m);
  pinxfer::python::bind_transfer(m);
  pinxfer::python::bind_plain_calls(m);
  m.def("_call_breakdown", &pinxfer::diag::call_breakdown,
        "_call_breakdown(iterations): ns per piece of a small call (diagnostics, not an API)");
}
