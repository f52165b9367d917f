// The functions of pinxfer._C that take no tensor: utilities, queries and test
// hooks. They are not operators (torch.ops.pinxfer holds the tensor ops only,
// csrc/module.cpp): nothing traces, fakes or autogrades them, and a pybind11
// call costs less than the dispatcher. Each file binds one area; the module
// itself (csrc/python/fast_calls.cpp) calls every bind_* once. Errors reach
// Python as torch's would (wrap_pybind_function: c10::ValueError -> ValueError,
// c10::Error -> RuntimeError, ...), with the GIL released during the call.
#pragma once

#include <torch/extension.h>

namespace pinxfer::python {

// The pinned pool: memory_stats, reset_*, empty_cache, the cap, install/uninstall,
// build_info, and the test hooks _set_debug_pause_us, _hold_use_records,
// _use_records_waiting, _inject_host_register_failures, _inject_host_unregister_failures.
void bind_memory(pybind11::module_& m);
// The settings object and the thread-budget derivations (csrc/runtime/settings.h,
// thread_budget.h, cpu_resources.h), cuda_unusable_reason.
void bind_settings(pybind11::module_& m);
// sysfs readers, the text parsers, device -> NUMA node (csrc/runtime/topology.h,
// parse.h, memory/placement.h).
void bind_topology(pybind11::module_& m);
// _chunk_plan (test-only view of csrc/transfer/chunk_plan.h); copy_stream and
// release_finished_sources in CUDA builds.
void bind_transfer(pybind11::module_& m);
// The hottest fast calls as METH_FASTCALL functions (plain_calls.cpp): pin_memory_if_plain,
// empty_if_eager and, in CUDA builds, to_device_if_plain. They take tensors, unlike the rest
// of this header's: the eager fast calls of csrc/python/fast_calls.cpp, without pybind11.
void bind_plain_calls(pybind11::module_& m);

// pinxfer/_ops.py's plain_dense_cpu in C++: `obj`'s tensor if obj is exactly a
// torch.Tensor (no subclass, no Parameter) on the CPU that needs no grad, strided, not
// nested and not quantized; else nullptr. The GIL must be held (it reads a Python object);
// the tensor lives as long as obj.
const at::Tensor* plain_dense_cpu(PyObject* obj);

// A send to the device may skip the dispatcher and pinxfer's Python: no __torch_dispatch__
// or __torch_function__ mode is active on this thread (what pinxfer/_ops.py's eager() asks
// torch) and torch's profiler does not run (pinxfer/transfer.py then brackets the send with
// its range). The one check of to_device_if_plain, to_device_batch_if_plain and
// BatchSender.submit_batch_if_plain.
bool send_may_skip_dispatch();

// The METH_FASTCALL functions' argument parsers (plain_calls.cpp, and BatchSender's two fast
// methods in transfer_bindings.cpp): each raises a TypeError that names the function and the
// argument, and returns false after it. The GIL must be held.
bool check_arity(const char* fn, Py_ssize_t nargs, Py_ssize_t expected);
bool parse_int(const char* fn, const char* name, PyObject* obj, int64_t& out);

}  // namespace pinxfer::python
