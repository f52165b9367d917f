// The hottest fast calls as bare CPython functions (METH_FASTCALL): pin_memory of one
// tensor, to_device of one tensor or of a collated batch, empty. pinxfer's Python calls them for
// every small pin, transfer and allocation of a training loop, where a call costs a few
// microseconds and torch's own (x.pin_memory(), x.to(), torch.empty) reach C++ through a parser of
// a few hundred nanoseconds. Through pybind11 (fast_calls.cpp) the same kernels cost more: its
// overload dispatch and argument casters, and before the call the Python checks that a fast call
// may be taken (plain_dense_cpu and eager() in pinxfer/_ops.py: about 0.7 µs on the H100 host, more
// than the rest of pinxfer's Python).
//
// So these take the checks into C++ and answer None where the dispatcher matters (the
// tensor is not a plain dense CPU tensor that needs no grad, a __torch_function__ or
// __torch_dispatch__ mode is active, or, for to_device, the profiler runs and the Python
// side brackets the call with its range): the Python caller then takes the operator. The
// one check left in Python is torch.compiler.is_compiling(): under torch.compile dynamo
// must see a constant there and never reach these functions.
//
// Errors and warnings reach Python as through torch's own functions (HANDLE_TH_ERRORS:
// c10::ValueError -> ValueError, OutOfMemoryError -> torch.OutOfMemoryError, TORCH_WARN
// -> warnings.warn), and the GIL is released while a kernel runs.
#include <ATen/PythonTorchFunctionTLS.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/Device.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/profiler/orchestration/observer.h>
#include <torch/extension.h>

#include <atomic>
#include <optional>
#include <vector>

#include "ops/kernels.h"
#include "python/bindings.h"
#include "python/plain_batch.h"
#include "runtime/fork.h"

namespace pinxfer::python {

const at::Tensor* plain_dense_cpu(PyObject* obj) {
  if (Py_TYPE(obj) != reinterpret_cast<PyTypeObject*>(THPVariableClass)) return nullptr;
  const at::Tensor& t = THPVariable_Unpack(obj);
  // has_storage: a functorch wrapper (under vmap/grad) reads as a plain CPU tensor but has
  // no memory of its own; the operator's path handles it (found by review, session 44).
  if (!t.is_cpu() || t.requires_grad() || t.layout() != at::kStrided || t.is_nested() ||
      t.is_quantized() || !t.has_storage()) {
    return nullptr;
  }
  return &t;
}

namespace {

// No __torch_dispatch__ or __torch_function__ mode is active on this thread: what
// torch._C._len_torch_dispatch_stack() and torch._C._is_torch_function_mode_enabled()
// answer in pinxfer/_ops.py's eager().
bool no_mode_active() {
  return c10::impl::TorchDispatchModeTLS::stack_len() == 0 &&
         !at::impl::torch_function_mode_enabled();
}

}  // namespace

bool send_may_skip_dispatch() {
  return no_mode_active() && !torch::profiler::impl::profilerEnabled();
}

// The arguments' parsers (bindings.h). The public functions check their arguments first, so a
// caller of pinxfer's API never meets their errors.
bool check_arity(const char* fn, Py_ssize_t nargs, Py_ssize_t expected) {
  if (nargs == expected) return true;
  PyErr_Format(PyExc_TypeError, "pinxfer._C.%s: expected %zd arguments, got %zd", fn, expected,
               nargs);
  return false;
}

bool parse_int(const char* fn, const char* name, PyObject* obj, int64_t& out) {
  if (!PyLong_Check(obj) || PyBool_Check(obj)) {
    PyErr_Format(PyExc_TypeError, "pinxfer._C.%s: %s must be an int, got %s", fn, name,
                 Py_TYPE(obj)->tp_name);
    return false;
  }
  const long long v = PyLong_AsLongLong(obj);
  if (v == -1 && PyErr_Occurred()) return false;
  out = v;
  return true;
}

namespace {

bool parse_node(const char* fn, PyObject* obj, std::optional<int64_t>& out) {
  if (obj == Py_None) return true;
  int64_t v = 0;
  if (!parse_int(fn, "numa_node", obj, v)) return false;
  out = v;
  return true;
}

// The hot calls' gate (pin_memory_hot, empty_hot): pinxfer/_ops.py's ensure_torch_cuda has
// run in this process (it initialises torch's CUDA state where CUDA is usable, as torch's own
// pinning does, and then marks it here), and this is not a forked child (where Python asks
// torch whether CUDA may be queried: _ops.in_bad_fork). Until both hold the hot calls answer
// None and pinxfer's Python takes the call.
std::atomic<bool> g_torch_cuda_ready{false};

bool hot_calls_open() {
  return g_torch_cuda_ready.load(std::memory_order_relaxed) && fork_generation() == 0;
}

PyObject* mark_torch_cuda_ready(PyObject* /*module*/, PyObject* /*unused*/) {
  g_torch_cuda_ready.store(true, std::memory_order_relaxed);
  Py_RETURN_NONE;
}

// pin_or_self's result for a plain tensor, without the GIL while it copies. An already pinned
// tensor comes back as itself: THPVariable_Wrap returns the Python object it already has.
PyObject* pinned_or_self(const at::Tensor& t, std::optional<int64_t> node, int64_t threads,
                         bool ask_torch) {
  at::Tensor out;
  {
    pybind11::gil_scoped_release no_gil;
    out = ops::pin_or_self(t, node, threads, ask_torch);
  }
  return THPVariable_Wrap(std::move(out));
}

// pin_memory_if_plain(tensor, numa_node, num_threads, ask_torch): pin_or_self's result, or
// None where the operator must run (see the top of this file).
PyObject* pin_memory_if_plain(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  constexpr const char* fn = "pin_memory_if_plain";
  if (!check_arity(fn, nargs, 4)) return nullptr;
  const at::Tensor* t = plain_dense_cpu(args[0]);
  if (t == nullptr || !no_mode_active()) Py_RETURN_NONE;
  std::optional<int64_t> node;
  int64_t threads = 0;
  if (!parse_node(fn, args[1], node) || !parse_int(fn, "num_threads", args[2], threads)) {
    return nullptr;
  }
  return pinned_or_self(*t, node, threads, /*ask_torch=*/args[3] == Py_True);
  END_HANDLE_TH_ERRORS
}

// pin_memory_hot(obj): pinxfer.pin_memory(obj) with every argument at its default, or None
// where pinxfer's Python must take it (hot_calls_open, and pin_memory_if_plain's None). The
// call a training loop makes, from the shortest Python path: pinxfer/pin.py's general
// path cost that call about 0.1-0.2 µs more than this path does (the project's 2-core
// machine), as much as pinxfer.pin_memory of 64 KiB trailed x.pin_memory() by (issue 22's
// small-call row, 4.39 against 4.26 µs on the H200, session 34). The one check left in
// Python is is_compiling() (the top of this file says why).
PyObject* pin_memory_hot(PyObject* /*module*/, PyObject* obj) {
  HANDLE_TH_ERRORS
  const at::Tensor* t = plain_dense_cpu(obj);
  if (t == nullptr || !hot_calls_open() || !no_mode_active()) Py_RETURN_NONE;
  return pinned_or_self(*t, std::nullopt, 0, /*ask_torch=*/true);
  END_HANDLE_TH_ERRORS
}

// `sizes` as pinxfer.empty(*size) takes them (ints, or one list, tuple or torch.Size of
// ints), into `out`, if every size is an exact int from 0 to 2^63 - 1; false for anything
// else (pinxfer/memory.py's checks then say what is wrong), with no Python error set.
// Not inlined: inlined into plain_empty, GCC 12-13 warn that SmallVector's growth reads
// the inline buffer uninitialised (-Wmaybe-uninitialized, a false positive; -Werror builds).
[[gnu::noinline]] bool plain_sizes(PyObject* sizes, c10::SmallVector<int64_t, 6>& out) {
  if (!PyTuple_Check(sizes) && !PyList_Check(sizes)) return false;
  if (PySequence_Fast_GET_SIZE(sizes) == 1) {
    PyObject* only = PySequence_Fast_ITEMS(sizes)[0];
    if (PyTuple_Check(only) || PyList_Check(only)) sizes = only;  // torch.Size is a tuple
  }
  const Py_ssize_t dims = PySequence_Fast_GET_SIZE(sizes);
  PyObject** items = PySequence_Fast_ITEMS(sizes);
  out.resize(static_cast<size_t>(dims));
  for (Py_ssize_t i = 0; i < dims; ++i) {
    if (!PyLong_CheckExact(items[i])) return false;  // bool and int subclasses: checked path
    int overflow = 0;
    const long long v = PyLong_AsLongLongAndOverflow(items[i], &overflow);
    if (overflow != 0 || v < 0) return false;
    out[static_cast<size_t>(i)] = v;
  }
  return true;
}

// pool_empty's tensor for Python's (sizes, dtype) and node, or None where pinxfer.empty's
// Python checks must speak (a size that is not an exact non-negative int, a dtype that is
// neither a torch.dtype nor None). The caller has checked that no mode is active.
PyObject* plain_empty(PyObject* sizes, PyObject* dtype_obj, std::optional<int64_t> node) {
  c10::SmallVector<int64_t, 6> size;
  if (!plain_sizes(sizes, size)) Py_RETURN_NONE;
  at::ScalarType dtype;
  if (dtype_obj == Py_None) {
    dtype = at::typeMetaToScalarType(at::get_default_dtype());
  } else if (THPDtype_Check(dtype_obj)) {
    dtype = reinterpret_cast<THPDtype*>(dtype_obj)->scalar_type;
  } else {
    Py_RETURN_NONE;
  }
  at::Tensor out;
  {
    pybind11::gil_scoped_release no_gil;
    out = ops::pool_empty(size, dtype, node);
  }
  return THPVariable_Wrap(std::move(out));
}

// empty_if_eager(sizes, dtype, numa_node): pool_empty's tensor, or None where the
// operator must run (a mode is active) and where plain_empty declines.
PyObject* empty_if_eager(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  constexpr const char* fn = "empty_if_eager";
  if (!check_arity(fn, nargs, 3)) return nullptr;
  if (!no_mode_active()) Py_RETURN_NONE;
  std::optional<int64_t> node;
  if (!parse_node(fn, args[2], node)) return nullptr;
  return plain_empty(args[0], args[1], node);
  END_HANDLE_TH_ERRORS
}

// empty_hot(sizes, dtype): pinxfer.empty(*sizes, dtype=dtype) with numa_node at its default,
// or None where pinxfer's Python must take it (hot_calls_open, a mode active, plain_empty's
// None). As pin_memory_hot is for pin_memory: the shortest Python path, which leaves only
// is_compiling() to Python (the general path's torch-CUDA-ready test, its attribute lookups
// and a third argument cost about 0.1 us of a call torch makes in about 2).
PyObject* empty_hot(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (!check_arity("empty_hot", nargs, 2)) return nullptr;
  if (!hot_calls_open() || !no_mode_active()) Py_RETURN_NONE;
  return plain_empty(args[0], args[1], std::nullopt);
  END_HANDLE_TH_ERRORS
}

#if PINXFER_WITH_CUDA
// The send calls' arguments after the first: (device, chunk_bytes, num_buffers), as the device
// and "auto" staging options.
struct SendArguments {
  c10::Device device;
  transfer::StagingOptions options;
};

// args[1..3] of to_device_if_plain and to_device_batch_if_plain; nullopt with a TypeError set
// (naming fn and the argument) where one is not what it must be.
std::optional<SendArguments> parse_send_arguments(const char* fn, PyObject* const* args) {
  if (!THPDevice_Check(args[1])) {
    PyErr_Format(PyExc_TypeError, "pinxfer._C.%s: device must be a torch.device, got %s", fn,
                 Py_TYPE(args[1])->tp_name);
    return std::nullopt;
  }
  int64_t chunk_bytes = 0, num_buffers = 0;
  if (!parse_int(fn, "chunk_bytes", args[2], chunk_bytes) ||
      !parse_int(fn, "num_buffers", args[3], num_buffers)) {
    return std::nullopt;
  }
  return SendArguments{reinterpret_cast<THPDevice*>(args[1])->device,
                       ops::staging_options(chunk_bytes, num_buffers, "auto", -1)};
}

// to_device_if_plain(tensor, device, chunk_bytes, num_buffers): send_to_device's result
// with "auto" staging, or None where the operator must run, or while torch's profiler
// runs (pinxfer/transfer.py then brackets the call with its range).
PyObject* to_device_if_plain(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  constexpr const char* fn = "to_device_if_plain";
  if (!check_arity(fn, nargs, 4)) return nullptr;
  const at::Tensor* t = plain_dense_cpu(args[0]);
  if (t == nullptr || !send_may_skip_dispatch()) Py_RETURN_NONE;
  std::optional<SendArguments> send = parse_send_arguments(fn, args);
  if (!send) return nullptr;
  at::Tensor out;
  {
    pybind11::gil_scoped_release no_gil;
    out = ops::send_to_device(*t, send->device, send->options);
  }
  return THPVariable_Wrap(std::move(out));
  END_HANDLE_TH_ERRORS
}
#endif

// TEST-ONLY _rebuilt_plain_batch(batch): the batch rebuilt around clones of its tensors, or
// None where to_device_batch_if_plain declines it: PlainBatch's walk and rebuild on the CPU
// (tests/test_fast_calls.py holds them to plain_batch and rebuilt_batch, which stay the
// definition).
PyObject* rebuilt_plain_batch(PyObject* /*module*/, PyObject* obj) {
  HANDLE_TH_ERRORS
  PlainBatch batch;
  if (!batch.take(obj)) Py_RETURN_NONE;
  std::vector<at::Tensor> clones;
  for (const at::Tensor& t : batch.leaves()) clones.push_back(t.clone());
  return batch.rebuilt(std::move(clones));
  END_HANDLE_TH_ERRORS
}

#if PINXFER_WITH_CUDA
// to_device_batch_if_plain(batch, device, chunk_bytes, num_buffers): the batch rebuilt around
// send_batch_leaves' results with "auto" staging, or None where pinxfer's Python must take it
// (not a PlainBatch, a mode active, the profiler running). pinxfer.to_device of a collated
// batch in one C call: plain_batch, the binding's conversions and rebuilt_batch cost that
// call about 3.5 µs of Python on the project's 2-core machine, and Python's steps run several
// times slower after an idle gap (csrc/README.md, "Host steps").
PyObject* to_device_batch_if_plain(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  constexpr const char* fn = "to_device_batch_if_plain";
  if (!check_arity(fn, nargs, 4)) return nullptr;
  if (!send_may_skip_dispatch()) Py_RETURN_NONE;
  std::optional<SendArguments> send = parse_send_arguments(fn, args);
  if (!send) return nullptr;
  PlainBatch batch;
  if (!batch.take(args[0])) Py_RETURN_NONE;
  std::vector<at::Tensor> results;
  {
    pybind11::gil_scoped_release no_gil;
    results = ops::send_batch_leaves(batch.leaves(), send->device, send->options);
  }
  return batch.rebuilt(std::move(results));
  END_HANDLE_TH_ERRORS
}
#endif

// METH_FASTCALL: the arguments arrive as a C array, with no tuple built and no parser.
PyMethodDef g_plain_calls[] = {
    {"pin_memory_if_plain",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void*>(&pin_memory_if_plain)), METH_FASTCALL,
     "pin_memory_if_plain(tensor, numa_node, num_threads, ask_torch): the tensor itself if "
     "pinned, else a pinned copy; None if the tensor is not a plain dense CPU tensor or a "
     "mode is active (then take the operator)"},
    {"pin_memory_hot", &pin_memory_hot, METH_O,
     "pin_memory_hot(obj): pinxfer.pin_memory(obj) with default arguments; None where "
     "pinxfer's Python must take it (before mark_torch_cuda_ready, in a forked child, not a "
     "plain dense CPU tensor, a mode active)"},
    {"_rebuilt_plain_batch", &rebuilt_plain_batch, METH_O,
     "TEST-ONLY _rebuilt_plain_batch(batch): the batch rebuilt around clones of its tensors, "
     "or None where to_device_batch_if_plain declines it"},
    {"mark_torch_cuda_ready", &mark_torch_cuda_ready, METH_NOARGS,
     "mark_torch_cuda_ready(): pinxfer._ops.ensure_torch_cuda has run (opens pin_memory_hot and "
     "empty_hot)"},
    {"empty_if_eager", reinterpret_cast<PyCFunction>(reinterpret_cast<void*>(&empty_if_eager)),
     METH_FASTCALL,
     "empty_if_eager(sizes, dtype, numa_node): a contiguous pool tensor; None if a mode is "
     "active (then take the operator) or a size or the dtype is not plain (then check them)"},
    {"empty_hot", reinterpret_cast<PyCFunction>(reinterpret_cast<void*>(&empty_hot)), METH_FASTCALL,
     "empty_hot(sizes, dtype): pinxfer.empty(*sizes, dtype=dtype); None where pinxfer's Python "
     "must take it (before mark_torch_cuda_ready, in a forked child, a mode active, a size or "
     "the dtype not plain)"},
#if PINXFER_WITH_CUDA
    {"to_device_if_plain",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void*>(&to_device_if_plain)), METH_FASTCALL,
     "to_device_if_plain(tensor, device, chunk_bytes, num_buffers): the tensor on the CUDA "
     "device (\"auto\" staging); None if the tensor is not a plain dense CPU tensor, a mode "
     "is active or torch's profiler runs (then take the operator)"},
    {"to_device_batch_if_plain",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void*>(&to_device_batch_if_plain)),
     METH_FASTCALL,
     "to_device_batch_if_plain(batch, device, chunk_bytes, num_buffers): a dict, list or tuple "
     "of plain dense CPU tensors (or of exact lists / tuples of them, two tensors at least) "
     "rebuilt around its tensors on the CUDA device, as to_device sends a batch; None for any "
     "other batch, or while a mode is active or torch's profiler runs"},
#endif
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

void bind_plain_calls(pybind11::module_& m) {
  if (PyModule_AddFunctions(m.ptr(), g_plain_calls) != 0) throw pybind11::error_already_set();
}

}  // namespace pinxfer::python
