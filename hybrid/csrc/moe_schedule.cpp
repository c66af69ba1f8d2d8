// The MoE layer's calls planned: tokens grouped by expert, the scratch sized, the tasks queued per pool group.
#include <algorithm>
#include <stdexcept>

#include "gemm_amx.h"
#include "gemm_int4.h"
#include "moe_plan.h"
#include "thread_pool.h"

namespace hybrid {
namespace {

void fail(const std::string& msg) { throw std::invalid_argument(msg); }

int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

int64_t read_id(const View& ids, int64_t t, int64_t k) {
  const int64_t i = t * ids.strides[0] + k;
  return ids.dtype == "int64" ? ids.data<const int64_t>()[i] : ids.data<const int32_t>()[i];
}

}  // namespace

void MoELayer::set_nodes(const std::vector<int>& node) {
  if (node.size() != w_.size()) fail("nodes: one per expert (" + std::to_string(w_.size()) + ")");
  for (int n : node)
    if (n < 0) fail("nodes: a node is >= 0");
  wait();  // not under a call in flight
  node_ = node;
}

std::vector<int64_t> MoELayer::last_group_bytes() const {
  std::vector<int64_t> out;
  for (int g = 0; p_->queues && g < p_->groups; ++g) out.push_back(p_->queues[g].bytes.load());
  return out;
}

std::vector<MoELayer::TaskRecord> MoELayer::last_trace() const { return p_->trace; }

void MoELayer::plan(const View& x, const View& ids, const View& weights, const View& out) {
  check_view(x, "x", {"bfloat16"}, 2);
  check_view(ids, "ids", {"int64", "int32"}, 2);
  check_view(weights, "weights", {"float32"}, 2);
  check_view(out, "out", {"float32", "bfloat16"}, 2);
  const int64_t T = x.dim(0), K = ids.dim(1), E = experts();
  check_shape(x, "x", {T, D_});
  check_shape(ids, "ids", {T, K});
  check_shape(weights, "weights", {T, K});
  check_shape(out, "out", {T, D_});
  Plan& p = *p_;
  std::vector<std::vector<int64_t>> slots(E);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < K; ++k) {
      const int64_t e = read_id(ids, t, k);
      if (e == kSkip) continue;  // computed elsewhere (an expert resident on the GPU)
      if (e < 0 || e >= E)
        fail("ids: expert id " + std::to_string(e) + " out of range 0.." + std::to_string(E - 1) + " (token " +
             std::to_string(t) + ", slot " + std::to_string(k) + ")");
      slots[e].push_back(t * K + k);
    }
  p.T = T, p.K = K;
  p.x = x.data<const uint16_t>(), p.ldx = x.strides[0];
  p.wts = weights.data<const float>(), p.ldw = weights.strides[0];
  p.out = reinterpret_cast<void*>(out.ptr), p.out_bf16 = out.dtype == "bfloat16", p.ldo = out.strides[0];
  p.used.clear(), p.row0.clear(), p.rows.clear(), p.token.clear();
  p.slot_row.assign(T * K, -1);
  for (int64_t e = 0; e < E; ++e) {
    if (slots[e].empty()) continue;
    p.used.push_back(int32_t(e));
    p.row0.push_back(int64_t(p.token.size()));
    p.rows.push_back(int64_t(slots[e].size()));
    for (int64_t s : slots[e]) {
      p.slot_row[s] = int64_t(p.token.size());
      p.token.push_back(int32_t(s / K));
    }
  }
}

void MoELayer::schedule(const std::string& isa, const std::vector<int>& participants, int caller_group) {
  Plan& p = *p_;
  p.isa = resolve_isa(isa);
  p.threads = 0;
  for (int n : participants) p.threads += n;
  p.caller_group = std::max(caller_group, 0);
  const int64_t R = int64_t(p.token.size()), n_used = int64_t(p.used.size());
  int64_t prepared = 0;  // rows of xprep and h
  bool any_prepared = false;
  p.layout.clear(), p.prow0.clear();
  for (int64_t e = 0; e < n_used; ++e) {
    const GemmProblem q{nullptr, 0, nullptr, 0, nullptr, 0, nullptr, 0, p.rows[e], 0, 0, wt_};
    p.layout.push_back(x_layout(p.isa, q));
    p.prow0.push_back(prepared);
    prepared += x_rows(p.layout.back(), p.rows[e]);
    any_prepared |= p.layout.back() != XLayout::plain;
  }
  p.ldxp = padded_k(D_);
  p.ldh = any_prepared ? padded_k(I_) : I_;
  p.xg.get(R * D_);
  if (any_prepared) p.xprep.get(prepared * p.ldxp);
  p.h.get(prepared * p.ldh, /*zero=*/p.ldh != I_);  // the lanes past I stay zero
  p.g.get(R * I_), p.u.get(R * I_), p.y.get(R * D_);
  const bool int4 = wt_ == WeightType::int4;
  p.ldxq = int4 ? int4_x_elems(p.isa, D_) : 0, p.ldhq = int4 ? int4_x_elems(p.isa, I_) : 0;
  p.xq.get(R * p.ldxq), p.hq.get(R * p.ldhq);

  const int64_t per_expert = std::max<int64_t>(1, (8 * p.threads + n_used - 1) / std::max<int64_t>(n_used, 1));
  const int64_t gu_chunk = round_up((I_ + per_expert - 1) / per_expert, 64);
  const int64_t d_chunk = round_up((D_ + per_expert - 1) / per_expert, 16);
  p.d_chunk = d_chunk, p.n_chunks = (D_ + d_chunk - 1) / d_chunk;
  queue_tasks(participants, gu_chunk, d_chunk);
  // Each (token, chunk) is summed by whoever finishes the last of its experts' down rows there: no barrier.
  // A token with no expert here (all computed elsewhere) is summed (to zeros) now.
  p.reduce_left.reset(new std::atomic<int>[p.T * p.n_chunks]);
  for (int64_t t = 0; t < p.T; ++t) {
    int n = 0;
    for (int64_t k = 0; k < p.K; ++k) n += p.slot_row[t * p.K + k] >= 0;
    for (int64_t j = 0; j < p.n_chunks; ++j) p.reduce_left[t * p.n_chunks + j].store(n, std::memory_order_relaxed);
    if (n == 0) reduce(t, 0, D_);
  }
  p.arrived = 0, p.syncs = 0;
  p.tracing = trace_;
  p.trace.assign(trace_ ? p.tasks.size() : 0, TaskRecord{});
  p.wait_ns = 0, p.out_ns = 0, p.tail_ns = 0;
  p.prep_ns = 0, p.gate_up_ns = 0, p.silu_ns = 0, p.down_ns = 0, p.sums_ns = 0;
}

// The tasks in one queue per group of the pool (one queue without groups). Each expert goes to its node's group, or,
// where that group has no thread in this call, to one that has; within a queue the experts' tasks are ordered as
// below, for the group's own threads.
void MoELayer::queue_tasks(const std::vector<int>& participants, int64_t gu_chunk, int64_t d_chunk) {
  Plan& p = *p_;
  const int G = int(participants.size());
  const int64_t n_used = int64_t(p.used.size());
  std::vector<int> staffed;
  for (int g = 0; g < G; ++g)
    if (participants[g] > 0) staffed.push_back(g);
  std::vector<std::vector<int32_t>> order(G);
  for (int32_t e = 0; e < n_used; ++e) {
    const int32_t id = p.used[e];
    const int g = node_[id] % G;
    order[participants[g] > 0 ? g : staffed[id % staffed.size()]].push_back(e);
  }
  p.tasks.clear();
  p.groups = G;
  p.queues.reset(new Plan::Queue[G]);
  auto push = [&](int32_t e, int32_t stage, int64_t n, int64_t chunk) {
    for (int64_t r = 0; r < n; r += chunk) p.tasks.push_back({e, stage, r, std::min(n, r + chunk)});
  };
  p.gu_left.reset(new std::atomic<int>[n_used]);
  p.prep.reset(new std::atomic<int>[n_used]);
  // An expert's down tasks go `lag` experts behind its gate/up tasks, tunables().moe_lag_rounds rounds of tasks
  // (one per thread of its group) later: by the time a thread takes them, the thread that took its gate/up has
  // usually finished, so it does not spin on the expert's counter. A gate/up task reads two matrices, a down task
  // one: with 16 threads and one task per stage (512 tokens over 256 experts, balanced), one round behind left the
  // threads waiting 7.5-9.4 % of the layer, two rounds 0.6 % (H200 test machine's Xeon; 151 against 160 ms); one
  // expert behind, ~1/3 of the time. At one token (many tasks per expert) the lag is 2 experts either way.
  const int64_t per_expert_tasks = (I_ + gu_chunk - 1) / gu_chunk + (D_ + d_chunk - 1) / d_chunk;
  for (int g = 0; g < G; ++g) {
    const int64_t rounds = tunables().moe_lag_rounds * participants[g];
    const int32_t lag = int32_t(1 + (rounds + per_expert_tasks - 1) / per_expert_tasks);
    // The experts in the order their tasks are queued: by token count, most first (tunables().moe_longest_first),
    // so that the layer ends on its cheapest tasks and the threads run out of work closer together. Under random
    // routing (T = 512: 8-27 tokens per expert, an expert with 17 or more paying a second AMX token tile) the order
    // of the ids left the threads waiting and idle at the end ~10 % of the layer on the H200 test machine's Xeon
    // (V1); side by side in one call, 6.8 % by ids against 3.2 % longest first (V2; docs/perf/journal.md).
    std::vector<int32_t>& ord = order[g];
    const int32_t n = int32_t(ord.size());
    if (tunables().moe_longest_first)
      std::stable_sort(ord.begin(), ord.end(), [&](int32_t a, int32_t b) { return p.rows[a] > p.rows[b]; });
    p.queues[g].next = int64_t(p.tasks.size());
    for (int32_t i = 0; i < n; ++i) {
      const int32_t e = ord[i];
      p.gu_left[e] = int((I_ + gu_chunk - 1) / gu_chunk) + (p.ldhq ? 1 : 0);  // + 1: h's preparation (gate_up)
      p.prep[e] = 0;
      push(e, 0, I_, gu_chunk);
      if (i >= lag) push(ord[i - lag], 1, D_, d_chunk);
    }
    for (int32_t i = std::max<int32_t>(0, n - lag); i < n; ++i) push(ord[i], 1, D_, d_chunk);
    p.queues[g].end = int64_t(p.tasks.size());
  }
}

// The weight bytes (and scales) a task reads: its rows of gate and up, or of down.
int64_t MoELayer::bytes_read(const Task& t) const {
  const int64_t rows = t.r1 - t.r0, K = t.stage == 0 ? D_ : I_, mats = t.stage == 0 ? 2 : 1;
  int64_t row = 2 * K, scales = 0;  // BF16
  if (wt_ == WeightType::fp8)
    row = K, scales = ((t.r1 - 1) / kBlock - t.r0 / kBlock + 1) * ((K + kBlock - 1) / kBlock) * 4;
  else if (wt_ == WeightType::int4)
    row = (K + 7) / 8 * 4 + (K + 31) / 32 * 2;  // packed words and bf16 group scales
  return mats * (rows * row + scales);
}

}  // namespace hybrid
