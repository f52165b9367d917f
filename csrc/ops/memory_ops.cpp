// Kernels for the pool's operators (schemas in csrc/module.cpp). The pool's
// functions that take no tensor (stats, cap, install, ...) are pinxfer._C's:
// csrc/python/memory_bindings.cpp.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "memory/graph_pools.h"
#include "memory/host_allocator.h"
#include "memory/pinned_pool.h"
#include "memory/placement.h"
#include "memory/pool_registry.h"
#include "ops/kernels.h"
#include "runtime/checked_size.h"
#include "runtime/cuda_runtime.h"
#include "runtime/node_registry.h"
#include "runtime/numa.h"

namespace pinxfer::ops {

namespace {

// The allocator of a pool tensor's storage: what torch's resize_ asks for a larger block
// (resize_bytes_cpu: a block from the storage's allocator, the old bytes copied, the old block
// freed through its deleter, so the pool's free keeps it from reuse while a recorded copy may
// read it). Blocks come from the pool of the node the tensor's memory came from, looked up at
// each allocation (a forked child has pools of its own), so that a pinxfer tensor resizes as
// torch's pinned tensors do (their allocator is torch's host allocator).
class NodePoolAllocator final : public c10::Allocator {
 public:
  explicit NodePoolAllocator(int node) : node_(node) {}

  c10::DataPtr allocate(size_t n) override {
    graph_pools::check_capture_allocation("resize_ of a pinxfer tensor");
    return pool_for_node(node_).allocate(n);
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

 private:
  const int node_;
};

// One allocator a node (storages keep a raw pointer to it). Not forgotten in a forked child:
// an allocator holds no lock and asks for the child's pool at each allocation.
NodeRegistry<NodePoolAllocator> g_storage_allocators;

c10::Allocator* storage_allocator_for_node(int node) {
  return &g_storage_allocators.get(node, [](int n) { return new NodePoolAllocator(n); });
}

}  // namespace

at::Tensor tensor_over(c10::DataPtr data, size_t nbytes, int node, at::IntArrayRef sizes,
                       at::IntArrayRef strides, at::ScalarType dtype) {
  c10::Storage storage(c10::Storage::use_byte_size_t(), nbytes, std::move(data),
                       storage_allocator_for_node(node), /*resizable=*/true);
  at::Tensor out =
      at::detail::make_tensor<c10::TensorImpl>(std::move(storage),
                                               c10::DispatchKeySet(c10::DispatchKey::CPU),
                                               c10::scalarTypeToTypeMeta(dtype));
  out.unsafeGetTensorImpl()->set_sizes_and_strides(sizes, strides);
  return out;
}

// The DataPtr carries the pool's deleter, so the tensor owns its block outright.
at::Tensor pool_empty(at::IntArrayRef size, at::ScalarType dtype,
                      std::optional<int64_t> numa_node) {
  graph_pools::check_capture_allocation("pinxfer.empty");
  // A quantized tensor needs a quantizer, which a plain storage cannot carry:
  // torch.empty refuses these dtypes too.
  TORCH_CHECK_VALUE(!c10::isQIntType(dtype), "pinxfer.empty: quantized dtype ", dtype,
                    " is not supported (a quantized tensor needs a quantizer). Allocate the "
                    "underlying integer dtype and quantize on the device, or use "
                    "torch._empty_affine_quantized and pinxfer.pin_memory on it.");
  const size_t nbytes = checked_tensor_bytes(size, c10::elementSize(dtype), "pinxfer.empty");
  const int node = resolve_numa_node(numa_node, "pinxfer.empty");
  return tensor_over(pool_for_node(node).allocate(nbytes), nbytes, node, size,
                     c10::contiguous_strides(size), dtype);
}

namespace {

void* pool_ctx(const at::Tensor& t) { return t.storage().data_ptr().get_context(); }

void record_stream(const at::Tensor& self, int64_t stream_id, int64_t device_index,
                   int64_t device_type) {
  TORCH_CHECK(self.is_cpu(),
              "pinxfer.record_stream: expected a CPU tensor from pinxfer's pool, "
              "got a tensor on ",
              self.device());
  const auto stream = c10::Stream::unpack3(stream_id, static_cast<c10::DeviceIndex>(device_index),
                                           static_cast<c10::DeviceType>(device_type));
  TORCH_CHECK(stream.device_type() == c10::DeviceType::CUDA,
              "pinxfer.record_stream: expected a CUDA stream, got one of device type ",
              stream.device_type());
  void* ctx = pool_ctx(self);
  PinnedPool* pool = PinnedPool::owner_of(ctx);
  TORCH_CHECK(pool != nullptr,
              "pinxfer.record_stream: the tensor's memory does not come from pinxfer's pool "
              "(allocate it with pinxfer.empty / pinxfer.pin_memory). For torch's own pinned "
              "tensors, torch records copies itself.");
  pool->record_stream(ctx, stream);
}

bool is_pool_tensor(const at::Tensor& self) {
  return self.is_cpu() && self.storage() && PinnedPool::owner_of(pool_ctx(self)) != nullptr;
}

std::string lock_kind(const at::Tensor& self) {
  void* ctx = self.is_cpu() && self.storage() ? pool_ctx(self) : nullptr;
  PinnedPool* pool = ctx ? PinnedPool::owner_of(ctx) : nullptr;
  TORCH_CHECK(pool != nullptr, "pinxfer.lock_kind: the tensor does not come from pinxfer's pool");
  return lock_kind_name(pool->lock_kind_of(ctx));
}

std::vector<int64_t> page_nodes_op(const at::Tensor& self) {
  TORCH_CHECK(self.is_cpu(), "pinxfer.page_nodes: expected a CPU tensor, got ", self.device());
  const auto nodes = page_nodes(self.data_ptr(), self.nbytes());
  return std::vector<int64_t>(nodes.begin(), nodes.end());
}

}  // namespace

TORCH_LIBRARY_IMPL(pinxfer, CPU, m) {
  m.impl("record_stream", &record_stream);
  m.impl("is_pool_tensor", &is_pool_tensor);
  m.impl("lock_kind", &lock_kind);
  m.impl("page_nodes", &page_nodes_op);
}

// Questions about the storage: a conj or neg view must reach the kernel as it
// is, not as the resolved copy torch's Conjugate / Negative fallbacks make
// (which is never a pool block).
TORCH_LIBRARY_IMPL(pinxfer, Conjugate, m) {
  m.impl("record_stream", torch::CppFunction::makeFallthrough());
  m.impl("is_pool_tensor", torch::CppFunction::makeFallthrough());
  m.impl("lock_kind", torch::CppFunction::makeFallthrough());
  m.impl("page_nodes", torch::CppFunction::makeFallthrough());
}
TORCH_LIBRARY_IMPL(pinxfer, Negative, m) {
  m.impl("record_stream", torch::CppFunction::makeFallthrough());
  m.impl("is_pool_tensor", torch::CppFunction::makeFallthrough());
  m.impl("lock_kind", torch::CppFunction::makeFallthrough());
  m.impl("page_nodes", torch::CppFunction::makeFallthrough());
}

// empty takes no tensor argument, so it dispatches to its composite kernel.
TORCH_LIBRARY_IMPL(pinxfer, CompositeExplicitAutograd, m) { m.impl("empty", &pool_empty); }

}  // namespace pinxfer::ops
