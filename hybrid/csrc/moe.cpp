#include "moe.h"

#include <immintrin.h>
#include <sched.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "clock.h"
#include "dispatch.h"
#include "gemm_amx.h"
#include "gemm_int4.h"
#include "gemm_op.h"
#include "moe_plan.h"
#include "thread_pool.h"

namespace hybrid {
namespace {

// out[i] = BF16(silu(g[i]) * u[i]), rounded to nearest even. exp(-g) is 2^n times a degree-6 polynomial on
// |r| <= ln2/2, so the loop vectorises (moe.cpp is built with -fno-trapping-math for its clamps; one clone per ISA).
// With gate_up's scatter into h (lane offsets computed once per piece) the SiLU step went from 8.6 to 3.4 ms of each
// thread's ~150-ms T = 512 layer on the H200 host (std::exp and amx_x_index per element before; perf notes, U11).
// Within 2.6e-7 of float64 silu(g) over 2 M draws (tests/kernels/test_moe.py holds it to 5e-7) wherever expf(-g)
// is finite (g > -88.7); below, as with expf, the denominator overflows and the result is -0; -inf and NaN give NaN.
// -g is clamped to [-87, 176] and 2^n built as two normal factors, so that the product overflows where expf does.
__attribute__((target_clones("avx512f", "avx2", "default"))) void silu_mul_bf16(const float* g, const float* u,
                                                                               int64_t n, uint16_t* out) {
  for (int64_t i = 0; i < n; ++i) {
    const float a = g[i];
    float x = -a;
    x = x > -87.0f ? x : -87.0f;  // a NaN x goes to a bound here; a / ... below is NaN anyway
    x = x < 176.0f ? x : 176.0f;
    const float nf = (x * 1.44269504f + 12582912.0f) - 12582912.0f;  // round(x / ln2)
    const float r = (x - nf * 0.693145752f) - nf * 1.42860677e-6f;   // x - n ln2, ln2 in two parts
    float q = 1.0f / 720;
    q = q * r + 1.0f / 120;
    q = q * r + 1.0f / 24;
    q = q * r + 1.0f / 6;
    q = q * r + 0.5f;
    q = q * r + 1.0f;
    q = q * r + 1.0f;
    const int32_t n1 = int32_t(nf) >> 1, n2 = int32_t(nf) - n1;  // n in [-126, 254]: both halves normal
    const int32_t b1 = (n1 + 127) << 23, b2 = (n2 + 127) << 23;
    float s1, s2;
    std::memcpy(&s1, &b1, 4);
    std::memcpy(&s2, &b2, 4);
    const float v = a / (1.0f + q * s1 * s2) * u[i];
    uint32_t b;
    std::memcpy(&b, &v, 4);
    out[i] = uint16_t((b + 0x7FFF + ((b >> 16) & 1)) >> 16);
  }
}

}  // namespace

void silu_mul(const View& g, const View& u, const View& out) {
  check_view(g, "g", {"float32"}, 1);
  check_view(u, "u", {"float32"}, 1);
  check_view(out, "out", {"bfloat16"}, 1);
  check_shape(u, "u", {g.dim(0)});
  check_shape(out, "out", {g.dim(0)});
  silu_mul_bf16(g.data<float>(), u.data<float>(), g.dim(0), out.data<uint16_t>());
}

namespace {

void fail(const std::string& msg) { throw std::invalid_argument(msg); }

// Spins until ready() holds; the time spent (if any) is added to waited.
template <class Ready>
void wait_until(Ready ready, std::atomic<int64_t>& waited) {
  if (ready()) return;
  const int64_t t0 = now_ns();
  while (!ready()) _mm_pause();
  waited.fetch_add(now_ns() - t0, std::memory_order_relaxed);
}

std::string at(const char* what, size_t e) { return std::string(what) + "[" + std::to_string(e) + "]"; }

}  // namespace

MoELayer::MoELayer(const std::vector<View>& gate, const std::vector<View>& gate_scale, const std::vector<View>& up,
                   const std::vector<View>& up_scale, const std::vector<View>& down,
                   const std::vector<View>& down_scale)
    : p_(std::make_unique<Plan>()) {
  const size_t E = gate.size();
  if (E == 0 || up.size() != E || down.size() != E) fail("gate, up and down need one weight per expert, same count");
  node_.assign(E, 0);
  check_view(gate[0], "gate[0]", {"float8_e4m3fn", "bfloat16", "int32"}, 2);  // before its dtype and dims are read
  wt_ = gate[0].dtype == "bfloat16" ? WeightType::bf16 : gate[0].dtype == "int32" ? WeightType::int4 : WeightType::fp8;
  if (wt_ == WeightType::int4) {
    add_int4_experts(gate, gate_scale, up, up_scale, down, down_scale);
    return;
  }
  const size_t n_scales = wt_ == WeightType::fp8 ? E : 0;
  if (gate_scale.size() != n_scales || up_scale.size() != n_scales || down_scale.size() != n_scales)
    fail(wt_ == WeightType::fp8 ? "FP8 experts need one scale per weight" : "BF16 experts take no scales");
  I_ = gate[0].dim(0);
  D_ = gate[0].dim(1);
  const char* dtype = wt_ == WeightType::fp8 ? "float8_e4m3fn" : "bfloat16";
  for (size_t e = 0; e < E; ++e) {
    const View* ws[3] = {&gate[e], &up[e], &down[e]};
    const char* names[3] = {"gate", "up", "down"};
    for (int j = 0; j < 3; ++j) check_view(*ws[j], at(names[j], e).c_str(), {dtype}, 2);
    check_shape(gate[e], at("gate", e).c_str(), {I_, D_});
    check_shape(up[e], at("up", e).c_str(), {I_, D_});
    check_shape(down[e], at("down", e).c_str(), {D_, I_});
    if (gate[e].strides[0] != up[e].strides[0]) fail(at("up", e) + ": row stride differs from gate's");
    Expert x{gate[e].data<const void>(), up[e].data<const void>(), down[e].data<const void>(), nullptr, nullptr,
             nullptr, gate[e].strides[0], down[e].strides[0], 0, 0};
    if (n_scales) {
      const int64_t gi = (I_ + kBlock - 1) / kBlock, gd = (D_ + kBlock - 1) / kBlock;
      const View* ss[3] = {&gate_scale[e], &up_scale[e], &down_scale[e]};
      const char* sn[3] = {"gate_scale", "up_scale", "down_scale"};
      for (int j = 0; j < 3; ++j) check_view(*ss[j], at(sn[j], e).c_str(), {"float32"}, 2);
      check_shape(gate_scale[e], at("gate_scale", e).c_str(), {gi, gd});
      check_shape(up_scale[e], at("up_scale", e).c_str(), {gi, gd});
      check_shape(down_scale[e], at("down_scale", e).c_str(), {gd, gi});
      if (gate_scale[e].strides[0] != up_scale[e].strides[0]) fail(at("up_scale", e) + ": row stride differs");
      x.gs = gate_scale[e].data<const float>();
      x.us = up_scale[e].data<const float>();
      x.ds = down_scale[e].data<const float>();
      x.lds_gu = gate_scale[e].strides[0];
      x.lds_d = down_scale[e].strides[0];
    }
    w_.push_back(x);
  }
}

MoELayer::~MoELayer() { wait(); }

int MoELayer::last_global_syncs() const { return p_->syncs.load(); }
double MoELayer::last_wait_s() const { return p_->wait_ns.load() * 1e-9; }
double MoELayer::last_tail_s() const { return p_->tail_ns.load() * 1e-9; }
std::map<std::string, double> MoELayer::last_stage_s() const {
  const Plan& p = *p_;
  return {{"prep", p.prep_ns.load() * 1e-9},
          {"gate_up", p.gate_up_ns.load() * 1e-9},
          {"silu", p.silu_ns.load() * 1e-9},
          {"down", p.down_ns.load() * 1e-9},
          {"sums", p.sums_ns.load() * 1e-9}};
}

void MoELayer::add_int4_experts(const std::vector<View>& gate, const std::vector<View>& gate_scale,
                                const std::vector<View>& up, const std::vector<View>& up_scale,
                                const std::vector<View>& down, const std::vector<View>& down_scale) {
  const size_t E = gate.size();
  if (gate_scale.size() != E || up_scale.size() != E || down_scale.size() != E)
    fail("INT4 experts need one scale per weight");
  check_view(down[0], "down[0]", {"int32"}, 2);
  I_ = gate[0].dim(0);
  D_ = down[0].dim(0);
  for (size_t e = 0; e < E; ++e) {
    check_int4(gate[e], &gate_scale[e], at("gate", e), at("gate_scale", e), I_, D_);
    check_int4(up[e], &up_scale[e], at("up", e), at("up_scale", e), I_, D_);
    check_int4(down[e], &down_scale[e], at("down", e), at("down_scale", e), D_, I_);
    if (gate[e].strides[0] != up[e].strides[0]) fail(at("up", e) + ": row stride differs from gate's");
    if (gate_scale[e].strides[0] != up_scale[e].strides[0]) fail(at("up_scale", e) + ": row stride differs");
    w_.push_back({gate[e].data<const void>(), up[e].data<const void>(), down[e].data<const void>(),
                  gate_scale[e].data<const void>(), up_scale[e].data<const void>(), down_scale[e].data<const void>(),
                  gate[e].strides[0], down[e].strides[0], gate_scale[e].strides[0], down_scale[e].strides[0]});
  }
}

GemmProblem MoELayer::problem(const uint16_t* x, int64_t ldx, const void* w, int64_t ldw, const void* scale,
                              int64_t lds, float* y, int64_t ldy, int64_t M, int64_t N, int64_t K) const {
  GemmProblem q{x, ldx, w, ldw, nullptr, lds, y, ldy, M, N, K, wt_};
  if (wt_ == WeightType::int4) q.group_scale = static_cast<const uint16_t*>(scale);
  else q.scale = static_cast<const float*>(scale);
  return q;
}

void MoELayer::submit(const View& x, const View& ids, const View& weights, const View& out, const std::string& isa,
                      std::function<void()> on_done) {
  if (pending_) fail("a previous submit() has not been waited for");
  plan(x, ids, weights, out);
  const int caller = pool().size() == 1 ? pool().caller_group() : -1;  // no worker: submit() runs it here
  schedule(isa, pool().participants(caller), caller);
  p_->on_done = std::move(on_done);
  pending_ = true;
  ticket_ = pool().submit([this](int worker) { run_job(worker); });
}

void MoELayer::forward(const View& x, const View& ids, const View& weights, const View& out, const std::string& isa) {
  if (pending_) fail("a previous submit() has not been waited for");
  plan(x, ids, weights, out);
  const int caller = pool().caller_group();
  schedule(isa, pool().participants(caller), caller);
  p_->on_done = nullptr;
  pool().run([this](int worker) { run_job(worker); });
  ++p_->syncs;  // the end of the job
}

void MoELayer::wait() {
  if (!pending_) return;
  pool().wait(ticket_);  // this layer's job only: another layer object's may be queued or running after it
  ++p_->syncs;  // the end of the job
  pending_ = false;
}

void MoELayer::prepare_expert(int e) {
  Plan& p = *p_;
  int expected = 0;
  if (p.prep[e].compare_exchange_strong(expected, 1)) {
    const int64_t t0 = now_ns();
    const int64_t base = p.row0[e];
    for (int64_t r = 0; r < p.rows[e]; ++r) {
      const uint16_t* x = p.x + p.token[base + r] * p.ldx;
      if (p.ldxq) int4_prepare_x(p.isa, x, p.ldx, 1, D_, p.xq.data() + (base + r) * p.ldxq);  // the gather itself
      else std::memcpy(p.xg.data() + (base + r) * D_, x, D_ * sizeof(uint16_t));
    }
    const GemmProblem q{p.xg.data() + base * D_, D_, nullptr, 0, nullptr, 0, nullptr, 0, p.rows[e], 0, D_, wt_};
    prepare_x_rows(p.isa, p.layout[e], q, p.xprep.data() + p.prow0[e] * p.ldxp);  // FP8, BF16
    p.prep_ns.fetch_add(now_ns() - t0, std::memory_order_relaxed);
    p.prep[e].store(2, std::memory_order_release);
  }
  wait_until([&] { return p.prep[e].load(std::memory_order_acquire) == 2; }, p.wait_ns);
}

void MoELayer::gate_up(int e, int64_t r0, int64_t r1, uint16_t* tile) {
  Plan& p = *p_;
  prepare_expert(e);
  const Expert& w = w_[p.used[e]];
  const int64_t base = p.row0[e], M = p.rows[e];
  const uint16_t* x = p.xg.data() + base * D_;
  const uint16_t* xprep = p.ldxq                            ? p.xq.data() + base * p.ldxq
                          : p.layout[e] == XLayout::plain ? nullptr
                                                          : p.xprep.data() + p.prow0[e] * p.ldxp;
  float* g = p.g.data() + base * I_;
  float* u = p.u.data() + base * I_;
  const int64_t t0 = now_ns();
  gemm_rows(p.isa, problem(x, D_, w.gate, w.ld_gu, w.gs, w.lds_gu, g, I_, M, I_, D_), xprep, r0, r1, tile);
  gemm_rows(p.isa, problem(x, D_, w.up, w.ld_gu, w.us, w.lds_gu, u, I_, M, I_, D_), xprep, r0, r1, tile);
  const int64_t t1 = now_ns();
  p.gate_up_ns.fetch_add(t1 - t0, std::memory_order_relaxed);
  // h in the layout the down kernel reads: row-major (lane order for the AVX-512 FP8 kernel) or the AMX layout
  const XLayout layout = p.layout[e];
  const bool lanes = layout == XLayout::avx512 && wt_ == WeightType::fp8;  // the BF16 kernel reads natural order
  uint16_t* h = p.h.data() + p.prow0[e] * p.ldh;
  // In the AMX layout the token rows past M, up to the token tile's end, are written too (zeros): the down tiles
  // multiply them (their outputs are dropped). Left holding whatever the scratch held before, they made the down
  // products of every expert with a partly filled token tile ~2x slower on the H200 test machine's Xeon (random
  // routing at T = 512: the down GEMMs' thread-seconds 6.7 -> 3.1 s over four layers; docs/perf/journal.md, U5-U6).
  const int64_t rows = layout == XLayout::amx ? amx_rows_padded(M) : M;
  constexpr int64_t kPiece = 256;
  uint16_t v[kPiece];
  int64_t at[kPiece];  // where lane i0 + j goes in a token's row (both layouts: a token part plus a lane part)
  for (int64_t i0 = r0; i0 < r1; i0 += kPiece) {
    const int64_t n = std::min(kPiece, r1 - i0);
    if (layout != XLayout::amx && !lanes) {  // natural order: straight into h
      for (int64_t m = 0; m < M; ++m) silu_mul_bf16(g + m * I_ + i0, u + m * I_ + i0, n, h + m * p.ldh + i0);
      continue;
    }
    for (int64_t j = 0; j < n; ++j)
      at[j] = layout == XLayout::amx ? amx_x_index(0, fp8_lane(i0 + j), p.ldh) : fp8_lane(i0 + j);
    for (int64_t m = 0; m < rows; ++m) {
      if (m < M) silu_mul_bf16(g + m * I_ + i0, u + m * I_ + i0, n, v);
      else std::memset(v, 0, sizeof(v));
      uint16_t* row = h + (layout == XLayout::amx ? amx_x_index(m, 0, p.ldh) : m * p.ldh);
      for (int64_t j = 0; j < n; ++j) row[at[j]] = v[j];
    }
  }
  const int64_t t2 = now_ns();
  p.silu_ns.fetch_add(t2 - t1, std::memory_order_relaxed);
  // INT4: the expert's last gate/up task (the count down to its + 1) prepares h for the down tasks, then lets them go
  if (p.gu_left[e].fetch_sub(1, std::memory_order_acq_rel) == 2 && p.ldhq) {
    int4_prepare_x(p.isa, h, p.ldh, M, I_, p.hq.data() + base * p.ldhq);
    p.prep_ns.fetch_add(now_ns() - t2, std::memory_order_relaxed);
    p.gu_left[e].fetch_sub(1, std::memory_order_release);
  }
}

void MoELayer::down(int e, int64_t r0, int64_t r1, uint16_t* tile) {
  Plan& p = *p_;
  wait_until([&] { return p.gu_left[e].load(std::memory_order_acquire) == 0; }, p.wait_ns);  // the expert's barrier
  const Expert& w = w_[p.used[e]];
  const int64_t base = p.row0[e];
  const uint16_t* h = p.h.data() + p.prow0[e] * p.ldh;
  const uint16_t* xprep = p.ldhq ? p.hq.data() + base * p.ldhq : p.layout[e] == XLayout::plain ? nullptr : h;
  const GemmProblem q = problem(h, p.ldh, w.down, w.ld_d, w.ds, w.lds_d, p.y.data() + base * D_, D_, p.rows[e], D_, I_);
  const int64_t t0 = now_ns();
  gemm_rows(p.isa, q, xprep, r0, r1, tile);
  const int64_t t1 = now_ns();
  p.down_ns.fetch_add(t1 - t0, std::memory_order_relaxed);
  const int64_t j = r0 / p.d_chunk;  // down tasks are whole chunks
  for (int64_t r = 0; r < p.rows[e]; ++r) {
    const int64_t t = p.token[base + r];
    if (p.reduce_left[t * p.n_chunks + j].fetch_sub(1, std::memory_order_acq_rel) == 1) reduce(t, r0, r1);
  }
  p.sums_ns.fetch_add(now_ns() - t1, std::memory_order_relaxed);
}

void MoELayer::reduce(int64_t t, int64_t d0, int64_t d1) {
  constexpr int64_t kPiece = 512;
  for (; d1 - d0 > kPiece; d0 += kPiece) reduce(t, d0, d0 + kPiece);
  Plan& p = *p_;
  float acc[kPiece];
  for (int64_t d = d0; d < d1; ++d) acc[d - d0] = 0.f;
  for (int64_t k = 0; k < p.K; ++k) {
    const int64_t row = p.slot_row[t * p.K + k];
    if (row < 0) continue;  // a skipped id
    const float wk = p.wts[t * p.ldw + k];
    const float* yr = p.y.data() + row * D_;
    for (int64_t d = d0; d < d1; ++d) acc[d - d0] += wk * yr[d];
  }
  if (p.out_bf16) {
    uint16_t* o = static_cast<uint16_t*>(p.out) + t * p.ldo;
    for (int64_t d = d0; d < d1; ++d) o[d] = float_to_bf16(acc[d - d0]);
  } else {
    float* o = static_cast<float*>(p.out) + t * p.ldo;
    for (int64_t d = d0; d < d1; ++d) o[d] = acc[d - d0];
  }
}

void MoELayer::run_job(int) {
  Plan& p = *p_;
  const int64_t scratch = scratch_elems(p.isa, std::max(D_, I_));
  uint16_t* tile = scratch ? thread_tile(scratch) : nullptr;
  int g = ThreadPool::worker_group();
  if (g < 0 || g >= p.groups) g = p.caller_group;  // the caller
  Plan::Queue& q = p.queues[g];
  for (int64_t i; (i = q.next.fetch_add(1)) < q.end;) {
    const Task& t = p.tasks[i];
    if (t.stage == 0) gate_up(t.expert, t.r0, t.r1, tile);
    else down(t.expert, t.r0, t.r1, tile);
    q.bytes.fetch_add(bytes_read(t), std::memory_order_relaxed);
    if (p.tracing) p.trace[i] = {p.used[t.expert], t.stage, t.r0, t.r1, g, ThreadPool::worker_index(), sched_getcpu()};
  }
  // A participant with no task left goes on to the pool's next job; the last one out ends the call. Each adds its
  // leaving time before it counts itself out; the last one turns the sum into the participants' idle time from
  // their leaving to the call's end (its clock read after the count: no leaving time is later).
  p.out_ns.fetch_add(now_ns(), std::memory_order_relaxed);
  if (p.arrived.fetch_add(1, std::memory_order_acq_rel) == p.threads - 1) {
    const int64_t end = now_ns();
    p.tail_ns.store(int64_t(p.threads) * end - p.out_ns.load(std::memory_order_relaxed), std::memory_order_relaxed);
    if (p.on_done) p.on_done();
  }
}

}  // namespace hybrid
