// pinxfer._C's pool functions (csrc/python/bindings.h); Python: pinxfer/_ops.py.
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "memory/host_allocator.h"
#include "memory/pinned_pool.h"
#include "memory/placement.h"
#include "memory/pool_registry.h"
#include "ops/kernels.h"
#include "python/bindings.h"
#include "runtime/cuda_runtime.h"

namespace pinxfer::python {

namespace {

// Counters of one pool, or the sum of all (None): names, values.
std::tuple<std::vector<std::string>, std::vector<int64_t>> memory_stats(
    std::optional<int64_t> numa_node) {
  std::vector<std::string> names;
  std::vector<int64_t> values;
  std::vector<PinnedPool*> pools;
  if (numa_node.has_value()) {
    pools.push_back(&pool_for_node(resolve_numa_node(numa_node, "pinxfer.memory_stats")));
  } else {
    pools = all_pools();
  }
  // An empty process still reports every key, with zeros.
  if (pools.empty()) pools.push_back(&pool_for_node(-1));
  // Peaks of different pools happened at different times; their sum is an
  // upper bound of the process peak, documented in memory_stats().
  PoolStats sum;
  for (PinnedPool* pool : pools) sum += pool->stats();
  for (const auto& [name, value] : sum.items()) {
    names.emplace_back(name);
    values.push_back(value);
  }
  return {names, values};
}

void reset_peak_memory_stats() {
  for (PinnedPool* p : all_pools()) p->reset_peak_stats();
}

void reset_accumulated_memory_stats() {
  for (PinnedPool* p : all_pools()) p->reset_accumulated_stats();
}

int64_t empty_cache() {
  ops::release_orphaned_pins();
  release_graph_memory();  // released CUDA graph pools first (memory/pool_registry.h)
  int64_t bytes = 0;
  for (PinnedPool* p : all_pools()) bytes += static_cast<int64_t>(p->release_cached());
  empty_previous_allocator_cache();  // graphs served by torch's allocator (not counted here)
  return bytes;
}

// torch_cuda_initialized: torch.cuda.is_initialized(), from the caller. A capture needs torch's
// CUDA state, and asking CUDA before torch did would start the driver in a process that may
// fork CUDA-using children next (install() made no CUDA call before; review, session 45).
void install(bool torch_cuda_initialized) {
  // A capture open on torch's allocator would go on allocating after the swap, from
  // pinxfer's shared pool, whose blocks are reused while the graph's replays read them.
  // pinxfer sees the calling thread's capture here; one open on another thread it cannot
  // see without asking CUDA on every allocation (~140 ns; README "Limitations").
  TORCH_CHECK(!torch_cuda_initialized || !cuda::current_stream_is_capturing(),
              "pinxfer.install(): the current stream is capturing a CUDA graph, which torch's "
              "host allocator serves; its later pinned allocations would come from pinxfer's "
              "pool, which does not keep them for the graph. Call install() before the "
              "capture begins or after it ends.");
  TORCH_CHECK(install_host_allocator(true),
              "pinxfer.install(): this pinxfer was built without CUDA, so there is no CUDA host "
              "allocator to replace. Rebuild against a CUDA build of torch with a CUDA toolkit.");
}

std::tuple<bool, std::string, bool> build_info() {
  return {cuda::built_with_cuda(), cuda::built_cuda_version(), cuda::cuda_usable()};
}

}  // namespace

void bind_memory(pybind11::module_& m) {
  using torch::wrap_pybind_function_no_gil;
  m.def("memory_stats", wrap_pybind_function_no_gil(&memory_stats),
        "memory_stats(numa_node=None) -> (names, values): one pool's counters, or all pools' sum");
  m.def("reset_peak_memory_stats", wrap_pybind_function_no_gil(&reset_peak_memory_stats),
        "sets every .peak counter to its .current value, in every pool");
  m.def("reset_accumulated_memory_stats",
        wrap_pybind_function_no_gil(&reset_accumulated_memory_stats),
        "zeroes the num_* counters and the timers, in every pool");
  m.def("empty_cache", wrap_pybind_function_no_gil(&empty_cache),
        "unmaps every fully free cached segment; returns the bytes released");
  m.def("set_max_pinned_bytes",
        wrap_pybind_function_no_gil([](int64_t bytes) { set_max_pinned_bytes(bytes); }),
        "hard cap on the bytes reserved by all pools (0: no cap)");
  m.def("get_max_pinned_bytes", wrap_pybind_function_no_gil([] { return max_pinned_bytes(); }),
        "the cap in bytes (0: no cap)");
  m.def("install", wrap_pybind_function_no_gil(&install), pybind11::arg("torch_cuda_initialized"),
        "install(torch_cuda_initialized): makes the pool torch's CUDA host allocator; raises "
        "in a build without CUDA, or while the current stream captures a graph (asked only "
        "where torch initialised CUDA)");
  m.def("uninstall", wrap_pybind_function_no_gil([] { install_host_allocator(false); }),
        "gives torch its own CUDA host allocator back");
  m.def("is_installed", wrap_pybind_function_no_gil([] { return host_allocator_installed(); }),
        "True while the pool is torch's CUDA host allocator");
  m.def("build_info", wrap_pybind_function_no_gil(&build_info),
        "(built with CUDA, toolkit version, CUDA usable now)");
  m.def("_set_debug_pause_us",
        wrap_pybind_function_no_gil([](int64_t us) { set_debug_pause_us(us); }),
        "TEST-ONLY: allocate/free sleep this many microseconds between their critical sections");
  m.def("_hold_use_records", wrap_pybind_function_no_gil([](bool hold) { hold_use_records(hold); }),
        "TEST-ONLY: while True, a freed block's event record (and a fence batch's) waits after "
        "the stream's capture check, until False (at most 10 s)");
  m.def("_use_records_waiting", wrap_pybind_function_no_gil([] { return use_records_waiting(); }),
        "TEST-ONLY: event records waiting now (_hold_use_records)");
  // TEST-ONLY fault injection, not an API: the next n cudaHostRegister calls of the pool's
  // segment mapping fail (as cudaErrorMemoryAllocation), so tests can check the documented
  // fallback (mlock, one warning).
  m.def("_inject_host_register_failures", wrap_pybind_function_no_gil([](int64_t n) {
          return cuda::inject_host_register_failures(n);
        }),
        "TEST-ONLY: the next n segment registrations fail; returns those pending before");
  m.def("_inplace_registrations",
        wrap_pybind_function_no_gil([] { return ops::inplace_registrations(); }),
        "TEST-ONLY: how many pin_ registrations this process holds");
  m.def("_register_rival_host_allocator", wrap_pybind_function_no_gil([](int64_t priority) {
          return register_rival_host_allocator_for_tests(static_cast<int>(priority));
        }),
        "TEST-ONLY: registers at `priority` a host allocator passing every call on to torch's "
        "current one (another library's); for good. Returns whether torch took it");
  // The next n cudaHostUnregister calls (a segment's unmapping, unpin_) fail, the memory
  // staying registered, so tests can check that such a segment is left mapped (host_region.cpp).
  m.def("_inject_host_unregister_failures", wrap_pybind_function_no_gil([](int64_t n) {
          return cuda::inject_host_unregister_failures(n);
        }),
        "TEST-ONLY: the next n cudaHostUnregister calls fail; returns those pending before");
}

}  // namespace pinxfer::python
