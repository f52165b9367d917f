#include "runtime/numa.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>

namespace pinxfer {

namespace {
constexpr int kMpolPreferred = 1;  // <linux/mempolicy.h> MPOL_PREFERRED
constexpr unsigned long kBitsPerWord = sizeof(unsigned long) * 8;
}  // namespace

bool bind_to_node(void* ptr, size_t size, int node) {
  if (node < 0 || size == 0) return true;
  std::vector<unsigned long> mask(node / kBitsPerWord + 1, 0);
  mask[node / kBitsPerWord] |= 1UL << (node % kBitsPerWord);
  // maxnode counts bits; the kernel wants one more than the highest node.
  const unsigned long maxnode = mask.size() * kBitsPerWord + 1;
  return syscall(SYS_mbind, ptr, size, kMpolPreferred, mask.data(), maxnode, 0U) == 0;
}

std::vector<int> page_nodes(void* ptr, size_t size) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const auto start = reinterpret_cast<uintptr_t>(ptr) & ~(page - 1);
  const auto end = reinterpret_cast<uintptr_t>(ptr) + size;
  std::vector<void*> pages;
  for (uintptr_t p = start; p < end; p += page) pages.push_back(reinterpret_cast<void*>(p));
  std::vector<int> status(pages.size(), -1);
  if (pages.empty()) return status;
  if (syscall(SYS_move_pages, 0, pages.size(), pages.data(), nullptr, status.data(), 0) != 0) {
    std::fill(status.begin(), status.end(), -errno);
  }
  return status;
}

}  // namespace pinxfer
