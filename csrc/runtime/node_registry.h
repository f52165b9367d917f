// One object per NUMA node (-1: unbound), made on first use and kept for the process:
// the pinned pools (memory/pool_registry.cpp), the copy-thread pools
// (runtime/thread_pool.cpp) and the allocators of pool tensors' storages
// (ops/memory_ops.cpp) each keep theirs in one of these.
//
// Lookups of nodes -1..kMaxFastNode are lock-free once the node's object exists (every
// allocation and every transfer asks); other nodes, and the first lookup of any node, take
// the registry's leaf lock, under which `make` runs. Objects are never freed: a published
// pointer never dangles, and nothing is destroyed at exit. Constant-initialised (a
// namespace-scope registry works whichever file's statics run first).
//
// Fork: forget_after_fork() (from a runtime/fork.h child handler) abandons the parent's
// objects, whose locks may be held by threads the child does not have, and starts empty.
#pragma once

#include <array>
#include <atomic>
#include <map>
#include <mutex>
#include <new>
#include <vector>

namespace pinxfer {

template <typename T>
class NodeRegistry {
 public:
  constexpr NodeRegistry() = default;
  NodeRegistry(const NodeRegistry&) = delete;
  NodeRegistry& operator=(const NodeRegistry&) = delete;

  // The object of `node`; make(node) -> T* builds it on first use (it may throw: nothing
  // is recorded then).
  template <typename Make>
  T& get(int node, const Make& make) {
    const bool fast = node >= -1 && node <= kMaxFastNode;
    if (fast) {
      if (T* found = fast_[node + 1].load(std::memory_order_acquire)) return *found;
    }
    std::lock_guard<std::mutex> lock(mutex_);
    if (by_node_ == nullptr) by_node_ = new std::map<int, T*>();
    auto it = by_node_->find(node);
    T* obj = it != by_node_->end() ? it->second : nullptr;
    if (obj == nullptr) {
      obj = make(node);
      by_node_->emplace(node, obj);
    }
    if (fast) fast_[node + 1].store(obj, std::memory_order_release);
    return *obj;
  }

  // Every object made so far (in this fork generation), by node.
  std::vector<T*> all() {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<T*> out;
    if (by_node_ != nullptr) {
      for (auto& [node, obj] : *by_node_) out.push_back(obj);
    }
    return out;
  }

  // In a forked child only (one thread, no lock taken): the parent's objects are leaked.
  void forget_after_fork() {
    new (&mutex_) std::mutex();
    by_node_ = nullptr;
    for (auto& slot : fast_) slot.store(nullptr, std::memory_order_relaxed);
  }

 private:
  static constexpr int kMaxFastNode = 63;
  std::mutex mutex_;
  std::map<int, T*>* by_node_ = nullptr;                  // leaked with its objects. LOCK: mutex_
  std::array<std::atomic<T*>, kMaxFastNode + 2> fast_{};  // slot node + 1
};

}  // namespace pinxfer
