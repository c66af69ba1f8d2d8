// AVX2 chunk kernel of the MLA decode attention (decode_attention.h), FP32 FMAs (also the code of variant avx512,
// AVX-512 CPUs without BF16 instructions). The cache rows are widened to FP32 (a shift) into L1-resident staging,
// 8 or 16 at a time, and reused there by every head of the task; the task's queries are widened once per chunk,
// latent and rope dims side by side in one zero-padded row.
// - scores: per head pair and 4 positions, 8 accumulators along the row, one fixed hadd tree each;
// - exp: Cody-Waite reduction, a degree-6 polynomial and the exponent built by integer add; weights kept in FP32;
// - o = Σ_t p[t] kv[t]: 4 heads x 16 latents per step, rows in order, over blocks of 16 positions.
// Every head's numbers are the same whichever heads share its task (no sum crosses heads).
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <tuple>

#include "decode_attention.h"
#include "gemm.h"

namespace hybrid {
namespace {

constexpr int64_t kLd = kChunkPositions + 32;
constexpr int kRowsB = 16;  // rows widened per block of the weighted sum

inline int64_t padded(const AttentionProblem& p) { return (p.C + p.R + 31) / 32 * 32; }

inline __m256 widen8(const uint16_t* x) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x))), 16));
}

// dst[0 .. ld) = a's n1 values, then b's n2, then zeros; BF16 -> FP32.
void widen_row(const uint16_t* a, int64_t n1, const uint16_t* b, int64_t n2, float* dst, int64_t ld) {
  int64_t i = 0;
  for (; i + 8 <= n1; i += 8) _mm256_store_ps(dst + i, widen8(a + i));
  for (; i < n1; ++i) dst[i] = bf16_to_float(a[i]);
  for (int64_t j = 0; j < n2; ++j) dst[n1 + j] = bf16_to_float(b[j]);
  std::fill(dst + n1 + n2, dst + ld, 0.0f);
}

// Lane n = the sum of v[n]'s 8 lanes, by the same tree for every n.
inline __m256 reduce8(const __m256 (&v)[8]) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// s[h][t] = scale · qf[h] · row t for the task's heads, t in [0, n): the chunk's rows from `at`.
void scores(const AttentionProblem& p, ChunkRows at, int64_t n, int64_t heads, const float* qf, float* rows,
            float* s) {
  const int64_t ld = padded(p);
  for (int64_t t = 0; t < n; t += 4) {
    for (int i = 0; i < 4; ++i) {  // rows past n repeat the last one (never used)
      const int64_t row = std::min(t + i, n - 1);
      widen_row(at.kv + row * p.skvt, p.C, at.pe + row * p.spet, p.R, rows + i * ld, ld);
    }
    for (int64_t h = 0; h < heads; h += 2) {
      const int64_t g = std::min(h + 1, heads - 1);
      __m256 acc[8];
      for (auto& a : acc) a = _mm256_setzero_ps();
      for (int64_t c = 0; c < ld; c += 8) {
        const __m256 qa = _mm256_load_ps(qf + h * ld + c), qb = _mm256_load_ps(qf + g * ld + c);
        for (int i = 0; i < 4; ++i) {
          const __m256 r = _mm256_load_ps(rows + i * ld + c);
          acc[i] = _mm256_fmadd_ps(qa, r, acc[i]);
          acc[4 + i] = _mm256_fmadd_ps(qb, r, acc[4 + i]);
        }
      }
      alignas(32) float v[8];
      _mm256_store_ps(v, _mm256_mul_ps(reduce8(acc), _mm256_set1_ps(p.scale)));
      std::memcpy(s + h * kLd + t, v, 16);
      std::memcpy(s + g * kLd + t, v + 4, 16);
    }
  }
}

// e^x for x <= 0 (below -87: e^-87).
inline __m256 exp_neg(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
  __m256 y = _mm256_set1_ps(1.0f / 720);
  for (float c : {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(c));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// One head's scores turned into weights in place (0 from n to the row's next 8); returns (max, Σ weights).
std::pair<float, float> weights(float* s, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < n; ++t) m = std::max(m, s[t]);
  std::fill(s + n, s + (n + 7) / 8 * 8, -std::numeric_limits<float>::infinity());
  __m256 sum = _mm256_setzero_ps();
  for (int64_t t = 0; t < n; t += 8) {
    const __m256 x = _mm256_loadu_ps(s + t);
    const __m256 e = _mm256_and_ps(exp_neg(_mm256_sub_ps(x, _mm256_set1_ps(m))),
                                   _mm256_cmp_ps(x, _mm256_set1_ps(-std::numeric_limits<float>::infinity()),
                                                 _CMP_NEQ_OQ));
    _mm256_storeu_ps(s + t, e);
    sum = _mm256_add_ps(sum, e);
  }
  alignas(32) float v[8];
  _mm256_store_ps(v, sum);
  return {m, ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]))};
}

// o[h][c .. c + 16) += Σ_{t < nt} w[h][t] rows[t][c ..] for NH heads.
template <int NH>
inline void weighted(const float* rows, int64_t ld, int nt, const float* w, float* o, int64_t C, int64_t c) {
  __m256 acc[NH][2];
  for (int h = 0; h < NH; ++h) {
    acc[h][0] = _mm256_loadu_ps(o + h * C + c);
    acc[h][1] = _mm256_loadu_ps(o + h * C + c + 8);
  }
  for (int t = 0; t < nt; ++t) {
    const __m256 r0 = _mm256_load_ps(rows + t * ld + c), r1 = _mm256_load_ps(rows + t * ld + c + 8);
    for (int h = 0; h < NH; ++h) {
      const __m256 x = _mm256_broadcast_ss(w + h * kLd + t);
      acc[h][0] = _mm256_fmadd_ps(x, r0, acc[h][0]);
      acc[h][1] = _mm256_fmadd_ps(x, r1, acc[h][1]);
    }
  }
  for (int h = 0; h < NH; ++h) {
    _mm256_storeu_ps(o + h * C + c, acc[h][0]);
    _mm256_storeu_ps(o + h * C + c + 8, acc[h][1]);
  }
}

}  // namespace

void attention_chunk_avx2(const AttentionProblem& p, int64_t b, int64_t t0, int64_t t1, int64_t h0, int64_t h1,
                          float* m, float* l, float* o, float* scratch) {
  const int64_t n = t1 - t0, heads = h1 - h0, ld = padded(p);
  float* s = scratch;
  float* qf = s + heads * kLd;
  float* rows = qf + heads * ld;  // kRowsB rows
  for (int64_t h = 0; h < heads; ++h)
    widen_row(p.q + b * p.sqb + (h0 + h) * p.sqh, p.C, p.qpe + b * p.spb + (h0 + h) * p.sph, p.R, qf + h * ld, ld);
  const ChunkRows at = chunk_rows(p, b, t0);
  scores(p, at, n, heads, qf, rows, s);
  for (int64_t h = 0; h < heads; ++h) std::tie(m[h], l[h]) = weights(s + h * kLd, n);
  std::fill(o, o + heads * p.C, 0.0f);
  const int64_t cv = p.C / 16 * 16;
  for (int64_t t = 0; t < n; t += kRowsB) {
    const int nt = int(std::min<int64_t>(kRowsB, n - t));
    for (int i = 0; i < nt; ++i) widen_row(at.kv + (t + i) * p.skvt, p.C, nullptr, 0, rows + i * ld, ld);
    for (int64_t c = 0; c < cv; c += 16) {
      int64_t h = 0;
      for (; h + 4 <= heads; h += 4) weighted<4>(rows, ld, nt, s + h * kLd + t, o + h * p.C, p.C, c);
      for (; h < heads; ++h) weighted<1>(rows, ld, nt, s + h * kLd + t, o + h * p.C, p.C, c);
    }
    for (int64_t h = 0; h < heads; ++h)  // latents past the last 16
      for (int64_t c = cv; c < p.C; ++c)
        for (int i = 0; i < nt; ++i) o[h * p.C + c] += s[h * kLd + t + i] * rows[i * ld + c];
  }
}

}  // namespace hybrid
