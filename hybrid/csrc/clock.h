// The steady clock in nanoseconds: the clock of Python's time.monotonic_ns.
#pragma once
#include <chrono>
#include <cstdint>

namespace hybrid {

static inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace hybrid
