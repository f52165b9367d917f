// PlainBatch: a collated batch taken apart into its tensors in C++ and rebuilt around their
// results, for the calls that send a whole batch in one C call (plain_calls.cpp's
// to_device_batch_if_plain, transfer_bindings.cpp's BatchSender.submit_batch_if_plain /
// take_batch). The GIL must be held for take() and rebuilt(), and while one is destroyed (it
// holds Python references).
#pragma once

#include <torch/csrc/autograd/python_variable.h>
#include <torch/extension.h>

#include <vector>

#include "python/bindings.h"

namespace pinxfer::python {

// A batch that to_device_batch_if_plain and BatchSender.submit_batch_if_plain take: exactly a dict,
// list or tuple whose values are plain dense CPU tensors or exactly lists / tuples of them (a
// collated batch with a list field), at least two tensors in all: pinxfer/_plain.py's plain_batch
// with layouts True and one level (the batch walker's batches stay in Python). What the rebuilt
// batch needs is kept here with references of its own, so a batch another thread changes while the
// copies run without the GIL cannot mislead the rebuild. Hidden, as pybind11's own types are
// (its py::object fields would make a visible class an error).
class __attribute__((visibility("hidden"))) PlainBatch {
 public:
  // False (no Python error set) for any other object.
  bool take(PyObject* obj) {
    if (PyDict_CheckExact(obj)) {
      PyObject *key = nullptr, *value = nullptr;
      Py_ssize_t pos = 0;
      while (PyDict_Next(obj, &pos, &key, &value)) {
        if (!take_value(value)) return false;
        keys_.emplace_back(pybind11::reinterpret_borrow<pybind11::object>(key));
      }
    } else if (PyList_CheckExact(obj) || PyTuple_CheckExact(obj)) {
      const Py_ssize_t n = PySequence_Fast_GET_SIZE(obj);
      PyObject** items = PySequence_Fast_ITEMS(obj);
      for (Py_ssize_t i = 0; i < n; ++i) {
        if (!take_value(items[i])) return false;
      }
    } else {
      return false;
    }
    top_ = Py_TYPE(obj);
    return leaves_.size() >= 2;
  }

  const std::vector<at::Tensor>& leaves() const { return leaves_; }

  // The batch again, each tensor replaced by its result, in order (a new reference; nullptr
  // with a Python error set if an allocation fails).
  PyObject* rebuilt(std::vector<at::Tensor>&& results) const {
    TORCH_INTERNAL_ASSERT(results.size() == leaves_.size(), "pinxfer: ", results.size(),
                          " results for ", leaves_.size(), " tensors");
    size_t next = 0;
    auto wrap_next = [&]() { return THPVariable_Wrap(std::move(results[next++])); };
    pybind11::list values(static_cast<Py_ssize_t>(values_.size()));
    for (size_t v = 0; v < values_.size(); ++v) {
      const Value& value = values_[v];
      PyObject* item = nullptr;
      if (value.count < 0) {
        item = wrap_next();
      } else {
        item = value.is_list ? PyList_New(value.count) : PyTuple_New(value.count);
        for (Py_ssize_t i = 0; item != nullptr && i < value.count; ++i) {
          PyObject* leaf = wrap_next();
          if (leaf == nullptr) {
            Py_CLEAR(item);
          } else if (value.is_list) {
            PyList_SET_ITEM(item, i, leaf);
          } else {
            PyTuple_SET_ITEM(item, i, leaf);
          }
        }
      }
      if (item == nullptr) return nullptr;
      PyList_SET_ITEM(values.ptr(), static_cast<Py_ssize_t>(v), item);
    }
    if (top_ == &PyList_Type) return values.release().ptr();
    if (top_ == &PyTuple_Type) return PyList_AsTuple(values.ptr());
    pybind11::dict out;
    for (size_t v = 0; v < keys_.size(); ++v) {
      out[keys_[v]] = values[static_cast<Py_ssize_t>(v)];
    }
    return out.release().ptr();
  }

 private:
  struct Value {
    Py_ssize_t count = -1;  // -1: a tensor; else the length of its list / tuple
    bool is_list = false;
  };

  bool take_leaf(PyObject* obj) {
    const at::Tensor* t = plain_dense_cpu(obj);
    if (t == nullptr) return false;
    leaves_.push_back(*t);
    return true;
  }

  bool take_value(PyObject* value) {
    if (PyList_CheckExact(value) || PyTuple_CheckExact(value)) {
      const Py_ssize_t n = PySequence_Fast_GET_SIZE(value);
      PyObject** items = PySequence_Fast_ITEMS(value);
      for (Py_ssize_t i = 0; i < n; ++i) {
        if (!take_leaf(items[i])) return false;
      }
      values_.push_back({n, PyList_CheckExact(value) != 0});
      return true;
    }
    if (!take_leaf(value)) return false;
    values_.push_back({});
    return true;
  }

  PyTypeObject* top_ = nullptr;
  std::vector<at::Tensor> leaves_;
  std::vector<Value> values_;
  std::vector<pybind11::object> keys_;  // a dict's keys, in order
};

}  // namespace pinxfer::python
