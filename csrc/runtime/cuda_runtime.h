// The few CUDA runtime calls the allocator needs, behind a CPU-safe facade.
//
// Built with PINXFER_WITH_CUDA=0 every function reports "no CUDA". Built with
// CUDA, nothing here runs at import: cuda_usable() asks the driver on first
// use, and answers false in a forked child (a DataLoader worker must not reach
// the parent's CUDA context) or when PINXFER_DISABLE_CUDA=1.
//
// Every CUDA return code is checked: the *_or_throw helpers raise c10::Error
// with the CUDA error string; the others return the error text to callers that
// must not throw (deleters).
#pragma once

#include <c10/core/Stream.h>

#include <cstdint>
#include <string>

namespace pinxfer::cuda {

bool built_with_cuda();
// Toolkit release the extension was compiled with ("13.0"), "" if none.
std::string built_cuda_version();

// True if this process can use a CUDA device: compiled with CUDA, not a forked
// child, PINXFER_DISABLE_CUDA unset, and the driver reports >= 1 device.
bool cuda_usable();
// Why cuda_usable() is false, as a clause for error messages ("PINXFER_DISABLE_CUDA=1
// is set"); "" when CUDA is usable. The one answer every message and
// pinxfer.build_info() give.
std::string cuda_unusable_reason();

// Page-locks host memory for DMA by every device (cudaHostRegisterPortable).
// Returns "" on success, else the CUDA error text. Used by the pool's segments
// (map_locked_region); honours inject_host_register_failures().
std::string host_register(void* ptr, size_t size);

// TEST-ONLY fault injection: the next n calls of host_register() fail, without
// calling CUDA, with the text of cudaErrorMemoryAllocation marked as injected.
// Process-wide and thread-safe (each failing call consumes one). Returns the
// number of injected failures that were still pending (so n = 0 cancels and
// reports). Only host_register() is affected: not pin_ (host_register_user),
// and nothing where CUDA is not usable, since host_register() is then not called.
int64_t inject_host_register_failures(int64_t n);

// Un-page-locks memory host_register() locked. Returns "" on success, else the CUDA error
// text. Honours inject_host_unregister_failures().
std::string host_unregister(void* ptr);

// TEST-ONLY fault injection, as inject_host_register_failures: the next n calls of
// host_unregister() (a pool segment's unmapping, unpin_ and its orphans) fail, without
// calling CUDA (the memory stays registered), with the text of
// cudaErrorStreamCaptureUnsupported marked as injected.
int64_t inject_host_unregister_failures(int64_t n);

// host_register for memory the caller does not own (pinxfer.pin_): also says
// whether CUDA refused because some of the range is already registered
// (cudaErrorHostMemoryAlreadyRegistered: by torch, another library, or an
// earlier pin_ of a tensor sharing a page). Returns "" on success.
std::string host_register_user(void* ptr, size_t size, bool* already_registered);

// True if ptr lies in memory CUDA considers page-locked host memory.
bool is_cuda_pinned(const void* ptr);

// An opaque recorded event. Created from a per-device free list, so steady
// state creates none.
struct Event {
  void* handle = nullptr;  // cudaEvent_t
  int device = -1;
};
// Records an event on `stream` (a CUDA c10::Stream). Throws on CUDA errors.
Event record_event(const c10::Stream& stream);
// Same, but never throws: returns false and fills *error instead.
bool try_record_event(const c10::Stream& stream, Event* out, std::string* error);
// cudaEventQuery, with the thread's capture mode relaxed (a query in global mode would
// invalidate another thread's capture): true once complete. A CUDA error other than "not
// ready" is reported as complete-with-error through *error (the caller decides).
bool event_done(const Event& event, std::string* error);
// Blocks until the event completes (cudaEventSynchronize: the driver spins,
// since our events are made without cudaEventBlockingSync). A wait is only a hint: the
// pools wait on copies of handles that another thread may recycle (or destroy, when its
// record fails) meanwhile, and decide from event_done afterwards; so a failure is cleared
// and answered false, never thrown.
bool event_synchronize(const Event& event);
// Blocks until the event completes without holding a core: polls for
// kEventWaitSpinUs, then sleeps kEventWaitSleepUs between polls. For waits
// that last as long as a chunk's DMA (hundreds of µs): a staging thread
// waiting for its ring slot. cudaEventSynchronize there kept every waiting
// copy thread spinning, most of pinxfer's CPU per GB over t.to()'s (issue 22).
void event_wait_sleeping(const Event& event);
constexpr int kEventWaitSpinUs = 20;
constexpr int kEventWaitSleepUs = 15;
// Returns an event to its device's free list.
void release_event(const Event& event);

// The current CUDA stream of the current device, if CUDA is in use in this
// process (a primary context exists); false otherwise. Never initialises CUDA.
bool current_stream_if_active(c10::Stream* out);

// CUDA graph capture (cudaStreamIsCapturing). Whether `stream` is capturing
// now; never throws (callers are deleters): false with *error filled when the
// query fails. A stream of a process without usable CUDA is not capturing.
bool stream_is_capturing(const c10::Stream& stream, std::string* error);
// The refusal of an op that cannot run into a capture: throws c10::Error when
// `stream`, a stream of device `index`, is capturing a CUDA graph ("pinxfer.<op>:
// the current CUDA stream of device N is capturing a CUDA graph; <why_and_advice>")
// or when the query fails.
void check_stream_not_capturing(const c10::Stream& stream, int index, const char* op,
                                const char* why_and_advice);
// Whether every piece of work queued so far on `stream`, a stream of the current
// device (a NULL handle is the current device's legacy stream), has completed
// (cudaStreamQuery). False while work is queued and on any error (cleared, not
// reported): the caller then waits for its events as it would have. Never ask a
// capturing stream (the query would invalidate the capture); the calling thread's
// capture mode is relaxed for the query, so another thread's capture in torch's
// default (global) mode does not forbid it.
bool stream_idle(const c10::Stream& stream);
// Whether the current stream of the current device is capturing; false when
// CUDA is not in use yet (no primary context: nothing can be capturing).
// Throws c10::Error on a CUDA error.
bool current_stream_is_capturing();
// cudaDeviceSynchronize on `device`. Throws c10::Error with the CUDA error.
// Never call it while a stream may be capturing (it would invalidate that
// capture): the graph-pool registry calls it only when no capture is open.
void device_synchronize(int device);
// device_synchronize of every device with a primary context (one without has
// run no work of this process, and synchronizing it would create a context).
void synchronize_active_devices();

// The PCI bus id of a device ("0000:1b:00.0"), "" if CUDA is not usable.
std::string pci_bus_id(int device);
// The current device, or -1 if CUDA is not usable.
int current_device();
int device_count();

}  // namespace pinxfer::cuda
