// The routed experts of one MoE layer on the CPU: for T tokens with top-k ids and weights,
// out[t] = Σ_k w[t,k] · down(SiLU(gate(x[t])) ⊙ up(x[t])) over expert ids[t,k].
//
// Tokens are grouped by expert. One job on the thread pool pulls tasks from one list: gate/up tasks split each
// expert's intermediate rows across threads (SiLU ⊙ fused, the result written straight in the layout the down
// kernel reads); an expert's down tasks (split along the hidden rows) start as soon as that expert's own gate/up
// tasks finish (a per-expert counter, no global barrier). The weighted sum over k of a token's chunk of hidden rows is
// taken by whoever finishes the last of its experts' down rows there (a per-(token, chunk) counter; the sum in k
// order whoever takes it). No barrier: a thread with no task left leaves for the pool's next job.
// Global synchronisations per layer: 1 (the end of the job).
// NUMA: each expert has a node (set_nodes). On a pool in node groups (thread_pool.h) the tasks are queued per group
// and a thread takes only its own group's: an expert's weights are read by the threads of the node that holds them.
// An expert whose group has no thread in a call goes to a group that has. The sums are taken as above, whichever
// group finishes a token's last expert: the results are the same bits with and without groups.
#pragma once
#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "gemm.h"
#include "scratch.h"
#include "tensor_view.h"

namespace hybrid {

constexpr int64_t kSkip = -1;

// out = BF16(silu(g) * u), elementwise over 1-D float32 g, u and bfloat16 out of one length: the op's SiLU step
// (gate_up), exposed for its tests.
void silu_mul(const View& g, const View& u, const View& out);

class MoELayer {
 public:
  // Per expert e: gate[e], up[e] [I, D] and down[e] [D, I], FP8 (with *_scale [ceil/128 blocks] f32), packed INT4
  // (int32 [I, ceil(D/8)] and [D, ceil(I/8)], with *_scale [ceil/32 groups] bf16; gemm_int4.h) or BF16 (scale
  // lists empty). The tensors must outlive the layer (the Python wrapper holds them).
  MoELayer(const std::vector<View>& gate, const std::vector<View>& gate_scale, const std::vector<View>& up,
           const std::vector<View>& up_scale, const std::vector<View>& down, const std::vector<View>& down_scale);
  ~MoELayer();  // waits for a submitted call still running

  // x [T, D] bf16; ids [T, K] int64 or int32 (kSkip = -1: that slot is computed elsewhere and adds nothing here);
  // weights [T, K] f32; out [T, D] f32 or bf16 (overwritten).
  // submit() returns at once (the pool's workers run the layer; the caller's core stays free), wait() joins.
  // One call at a time per object; two objects over the same weights (two decode lanes) may each have one
  // pending: the pool queues them (a thread with no task left in one goes on to the next), each wait() joining
  // its own.
  // on_done, if given, is called on a worker once the call is complete (before wait() would return).
  void submit(const View& x, const View& ids, const View& weights, const View& out, const std::string& isa,
              std::function<void()> on_done = nullptr);
  void wait();
  // The same, synchronously, with the calling thread working too.
  void forward(const View& x, const View& ids, const View& weights, const View& out, const std::string& isa);

  int64_t experts() const { return int64_t(w_.size()); }
  int64_t hidden() const { return D_; }
  int64_t intermediate() const { return I_; }
  // Global synchronisation points the last call passed (barriers every thread waited at, the job's end).
  int last_global_syncs() const;
  // The last call's participants' seconds, summed over them, spent waiting for another thread's task and idle at
  // the end (from leaving the task list to the last one's leaving).
  double last_wait_s() const;
  double last_tail_s() const;
  // The last call's participants' seconds in each stage of the tasks, summed over them: "prep" (an expert's
  // activations gathered and packed; INT4: its h too), "gate_up" (the two GEMMs), "silu" (SiLU ⊙ up into the down GEMM's layout),
  // "down" (its GEMM), "sums" (the weighted sums over experts).
  std::map<std::string, double> last_stage_s() const;

  // Each expert's NUMA node: the pool group whose threads run its tasks (node % the pool's groups; default 0).
  void set_nodes(const std::vector<int>& node);
  const std::vector<int>& nodes() const { return node_; }
  // The last call's expert weight bytes (and their scales) read, per group of the pool.
  std::vector<int64_t> last_group_bytes() const;
  // While on, each call records who ran each of its tasks (last_trace).
  struct TaskRecord {
    int expert, stage;  // the expert's id; 0 gate/up rows, 1 down rows
    int64_t r0, r1;
    int group, worker, cpu;  // the thread's group, its worker index (-1: the caller), the CPU it ran on
  };
  void set_trace(bool on) { trace_ = on; }
  std::vector<TaskRecord> last_trace() const;

 private:
  struct Expert {
    const void *gate, *up, *down;
    const void *gs, *us, *ds;  // f32 block scales (FP8) or bf16 group scales (INT4)
    int64_t ld_gu, ld_d, lds_gu, lds_d;
  };
  struct Task {
    int32_t expert;  // index into used_
    int32_t stage;   // 0 = gate/up rows, 1 = down rows
    int64_t r0, r1;
  };
  struct Plan;

  void plan(const View& x, const View& ids, const View& weights, const View& out);
  void schedule(const std::string& isa, const std::vector<int>& participants, int caller_group);
  void run_job(int worker);
  void queue_tasks(const std::vector<int>& participants, int64_t gu_chunk, int64_t d_chunk);
  int64_t bytes_read(const Task& t) const;
  void prepare_expert(int e);
  void gate_up(int e, int64_t r0, int64_t r1, uint16_t* tile);
  void down(int e, int64_t r0, int64_t r1, uint16_t* tile);
  void reduce(int64_t t, int64_t d0, int64_t d1);
  void add_int4_experts(const std::vector<View>& gate, const std::vector<View>& gate_scale,
                        const std::vector<View>& up, const std::vector<View>& up_scale, const std::vector<View>& down,
                        const std::vector<View>& down_scale);
  GemmProblem problem(const uint16_t* x, int64_t ldx, const void* w, int64_t ldw, const void* scale, int64_t lds,
                      float* y, int64_t ldy, int64_t M, int64_t N, int64_t K) const;

  std::vector<Expert> w_;
  std::vector<int> node_;  // per expert
  bool trace_ = false;
  WeightType wt_;
  int64_t D_, I_;
  std::unique_ptr<Plan> p_;
  bool pending_ = false;
  uint64_t ticket_ = 0;  // the pool's ticket of the submitted call
};

}  // namespace hybrid
