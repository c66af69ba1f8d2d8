// Memory on NUMA nodes through the kernel's own calls (mbind, move_pages; no libnuma at build or run time).
#pragma once
#include <cstdint>
#include <vector>

namespace hybrid {

// The whole pages inside [addr, addr + bytes) bound to `node` (MPOL_BIND): pages already there move to it
// (MPOL_MF_MOVE; pages another process maps, or page-locked ones, stay where they are), pages yet to be touched are
// allocated on it. 0, or the errno of the refusal (ENOSYS, EPERM: no NUMA calls here; EINVAL: no such node).
int bind_memory(uintptr_t addr, int64_t bytes, int node);

// The node of `samples` pages spread evenly over [addr, addr + bytes) (the first and the last included): each a
// node >= 0, or -errno (-ENOENT: not yet touched; -ENOSYS, -EPERM: the call is refused here).
std::vector<int> page_nodes(uintptr_t addr, int64_t bytes, int64_t samples);

}  // namespace hybrid
