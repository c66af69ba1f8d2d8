#include "scan.h"

#include <algorithm>
#include <vector>

#include "thread_pool.h"

namespace hybrid {
namespace {

// Counted in blocks whose count fits 32 bits, so the compiler keeps wide vector lanes (SSE2 here, no flags needed).
int64_t count_range(const uint8_t* p, int64_t n) {
  constexpr int64_t kBlock = 1 << 20;
  int64_t total = 0;
  for (int64_t lo = 0; lo < n; lo += kBlock) {
    const int64_t hi = std::min(n, lo + kBlock);
    uint32_t c = 0;
    for (int64_t i = lo; i < hi; ++i) c += uint32_t((p[i] & 0x7F) == 0x7F);
    total += c;
  }
  return total;
}

}  // namespace

int64_t count_fp8_nan(const View& codes) {
  check_view(codes, "codes", {"float8_e4m3fn", "uint8"}, 1);
  const int64_t n = codes.dim(0);
  const uint8_t* p = codes.data<uint8_t>();
  ThreadPool& tp = pool();
  const int T = n < (int64_t(1) << 22) ? 1 : tp.size();  // small tensors: not worth waking the workers
  if (T == 1) return count_range(p, n);
  std::vector<int64_t> counts(T, 0);
  const int64_t share = (n + T - 1) / T;
  tp.run([&](int w) {
    const int64_t lo = std::min(n, int64_t(w) * share), hi = std::min(n, lo + share);
    counts[w] = count_range(p + lo, hi - lo);
  });
  int64_t total = 0;
  for (int64_t c : counts) total += c;
  return total;
}

}  // namespace hybrid
