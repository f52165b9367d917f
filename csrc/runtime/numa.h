// NUMA memory policy through the documented Linux system calls (mbind(2),
// get_mempolicy(2), move_pages(2)); no libnuma link dependency.
#pragma once

#include <cstddef>
#include <vector>

namespace pinxfer {

// Binds [ptr, ptr+size) to `node` (MPOL_BIND) before first touch, so pages are
// allocated there. Returns false (errno set) if the kernel refused; node < 0 is
// a no-op returning true.
bool bind_to_node(void* ptr, size_t size, int node);

// The node each page of [ptr, ptr+size) currently lives on (move_pages with no
// target: a query). Pages not present read as a negative errno value.
std::vector<int> page_nodes(void* ptr, size_t size);

}  // namespace pinxfer
