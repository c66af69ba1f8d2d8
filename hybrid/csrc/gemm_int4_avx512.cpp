// AVX-512 BF16 INT4 kernel (compiled with -mavx512f -mavx512bw -mavx512vl -mavx512bf16).
//
// Weights go 64 at a time (two groups, 32 bytes): the bytes zero-extended to 16-bit lanes, their low nibbles (even
// elements) and high nibbles (odd elements) masked apart, and one vpermw from a 16-entry table each turns every
// nibble into the BF16 value of q, exactly. The activations are prepared once per call in the matching order (per
// 64: the even elements, then the odd ones), so two vdpbf16ps give the two groups' dot products in the low and the
// high 8 fp32 lanes; one FMA applies both groups' scales (permuted into those halves) to each token's accumulator
// (two per token, alternating, so consecutive FMAs do not wait on each other); one horizontal sum per output at the
// end. A row's last K % 64 weights go a group at a time (16 bytes zero-extended to 32-bit lanes: low and high
// nibble in the two halves, the activations as they are), the ragged last group under masks. Up to 4 tokens share
// each decoded chunk; more tokens go 4 at a time, the weights decoded again for each 4.
#include <immintrin.h>

#include "gemm_int4.h"

namespace hybrid {
namespace {

constexpr int kTokens = 4;
constexpr int64_t kTwoGroups = 2 * kGroup;  // weights decoded together

inline __m512bh bh(__m512i v) { return (__m512bh)v; }

// The BF16 values of q = nibble - 8 for nibbles 0..15, twice (vpermw reads 32 entries; indices are 0..15).
__m512i nibble_table() {
  alignas(64) uint16_t t[32];
  for (int i = 0; i < 32; ++i) t[i] = float_to_bf16(float(i % 16 - 8));
  return _mm512_load_si512(t);
}

// 32 weights from 16 bytes (`bytes` of them read: the rest as zero nibbles) as 16 BF16 pairs in element order.
inline __m512i decode_group(const uint8_t* w, int bytes, __m512i table) {
  const __m128i raw = bytes == 16 ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(w))
                                  : _mm_maskz_loadu_epi8(__mmask16((1u << bytes) - 1), w);
  const __m512i v = _mm512_cvtepu8_epi32(raw);
  const __m512i halves = _mm512_and_si512(_mm512_or_si512(v, _mm512_slli_epi32(v, 12)), _mm512_set1_epi32(0x000F000F));
  return _mm512_permutexvar_epi16(halves, table);
}

// Activations for the chunked part: per 64, x[2j] at j and x[2j + 1] at 32 + j.
void prepare(const GemmProblem& p, int64_t m0, int mt, int64_t chunks, uint16_t* xp) {
  for (int t = 0; t < mt; ++t) {
    const uint16_t* x = p.x + (m0 + t) * p.ldx;
    uint16_t* out = xp + t * chunks * kTwoGroups;
    for (int64_t c = 0; c < chunks; ++c)
      for (int64_t j = 0; j < kGroup; ++j) {
        out[c * kTwoGroups + j] = x[c * kTwoGroups + 2 * j];
        out[c * kTwoGroups + kGroup + j] = x[c * kTwoGroups + 2 * j + 1];
      }
  }
}

template <int MT>
void rows(const GemmProblem& p, const uint16_t* xp, int64_t m0, int64_t n0, int64_t n1, __m512i table) {
  const int64_t chunks = p.K / kTwoGroups, groups = (p.K + kGroup - 1) / kGroup;
  const int64_t rem = p.K % kGroup;
  const __m512i nibble = _mm512_set1_epi16(0xF);
  const __m512i halves = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* w = reinterpret_cast<const uint8_t*>(static_cast<const uint32_t*>(p.w) + n * p.ldw);
    const uint16_t* s = p.group_scale + n * p.lds;
    __m512 total[MT][2];
    for (int t = 0; t < MT; ++t) total[t][0] = total[t][1] = _mm512_setzero_ps();
    __m512 scales = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; ++c) {
      if (c % 8 == 0) {  // the next 16 groups' scales in fp32 (past the row's end: whatever, never used)
        const int64_t left = groups - 2 * c;
        const __m256i raw = left >= 16 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 2 * c))
                                       : _mm256_maskz_loadu_epi16(__mmask16((1u << left) - 1), s + 2 * c);
        scales = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
      }
      const __m512 scale = _mm512_permutexvar_ps(_mm512_add_epi32(halves, _mm512_set1_epi32(int(2 * (c % 8)))), scales);
      const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c * 32)));
      const __m512i even = _mm512_permutexvar_epi16(_mm512_and_si512(bytes, nibble), table);
      const __m512i odd = _mm512_permutexvar_epi16(_mm512_srli_epi16(bytes, 4), table);
      for (int t = 0; t < MT; ++t) {
        const uint16_t* x = xp + (t * chunks + c) * kTwoGroups;
        const __m512 dot = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), bh(even), bh(_mm512_loadu_si512(x))),
                                            bh(odd), bh(_mm512_loadu_si512(x + kGroup)));
        total[t][c & 1] = _mm512_fmadd_ps(dot, scale, total[t][c & 1]);
      }
    }
    for (int64_t g = 2 * chunks; g < groups; ++g) {  // the last K % 64 weights, a group at a time
      const bool full = g < p.K / kGroup;
      const __m512i wb = decode_group(w + g * kGroup / 2, full ? 16 : int((rem + 1) / 2), table);
      const __m512 scale = _mm512_set1_ps(bf16_to_float(s[g]));
      for (int t = 0; t < MT; ++t) {
        const uint16_t* x = p.x + (m0 + t) * p.ldx + g * kGroup;
        const __m512i xv = full ? _mm512_loadu_si512(x) : _mm512_maskz_loadu_epi16(__mmask32((1u << rem) - 1), x);
        total[t][0] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), bh(wb), bh(xv)), scale, total[t][0]);
      }
    }
    for (int t = 0; t < MT; ++t) p.y[(m0 + t) * p.ldy + n] = _mm512_reduce_add_ps(_mm512_add_ps(total[t][0], total[t][1]));
  }
}

}  // namespace

void int4_rows_avx512_bf16(const GemmProblem& p, int64_t n0, int64_t n1) {
  const __m512i table = nibble_table();
  const int64_t chunks = p.K / kTwoGroups;
  uint16_t* xp = reinterpret_cast<uint16_t*>(thread_floats((kTokens * chunks * kTwoGroups + 1) / 2));
  for (int64_t m0 = 0; m0 < p.M; m0 += kTokens) {
    const int mt = int(p.M - m0 < kTokens ? p.M - m0 : kTokens);
    prepare(p, m0, mt, chunks, xp);
    switch (mt) {
      case 1: rows<1>(p, xp, m0, n0, n1, table); break;
      case 2: rows<2>(p, xp, m0, n0, n1, table); break;
      case 3: rows<3>(p, xp, m0, n0, n1, table); break;
      default: rows<4>(p, xp, m0, n0, n1, table);
    }
  }
}

}  // namespace hybrid
