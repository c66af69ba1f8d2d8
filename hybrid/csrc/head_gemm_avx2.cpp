// AVX2 + FMA batched-head kernel (compiled with -mavx2 -mfma): FP32 FMAs, 8 floats per vector. See head_gemm.h
// for the two forms.
//
// BF16 -> FP32 without shuffles: 16 weights (32 bytes) load as 8 32-bit lanes, each holding an even weight in its
// low half and the next odd one in its high half; a shift left by 16 gives the 8 even weights as floats, a mask of
// the high halves the 8 odd ones (exact, 3 instructions per 16 weights where widening costs two shuffles more).
// The kernel works in that order throughout: by columns, the activations are widened into the same even/odd
// order, so the dot products pair the right terms; by rows, the accumulator row is kept in it and is put back
// in order by the final rounding, which packs an even and an odd sum into one 32-bit lane.
//
// Both forms stream one head's W in groups of rows stored back to back and prefetch the group after next in
// address order (per cache line of a row's columns, one line per row of that group, walking its bytes in order:
// one sequential stream, see the GEMM's Prefetch); the last groups of a head prefetch the next head's, which is
// where a thread goes next within its run of heads.
#include <immintrin.h>

#include <cstring>

#include "head_gemm.h"

namespace hybrid {
namespace {

constexpr int64_t kBlk = 16;       // weights per step: an even and an odd vector of 8 floats
constexpr int64_t kLineCols = 32;  // bf16 columns per cache line
constexpr int kAheadGroups = 2;    // prefetch distance, in row groups (8-16 KB); into L2 (T1): faster than T0 here

struct Pair {
  __m256 even, odd;
};

inline Pair split(__m256i v) {
  return {_mm256_castsi256_ps(_mm256_slli_epi32(v, 16)),
          _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(int(0xFFFF0000u))))};
}
inline Pair bf16x16(const uint16_t* p) { return split(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline Pair bf16x16_tail(const uint16_t* p, int64_t n) {  // n < 16 weights (n <= 0: none), the rest zero
  alignas(32) uint16_t t[kBlk] = {};
  if (n > 0) std::memcpy(t, p, size_t(n) * sizeof(uint16_t));
  return bf16x16(t);
}

// FP32 -> BF16 rounded as head_round (nearest even, NaN -> 0x7FC0), left in the high half of each lane.
inline __m256i round_hi(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb);
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC00000), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}
// The even and odd sums of 16 outputs -> 16 BF16 in order.
inline __m256i round16(const Pair& s) {
  return _mm256_or_si256(_mm256_srli_epi32(round_hi(s.even), 16),
                         _mm256_and_si256(round_hi(s.odd), _mm256_set1_epi32(int(0xFFFF0000u))));
}

inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// Prefetch of a later row group: at column c (a multiple of kLineCols), lines (c / 32) * R + r of the group
// starting at `at`, r < R. Null: none.
template <int R>
inline void prefetch_lines(const char* at, int64_t c) {
  if (!at) return;
  for (int r = 0; r < R; ++r) _mm_prefetch(at + ((c / kLineCols) * R + r) * 64, _MM_HINT_T1);
}

// ----------------------------------------------------------------------------------------------- by columns

// x rows of head h widened to fp32 in the weights' even/odd order: per 16 columns, the 8 even then the 8 odd
// ones, zero-padded; row m at xf + m * ldx.
void widen_x_paired(const HeadProblem& p, int64_t h, float* xf, int64_t ldx) {
  for (int64_t m = 0; m < p.M; ++m) {
    const uint16_t* x = p.x + m * p.sxm + h * p.sxh;
    for (int64_t i = 0; i < p.I; i += kBlk) {
      const Pair v = i + kBlk <= p.I ? bf16x16(x + i) : bf16x16_tail(x + i, p.I - i);
      _mm256_store_ps(xf + m * ldx + i, v.even);
      _mm256_store_ps(xf + m * ldx + i + 8, v.odd);
    }
  }
}

// Rows 0..R-1 of w (a head's W[o..], row stride swr) against tokens 0..MT-1 (x paired, zero-padded): out[r][m].
template <int R, int MT>
inline void dot_group(const uint16_t* w, int64_t swr, int64_t I, const float* x, int64_t ldx, const char* pf,
                      float (&out)[R][MT]) {
  __m256 acc[R][MT];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) acc[r][m] = _mm256_setzero_ps();
  const int64_t full = I / kBlk * kBlk;
  auto step = [&](int64_t i, bool tail) {
    for (int r = 0; r < R; ++r) {
      const Pair wv = tail ? bf16x16_tail(w + r * swr + i, I - i) : bf16x16(w + r * swr + i);
      for (int m = 0; m < MT; ++m) {
        acc[r][m] = _mm256_fmadd_ps(wv.even, _mm256_load_ps(x + m * ldx + i), acc[r][m]);
        acc[r][m] = _mm256_fmadd_ps(wv.odd, _mm256_load_ps(x + m * ldx + i + 8), acc[r][m]);
      }
    }
  };
  for (int64_t i = 0; i < full; i += kBlk) {
    if (i % kLineCols == 0) prefetch_lines<R>(pf, i);
    step(i, false);
  }
  if (full < I) step(full, true);
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) out[r][m] = hsum(acc[r][m]);
}

#include "head_gemm_columns.h"

// -------------------------------------------------------------------------------------------------- by rows

// acc[m] += Σ_g x[m][g] · w[g] for g = 0..G-1 in order (one FMA each), tokens 0..M-1; w: G rows of a head's W
// (row stride swr), x: fp32 in natural order (row m at x + m * ldx), acc rows paired and padded.
template <int G>
void axpy_group(const uint16_t* w, int64_t swr, int64_t O, int64_t M, const float* x, int64_t ldx, float* acc,
                int64_t lda, const char* pf) {
  const int64_t full = O / kBlk * kBlk;
  auto step = [&](int64_t o, bool tail) {
    Pair wv[G];
    for (int g = 0; g < G; ++g) wv[g] = tail ? bf16x16_tail(w + g * swr + o, O - o) : bf16x16(w + g * swr + o);
    for (int64_t m = 0; m < M; ++m) {
      float* a = acc + m * lda + o;
      __m256 even = _mm256_load_ps(a), odd = _mm256_load_ps(a + 8);
      for (int g = 0; g < G; ++g) {
        const __m256 xv = _mm256_broadcast_ss(x + m * ldx + g);
        even = _mm256_fmadd_ps(xv, wv[g].even, even);
        odd = _mm256_fmadd_ps(xv, wv[g].odd, odd);
      }
      _mm256_store_ps(a, even);
      _mm256_store_ps(a + 8, odd);
    }
  };
  for (int64_t o = 0; o < full; o += kBlk) {
    if (o % kLineCols == 0) prefetch_lines<G>(pf, o);
    step(o, false);
  }
  if (full < O) step(full, true);
}

// One token (decode), the same sums: its G values broadcast once per group, each row's 16 weights widened and
// multiplied in turn (no row's weights kept in registers: with a run-time token count the loop above spills).
template <int G>
void axpy_one(const uint16_t* w, int64_t swr, int64_t O, const float* x, float* acc, const char* pf) {
  __m256 xv[G];
  for (int g = 0; g < G; ++g) xv[g] = _mm256_broadcast_ss(x + g);
  const int64_t full = O / kBlk * kBlk;
  auto step = [&](int64_t o, bool tail) {
    __m256 even = _mm256_load_ps(acc + o), odd = _mm256_load_ps(acc + o + 8);
    for (int g = 0; g < G; ++g) {
      const Pair v = tail ? bf16x16_tail(w + g * swr + o, O - o) : bf16x16(w + g * swr + o);
      even = _mm256_fmadd_ps(xv[g], v.even, even);
      odd = _mm256_fmadd_ps(xv[g], v.odd, odd);
    }
    _mm256_store_ps(acc + o, even);
    _mm256_store_ps(acc + o + 8, odd);
  };
  for (int64_t o = 0; o < full; o += kBlk) {
    if (o % kLineCols == 0) prefetch_lines<G>(pf, o);
    step(o, false);
  }
  if (full < O) step(full, true);
}

template <int G>
void by_rows(const HeadProblem& p, int64_t h0, int64_t h1, float* scratch) {
  const int64_t ldx = head_pad(p.I), lda = head_pad(p.O), full = p.O / kBlk * kBlk;
  float* xf = scratch;
  float* acc = scratch + p.M * ldx;
  for (int64_t h = h0; h < h1; ++h) {
    for (int64_t m = 0; m < p.M; ++m)
      for (int64_t i = 0; i < p.I; ++i) xf[m * ldx + i] = bf16_to_float(p.x[m * p.sxm + h * p.sxh + i]);
    std::memset(acc, 0, size_t(p.M * lda) * sizeof(float));
    const uint16_t* w = p.w + h * p.swh;
    int64_t i = 0;
    for (; i + G <= p.I; i += G) {
      const char* pf = reinterpret_cast<const char*>(w + (i + kAheadGroups * G) * p.swr);
      if (p.M == 1) axpy_one<G>(w + i * p.swr, p.swr, p.O, xf + i, acc, pf);
      else axpy_group<G>(w + i * p.swr, p.swr, p.O, p.M, xf + i, ldx, acc, lda, pf);
    }
    for (; i < p.I; ++i) axpy_group<1>(w + i * p.swr, p.swr, p.O, p.M, xf + i, ldx, acc, lda, nullptr);
    for (int64_t m = 0; m < p.M; ++m) {
      uint16_t* y = p.y + m * p.sym + h * p.syh;
      const float* a = acc + m * lda;
      auto sums = [&](int64_t o) { return Pair{_mm256_load_ps(a + o), _mm256_load_ps(a + o + 8)}; };
      for (int64_t o = 0; o < full; o += kBlk)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + o), round16(sums(o)));
      if (full < p.O) {
        alignas(32) uint16_t t[kBlk];
        _mm256_store_si256(reinterpret_cast<__m256i*>(t), round16(sums(full)));
        std::memcpy(y + full, t, size_t(p.O - full) * sizeof(uint16_t));
      }
    }
  }
}

}  // namespace

void head_rows_avx2(const HeadProblem& p, int64_t h0, int64_t h1, float* scratch) {
  if (p.by_rows) return by_rows<8>(p, h0, h1, scratch);
  if (p.M == 1) return by_columns<8, 1>(p, h0, h1, scratch);
  by_columns<4, 2>(p, h0, h1, scratch);
}

}  // namespace hybrid
