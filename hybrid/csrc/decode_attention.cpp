// Entry point of the MLA decode attention (decode_attention.h): checks (the block table's entries where sequences
// read), the variant, the two schedules over the thread pool, the in-order merge of chunks; and the plain reference
// chunk kernel (any CPU).
#include "decode_attention.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <vector>

#include "dispatch.h"
#include "gemm.h"
#include "scratch.h"
#include "thread_pool.h"

namespace hybrid {

namespace {

std::atomic<int> g_schedule{0};

void fail(const std::string& msg) { throw std::invalid_argument("decode_attention: " + msg); }

std::string dims(const std::vector<int64_t>& v) {
  std::string s;
  for (auto d : v) s += (s.empty() ? "" : ", ") + std::to_string(d);
  return "[" + s + "]";
}

void check(const View& v, const char* name, const char* dtype, std::vector<int64_t> shape) {
  if (v.dtype != dtype) fail(std::string(name) + ": dtype " + v.dtype + ", expected " + dtype);
  if (v.shape != shape) fail(std::string(name) + ": shape " + dims(v.shape) + ", expected " + dims(shape));
  for (size_t d = 0; d < v.shape.size(); ++d)
    if (v.strides[d] < 0) fail(std::string(name) + ": negative strides " + dims(v.strides));
  if (v.shape.back() > 1 && v.strides.back() != 1)
    fail(std::string(name) + ": last dimension must be contiguous (strides " + dims(v.strides) + ")");
  if (!v.ptr) fail(std::string(name) + ": null data pointer");
}

// The next chunk's partials (m_j, l_j, o_j of `heads` heads) merged into the running (m, l, acc): the usual
// rescaling by the new running max. The only merge either schedule uses, always in chunk order.
void fold(int64_t heads, int64_t C, const float* mj, const float* lj, const float* oj, float* m, float* l,
          float* acc) {
  for (int64_t h = 0; h < heads; ++h) {
    const float top = std::max(m[h], mj[h]);
    const float keep = std::exp(m[h] - top), add = std::exp(mj[h] - top);
    float* a = acc + h * C;
    const float* o = oj + h * C;
    for (int64_t c = 0; c < C; ++c) a[c] = a[c] * keep + o[c] * add;
    l[h] = l[h] * keep + lj[h] * add;
    m[h] = top;
  }
}

void start(int64_t heads, int64_t C, float* m, float* l, float* acc) {
  std::fill(m, m + heads, -std::numeric_limits<float>::infinity());
  std::fill(l, l + heads, 0.0f);
  std::fill(acc, acc + heads * C, 0.0f);
}

void finish(int64_t heads, int64_t C, const float* l, float* acc) {
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t c = 0; c < C; ++c) acc[h * C + c] /= l[h];
}

int64_t chunks_of(const AttentionProblem& p, int64_t b) { return (p.lengths[b] + kChunkPositions - 1) / kChunkPositions; }

// Heads schedule: a task is (sequence, group of heads), its chunks done and folded in order.
void run_heads(const AttentionProblem& p, ChunkKernel chunk, int64_t group) {
  const int64_t groups = (p.H + group - 1) / group, tasks = p.B * groups;
  std::atomic<int64_t> next{0};
  pool().run([&](int) {
    thread_local Scratch<float> buf;
    const int64_t own = (4 * group + group * p.C + 15) / 16 * 16;  // the chunk kernel's scratch 64-byte aligned
    float* m = buf.get(own + chunk_scratch_floats(p, group));
    float *l = m + group, *mj = l + group, *lj = mj + group, *oj = lj + group;
    float* scratch = m + own;
    for (int64_t t; (t = next.fetch_add(1)) < tasks;) {
      const int64_t b = t / groups, h0 = t % groups * group, h1 = std::min(p.H, h0 + group), n = h1 - h0;
      float* acc = p.out + (b * p.H + h0) * p.C;
      start(n, p.C, m, l, acc);
      for (int64_t t0 = 0; t0 < p.lengths[b]; t0 += kChunkPositions) {
        chunk(p, b, t0, std::min(p.lengths[b], t0 + kChunkPositions), h0, h1, mj, lj, oj, scratch);
        fold(n, p.C, mj, lj, oj, m, l, acc);
      }
      finish(n, p.C, l, acc);
    }
  });
}

// Split-K schedule: a task per (sequence, chunk) with every head, partials in the caller's scratch; then a merge
// task per (sequence, group of heads) folds that sequence's chunks in order.
void run_split(const AttentionProblem& p, ChunkKernel chunk, int64_t group) {
  std::vector<int64_t> first(p.B + 1, 0);  // the sequence's first chunk among all
  for (int64_t b = 0; b < p.B; ++b) first[b + 1] = first[b] + chunks_of(p, b);
  const int64_t total = first[p.B], per = p.H * (p.C + 2);  // a chunk's partials: o [H, C], m [H], l [H]
  thread_local Scratch<float> parts;
  float* part = parts.get(total * per);
  std::atomic<int64_t> next{0};
  ThreadPool& tp = pool();
  tp.run([&](int) {
    thread_local Scratch<float> buf;
    float* scratch = buf.get(chunk_scratch_floats(p, p.H));
    for (int64_t j; (j = next.fetch_add(1)) < total;) {
      const int64_t b = std::upper_bound(first.begin(), first.end(), j) - first.begin() - 1;
      const int64_t t0 = (j - first[b]) * kChunkPositions;
      float* o = part + j * per;
      chunk(p, b, t0, std::min(p.lengths[b], t0 + kChunkPositions), 0, p.H, o + p.H * p.C, o + p.H * p.C + p.H, o, scratch);
    }
  });
  const int64_t groups = (p.H + group - 1) / group, tasks = p.B * groups;
  next = 0;
  tp.run([&](int) {
    thread_local Scratch<float> buf;
    float *m = buf.get(2 * group), *l = m + group;
    for (int64_t t; (t = next.fetch_add(1)) < tasks;) {
      const int64_t b = t / groups, h0 = t % groups * group, n = std::min(p.H, h0 + group) - h0;
      float* acc = p.out + (b * p.H + h0) * p.C;
      start(n, p.C, m, l, acc);
      for (int64_t j = first[b]; j < first[b + 1]; ++j) {
        const float* o = part + j * per;
        fold(n, p.C, o + p.H * p.C + h0, o + p.H * p.C + p.H + h0, o + h0 * p.C, m, l, acc);
      }
      finish(n, p.C, l, acc);
    }
  });
}

enum class Code { generic, avx2, avx512_bf16 };

Code code_for(const std::string& name) {
  switch (resolve_isa(name)) {  // the GEMM's names and checks: each variant's CPUs have its code's ISA
    case Isa::amx:
    case Isa::avx512_bf16: return Code::avx512_bf16;
    case Isa::avx512:
    case Isa::avx2: return Code::avx2;
    default: return Code::generic;  // generic, amx_emulated
  }
}

}  // namespace

// The reference: per head, each score one FP32 sum over the latent then the rope dims in order, exp by libm,
// each latent output one FP32 sum over the positions in order.
void attention_chunk_generic(const AttentionProblem& p, int64_t b, int64_t t0, int64_t t1, int64_t h0, int64_t h1,
                             float* m, float* l, float* o, float* scratch) {
  const auto [kv, pe] = chunk_rows(p, b, t0);
  const int64_t n = t1 - t0;
  float* s = scratch;
  for (int64_t h = h0; h < h1; ++h) {
    const uint16_t* q = p.q + b * p.sqb + h * p.sqh;
    const uint16_t* qp = p.qpe + b * p.spb + h * p.sph;
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < n; ++t) {
      float acc = 0.0f;
      for (int64_t c = 0; c < p.C; ++c) acc += bf16_to_float(q[c]) * bf16_to_float(kv[t * p.skvt + c]);
      for (int64_t r = 0; r < p.R; ++r) acc += bf16_to_float(qp[r]) * bf16_to_float(pe[t * p.spet + r]);
      s[t] = acc * p.scale;
      top = std::max(top, s[t]);
    }
    float sum = 0.0f;
    float* out = o + (h - h0) * p.C;
    std::fill(out, out + p.C, 0.0f);
    for (int64_t t = 0; t < n; ++t) {
      const float e = std::exp(s[t] - top);
      sum += e;
      for (int64_t c = 0; c < p.C; ++c) out[c] += e * bf16_to_float(kv[t * p.skvt + c]);
    }
    m[h - h0] = top;
    l[h - h0] = sum;
  }
}

std::string attention_code(const std::string& isa) {
  switch (code_for(isa)) {
    case Code::avx512_bf16: return "avx512_bf16";
    case Code::avx2: return "avx2";
    default: return "generic";
  }
}

void set_attention_schedule(int schedule) {
  if (schedule < 0 || schedule > 2) fail("schedule: 0 (by the batch), 1 (split-K) or 2 (heads)");
  g_schedule = schedule;
}

void decode_attention(const View& q, const View& qpe, const View& kv, const View& pe, const View& table,
                      const View& slots, const View& lengths, const View& out, double scale, const std::string& isa) {
  if (q.shape.size() != 3 || kv.shape.size() != 3 || pe.shape.size() != 3)
    fail("q [B, H, C], kv [N, P, C] and pe [N, P, R] are 3-D; got " + dims(q.shape) + ", " + dims(kv.shape) + ", " +
         dims(pe.shape));
  if (table.shape.size() != 2) fail("table [slots, blocks per slot] is 2-D; got " + dims(table.shape));
  const int64_t B = q.dim(0), H = q.dim(1), C = q.dim(2), N = kv.dim(0), P = kv.dim(1), R = pe.dim(2);
  const int64_t S = table.dim(0), M = table.dim(1);
  if (B == 0 || H == 0) return;
  check(q, "q_lat", "bfloat16", {B, H, C});
  check(qpe, "q_pe", "bfloat16", {B, H, R});
  check(kv, "kv", "bfloat16", {N, P, C});
  check(pe, "pe", "bfloat16", {N, P, R});
  check(table, "table", "int64", {S, M});
  check(slots, "slots", "int64", {B});
  check(lengths, "lengths", "int64", {B});
  check(out, "out", "float32", {B, H, C});
  if (out.strides != std::vector<int64_t>{H * C, C, 1} && B * H * C > 1) fail("out: must be contiguous");
  if (C < 1) fail("the latent dimension is empty");
  const int64_t *tab = table.data<const int64_t>(), *sl = slots.data<const int64_t>(),
                *len = lengths.data<const int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    const std::string at = "[" + std::to_string(b) + "] = ";
    if (sl[b] < 0 || sl[b] >= S) fail("slots" + at + std::to_string(sl[b]) + " outside 0.." + std::to_string(S - 1));
    if (len[b] < 1 || len[b] > M * P)
      fail("lengths" + at + std::to_string(len[b]) + " outside 1.." + std::to_string(M * P) + " (" +
           std::to_string(M) + " blocks of " + std::to_string(P) + " positions)");
    if (len[b] > P && P % kChunkPositions)
      fail("lengths" + at + std::to_string(len[b]) + " spans several blocks of " + std::to_string(P) +
           " positions: a sequence past its first block needs P a multiple of " + std::to_string(kChunkPositions));
    for (int64_t j = 0; j < (len[b] + P - 1) / P; ++j) {
      const int64_t id = tab[sl[b] * table.strides[0] + j];
      if (id < 0 || id >= N)
        fail("table[" + std::to_string(sl[b]) + ", " + std::to_string(j) + "] = " + std::to_string(id) +
             " (sequence " + std::to_string(b) + "'s block) outside 0.." + std::to_string(N - 1));
    }
  }
  const Code code = code_for(isa);
  const AttentionProblem p{q.data<const uint16_t>(), q.strides[0], q.strides[1], qpe.data<const uint16_t>(),
                           qpe.strides[0], qpe.strides[1], kv.data<const uint16_t>(), kv.strides[0], kv.strides[1],
                           pe.data<const uint16_t>(), pe.strides[0], pe.strides[1], tab, table.strides[0], P, sl,
                           len, out.data<float>(), B, H, C, R, float(scale)};
  const ChunkKernel chunk = code == Code::avx512_bf16 ? attention_chunk_avx512_bf16
                            : code == Code::avx2      ? attention_chunk_avx2
                                                      : attention_chunk_generic;
  const int64_t threads = pool().size();
  int64_t chunks = 0;
  for (int64_t b = 0; b < B; ++b) chunks += chunks_of(p, b);
  // split-K once there are chunks enough to keep every thread busy; short contexts split the heads instead (each
  // group re-reads its sequence's few chunks, a small cache). Groups of at least 8 heads keep the queries' loads
  // amortised. Either way the same numbers (decode_attention.h).
  const int schedule = g_schedule ? g_schedule.load() : chunks >= 2 * threads ? 1 : 2;
  const int64_t per_seq = std::max<int64_t>(1, (2 * threads + B - 1) / B);
  const int64_t group = std::max<int64_t>(std::min<int64_t>(8, H), (H + per_seq - 1) / per_seq);
  if (schedule == 1) run_split(p, chunk, std::max<int64_t>(1, std::min<int64_t>(group, 16)));
  else run_heads(p, chunk, group);
}

}  // namespace hybrid
