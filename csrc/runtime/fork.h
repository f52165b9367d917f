// The one pthread_atfork of pinxfer, and the order in which its parts are
// rebuilt in a forked child (a DataLoader worker).
//
// A child has only the thread that called fork(). Any lock another thread of
// the parent held at that moment stays held forever in the child, and the
// parent's worker threads and CUDA context are gone. So each part of pinxfer
// that owns locks or threads registers one child handler, which abandons the
// parent's state (leaked, never touched again) and makes its locks new.
//
// Order: the child runs, from one handler, first the fork generation bump
// (fork_generation() then says "child", which every generation check below
// relies on), then the handlers by ForkChildStep, lowest first: a layer is
// rebuilt before the layers that call into it, so a handler (and the first
// call after fork) may use any layer below its own. The CUDA runtime's locks
// come before the pools, because a pool's allocate and free call cuda_usable()
// and the event free lists; the thread pools come before the pinned pools,
// whose segments are first-touched by them; the graph-pool registry comes before the
// pinned pools, which ask it whether a capture is open; the pinned pools come before the
// pin_ registry, which asks the pools who owns a tensor.
//
// Registration happens during static initialisation (one handler per step);
// the registry is constant-initialised, so it works whichever file's statics
// run first. Thread-safe; the child handler takes no lock.
#pragma once

#include <cstdint>

namespace pinxfer {

enum class ForkChildStep : int {
  kCudaRuntime = 0,  // runtime/cuda_runtime.cpp: probe and event free-list locks
  kThreadPools,      // runtime/thread_pool.cpp: per-node worker pools (threads are gone)
  kGraphPools,       // memory/graph_pools.cpp: the graph-pool registry and its locks
  kPinnedPools,      // memory/pool_registry.cpp: per-node pools and the cap's accounting
  kPinInplace,       // ops/cpu/pin_inplace_cpu.cpp: the pin_ registry and its lock
  kBatchSenders,     // ops/cuda/batch_sender.cpp: prefetch's per-device senders (threads gone)
  kHostAllocator,    // memory/host_allocator.cpp: install()'s lock
  kCount,
};

// Installs `handler` to run in every forked child at `step`. Each step takes
// exactly one handler; registering a step twice is a programming error.
void register_fork_child_handler(ForkChildStep step, void (*handler)());

// 0 in the process that loaded pinxfer; incremented in the child after every
// fork(). Objects that hold threads, locks or CUDA state remember the value
// they were built under and, when it differs, treat themselves as abandoned.
uint64_t fork_generation();

}  // namespace pinxfer
