#include "membw.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <stdexcept>
#include <string>
#include <sys/mman.h>

#include "numa.h"
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

std::pair<double, double> read_bandwidth_node(int64_t bytes, int iters, int streams, int group, int node,
                                              bool bind) {
  if (bytes < (1 << 20) || iters < 1) throw std::invalid_argument("read_bandwidth_node: need >= 1 MiB and >= 1 pass");
  if (streams < 1 || streams > kMaxStreams) throw std::invalid_argument("read_bandwidth_node: streams must be 1..32");
  ThreadPool& tp = pool();
  const std::vector<int> workers = tp.participants(-1);
  if (group < 0 || group >= int(workers.size()) || node < 0)
    throw std::invalid_argument("read_bandwidth_node: group " + std::to_string(group) + " of a pool of " +
                                std::to_string(workers.size()) + " group(s)");
  const int T = workers[group];
  if (T < 1) throw std::invalid_argument("read_bandwidth_node: group " + std::to_string(group) + " has no worker");
  const int64_t words = bytes / 8 / (8 * kMaxStreams * T) * (8 * kMaxStreams * T), share = words / T;
  struct Buffer {
    uint64_t* data = nullptr;
    int64_t words = 0;
  };
  static std::map<std::pair<int, bool>, Buffer> buffers;  // per (node, bound): kept, as read_bandwidth's is
  Buffer& b = buffers[{node, bind}];
  if (b.words < words) {
    if (b.data) munmap(b.data, b.words * 8);
    void* p = mmap(nullptr, words * 8, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    b = {static_cast<uint64_t*>(p), words};
    madvise(p, words * 8, MADV_HUGEPAGE);
    if (bind) bind_memory(uintptr_t(p), words * 8, node);  // refused: the pages' nodes below say where they went
    const int toucher = node < int(workers.size()) && workers[node] > 0 ? node : group;
    const int n = workers[toucher];
    const int64_t part = (words + n - 1) / n;
    tp.submit([&](int) {
      if (ThreadPool::worker_group() != toucher) return;
      const int64_t lo = std::min(words, ThreadPool::worker_rank() * part), hi = std::min(words, lo + part);
      std::memset(b.data + lo, 1, (hi - lo) * 8);
    });
    tp.wait();
  }
  std::atomic<uint64_t> sink{0};
  double best = 0;
  for (int it = 0; it < iters; ++it) {
    const auto t0 = std::chrono::steady_clock::now();
    tp.submit([&](int) {
      if (ThreadPool::worker_group() != group || ThreadPool::worker_rank() >= T) return;
      sink += sum_streams(b.data + ThreadPool::worker_rank() * share, share, streams);
    });
    tp.wait();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, double(words * 8) / s / 1e9);
  }
  const std::vector<int> where = page_nodes(uintptr_t(b.data), words * 8, 256);
  int on = 0, known = 0;
  for (int w : where) on += w == node, known += w >= 0;
  return {sink.load() == 42 ? best * 1.0 : best, known ? double(on) / known : -1.0};
}

}  // namespace hybrid
