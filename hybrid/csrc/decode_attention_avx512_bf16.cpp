// AVX-512 BF16 chunk kernel of the MLA decode attention (decode_attention.h), on vdpbf16ps throughout: at 128
// heads the attention is bound by its products (each cached position meets every head: ~2,200 FLOPs per 1,152
// bytes), not by reading the cache, so the products take the widest instruction there is.
// - scores: per head pair and block of 8 positions, 16 accumulators along the latent then rope dims (the query
//   and the cache rows as they are: 32 BF16 per step, products exact, summed in pairs), then one fixed reduction
//   tree per accumulator;
// - exp: Cody-Waite reduction and a degree-6 polynomial; the weights rounded to BF16 (RNE), l their sum;
// - o = Σ_t p[t] kv[t]: rows t, t+1 interleaved (unpack) into pairs along the latent, the weights' pair
//   broadcast, 8 heads x 32 latents per step; the lanes put back in order at the store.
// Every head's numbers are the same whichever heads share its task (no sum crosses heads).
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <tuple>

#include "decode_attention.h"

namespace hybrid {
namespace {

constexpr int64_t kSeg = 32;  // BF16 per vector
constexpr int64_t kLd = kChunkPositions + 32;  // a head's row of scores (floats) and of weights (BF16)

inline __mmask32 first(int64_t n) { return n >= kSeg ? ~__mmask32(0) : n <= 0 ? 0 : __mmask32((1u << n) - 1); }
inline __m512bh bh(__m512i v) { return (__m512bh)v; }

// Lane n = the sum of v[n]'s 16 lanes, by the same tree for every n.
inline __m512 reduce16(__m512 (&v)[16]) {
  __m512 w[8], u[4], z[2];
  for (int i = 0; i < 8; ++i)
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 4; ++i)
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int i = 0; i < 2; ++i)
    z[i] = _mm512_add_ps(_mm512_unpacklo_ps(u[2 * i], u[2 * i + 1]), _mm512_unpackhi_ps(u[2 * i], u[2 * i + 1]));
  const __m512 r = _mm512_add_ps(_mm512_unpacklo_ps(z[0], z[1]), _mm512_unpackhi_ps(z[0], z[1]));
  // r's lane 4k + j holds v[k], v[8 + k], v[4 + k], v[12 + k] for j = 0..3
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 1, 5, 9, 13, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, r);
}

// acc[i] (head a) and acc[8 + i] (head b) += q · row i over n BF16 from `off`.
inline void dots(__m512 (&acc)[16], const uint16_t* qa, const uint16_t* qb, const uint16_t* const (&rows)[8],
                 int64_t n) {
  int64_t off = 0;
  auto step = [&](__mmask32 k) {
    const __m512bh a = bh(_mm512_maskz_loadu_epi16(k, qa + off)), b = bh(_mm512_maskz_loadu_epi16(k, qb + off));
    for (int i = 0; i < 8; ++i) {
      const __m512bh r = bh(_mm512_maskz_loadu_epi16(k, rows[i] + off));
      acc[i] = _mm512_dpbf16_ps(acc[i], a, r);
      acc[8 + i] = _mm512_dpbf16_ps(acc[8 + i], b, r);
    }
  };
  for (; off + kSeg <= n; off += kSeg) step(~__mmask32(0));
  if (off < n) step(first(n - off));
}

// s[h][t] = scale · (q_lat[h] · kv[t] + q_pe[h] · pe[t]) for heads [h0, h1), t in [0, n): the chunk's rows from
// `at`.
void scores(const AttentionProblem& p, int64_t b, ChunkRows at, int64_t n, int64_t h0, int64_t h1, float* s) {
  const __m512 scale = _mm512_set1_ps(p.scale);
  for (int64_t t = 0; t < n; t += 8) {
    const uint16_t *rk[8], *rp[8];
    for (int i = 0; i < 8; ++i) {  // rows past n repeat the last one (read, never used)
      const int64_t row = std::min(t + i, n - 1);
      rk[i] = at.kv + row * p.skvt;
      rp[i] = at.pe + row * p.spet;
    }
    for (int64_t h = h0; h < h1; h += 2) {
      const int64_t g = std::min(h + 1, h1 - 1);  // an odd last head pairs with itself
      __m512 acc[16];
      for (auto& a : acc) a = _mm512_setzero_ps();
      dots(acc, p.q + b * p.sqb + h * p.sqh, p.q + b * p.sqb + g * p.sqh, rk, p.C);
      dots(acc, p.qpe + b * p.spb + h * p.sph, p.qpe + b * p.spb + g * p.sph, rp, p.R);
      const __m512 v = _mm512_mul_ps(reduce16(acc), scale);
      _mm256_storeu_ps(s + (h - h0) * kLd + t, _mm512_castps512_ps256(v));
      _mm256_storeu_ps(s + (g - h0) * kLd + t, _mm512_extractf32x8_ps(v, 1));
    }
  }
}

// e^x for x <= 0 (-inf and below -87 give 0 or a denormal-range value scaled exactly by scalef).
inline __m512 exp_neg(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);  // ln 2 in two parts
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 y = _mm512_set1_ps(1.0f / 720);
  for (float c : {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(y, n);
}

// One head's weights: w[t] = bf16(e^(s[t] - max)) for t < n, 0 up to the row's end; returns (max, Σ w).
std::pair<float, float> weights(const float* s, int64_t n, uint16_t* w) {
  __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t t = 0; t < n; t += 16)
    top = _mm512_max_ps(top, _mm512_maskz_loadu_ps(__mmask16(first(n - t)), s + t));
  const float m = _mm512_reduce_max_ps(top);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t t = 0; t < n + 2; t += 16) {  // through the pair that holds the last position
    const __mmask16 k = __mmask16(first(n - t));
    const __m512 e = _mm512_maskz_mov_ps(k, exp_neg(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + t),
                                                                  _mm512_set1_ps(m))));
    const __m256bh r = _mm512_cvtneps_pbh(e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + t), (__m256i)r);
    sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(
                                 _mm512_cvtepu16_epi32((__m256i)r), 16)));
  }
  return {m, _mm512_reduce_add_ps(sum)};
}

// o[h][c0 .. c0 + 32) = Σ_t w[h][t] kv[t][c0 ..] for NH heads; `cn` latents of the segment are real.
template <int NH>
void weighted(const uint16_t* kv, int64_t skvt, int64_t n, const uint16_t* w, float* o, int64_t C, int64_t c0,
              int64_t cn) {
  const __mmask32 k = first(cn);
  __m512 acc[NH][2];
  for (auto& a : acc) a[0] = a[1] = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; t += 2) {
    const uint16_t* r0 = kv + t * skvt + c0;
    const __m512i a = _mm512_maskz_loadu_epi16(k, r0);
    const __m512i b = t + 1 < n ? _mm512_maskz_loadu_epi16(k, r0 + skvt) : a;  // its weight is 0
    const __m512bh lo = bh(_mm512_unpacklo_epi16(a, b)), hi = bh(_mm512_unpackhi_epi16(a, b));
    for (int h = 0; h < NH; ++h) {
      uint32_t pair;
      std::memcpy(&pair, w + h * kLd + t, 4);
      const __m512bh pw = bh(_mm512_set1_epi32(int(pair)));
      acc[h][0] = _mm512_dpbf16_ps(acc[h][0], lo, pw);
      acc[h][1] = _mm512_dpbf16_ps(acc[h][1], hi, pw);
    }
  }
  // lane 4k + i of acc[.][0] is latent 8k + i, of acc[.][1] latent 8k + 4 + i
  const __m512i first16 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i next16 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int h = 0; h < NH; ++h) {
    float* out = o + h * C + c0;
    _mm512_mask_storeu_ps(out, __mmask16(k), _mm512_permutex2var_ps(acc[h][0], first16, acc[h][1]));
    _mm512_mask_storeu_ps(out + 16, __mmask16(k >> 16), _mm512_permutex2var_ps(acc[h][0], next16, acc[h][1]));
  }
}

}  // namespace

void attention_chunk_avx512_bf16(const AttentionProblem& p, int64_t b, int64_t t0, int64_t t1, int64_t h0,
                                 int64_t h1, float* m, float* l, float* o, float* scratch) {
  const int64_t n = t1 - t0, heads = h1 - h0;
  float* s = scratch;
  uint16_t* w = reinterpret_cast<uint16_t*>(scratch + heads * kLd);
  const ChunkRows at = chunk_rows(p, b, t0);
  scores(p, b, at, n, h0, h1, s);
  for (int64_t h = 0; h < heads; ++h) std::tie(m[h], l[h]) = weights(s + h * kLd, n, w + h * kLd);
  for (int64_t c0 = 0; c0 < p.C; c0 += kSeg) {  // a segment of the chunk's rows (n x 64 B) stays in L1
    const int64_t cn = std::min(kSeg, p.C - c0);
    int64_t h = 0;
    for (; h + 8 <= heads; h += 8) weighted<8>(at.kv, p.skvt, n, w + h * kLd, o + h * p.C, p.C, c0, cn);
    for (; h + 2 <= heads; h += 2) weighted<2>(at.kv, p.skvt, n, w + h * kLd, o + h * p.C, p.C, c0, cn);
    for (; h < heads; ++h) weighted<1>(at.kv, p.skvt, n, w + h * kLd, o + h * p.C, p.C, c0, cn);
  }
}

}  // namespace hybrid
