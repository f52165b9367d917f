#include "runtime/cuda_runtime.h"

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <mutex>
#include <new>
#include <string>
#include <thread>
#include <vector>

#include <sys/prctl.h>
#include <unistd.h>

#include <c10/util/Exception.h>

#include "runtime/fork.h"
#include "runtime/settings.h"

#if PINXFER_WITH_CUDA
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

namespace pinxfer::cuda {

bool built_with_cuda() { return PINXFER_WITH_CUDA != 0; }

std::string built_cuda_version() {
#if PINXFER_WITH_CUDA && defined(PINXFER_CUDA_VERSION_STR)
  return PINXFER_CUDA_VERSION_STR;
#else
  return "";
#endif
}

namespace {
std::atomic<int64_t> g_injected_register_failures{0};
std::atomic<int64_t> g_injected_unregister_failures{0};

// Consumes one injected failure of `pending`, if any is left.
[[maybe_unused]] bool take_injected_failure(std::atomic<int64_t>& pending) {
  int64_t n = pending.load();
  while (n > 0) {
    if (pending.compare_exchange_weak(n, n - 1)) return true;
  }
  return false;
}

int64_t set_injected_failures(std::atomic<int64_t>& pending, int64_t n, const char* hook) {
  TORCH_CHECK(n >= 0, "pinxfer.", hook, ": n must be >= 0, got ", n);
  return pending.exchange(n);
}
}  // namespace

int64_t inject_host_register_failures(int64_t n) {
  return set_injected_failures(g_injected_register_failures, n, "_inject_host_register_failures");
}

int64_t inject_host_unregister_failures(int64_t n) {
  return set_injected_failures(g_injected_unregister_failures, n,
                               "_inject_host_unregister_failures");
}

#if PINXFER_WITH_CUDA

namespace {
// Relaxes the calling thread's stream-capture mode for one CUDA call that touches
// no stream (registering pages, querying a stream known not to capture), and puts
// the thread's own mode back: in torch's default capture mode (global) a capture
// in any thread forbids such "unsafe" calls. Both exchanges are checked; an error
// is cleared from CUDA's last-error slot and returned to the caller, which decides
// what it means. The destructor restores the mode if restore() was not called.
class RelaxedCaptureMode {
 public:
  RelaxedCaptureMode() { entered_ = exchange(); }
  RelaxedCaptureMode(const RelaxedCaptureMode&) = delete;
  RelaxedCaptureMode& operator=(const RelaxedCaptureMode&) = delete;
  ~RelaxedCaptureMode() {
    if (entered_ == cudaSuccess && !restored_) (void)restore();
  }

  // cudaSuccess when the thread runs relaxed; else the error (nothing to restore).
  cudaError_t entered() const { return entered_; }

  // Puts the thread's mode back, once; returns the exchange's error.
  cudaError_t restore() {
    if (entered_ != cudaSuccess || restored_) return cudaSuccess;
    restored_ = true;
    return exchange();
  }

 private:
  cudaError_t exchange() {
    const cudaError_t err = cudaThreadExchangeStreamCaptureMode(&mode_);
    if (err != cudaSuccess) (void)cudaGetLastError();
    return err;
  }

  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
  cudaError_t entered_ = cudaSuccess;
  bool restored_ = false;
};

std::mutex g_probe_mutex;
uint64_t g_probed_generation = ~uint64_t{0};  // LOCK: g_probe_mutex
bool g_usable = false;                        // LOCK: g_probe_mutex
std::string g_probe_error;                    // why the driver said no. LOCK: g_probe_mutex

std::mutex g_events_mutex;
// Free events per device; leaked at exit on purpose (the driver may already be
// gone when static destructors run). LOCK: g_events_mutex
std::vector<std::vector<cudaEvent_t>>* g_free_events = new std::vector<std::vector<cudaEvent_t>>();
uint64_t g_events_generation = 0;  // LOCK: g_events_mutex
// The probe's answer for the parent process (generation 0): -1 not probed yet,
// 0 no, 1 yes. Written once under g_probe_mutex, read without it. A forked
// child never reads it (cuda_usable() answers false there first).
std::atomic<int> g_usable_answer{-1};

std::string error_text(cudaError_t err) {
  return std::string(cudaGetErrorName(err)) + ": " + cudaGetErrorString(err);
}

// Why cudaGetDeviceCount failed, in words that send the user the right way. The runtime
// answers cudaErrorInsufficientDriver both when the driver is too old and when there is no
// driver at all (no libcuda.so.1), which would send someone without a GPU to upgrade a
// driver they do not have. cudaDriverGetVersion tells them apart: it gives 0 when no driver
// is installed; /proc/driver/nvidia/version exists only while the kernel module is loaded.
std::string driver_error_reason(cudaError_t err) {
  int driver_version = 0;
  (void)cudaDriverGetVersion(&driver_version);
  (void)cudaGetLastError();
  const bool kernel_module = access("/proc/driver/nvidia/version", F_OK) == 0;
  if (err == cudaErrorInsufficientDriver || err == cudaErrorNoDevice) {
    if (driver_version == 0 && !kernel_module) {
      return "no NVIDIA driver or GPU on this machine (no loadable libcuda.so.1, no "
             "/proc/driver/nvidia/version; the CUDA runtime reports " +
             error_text(err) + ")";
    }
    if (err == cudaErrorNoDevice) {
      return "the NVIDIA driver is installed but sees no GPU (the CUDA runtime reports " +
             error_text(err) + ")";
    }
    int runtime_version = 0;
    (void)cudaRuntimeGetVersion(&runtime_version);
    (void)cudaGetLastError();
    auto dotted = [](int v) {
      return std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10);
    };
    if (driver_version == 0) {
      return "the NVIDIA kernel module is loaded but libcuda.so.1 cannot be loaded (driver "
             "user-space library missing or mismatched; the CUDA runtime reports " +
             error_text(err) + "): reinstall the NVIDIA driver";
    }
    return "the NVIDIA driver is too old for this build: it supports CUDA up to " +
           dotted(driver_version) + ", pinxfer and torch use the CUDA " + dotted(runtime_version) +
           " runtime (" + error_text(err) +
           "): upgrade the driver, or use a torch and pinxfer "
           "built for an older CUDA";
  }
  return "the CUDA driver reports " + error_text(err);
}

// A thread of the parent may have held one of these locks at fork(); in the
// child that thread does not exist, so the locks are rebuilt (the state they
// guard is generation-checked: the child never uses the parent's events).
void cuda_runtime_child_after_fork() {
  new (&g_probe_mutex) std::mutex();
  new (&g_events_mutex) std::mutex();
}

struct CudaRuntimeForkHandlerInstaller {
  CudaRuntimeForkHandlerInstaller() {
    register_fork_child_handler(ForkChildStep::kCudaRuntime, &cuda_runtime_child_after_fork);
  }
} g_cuda_runtime_fork_handler;
}  // namespace

bool cuda_usable() {
  const uint64_t gen = fork_generation();
  if (gen != 0) return false;  // forked child: never touch the parent's CUDA state
  // Every allocation asks: once probed, answer without the lock.
  const int answered = g_usable_answer.load(std::memory_order_acquire);
  if (answered >= 0) return answered == 1;
  // Before the lock: a malformed setting throws, and must not leave a
  // half-made answer behind.
  const bool disabled = settings().disable_cuda;
  std::lock_guard<std::mutex> lock(g_probe_mutex);
  if (g_probed_generation == gen) return g_usable;
  g_probed_generation = gen;
  g_usable = false;
  if (disabled) {
    g_usable_answer.store(0, std::memory_order_release);
    return false;
  }
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky-free error so torch does not see it
    g_probe_error = driver_error_reason(err);
    g_usable_answer.store(0, std::memory_order_release);
    return false;
  }
  if (count == 0) g_probe_error = "the CUDA driver sees no device (CUDA_VISIBLE_DEVICES?)";
  g_usable = count > 0;
  g_usable_answer.store(g_usable ? 1 : 0, std::memory_order_release);
  return g_usable;
}

static std::string probe_error() {
  std::lock_guard<std::mutex> lock(g_probe_mutex);
  return g_probe_error;
}

std::string host_register(void* ptr, size_t size) {
  if (take_injected_failure(g_injected_register_failures)) {
    return error_text(cudaErrorMemoryAllocation) +
           " [injected by pinxfer._inject_host_register_failures, a test-only fault]";
  }
  // A graph pool maps its segments while the calling thread captures (torch's
  // default capture mode, global, forbids "unsafe" calls such as this one in
  // the capturing thread and every other). Registering host pages touches no
  // stream, so the thread's mode is relaxed around it, as torch's caching
  // allocator does around cudaMalloc.
  RelaxedCaptureMode relaxed;
  if (relaxed.entered() != cudaSuccess) {
    return "cudaThreadExchangeStreamCaptureMode failed: " + error_text(relaxed.entered());
  }
  // Mapped: a kernel may read the pool's staging blocks (transfer/cuda/staged_read.h); under
  // unified addressing that is the default, said here so that it holds everywhere.
  const cudaError_t err =
      cudaHostRegister(ptr, size, cudaHostRegisterPortable | cudaHostRegisterMapped);
  if (err != cudaSuccess) (void)cudaGetLastError();
  const cudaError_t restore = relaxed.restore();
  if (restore != cudaSuccess) {
    if (err == cudaSuccess) (void)cudaHostUnregister(ptr);  // the caller sees a failure
    return "cudaThreadExchangeStreamCaptureMode (restoring the thread's mode) failed: " +
           error_text(restore);
  }
  if (err == cudaSuccess) return "";
  return error_text(err);
}

std::string host_register_user(void* ptr, size_t size, bool* already_registered) {
  *already_registered = false;
  if (!cuda_usable()) return "CUDA is not usable in this process";
  const cudaError_t err = cudaHostRegister(ptr, size, cudaHostRegisterPortable);
  if (err == cudaSuccess) return "";
  (void)cudaGetLastError();
  *already_registered = err == cudaErrorHostMemoryAlreadyRegistered;
  return error_text(err);
}

std::string host_unregister(void* ptr) {
  if (take_injected_failure(g_injected_unregister_failures)) {
    return error_text(cudaErrorStreamCaptureUnsupported) +
           " [injected by pinxfer._inject_host_unregister_failures, a test-only fault]";
  }
  const cudaError_t err = cudaHostUnregister(ptr);
  if (err == cudaSuccess) return "";
  (void)cudaGetLastError();
  return error_text(err);
}

bool is_cuda_pinned(const void* ptr) {
  if (!cuda_usable()) return false;
  cudaPointerAttributes attr{};
  const cudaError_t err = cudaPointerGetAttributes(&attr, ptr);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return attr.type == cudaMemoryTypeHost;
}

namespace {
// The free list of `device`'s events, made on first use; null if memory ran out (callers
// are deleters: nothing may escape them; found by review, session 44). LOCK: g_events_mutex
std::vector<cudaEvent_t>* free_events_locked(int device) noexcept {
  try {
    if (g_events_generation != fork_generation()) {
      g_free_events = new std::vector<std::vector<cudaEvent_t>>();
      g_events_generation = fork_generation();
    }
    if (static_cast<int>(g_free_events->size()) <= device) g_free_events->resize(device + 1);
    return &(*g_free_events)[device];
  } catch (...) {
    return nullptr;
  }
}
}  // namespace

bool try_record_event(const c10::Stream& stream, Event* out, std::string* error) {
  const int device = stream.device_index();
  cudaEvent_t ev = nullptr;
  {
    std::lock_guard<std::mutex> lock(g_events_mutex);
    std::vector<cudaEvent_t>* list = free_events_locked(device);
    if (list != nullptr && !list->empty()) {
      ev = list->back();
      list->pop_back();
    }
  }
  // Callers are deleters (PinnedPool::free): nothing may escape. CUDAGuard
  // throws when the device cannot be set (no GPU, a stream of a device this
  // process cannot use); report that like a CUDA error.
  try {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    if (ev == nullptr) {
      const cudaError_t err = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
      if (err != cudaSuccess) {
        (void)cudaGetLastError();
        *error = "cudaEventCreateWithFlags failed: " + error_text(err);
        return false;
      }
    }
    const c10::cuda::CUDAStream cuda_stream(c10::cuda::CUDAStream::UNCHECKED, stream);
    const cudaError_t err = cudaEventRecord(ev, cuda_stream.stream());
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      *error = "cudaEventRecord failed: " + error_text(err);
      // Best effort: the record's failure is the error reported; a failed destroy adds
      // nothing the caller can act on, and its error is cleared.
      if (cudaEventDestroy(ev) != cudaSuccess) (void)cudaGetLastError();
      return false;
    }
  } catch (const std::exception& e) {
    const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
    *error = "cannot use CUDA device " + std::to_string(device) + ": " +
             (c10_error ? c10_error->what_without_backtrace() : e.what());
    if (ev != nullptr) {  // from the free list, untouched: give it back
      Event unused;
      unused.handle = ev;
      unused.device = device;
      release_event(unused);
    }
    return false;
  }
  out->handle = ev;
  out->device = device;
  return true;
}

Event record_event(const c10::Stream& stream) {
  TORCH_CHECK(stream.device_type() == c10::DeviceType::CUDA,
              "pinxfer: expected a CUDA stream, got a stream of device type ",
              stream.device_type());
  Event ev;
  std::string error;
  TORCH_CHECK(try_record_event(stream, &ev, &error), "pinxfer: ", error);
  return ev;
}

bool event_done(const Event& event, std::string* error) {
  // Relaxed: in torch's default capture mode (global) a query while any thread captures is
  // an "unsafe" call that invalidates that capture (found by review, session 43: a pin thread
  // allocating while the main thread captured a graph). torch's host allocator queries its
  // events relaxed too.
  RelaxedCaptureMode relaxed;
  if (relaxed.entered() != cudaSuccess) {
    *error = "cudaThreadExchangeStreamCaptureMode failed: " + error_text(relaxed.entered());
    return true;
  }
  const cudaError_t err = cudaEventQuery(static_cast<cudaEvent_t>(event.handle));
  if (err == cudaSuccess) return true;
  if (err == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return false;
  }
  (void)cudaGetLastError();
  *error = "cudaEventQuery failed: " + error_text(err);
  return true;
}

bool event_synchronize(const Event& event) {
  // Relaxed, as event_done: a capture pinxfer does not know of (begun without install())
  // may be open in another thread, and a wait in global mode would invalidate it.
  RelaxedCaptureMode relaxed;
  if (relaxed.entered() != cudaSuccess) return false;
  const cudaError_t err = cudaEventSynchronize(static_cast<cudaEvent_t>(event.handle));
  if (err != cudaSuccess) (void)cudaGetLastError();
  return err == cudaSuccess;
}

void event_wait_sleeping(const Event& event) {
  using Clock = std::chrono::steady_clock;
  const auto spin_until = Clock::now() + std::chrono::microseconds(kEventWaitSpinUs);
  // The sleeps are short: keep this thread's timer slack (50 us by default) from
  // stretching each one, and give the caller's back afterwards.
  const int old_slack = prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0);
  bool slack_set = false;
  for (;;) {
    // event_done: relaxed (a pool worker's query would invalidate another thread's
    // global-mode capture; found by review, session 44), "not ready" cleared.
    std::string error;
    if (event_done(event, &error)) {
      if (error.empty()) break;
      if (slack_set) prctl(PR_SET_TIMERSLACK, static_cast<unsigned long>(old_slack), 0, 0, 0);
      TORCH_CHECK(false, "pinxfer: while waiting for a copy: ", error);
    }
    if (Clock::now() < spin_until) continue;
    if (!slack_set && old_slack > 1000) {
      slack_set = prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0) == 0;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(kEventWaitSleepUs));
  }
  if (slack_set) prctl(PR_SET_TIMERSLACK, static_cast<unsigned long>(old_slack), 0, 0, 0);
}

void release_event(const Event& event) {
  const auto ev = static_cast<cudaEvent_t>(event.handle);
  {
    std::lock_guard<std::mutex> lock(g_events_mutex);
    if (g_events_generation != fork_generation()) return;  // parent's event: drop it
    try {
      if (std::vector<cudaEvent_t>* list = free_events_locked(event.device)) {
        list->push_back(ev);
        return;
      }
    } catch (...) {
      // no room to keep it: destroyed below (called from destructors: nothing may escape)
    }
  }
  if (cudaEventDestroy(ev) != cudaSuccess) (void)cudaGetLastError();
}

bool current_stream_if_active(c10::Stream* out) {
  if (!cuda_usable()) return false;
  int device = -1;
  if (cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  if (!at::detail::getCUDAHooks().hasPrimaryContext(static_cast<c10::DeviceIndex>(device))) {
    return false;
  }
  *out = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).unwrap();
  return true;
}

// stream_is_capturing() reads a NULL handle as the legacy default stream.
#ifdef CUDA_API_PER_THREAD_DEFAULT_STREAM
#error "pinxfer assumes the legacy default stream (see stream_is_capturing)"
#endif

bool stream_is_capturing(const c10::Stream& stream, std::string* error) {
  if (!cuda_usable()) return false;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  const auto raw = c10::cuda::CUDAStream(c10::cuda::CUDAStream::UNCHECKED, stream).stream();
  // torch's default stream is the legacy NULL stream (handle 0 in this library,
  // built without per-thread default streams), which CUDA never lets capture
  // (cudaStreamBeginCapture refuses it). Most small calls run there: the query
  // cost 150-500 ns of a 4 KiB transfer's budget on an H100
  // (benchmarks/results/h100/small_breakdown.json).
  if (raw == nullptr) return false;
  const cudaError_t err = cudaStreamIsCapturing(raw, &status);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    *error = "cudaStreamIsCapturing failed: " + error_text(err);
    return false;
  }
  // "Invalidated" is still a capture in progress (it ends with an error): a
  // stream in it must not be treated as idle either.
  return status != cudaStreamCaptureStatusNone;
}

bool stream_idle(const c10::Stream& stream) {
  if (!cuda_usable()) return false;
  const auto raw = c10::cuda::CUDAStream(c10::cuda::CUDAStream::UNCHECKED, stream).stream();
  // A failure to relax or to restore the mode answers "not idle": the pool then
  // waits for the block's event as it would without this question.
  RelaxedCaptureMode relaxed;
  if (relaxed.entered() != cudaSuccess) return false;
  const cudaError_t err = cudaStreamQuery(raw);
  if (err != cudaSuccess) (void)cudaGetLastError();  // not ready, or an error: not idle
  return relaxed.restore() == cudaSuccess && err == cudaSuccess;
}

bool current_stream_is_capturing() {
  c10::Stream current(c10::Stream::DEFAULT, c10::Device(c10::DeviceType::CPU));
  if (!current_stream_if_active(&current)) return false;
  std::string error;
  const bool capturing = stream_is_capturing(current, &error);
  TORCH_CHECK(error.empty(), "pinxfer: ", error);
  return capturing;
}

void device_synchronize(int device) {
  if (!cuda_usable()) return;
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  const cudaError_t err = cudaDeviceSynchronize();
  if (err != cudaSuccess) (void)cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, "pinxfer: cudaDeviceSynchronize(device ", device,
              ") failed while waiting for CUDA graph replays before reusing their pinned "
              "memory: ",
              error_text(err));
}

void synchronize_active_devices() {
  if (!cuda_usable()) return;
  const int n = device_count();
  for (int d = 0; d < n; ++d) {
    if (at::detail::getCUDAHooks().hasPrimaryContext(static_cast<c10::DeviceIndex>(d))) {
      device_synchronize(d);
    }
  }
}

std::string pci_bus_id(int device) {
  if (!cuda_usable()) return "";
  char buf[64] = {0};
  const cudaError_t err = cudaDeviceGetPCIBusId(buf, sizeof(buf), device);
  TORCH_CHECK(err == cudaSuccess, "pinxfer: cudaDeviceGetPCIBusId(", device,
              ") failed: ", error_text(err));
  return buf;
}

int current_device() {
  if (!cuda_usable()) return -1;
  int device = -1;
  const cudaError_t err = cudaGetDevice(&device);
  TORCH_CHECK(err == cudaSuccess, "pinxfer: cudaGetDevice failed: ", error_text(err));
  return device;
}

int device_count() {
  if (!cuda_usable()) return 0;
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  TORCH_CHECK(err == cudaSuccess, "pinxfer: cudaGetDeviceCount failed: ", error_text(err));
  return count;
}

#else  // CPU-only build

std::string pci_bus_id(int) { return ""; }
int current_device() { return -1; }
int device_count() { return 0; }

bool cuda_usable() { return false; }
static std::string probe_error() {
  return "this pinxfer was built without CUDA (the CPU-only variant), so it has no GPU paths; "
         "rebuild it against a CUDA build of torch with a CUDA toolkit";
}
std::string host_register(void*, size_t) { return "pinxfer was built without CUDA"; }
std::string host_unregister(void*) { return "pinxfer was built without CUDA"; }
std::string host_register_user(void*, size_t, bool* already_registered) {
  *already_registered = false;
  return "pinxfer was built without CUDA";
}
bool is_cuda_pinned(const void*) { return false; }
bool try_record_event(const c10::Stream&, Event*, std::string* error) {
  *error = "pinxfer was built without CUDA";
  return false;
}
Event record_event(const c10::Stream&) {
  TORCH_CHECK(false, "pinxfer was built without CUDA: stream events are unavailable");
}
bool event_done(const Event&, std::string*) { return true; }
bool event_synchronize(const Event&) { return true; }
void release_event(const Event&) {}
bool current_stream_if_active(c10::Stream*) { return false; }
bool stream_is_capturing(const c10::Stream&, std::string*) { return false; }
bool stream_idle(const c10::Stream&) { return false; }
bool current_stream_is_capturing() { return false; }
void device_synchronize(int) {}
void synchronize_active_devices() {}

#endif

void check_stream_not_capturing(const c10::Stream& stream, int index, const char* op,
                                const char* why_and_advice) {
  std::string error;
  const bool capturing = stream_is_capturing(stream, &error);
  TORCH_CHECK(error.empty(), "pinxfer.", op, ": ", error);
  TORCH_CHECK(!capturing, "pinxfer.", op, ": the current CUDA stream of device ", index,
              " is capturing a CUDA graph; ", why_and_advice);
}

std::string cuda_unusable_reason() {
  if (!built_with_cuda()) return probe_error();
  if (fork_generation() != 0) {
    return "this is a forked child process (such as a DataLoader worker), and CUDA belongs to "
           "its parent";
  }
  if (settings().disable_cuda) return "PINXFER_DISABLE_CUDA=1 is set";
  if (cuda_usable()) return "";
  const std::string error = probe_error();
  return error.empty() ? "no CUDA device is usable" : error;
}

}  // namespace pinxfer::cuda
