// The machine's memory read roof: every pool thread streams its share of a buffer far larger than the caches.
#pragma once
#include <cstdint>
#include <utility>

namespace hybrid {

// Best read bandwidth over `iters` passes over a `bytes`-sized buffer, in GB/s (1e9 bytes per second); each
// thread reads its share as `streams` sequential streams in lockstep (1..32).
double read_bandwidth(int64_t bytes, int iters, int streams);

// The same read by the workers of one group of a grouped pool (a NUMA node's threads) from a buffer on `node`:
// bound there (bind_memory) when `bind`, else first touched by that group's workers (a simulated node). Returns
// (GB/s, the share of the buffer's sampled pages that lie on `node`; -1 where the pages' nodes cannot be read).
std::pair<double, double> read_bandwidth_node(int64_t bytes, int iters, int streams, int group, int node, bool bind);

}  // namespace hybrid
