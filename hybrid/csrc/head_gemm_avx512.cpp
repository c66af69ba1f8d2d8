// AVX-512 batched-head kernel (compiled with -mavx512f -mavx512bw -mavx512vl, nothing more: it runs on every
// AVX-512 CPU the GEMM's avx512_bf16 / amx variants run on, and on those without AVX-512 BF16, e.g. Ice Lake
// and Cascade Lake Xeons). FP32 FMAs, 16 floats per vector, 32 weights (one cache line) per step; tails through
// masked loads and stores. vdpbf16ps would not make a loop bound by reading faster, and it sums products in pairs
// (another rounding order) with denormals flushed: the FMAs keep the AVX2 and generic code's arithmetic.
// Same structure, even/odd weight order and prefetch as head_gemm_avx2.cpp.
#include <immintrin.h>

#include <cstring>

#include "head_gemm.h"

namespace hybrid {
namespace {

constexpr int64_t kBlk = 32;       // weights per step: an even and an odd vector of 16 floats
constexpr int64_t kLineCols = 32;  // bf16 columns per cache line
constexpr int kAheadGroups = 2;    // prefetch distance, in row groups (8-16 KB); into L2 (T1): faster than T0 here

struct Pair {
  __m512 even, odd;
};

inline __mmask32 first(int64_t n) {  // the first n lanes (none for n <= 0)
  return n >= kBlk ? ~__mmask32(0) : n <= 0 ? __mmask32(0) : __mmask32((1u << n) - 1);
}
inline Pair split(__m512i v) {
  return {_mm512_castsi512_ps(_mm512_slli_epi32(v, 16)),
          _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(int(0xFFFF0000u))))};
}
inline Pair bf16x32(const uint16_t* p) { return split(_mm512_loadu_si512(p)); }
inline Pair bf16x32_tail(const uint16_t* p, int64_t n) { return split(_mm512_maskz_loadu_epi16(first(n), p)); }

// FP32 -> BF16 rounded as head_round (nearest even, NaN -> 0x7FC0), left in the high half of each lane.
inline __m512i round_hi(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb);
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000));
}
// The even and odd sums of 32 outputs -> 32 BF16 in order.
inline __m512i round32(const Pair& s) {
  return _mm512_or_si512(_mm512_srli_epi32(round_hi(s.even), 16),
                         _mm512_and_si512(round_hi(s.odd), _mm512_set1_epi32(int(0xFFFF0000u))));
}

template <int R>
inline void prefetch_lines(const char* at, int64_t c) {
  if (!at) return;
  for (int r = 0; r < R; ++r) _mm_prefetch(at + ((c / kLineCols) * R + r) * 64, _MM_HINT_T1);
}

// ----------------------------------------------------------------------------------------------- by columns

void widen_x_paired(const HeadProblem& p, int64_t h, float* xf, int64_t ldx) {
  for (int64_t m = 0; m < p.M; ++m) {
    const uint16_t* x = p.x + m * p.sxm + h * p.sxh;
    for (int64_t i = 0; i < p.I; i += kBlk) {
      const Pair v = bf16x32_tail(x + i, p.I - i);
      _mm512_store_ps(xf + m * ldx + i, v.even);
      _mm512_store_ps(xf + m * ldx + i + 16, v.odd);
    }
  }
}

template <int R, int MT>
inline void dot_group(const uint16_t* w, int64_t swr, int64_t I, const float* x, int64_t ldx, const char* pf,
                      float (&out)[R][MT]) {
  __m512 acc[R][MT];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) acc[r][m] = _mm512_setzero_ps();
  const int64_t full = I / kBlk * kBlk;
  auto step = [&](int64_t i, bool tail) {
    for (int r = 0; r < R; ++r) {
      const Pair wv = tail ? bf16x32_tail(w + r * swr + i, I - i) : bf16x32(w + r * swr + i);
      for (int m = 0; m < MT; ++m) {
        acc[r][m] = _mm512_fmadd_ps(wv.even, _mm512_load_ps(x + m * ldx + i), acc[r][m]);
        acc[r][m] = _mm512_fmadd_ps(wv.odd, _mm512_load_ps(x + m * ldx + i + 16), acc[r][m]);
      }
    }
  };
  for (int64_t i = 0; i < full; i += kBlk) {
    prefetch_lines<R>(pf, i);
    step(i, false);
  }
  if (full < I) step(full, true);
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) out[r][m] = _mm512_reduce_add_ps(acc[r][m]);
}

#include "head_gemm_columns.h"

// -------------------------------------------------------------------------------------------------- by rows

template <int G>
void axpy_group(const uint16_t* w, int64_t swr, int64_t O, int64_t M, const float* x, int64_t ldx, float* acc,
                int64_t lda, const char* pf) {
  const int64_t full = O / kBlk * kBlk;
  auto step = [&](int64_t o, bool tail) {
    Pair wv[G];
    for (int g = 0; g < G; ++g) wv[g] = tail ? bf16x32_tail(w + g * swr + o, O - o) : bf16x32(w + g * swr + o);
    for (int64_t m = 0; m < M; ++m) {
      float* a = acc + m * lda + o;
      __m512 even = _mm512_load_ps(a), odd = _mm512_load_ps(a + 16);
      for (int g = 0; g < G; ++g) {
        const __m512 xv = _mm512_set1_ps(x[m * ldx + g]);
        even = _mm512_fmadd_ps(xv, wv[g].even, even);
        odd = _mm512_fmadd_ps(xv, wv[g].odd, odd);
      }
      _mm512_store_ps(a, even);
      _mm512_store_ps(a + 16, odd);
    }
  };
  for (int64_t o = 0; o < full; o += kBlk) {
    prefetch_lines<G>(pf, o);
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
      axpy_group<G>(w + i * p.swr, p.swr, p.O, p.M, xf + i, ldx, acc, lda, pf);
    }
    for (; i < p.I; ++i) axpy_group<1>(w + i * p.swr, p.swr, p.O, p.M, xf + i, ldx, acc, lda, nullptr);
    for (int64_t m = 0; m < p.M; ++m) {
      uint16_t* y = p.y + m * p.sym + h * p.syh;
      const float* a = acc + m * lda;
      for (int64_t o = 0; o < p.O; o += kBlk) {
        const __m512i v = round32(Pair{_mm512_load_ps(a + o), _mm512_load_ps(a + o + 16)});
        if (o < full) _mm512_storeu_si512(y + o, v);
        else _mm512_mask_storeu_epi16(y + o, first(p.O - o), v);
      }
    }
  }
}

}  // namespace

void head_rows_avx512(const HeadProblem& p, int64_t h0, int64_t h1, float* scratch) {
  if (p.by_rows) return by_rows<4>(p, h0, h1, scratch);
  if (p.M == 1) return by_columns<8, 1>(p, h0, h1, scratch);
  by_columns<4, 4>(p, h0, h1, scratch);
}

}  // namespace hybrid
