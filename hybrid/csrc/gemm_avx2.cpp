// AVX2 + FMA kernel (compiled with -mavx2 -mfma): fp32 arithmetic, 8 weights per vector. FP8 -> fp32 exactly:
// normal codes by placing exponent and mantissa bits and adding the exponent bias, subnormal codes by m * 2^-9.
#include <immintrin.h>

#include "gemm.h"

namespace hybrid {
namespace {

inline __m256 fp8x8(const uint8_t* p) {
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i mag = _mm256_and_si256(b, _mm256_set1_epi32(0x7F));
  const __m256 normal = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(mag, 20), _mm256_set1_epi32(120 << 23)));
  const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(1.0f / 512));
  const __m256 is_sub = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), mag));
  const __m256 sign = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24));
  return _mm256_or_ps(_mm256_blendv_ps(normal, sub, is_sub), sign);
}

inline __m256 bf16x8(const uint16_t* p) {
  const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

inline __m256 weights8(const GemmProblem& p, int64_t n, int64_t k) {
  if (p.wt == WeightType::fp8) return fp8x8(static_cast<const uint8_t*>(p.w) + n * p.ldw + k);
  return bf16x8(static_cast<const uint16_t*>(p.w) + n * p.ldw + k);
}

inline float weight1(const GemmProblem& p, int64_t n, int64_t k) {
  if (p.wt == WeightType::fp8) return fp8_to_float(static_cast<const uint8_t*>(p.w)[n * p.ldw + k]);
  return bf16_to_float(static_cast<const uint16_t*>(p.w)[n * p.ldw + k]);
}

float row_dot(const GemmProblem& p, const float* x, int64_t n) {
  float acc = 0.f;
  for (int64_t kb = 0; kb < p.K; kb += kBlock) {
    const int64_t ke = p.K < kb + kBlock ? p.K : kb + kBlock;
    __m256 blk = _mm256_setzero_ps();
    int64_t k = kb;
    for (; k + 8 <= ke; k += 8) blk = _mm256_fmadd_ps(weights8(p, n, k), _mm256_loadu_ps(x + k), blk);
    float b = hsum(blk);
    for (; k < ke; ++k) b += weight1(p, n, k) * x[k];
    acc += p.scale ? b * p.scale[(n / kBlock) * p.lds + kb / kBlock] : b;
  }
  return acc;
}

}  // namespace

void gemm_rows_avx2(const GemmProblem& p, int64_t n0, int64_t n1) {
  float* x = thread_floats(p.K);
  for (int64_t m = 0; m < p.M; ++m) {
    for (int64_t k = 0; k < p.K; ++k) x[k] = bf16_to_float(p.x[m * p.ldx + k]);
    for (int64_t n = n0; n < n1; ++n) p.y[m * p.ldy + n] = row_dot(p, x, n);
  }
}

}  // namespace hybrid
