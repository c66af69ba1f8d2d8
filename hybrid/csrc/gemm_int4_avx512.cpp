// AVX-512 BF16 INT4 kernel (compiled with -mavx512f -mavx512bw -mavx512vl -mavx512bf16).
//
// A group's 16 bytes (32 weights) are zero-extended to 16 dword lanes (byte j in lane j), each lane's low and high
// nibble moved to its two 16-bit halves, and one vpermw from a 16-entry table turns every nibble into the BF16 value
// of q, exactly: lane j then holds elements 2j and 2j + 1 as a BF16 pair, the layout vdpbf16ps multiplies with the 32
// activations read as they are (no preparation). Each group's dot product goes into a zeroed accumulator, then its
// scale is applied with one FMA per token; one horizontal sum per output at the end. Up to 4 tokens share each
// decoded group; more tokens go 4 at a time, the weights decoded again for each 4. A row's ragged last group loads
// its bytes and activations under masks (activations past K read as zero).
#include <immintrin.h>

#include "gemm_int4.h"

namespace hybrid {
namespace {

constexpr int kTokens = 4;

inline __m512bh bh(__m512i v) { return (__m512bh)v; }

// The BF16 values of q = nibble - 8 for nibbles 0..15, twice (vpermw reads 32 entries; indices are 0..15).
__m512i nibble_table() {
  alignas(64) uint16_t t[32];
  for (int i = 0; i < 32; ++i) t[i] = float_to_bf16(float(i % 16 - 8));
  return _mm512_load_si512(t);
}

// 32 weights from 16 bytes (`bytes` of them read: the rest as zero nibbles) as 16 BF16 pairs.
inline __m512i decode(const uint8_t* w, int bytes, __m512i table) {
  const __m128i raw = bytes == 16 ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(w))
                                  : _mm_maskz_loadu_epi8(__mmask16((1u << bytes) - 1), w);
  const __m512i v = _mm512_cvtepu8_epi32(raw);
  const __m512i halves = _mm512_and_si512(_mm512_or_si512(v, _mm512_slli_epi32(v, 12)), _mm512_set1_epi32(0x000F000F));
  return _mm512_permutexvar_epi16(halves, table);
}

template <int MT>
void rows(const GemmProblem& p, int64_t m0, int64_t n0, int64_t n1, __m512i table) {
  const int64_t full = p.K / kGroup, rem = p.K % kGroup;
  const __mmask32 tail_x = __mmask32((uint64_t(1) << rem) - 1);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* w = reinterpret_cast<const uint8_t*>(static_cast<const uint32_t*>(p.w) + n * p.ldw);
    const uint16_t* s = p.group_scale + n * p.lds;
    __m512 total[MT];
    for (int t = 0; t < MT; ++t) total[t] = _mm512_setzero_ps();
    for (int64_t g = 0; g <= full; ++g) {
      if (g == full && rem == 0) break;
      const __m512i wb = decode(w + g * kGroup / 2, g < full ? 16 : int((rem + 1) / 2), table);
      const __m512 scale = _mm512_set1_ps(bf16_to_float(s[g]));
      for (int t = 0; t < MT; ++t) {
        const uint16_t* x = p.x + (m0 + t) * p.ldx + g * kGroup;
        const __m512i xv = g < full ? _mm512_loadu_si512(x) : _mm512_maskz_loadu_epi16(tail_x, x);
        total[t] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), bh(wb), bh(xv)), scale, total[t]);
      }
    }
    for (int t = 0; t < MT; ++t) p.y[(m0 + t) * p.ldy + n] = _mm512_reduce_add_ps(total[t]);
  }
}

}  // namespace

void int4_rows_avx512_bf16(const GemmProblem& p, int64_t n0, int64_t n1) {
  const __m512i table = nibble_table();
  for (int64_t m0 = 0; m0 < p.M; m0 += kTokens) {
    switch (p.M - m0 < kTokens ? p.M - m0 : kTokens) {
      case 1: rows<1>(p, m0, n0, n1, table); break;
      case 2: rows<2>(p, m0, n0, n1, table); break;
      case 3: rows<3>(p, m0, n0, n1, table); break;
      default: rows<4>(p, m0, n0, n1, table);
    }
  }
}

}  // namespace hybrid
