// A MoE layer call that a CUDA stream runs as host functions (cuLaunchHostFunc, also inside a CUDA graph):
// `host_submit` starts the layer on the thread pool over buffers fixed when the job is made (the pinned staging
// buffers the stream copies into), `host_wait` joins it. The GPU work enqueued between the two overlaps the CPU.
// With a `signal` (a word of pinned host memory the GPU can read), the call stores 0 there when submitted and 1 once
// complete, and the stream can wait for the 1 itself (a stream memory operation) instead of a `host_wait`: no host
// thread is held while the CPU works, so the driver's host-function thread is free to submit another stream's
// call meanwhile (CUDA may run all host functions on one thread).
// Host functions cannot throw into the stream: an error is kept in the job and read from Python after the step.
// Each job also adds up its own timings (for the step profiler) and, while `tracing`, notes each call's span
// (submit, complete; steady clock ns, the clock of Python's time.monotonic_ns) for a timeline of the steps.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "moe.h"
#include "tensor_view.h"

namespace hybrid {

struct HostJob {
  HostJob(MoELayer* layer, View x, View ids, View weights, View out, std::string isa, uintptr_t signal = 0);
  MoELayer* layer;
  View x, ids, weights, out;
  std::string isa, error;
  uint32_t* signal;  // or nullptr
  int64_t calls = 0;
  double cpu_s = 0;  // from submit to complete
  int64_t t_submit_ns = 0;
  bool tracing = false;
  std::vector<int64_t> spans;  // submit, complete, submit, ... (at most kMaxSpans pairs kept)
  static constexpr size_t kMaxSpans = 1 << 16;
};

extern "C" {
void hybrid_host_submit(void* job);
void hybrid_host_wait(void* job);
}

}  // namespace hybrid
