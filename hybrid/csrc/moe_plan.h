// The MoE layer's state for a call (moe.cpp runs its tasks, moe_schedule.cpp plans and queues them).
#pragma once
#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "dispatch.h"
#include "gemm_op.h"
#include "moe.h"

namespace hybrid {

struct MoELayer::Plan {
  Isa isa = Isa::generic;
  int64_t T = 0, K = 0;
  const uint16_t* x = nullptr;
  int64_t ldx = 0;
  const float* wts = nullptr;
  int64_t ldw = 0;
  void* out = nullptr;
  bool out_bf16 = false;
  int64_t ldo = 0;
  std::vector<int32_t> used;          // experts with at least one token
  std::vector<int64_t> row0, rows;    // per used expert: first row in the grouped buffers, token count
  std::vector<XLayout> layout;        // per used expert: the activations its kernels read (x_layout)
  std::vector<int64_t> prow0;         // per used expert: first row in xprep and h (AMX layout: padded to 16)
  std::vector<int32_t> token;         // per grouped row: its token
  std::vector<int64_t> slot_row;      // per (t, k): its grouped row
  std::vector<Task> tasks;
  struct alignas(64) Queue {  // one pool group's tasks: tasks[next, end), taken in order by its threads
    std::atomic<int64_t> next{0};
    int64_t end = 0;
    std::atomic<int64_t> bytes{0};  // the weight bytes its tasks read
  };
  std::unique_ptr<Queue[]> queues;
  int groups = 1, caller_group = 0;  // the pool's groups in this call; the caller's (when it works)
  bool tracing = false;
  std::vector<TaskRecord> trace;  // per task, while tracing
  std::unique_ptr<std::atomic<int>[]> gu_left, prep;  // per used expert
  // per (token, down chunk): the token's experts whose down rows of that chunk are still to come
  std::unique_ptr<std::atomic<int>[]> reduce_left;
  std::atomic<int> arrived{0};
  std::atomic<int> syncs{0};  // global synchronisation points passed by the current call
  // Where the participants' time went besides tasks, summed over them (ns): waiting for another thread's task
  // (an expert's gate/up rows, its prepared activations), and the end (leaving the task list until the call ends).
  std::atomic<int64_t> wait_ns{0}, out_ns{0}, tail_ns{0};
  // ... and in the tasks' stages (last_stage_s): an expert's activations gathered and packed, the gate/up GEMMs,
  // SiLU, the down GEMM, the weighted sums (a cache line of their own: every task adds to them)
  alignas(64) std::atomic<int64_t> prep_ns{0}, gate_up_ns{0}, silu_ns{0}, down_ns{0}, sums_ns{0};
  std::function<void()> on_done;  // called by the last participant out of a submitted call
  int threads = 1;
  int64_t d_chunk = 0, n_chunks = 0, ldxp = 0, ldh = 0;
  // INT4 experts: x and h rows as the INT4 kernel reads them (int4_prepare_x), per grouped row (0: read as they are)
  int64_t ldxq = 0, ldhq = 0;
  Scratch<uint16_t> xg, xprep, h, xq, hq;
  Scratch<float> g, u, y;
};

}  // namespace hybrid
