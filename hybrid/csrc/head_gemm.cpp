// Entry point of the batched-head products (head_gemm.h): checks, the variant, heads split over the thread pool;
// and the plain reference kernel (any CPU).
#include "head_gemm.h"

#include <algorithm>
#include <atomic>
#include <stdexcept>

#include "cpu_features.h"
#include "dispatch.h"
#include "scratch.h"
#include "thread_pool.h"

namespace hybrid {

namespace {

void fail(const std::string& msg) { throw std::invalid_argument("head_gemm: " + msg); }

std::string dims(const std::vector<int64_t>& v) {
  std::string s;
  for (auto d : v) s += (s.empty() ? "" : ", ") + std::to_string(d);
  return "[" + s + "]";
}

// A bf16 3-D view with its last dimension contiguous and no negative strides.
void check3(const View& v, const char* name) {
  if (v.dtype != "bfloat16") fail(std::string(name) + ": dtype " + v.dtype + ", expected bfloat16");
  if (v.shape.size() != 3) fail(std::string(name) + ": expected 3 dimensions, got " + std::to_string(v.shape.size()));
  for (int d = 0; d < 3; ++d)
    if (v.strides[d] < 0) fail(std::string(name) + ": negative strides " + dims(v.strides));
  if (v.shape[2] > 1 && v.strides[2] != 1)
    fail(std::string(name) + ": last dimension must be contiguous (strides " + dims(v.strides) + ")");
}

// Bytes from the first element to one past the last (0 when empty).
std::pair<uintptr_t, uintptr_t> span(const View& v) {
  int64_t last = 0;
  for (size_t d = 0; d < v.shape.size(); ++d) {
    if (v.shape[d] == 0) return {v.ptr, v.ptr};
    last += (v.shape[d] - 1) * v.strides[d];
  }
  return {v.ptr, v.ptr + uintptr_t(last + 1) * 2};
}

bool overlap(const View& a, const View& b) {
  const auto [a0, a1] = span(a);
  const auto [b0, b1] = span(b);
  return a0 < a1 && b0 < b1 && a0 < b1 && b0 < a1;
}

enum class HeadCode { generic, avx2, avx512 };

// "" when the CPU has what the AVX-512 code needs, else which features it lacks.
const std::string& avx512_lacks() {
  static const std::string lacks = [] {
    const auto f = cpu_features();
    std::string out;
    for (const char* n : {"avx512f", "avx512bw", "avx512vl"})
      if (!f.at(n)) out += (out.empty() ? "" : ", ") + std::string(n);
    return out;
  }();
  return lacks;
}

// auto: the AVX-512 code wherever the CPU has AVX-512 F/BW/VL, also where the GEMM's best variant is avx512 or
// avx2 (AVX-512 without BF16: on such a Xeon the AVX-512 code reads the key half at 36 GB/s per thread from L2
// against the AVX2 code's 30, 16-17 against 13-14 GB/s from memory on 2 threads; docs/perf/journal.md); a named
// variant runs its own ISA's code (policy.cpu.kernel=avx2 forces the AVX2 code, as for the GEMM).
HeadCode head_code(const std::string& name) {
  if (name == "avx512") {
    const std::string& lacks = avx512_lacks();
    if (!lacks.empty()) throw std::invalid_argument("CPU kernel 'avx512' needs " + lacks + ", which this CPU lacks");
    return HeadCode::avx512;
  }
  if (name == "auto" && avx512_lacks().empty()) return HeadCode::avx512;
  switch (resolve_isa(name)) {  // the GEMM's variant names and checks; each variant's CPUs have the code's ISA
    case Isa::amx:
    case Isa::avx512_bf16:
    case Isa::avx512: return HeadCode::avx512;
    case Isa::avx2: return HeadCode::avx2;
    default: return HeadCode::generic;  // generic, amx_emulated
  }
}

}  // namespace

// The reference: every output one FP32 sum in input order, rounded once.
void head_rows_generic(const HeadProblem& p, int64_t h0, int64_t h1, float* scratch) {
  const int64_t ldx = head_pad(p.I), lda = head_pad(p.O);
  float* xf = scratch;
  float* acc = scratch + p.M * ldx;
  for (int64_t h = h0; h < h1; ++h) {
    const uint16_t* w = p.w + h * p.swh;
    for (int64_t m = 0; m < p.M; ++m)
      for (int64_t i = 0; i < p.I; ++i) xf[m * ldx + i] = bf16_to_float(p.x[m * p.sxm + h * p.sxh + i]);
    for (int64_t m = 0; m < p.M; ++m) {
      uint16_t* y = p.y + m * p.sym + h * p.syh;
      const float* x = xf + m * ldx;
      if (p.by_rows) {
        float* a = acc + m * lda;
        std::fill(a, a + p.O, 0.0f);
        for (int64_t i = 0; i < p.I; ++i)
          for (int64_t o = 0; o < p.O; ++o) a[o] += x[i] * bf16_to_float(w[i * p.swr + o]);
        for (int64_t o = 0; o < p.O; ++o) y[o] = head_round(a[o]);
      } else {
        for (int64_t o = 0; o < p.O; ++o) {
          float s = 0.0f;
          for (int64_t i = 0; i < p.I; ++i) s += x[i] * bf16_to_float(w[o * p.swr + i]);
          y[o] = head_round(s);
        }
      }
    }
  }
}

std::string head_isa(const std::string& isa) {
  switch (head_code(isa)) {
    case HeadCode::avx512: return "avx512";
    case HeadCode::avx2: return "avx2";
    default: return "generic";
  }
}

void head_gemm(const View& x, const View& w, const View& y, bool by_rows, const std::string& isa) {
  check3(x, "x");
  check3(w, "w");
  check3(y, "y");
  const int64_t M = x.dim(0), H = x.dim(1), I = x.dim(2);
  const int64_t O = by_rows ? w.dim(2) : w.dim(1);
  const int64_t wI = by_rows ? w.dim(1) : w.dim(2);
  if (w.dim(0) != H || wI != I)
    fail("w: shape " + dims(w.shape) + " does not fit x " + dims(x.shape) + (by_rows ? " (by rows: w is [H, I, O])"
                                                                                  : " (by columns: w is [H, O, I])"));
  if (y.shape != std::vector<int64_t>{M, H, O}) fail("y: shape " + dims(y.shape) + ", expected " + dims({M, H, O}));
  const int64_t dense[3] = {H * O, O, 1};
  for (int d = 0; d < 3; ++d)
    if (y.shape[d] > 1 && y.strides[d] != dense[d]) fail("y: must be contiguous (strides " + dims(y.strides) + ")");
  if (overlap(y, x) || overlap(y, w)) fail("y overlaps an input");
  for (const View* v : {&x, &w})
    if (!v->ptr && span(*v).first != span(*v).second) fail("null data pointer");
  const HeadCode code = head_code(isa);
  HeadProblem p{x.data<const uint16_t>(), x.strides[0], x.strides[1], w.data<const uint16_t>(), w.strides[0],
                w.strides[1], y.data<uint16_t>(), y.strides[0], y.strides[1], M, H, I, O, by_rows};
  if (M == 0 || H == 0 || O == 0) return;
  auto rows = code == HeadCode::avx512 ? head_rows_avx512 : code == HeadCode::avx2 ? head_rows_avx2
                                                                                    : head_rows_generic;
  ThreadPool& tp = pool();
  // a few chunks per thread (a co-tenant can stall one thread), each a run of heads read in address order
  const int64_t chunk = std::max<int64_t>(1, (H + 4 * tp.size() - 1) / (4 * tp.size()));
  std::atomic<int64_t> next{0};
  tp.run([&](int) {
    thread_local Scratch<float> buf;
    float* scratch = buf.get(head_scratch_floats(p));
    for (int64_t h0; (h0 = next.fetch_add(chunk)) < p.H;) rows(p, h0, std::min(p.H, h0 + chunk), scratch);
  });
}

}  // namespace hybrid
