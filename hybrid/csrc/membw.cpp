#include "membw.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <sys/mman.h>

#include "scratch.h"
#include "thread_pool.h"

namespace hybrid {
namespace {

typedef uint64_t Line __attribute__((vector_size(64)));  // one cache line; plain SSE2 code in this file
constexpr int kMaxStreams = 32;

// Sums n words read as `streams` equal parts in lockstep (more streams = more misses in flight per core).
uint64_t sum_streams(const uint64_t* p, int64_t n, int streams) {
  const int64_t per = n / streams / 8 * 8;
  Line acc[kMaxStreams] = {};
  for (int64_t i = 0; i < per; i += 8)
    for (int s = 0; s < streams; ++s) acc[s] += *reinterpret_cast<const Line*>(p + s * per + i);
  uint64_t out = 0;
  for (int s = 0; s < streams; ++s)
    for (int j = 0; j < 8; ++j) out += acc[s][j];
  return out;
}

}  // namespace

double read_bandwidth(int64_t bytes, int iters, int streams) {
  if (bytes < (1 << 20) || iters < 1) throw std::invalid_argument("read_bandwidth: need >= 1 MiB and >= 1 pass");
  if (streams < 1 || streams > kMaxStreams) throw std::invalid_argument("read_bandwidth: streams must be 1..32");
  ThreadPool& tp = pool();
  const int T = tp.size();
  const int64_t words = bytes / 8 / (8 * kMaxStreams * T) * (8 * kMaxStreams * T), share = words / T;
  static Scratch<uint64_t> buf;  // kept between calls: a run measures the roof again and again
  static int64_t touched = 0;
  uint64_t* data = buf.get(words);
  if (words > touched) {
    madvise(data, words * 8, MADV_HUGEPAGE);  // as numpy and torch do for big buffers: 2 MB pages, fewer TLB misses
    tp.run([&](int w) { std::memset(data + w * share, w + 1, share * 8); });  // first touch by the reader
    touched = words;
  }
  std::atomic<uint64_t> sink{0};
  double best = 0;
  for (int it = 0; it < iters; ++it) {
    const auto t0 = std::chrono::steady_clock::now();
    tp.run([&](int w) { sink += sum_streams(data + w * share, share, streams); });
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, double(words * 8) / s / 1e9);
  }
  return sink.load() == 42 ? best * 1.0 : best;  // keep the sums alive
}

}  // namespace hybrid
