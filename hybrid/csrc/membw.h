// The machine's memory read roof: every pool thread streams its share of a buffer far larger than the caches.
#pragma once
#include <cstdint>

namespace hybrid {

// Best read bandwidth over `iters` passes over a `bytes`-sized buffer, in GB/s (1e9 bytes per second); each
// thread reads its share as `streams` sequential streams in lockstep (1..32).
double read_bandwidth(int64_t bytes, int iters, int streams);

}  // namespace hybrid
