// AVX2 + FMA INT4 kernel (compiled with -mavx2 -mfma): fp32 arithmetic, 8 weights per vector.
//
// Each int32 word is broadcast and shifted right by 0, 4, ..., 28 per lane: its 8 nibbles in column order, minus 8,
// converted to fp32 exactly. The activations are prepared in fp32 (int4_prepare_x_avx2: zero past K, so a row's
// padding nibbles multiply zeros), once for every call over them; each group's words are multiplied with up to 4
// tokens into per-group accumulators, then the group's scale is applied with one FMA; one horizontal sum per output
// at the end.
#include <immintrin.h>

#include "gemm_int4.h"

namespace hybrid {
namespace {

constexpr int kTokens = 4;  // tokens sharing each decoded word
constexpr int64_t kWordsPerGroup = kGroup / kPerWord;

inline __m256 weights8(uint32_t word) {
  const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
  const __m256i nibbles = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(int(word)), shifts),
                                           _mm256_set1_epi32(0xF));
  return _mm256_cvtepi32_ps(_mm256_sub_epi32(nibbles, _mm256_set1_epi32(8)));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// Tokens [m0, m0 + MT) of rows [n0, n1); xf: their activations in fp32, row stride ld (whole words, zero past K).
template <int MT>
void rows(const GemmProblem& p, const float* xf, int64_t ld, int64_t m0, int64_t n0, int64_t n1) {
  const int64_t words = (p.K + kPerWord - 1) / kPerWord, groups = (p.K + kGroup - 1) / kGroup;
  for (int64_t n = n0; n < n1; ++n) {
    const uint32_t* w = static_cast<const uint32_t*>(p.w) + n * p.ldw;
    const uint16_t* s = p.group_scale + n * p.lds;
    __m256 total[MT];
    for (int t = 0; t < MT; ++t) total[t] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      __m256 acc[MT];
      for (int t = 0; t < MT; ++t) acc[t] = _mm256_setzero_ps();
      const int64_t j1 = (g + 1) * kWordsPerGroup < words ? (g + 1) * kWordsPerGroup : words;
      for (int64_t j = g * kWordsPerGroup; j < j1; ++j) {
        const __m256 wv = weights8(w[j]);
        for (int t = 0; t < MT; ++t) acc[t] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xf + t * ld + j * kPerWord), acc[t]);
      }
      const __m256 scale = _mm256_set1_ps(bf16_to_float(s[g]));
      for (int t = 0; t < MT; ++t) total[t] = _mm256_fmadd_ps(acc[t], scale, total[t]);
    }
    for (int t = 0; t < MT; ++t) p.y[(m0 + t) * p.ldy + n] = hsum(total[t]);
  }
}

}  // namespace

int64_t int4_x_elems_avx2(int64_t K) { return 2 * ((K + kPerWord - 1) / kPerWord * kPerWord); }

void int4_prepare_x_avx2(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, float* out) {
  const int64_t ld = int4_x_elems_avx2(K) / 2;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < ld; ++k) out[m * ld + k] = k < K ? bf16_to_float(x[m * ldx + k]) : 0.f;
}

void int4_rows_avx2(const GemmProblem& p, const float* xprep, int64_t n0, int64_t n1) {
  const int64_t ld = int4_x_elems_avx2(p.K) / 2;
  if (!xprep) {  // prepared here, for this call's tokens only
    float* buf = thread_floats(p.M * ld);
    int4_prepare_x_avx2(p.x, p.ldx, p.M, p.K, buf);
    xprep = buf;
  }
  for (int64_t m0 = 0; m0 < p.M; m0 += kTokens) {
    const float* xf = xprep + m0 * ld;
    switch (p.M - m0 < kTokens ? p.M - m0 : kTokens) {
      case 1: rows<1>(p, xf, ld, m0, n0, n1); break;
      case 2: rows<2>(p, xf, ld, m0, n0, n1); break;
      case 3: rows<3>(p, xf, ld, m0, n0, n1); break;
      default: rows<4>(p, xf, ld, m0, n0, n1);
    }
  }
}

}  // namespace hybrid
