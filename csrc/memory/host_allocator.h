// pinxfer's pool behind torch's at::HostAllocator interface, so that
// Tensor.pin_memory(), torch.empty(pin_memory=True), the DataLoader's pin
// thread and copy_(non_blocking=True)'s record_event all reach it once
// installed (at::setHostAllocator(kCUDA, ..., priority)).
//
// The outermost layer over the pools of memory/pool_registry.h (the pools do
// not know about it: install tells them through
// PinnedPool::set_fence_unrecorded_frees()).
//
// Opt-in: install_host_allocator(true) takes over; (false) gives torch's own
// allocator back. Blocks keep their own deleters, so tensors allocated by
// either allocator stay valid across install/uninstall. Thread-safe.
#pragma once

namespace pinxfer {

// Returns true if the swap happened (false in CPU-only builds).
bool install_host_allocator(bool enable);
bool host_allocator_installed();

// While installed: empties the cache of the allocator torch had before (torch's own). Graphs
// captured on pools made before install() are served there (memory/graph_pools.h,
// begin_capture_served_elsewhere), and torch frees a released graph pool only in its
// empty_cache, which nothing else reaches then. Nothing while a capture is open (torch's
// cudaFreeHost synchronizes). Called by both empty_caches (pinxfer's and torch's, which
// reaches pinxfer's allocator).
void empty_previous_allocator_cache();

// TEST-ONLY: registers, at `priority`, a host allocator that passes every call on to the
// one torch has now: another library's, for the tests of install()'s priority check.
// Process-wide and for good (tests call it in a fresh process). False in CPU-only builds.
bool register_rival_host_allocator_for_tests(int priority);

}  // namespace pinxfer
