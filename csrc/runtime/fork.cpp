#include "runtime/fork.h"

#include <pthread.h>

#include <array>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <c10/util/Exception.h>

namespace pinxfer {

namespace {

constexpr int kSteps = static_cast<int>(ForkChildStep::kCount);

// Constant-initialised (no constructor runs), so static initialisers of other
// files may register before this file's statics are set up.
std::atomic<uint64_t> g_fork_generation{0};
std::array<std::atomic<void (*)()>, kSteps> g_child_handlers{};
pthread_once_t g_install_once = PTHREAD_ONCE_INIT;

void run_child_handlers() {
  g_fork_generation.fetch_add(1);
  for (auto& slot : g_child_handlers) {
    if (void (*handler)() = slot.load()) handler();
  }
}

void install_atfork() {
  const int err = pthread_atfork(nullptr, nullptr, &run_child_handlers);
  // Without the handler a forked child could wait forever on a lock held by a
  // parent thread; failing at load (static initialisation, where nothing can
  // catch) is the better failure. pthread_atfork fails only with ENOMEM.
  if (err != 0) {
    std::fprintf(stderr, "pinxfer: pthread_atfork failed (%s); cannot load safely\n",
                 std::strerror(err));
    std::abort();
  }
}

}  // namespace

void register_fork_child_handler(ForkChildStep step, void (*handler)()) {
  const int index = static_cast<int>(step);
  TORCH_INTERNAL_ASSERT(index >= 0 && index < kSteps && handler != nullptr,
                        "pinxfer: bad fork child step ", index);
  pthread_once(&g_install_once, &install_atfork);
  void (*expected)() = nullptr;
  TORCH_INTERNAL_ASSERT(g_child_handlers[index].compare_exchange_strong(expected, handler),
                        "pinxfer: fork child step ", index, " registered twice");
}

uint64_t fork_generation() { return g_fork_generation.load(); }

}  // namespace pinxfer
