// INT4 GEMM: its checks, the variants' fallback table and the plain reference kernel (any CPU).
#include "gemm_int4.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace hybrid {

namespace {
void fail(const std::string& msg) { throw std::invalid_argument(msg); }
int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
}  // namespace

void check_int4(const View& w, const View* scale, const std::string& w_name, const std::string& s_name, int64_t N,
                int64_t K) {
  check_view(w, w_name.c_str(), {"int32"}, 2);
  check_shape(w, w_name.c_str(), {N, ceil_div(K, kPerWord)});
  if (!scale) fail(s_name + ": INT4 weights need their weight_scale");
  check_view(*scale, s_name.c_str(), {"bfloat16"}, 2);
  check_shape(*scale, s_name.c_str(), {N, ceil_div(K, kGroup)});
}

GemmProblem make_int4_problem(const View& x, const View& w, const View* scale, const View& y) {
  check_view(x, "x", {"bfloat16"}, 2);
  check_view(y, "y", {"float32"}, 2);
  const int64_t M = x.dim(0), K = x.dim(1), N = w.shape.empty() ? 0 : w.dim(0);
  check_int4(w, scale, "w", "scale", N, K);
  check_shape(y, "y", {M, N});
  GemmProblem p{x.data<const uint16_t>(), x.strides[0], w.data<const void>(), w.strides[0], nullptr,
                scale->strides[0], y.data<float>(), y.strides[0], M, N, K, WeightType::int4};
  p.group_scale = scale->data<const uint16_t>();
  return p;
}

// Variant -> INT4 kernel. amx: the AVX-512 BF16 kernel at every token count (no AMX tiles for INT4 weights yet);
// avx512 (no BF16 instructions): the AVX2 kernel; amx_emulated (tests of the FP8 tiling): the reference.
namespace {
Isa int4_kernel(Isa isa) {
  switch (isa) {
    case Isa::amx:
    case Isa::avx512_bf16: return Isa::avx512_bf16;
    case Isa::avx512:
    case Isa::avx2: return Isa::avx2;
    default: return Isa::generic;
  }
}
}  // namespace

int64_t int4_x_elems(Isa isa, int64_t K) {
  switch (int4_kernel(isa)) {
    case Isa::avx512_bf16: return int4_x_elems_avx512_bf16(K);
    case Isa::avx2: return int4_x_elems_avx2(K);
    default: return 0;
  }
}

void int4_prepare_x(Isa isa, const uint16_t* x, int64_t ldx, int64_t M, int64_t K, uint16_t* out) {
  switch (int4_kernel(isa)) {
    case Isa::avx512_bf16: return int4_prepare_x_avx512_bf16(x, ldx, M, K, out);
    case Isa::avx2: return int4_prepare_x_avx2(x, ldx, M, K, reinterpret_cast<float*>(out));
    default: return;
  }
}

void int4_rows(Isa isa, const GemmProblem& p, const uint16_t* xprep, int64_t n0, int64_t n1) {
  switch (int4_kernel(isa)) {
    case Isa::avx512_bf16: return int4_rows_avx512_bf16(p, xprep, n0, n1);
    case Isa::avx2: return int4_rows_avx2(p, reinterpret_cast<const float*>(xprep), n0, n1);
    default: return int4_rows_generic(p, n0, n1);
  }
}

void int4_rows_generic(const GemmProblem& p, int64_t n0, int64_t n1) {
  const uint32_t* words = static_cast<const uint32_t*>(p.w);
  for (int64_t m = 0; m < p.M; ++m) {
    const uint16_t* x = p.x + m * p.ldx;
    for (int64_t n = n0; n < n1; ++n) {
      const uint32_t* w = words + n * p.ldw;
      float acc = 0.f;
      for (int64_t k0 = 0; k0 < p.K; k0 += kGroup) {
        float group = 0.f;
        for (int64_t k = k0; k < std::min(p.K, k0 + kGroup); ++k) {
          const int q = int((w[k / kPerWord] >> (4 * (k % kPerWord))) & 0xF) - 8;
          group += float(q) * bf16_to_float(x[k]);
        }
        acc += group * bf16_to_float(p.group_scale[n * p.lds + k0 / kGroup]);
      }
      p.y[m * p.ldy + n] = acc;
    }
  }
}

}  // namespace hybrid
