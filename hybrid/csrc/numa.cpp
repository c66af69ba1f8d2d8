#include "numa.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <stdexcept>

namespace hybrid {
namespace {

constexpr int kMpolBind = 2;           // MPOL_BIND (linux/mempolicy.h)
constexpr unsigned kMpolMfMove = 1u << 1;  // MPOL_MF_MOVE
constexpr int64_t kBits = 8 * sizeof(unsigned long);

int64_t page_size() {
  static const int64_t page = sysconf(_SC_PAGESIZE);
  return page;
}

}  // namespace

int bind_memory(uintptr_t addr, int64_t bytes, int node) {
  if (node < 0 || bytes < 0) throw std::invalid_argument("bind_memory: node and bytes must be >= 0");
  const int64_t page = page_size();
  const uintptr_t lo = (addr + page - 1) / page * page, hi = (addr + bytes) / page * page;
  if (hi <= lo) return 0;  // no whole page inside
  std::vector<unsigned long> mask(node / kBits + 1, 0);
  mask[node / kBits] = 1ul << (node % kBits);
  // maxnode counts one past the mask's bits: the kernel reads one bit fewer than it is told
  const long rc = syscall(SYS_mbind, lo, hi - lo, kMpolBind, mask.data(), mask.size() * kBits + 1, kMpolMfMove);
  return rc == 0 ? 0 : errno;
}

std::vector<int> page_nodes(uintptr_t addr, int64_t bytes, int64_t samples) {
  if (bytes <= 0 || samples < 1) throw std::invalid_argument("page_nodes: needs bytes > 0 and samples >= 1");
  const int64_t page = page_size();
  const uintptr_t first = addr / page * page, last = (addr + bytes - 1) / page * page;
  const int64_t pages = int64_t((last - first) / page) + 1, n = std::min(samples, pages);
  std::vector<void*> where(n);
  for (int64_t i = 0; i < n; ++i)
    where[i] = reinterpret_cast<void*>(first + (n == 1 ? 0 : (pages - 1) * i / (n - 1)) * page);
  std::vector<int> status(n, -ENOSYS);
  // nodes = NULL: nothing moves, each page's node (or -errno) is written to status
  if (syscall(SYS_move_pages, 0, n, where.data(), nullptr, status.data(), 0) != 0)
    std::fill(status.begin(), status.end(), -errno);
  return status;
}

}  // namespace hybrid
