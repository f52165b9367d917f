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
// build_info, and the test hooks _set_debug_pause_us, _inject_host_register_failures.
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

}  // namespace pinxfer::python
