// NUMA memory policy through the documented Linux system calls (mbind(2),
// get_mempolicy(2), move_pages(2)); no libnuma link dependency.
#pragma once

#include <cstddef>
#include <vector>

namespace pinxfer {

// Sets [ptr, ptr+size)'s policy to prefer `node` (MPOL_PREFERRED) before first touch, so
// pages are allocated there while it has free memory, and on other nodes after. (Until
// session 43 MPOL_BIND: with the node full, the first touch of a large segment would have
// the kernel's OOM killer end the process though other nodes had memory free; found by
// review.) Returns false (errno set) if the kernel refused; node < 0 is a no-op returning
// true.
bool bind_to_node(void* ptr, size_t size, int node);

// The node each page of [ptr, ptr+size) currently lives on (move_pages with no
// target: a query). Pages not present read as a negative errno value.
std::vector<int> page_nodes(void* ptr, size_t size);

}  // namespace pinxfer
