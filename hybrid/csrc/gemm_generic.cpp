// The plain reference kernel: any CPU, exact FP8 decoding through a table, fp32 accumulation.
#include <cmath>
#include <vector>

#include "gemm.h"

namespace hybrid {

float fp8_to_float(uint8_t code) {
  const int sign = code >> 7, exp = (code >> 3) & 0xF, man = code & 0x7;
  if (exp == 0xF && man == 0x7) return NAN;
  const float mag = exp == 0 ? std::ldexp(float(man), -9) : std::ldexp(1.0f + man / 8.0f, exp - 7);
  return sign ? -mag : mag;
}

namespace {
struct Fp8Table {
  float v[256];
  Fp8Table() {
    for (int i = 0; i < 256; ++i) v[i] = fp8_to_float(uint8_t(i));
  }
};
const Fp8Table kTable;

float weight(const GemmProblem& p, int64_t n, int64_t k) {
  if (p.wt == WeightType::fp8) return kTable.v[static_cast<const uint8_t*>(p.w)[n * p.ldw + k]];
  return bf16_to_float(static_cast<const uint16_t*>(p.w)[n * p.ldw + k]);
}
}  // namespace

void gemm_rows_generic(const GemmProblem& p, int64_t n0, int64_t n1) {
  for (int64_t m = 0; m < p.M; ++m) {
    const uint16_t* x = p.x + m * p.ldx;
    for (int64_t n = n0; n < n1; ++n) {
      float acc = 0.f;
      for (int64_t kb = 0; kb < p.K; kb += kBlock) {
        float blk = 0.f;
        const int64_t ke = std::min(p.K, kb + kBlock);
        for (int64_t k = kb; k < ke; ++k) blk += weight(p, n, k) * bf16_to_float(x[k]);
        acc += p.scale ? blk * p.scale[(n / kBlock) * p.lds + kb / kBlock] : blk;
      }
      p.y[m * p.ldy + n] = acc;
    }
  }
}

}  // namespace hybrid
