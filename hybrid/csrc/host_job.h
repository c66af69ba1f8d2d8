// A MoE layer call that a CUDA stream runs as two host functions (cuLaunchHostFunc, also inside a CUDA graph):
// `host_submit` starts the layer on the thread pool over buffers fixed when the job is made (the pinned staging
// buffers the stream copies into), `host_wait` joins it. The GPU work enqueued between the two overlaps the CPU.
// Host functions cannot throw into the stream: an error is kept in the job and read from Python after the step.
// Each job also adds up its own timings (for the step profiler).
#pragma once
#include <cstdint>
#include <string>

#include "moe.h"
#include "tensor_view.h"

namespace hybrid {

struct HostJob {
  HostJob(MoELayer* layer, View x, View ids, View weights, View out, std::string isa);
  MoELayer* layer;
  View x, ids, weights, out;
  std::string isa, error;
  int64_t calls = 0;
  double cpu_s = 0;  // from submit to joined
  int64_t t_submit_ns = 0;
};

extern "C" {
void hybrid_host_submit(void* job);
void hybrid_host_wait(void* job);
}

}  // namespace hybrid
