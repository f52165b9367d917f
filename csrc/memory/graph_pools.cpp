#include "memory/graph_pools.h"

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <shared_mutex>
#include <string>

#include <c10/util/Exception.h>

#include "runtime/cuda_runtime.h"
#include "runtime/fork.h"

namespace pinxfer::graph_pools {

namespace {

struct GraphPool {
  int use_count = 0;
  std::vector<int> devices;  // capture devices, synchronized before reuse
};

struct Capture {
  PoolId id;
  StreamFilter filter;
  bool served_elsewhere;  // begin_capture_served_elsewhere: the pool is not pinxfer's
};

// The registry's state, made while the extension loads, leaked on purpose (no destruction at
// exit), and made anew in a forked child (registry_child_after_fork), where a parent thread
// may have held a lock or been changing a container at the fork. Not function-local statics:
// the child handler must not meet an initialisation guard a parent thread held.
std::shared_mutex* g_registry_mutex = new std::shared_mutex();  // guards the three below
std::mutex* g_capture_begins_mutex = new std::mutex();          // hold_off_capture_begins()
std::map<PoolId, GraphPool>* g_pools = new std::map<PoolId, GraphPool>();
std::vector<Capture>* g_captures = new std::vector<Capture>();
std::vector<PoolId>* g_released = new std::vector<PoolId>();  // use count reached 0
// captures().empty(), readable without the lock (the allocation fast path).
std::atomic<bool> g_no_capture{true};

std::shared_mutex& registry_mutex() { return *g_registry_mutex; }
std::mutex& capture_begins_mutex() { return *g_capture_begins_mutex; }
std::map<PoolId, GraphPool>& pools() { return *g_pools; }  // LOCK: registry_mutex()
std::vector<Capture>& captures() { return *g_captures; }   // LOCK: registry_mutex()
std::vector<PoolId>& released() { return *g_released; }    // LOCK: registry_mutex()

// A forked child has no CUDA, so no capture and no graph pool: it starts empty, with locks
// of its own (the parent's are leaked).
void registry_child_after_fork() {
  g_registry_mutex = new std::shared_mutex();
  g_capture_begins_mutex = new std::mutex();
  g_pools = new std::map<PoolId, GraphPool>();
  g_captures = new std::vector<Capture>();
  g_released = new std::vector<PoolId>();
  g_no_capture.store(true, std::memory_order_relaxed);
}

struct ForkHandlerInstaller {
  ForkHandlerInstaller() {
    register_fork_child_handler(ForkChildStep::kGraphPools, &registry_child_after_fork);
  }
} g_fork_handler_installer;

std::string id_text(PoolId id) {
  return "(" + std::to_string(id.first) + ", " + std::to_string(id.second) + ")";
}

}  // namespace

size_t live_pools() {
  std::shared_lock<std::shared_mutex> lock(registry_mutex());
  size_t n = 0;
  for (const auto& [id, pool] : pools()) n += pool.use_count > 0 ? 1 : 0;
  return n;
}

namespace {
void check_not_routed_locked(PoolId id) {
  for (const Capture& c : captures()) {
    TORCH_CHECK(c.id != id, "pinxfer: begin_allocate_to_pool: already allocating to graph pool ",
                id_text(id),
                "; end_allocate_to_pool must come first (torch's CUDAGraph pairs them)");
  }
}
}  // namespace

void begin_allocate_to_pool(PoolId id, StreamFilter filter, int device) {
  TORCH_CHECK(id != kShared && id != kServedElsewhere,
              "pinxfer: begin_allocate_to_pool got the "
              "pool id ",
              id_text(id), ", which names no graph pool");
  const std::lock_guard<std::mutex> no_unmap_or_return_under_way(capture_begins_mutex());
  std::unique_lock<std::shared_mutex> lock(registry_mutex());
  check_not_routed_locked(id);
  GraphPool& pool = pools()[id];
  // A released pool used again before its memory was given back: it lives on.
  if (pool.use_count == 0) {
    auto& r = released();
    r.erase(std::remove(r.begin(), r.end(), id), r.end());
  }
  ++pool.use_count;
  if (device >= 0 &&
      std::find(pool.devices.begin(), pool.devices.end(), device) == pool.devices.end()) {
    pool.devices.push_back(device);
  }
  captures().push_back({id, std::move(filter), false});
  g_no_capture.store(false, std::memory_order_relaxed);
}

void begin_capture_served_elsewhere(PoolId id, StreamFilter filter) {
  // The lock an unmap holds (hold_off_captures_to_unmap): this capture must not begin while
  // pinned memory is being unregistered either.
  const std::lock_guard<std::mutex> no_unmap_under_way(capture_begins_mutex());
  std::unique_lock<std::shared_mutex> lock(registry_mutex());
  check_not_routed_locked(id);
  captures().push_back({id, std::move(filter), true});
  g_no_capture.store(false, std::memory_order_relaxed);
}

bool end_allocate_to_pool(PoolId id) {
  std::unique_lock<std::shared_mutex> lock(registry_mutex());
  auto& list = captures();
  for (auto it = list.begin(); it != list.end(); ++it) {
    if (it->id == id) {
      const bool ours = !it->served_elsewhere;
      list.erase(it);
      g_no_capture.store(list.empty(), std::memory_order_relaxed);
      return ours;
    }
  }
  return false;
}

bool release_pool(PoolId id) {
  std::unique_lock<std::shared_mutex> lock(registry_mutex());
  auto it = pools().find(id);
  // Not in use: released already, and its id since served elsewhere (a capture after a
  // later install(), whose graph's release this is). The other allocator counts it.
  if (it == pools().end() || it->second.use_count == 0) return false;
  if (--it->second.use_count == 0) released().push_back(id);
  return true;
}

bool while_registered(PoolId id, const std::function<void()>& fn) {
  std::shared_lock<std::shared_mutex> lock(registry_mutex());
  if (pools().find(id) == pools().end()) return false;
  fn();
  return true;
}

PoolId pool_for_current_stream() {
  if (g_no_capture.load(std::memory_order_relaxed)) return kShared;
  c10::Stream current(c10::Stream::DEFAULT, c10::Device(c10::DeviceType::CPU));
  if (!cuda::current_stream_if_active(&current)) return kShared;
  // The filters ask CUDA about the stream (torch's: cudaStreamGetCaptureInfo);
  // they run under the shared lock only, never under a pool lock.
  std::shared_lock<std::shared_mutex> lock(registry_mutex());
  for (const Capture& c : captures()) {
    if (c.filter(current)) return c.served_elsewhere ? kServedElsewhere : c.id;
  }
  return kShared;
}

bool any_capture_open() { return !g_no_capture.load(std::memory_order_relaxed); }

std::unique_lock<std::mutex> hold_off_capture_begins() {
  return std::unique_lock<std::mutex>(capture_begins_mutex());
}

std::unique_lock<std::mutex> hold_off_captures_to_unmap() {
  auto held = hold_off_capture_begins();
  if (any_capture_open()) held.unlock();  // one begun earlier is still open
  return held;
}

bool take_released(bool sync_all, std::vector<PoolId>* ids) {
  std::unique_lock<std::shared_mutex> lock(registry_mutex());
  if (!captures().empty()) return false;
  std::vector<int> devices;
  for (const PoolId& id : released()) {
    auto it = pools().find(id);
    if (it == pools().end()) continue;
    for (int d : it->second.devices) {
      if (std::find(devices.begin(), devices.end(), d) == devices.end()) devices.push_back(d);
    }
  }
  // A replay launched before the release (or a captured copy's replay) may
  // still read the memory: no event of ours covers it, a synchronize does.
  if (sync_all) {
    cuda::synchronize_active_devices();
  } else {
    for (int d : devices) cuda::device_synchronize(d);
  }
  for (const PoolId& id : released()) {
    if (pools().erase(id) != 0) ids->push_back(id);
  }
  released().clear();
  return true;
}

void raise_capture_served_elsewhere(const char* op) {
  TORCH_CHECK(false, op,
              ": called while the current CUDA stream is capturing a graph into a pool made "
              "before pinxfer.install() (a `pool=` handle, or torch.compile's cudagraph pool, "
              "that graphs captured before install() may share). torch's own host allocator "
              "serves that capture, so that its count of the pool's graphs stays whole, and "
              "pinxfer cannot allocate into it. Make the pool handle after install() (for "
              "torch.compile: call torch._dynamo.reset() after install()), or allocate the "
              "pinned buffer before the capture and keep it alive while the graph lives.");
}

void check_capture_allocation(const char* op) {
  if (!cuda::current_stream_is_capturing()) return;
  const PoolId pool = pool_for_current_stream();
  if (pool == kServedElsewhere) raise_capture_served_elsewhere(op);
  TORCH_CHECK(pool != kShared, op,
              ": called while the current CUDA stream is capturing a graph, but the pinned memory "
              "would not belong to the graph (pinxfer is not installed as torch's host allocator, "
              "or the capture was not begun by torch.cuda.graph). It could then be reused while a "
              "replay still reads it. Call pinxfer.install() before capturing, or allocate the "
              "pinned buffer before the capture and keep it alive while the graph lives.");
}

}  // namespace pinxfer::graph_pools
