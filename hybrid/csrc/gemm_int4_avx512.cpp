// AVX-512 BF16 INT4 kernel (compiled with -mavx512f -mavx512bw -mavx512vl -mavx512bf16).
//
// Weights go 128 at a time (a chunk: four groups, 64 bytes, one load), decoded without widening or masking: vpermw
// reads the low 5 bits of each 16-bit word as its index, so over a 32-entry table (the BF16 value of q = nibble - 8
// for nibbles 0..15, twice) the words as loaded give the BF16 weights of their nibble 0, and the words shifted right
// by 4, 8 and 12 those of nibbles 1, 2 and 3, exactly: 3 shifts and 4 vpermw per 128 weights. The activations are
// prepared once (int4_prepare_x_avx512_bf16, shared by every call over them) in the matching order: per chunk, slot
// 32·j + i holds input 4·i + j. One vdpbf16ps per decoded vector then adds two products to each fp32 lane, and lane
// l only ever sees inputs of the chunk's group l / 4: four vdpbf16ps give the four groups' sums in lanes 0-3, 4-7,
// 8-11 and 12-15 (8 exact products each, summed in fp32), and one FMA applies the four scales (permuted into those
// lanes from 16 groups' scales loaded at a time) to each token's accumulator (two per token, alternating, so that
// consecutive FMAs do not wait on each other); one horizontal sum per output at the end. A row's last partial chunk
// is loaded under a mask (the activations are zero past K, so the padding nibbles multiply zeros). Up to 4 tokens
// share each decoded chunk; more go 4 at a time, the weights decoded again for each 4.
#include <immintrin.h>

#include "gemm_int4.h"

namespace hybrid {
namespace {

constexpr int kTokens = 4;
constexpr int64_t kChunkWeights = 128;  // one 64-byte load
constexpr int64_t kChunkBytes = kChunkWeights / 2;
constexpr int64_t kScaleBlock = 4;      // chunks per load of 16 scales

inline __m512bh bh(__m512i v) { return (__m512bh)v; }

int64_t prepared_k(int64_t K) { return (K + kChunkWeights - 1) / kChunkWeights * kChunkWeights; }

// The BF16 values of q = nibble - 8 for nibbles 0..15, twice (vpermw reads 32 entries; bit 4 of an index is the next
// nibble's lowest bit).
__m512i nibble_table() {
  alignas(64) uint16_t t[32];
  for (int i = 0; i < 32; ++i) t[i] = float_to_bf16(float(i % 16 - 8));
  return _mm512_load_si512(t);
}

// Token t's dot products with one decoded chunk, its group scales applied, added to acc.
inline __m512 chunk_dot(const __m512i (&q)[4], const uint16_t* x, __m512 scale, __m512 acc) {
  __m512 dot = _mm512_dpbf16_ps(_mm512_setzero_ps(), bh(q[0]), bh(_mm512_loadu_si512(x)));
  dot = _mm512_dpbf16_ps(dot, bh(q[1]), bh(_mm512_loadu_si512(x + 32)));
  dot = _mm512_dpbf16_ps(dot, bh(q[2]), bh(_mm512_loadu_si512(x + 64)));
  dot = _mm512_dpbf16_ps(dot, bh(q[3]), bh(_mm512_loadu_si512(x + 96)));
  return _mm512_fmadd_ps(dot, scale, acc);
}

inline void decode(__m512i raw, __m512i table, __m512i (&q)[4]) {
  q[0] = _mm512_permutexvar_epi16(raw, table);
  q[1] = _mm512_permutexvar_epi16(_mm512_srli_epi16(raw, 4), table);
  q[2] = _mm512_permutexvar_epi16(_mm512_srli_epi16(raw, 8), table);
  q[3] = _mm512_permutexvar_epi16(_mm512_srli_epi16(raw, 12), table);
}

// 16 groups' scales from s in fp32 (`left` of them read, the rest zero).
inline __m512 load_scales(const uint16_t* s, int64_t left) {
  const __m256i raw = left >= 16 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s))
                                 : _mm256_maskz_loadu_epi16(__mmask16((1u << left) - 1), s);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// Chunk i of a scale block's scales in its lanes: lane l gets the scale of the chunk's group l / 4.
inline __m512 chunk_scale(__m512 scales, int i) {
  const __m512i lanes = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  return _mm512_permutexvar_ps(_mm512_add_epi32(lanes, _mm512_set1_epi32(4 * i)), scales);
}

// Tokens [m0, m0 + MT) of rows [n0, n1); xp: their prepared activations, row stride ld.
template <int MT>
void rows(const GemmProblem& p, const uint16_t* xp, int64_t ld, int64_t m0, int64_t n0, int64_t n1) {
  const __m512i table = nibble_table();
  const int64_t row_bytes = (p.K + kPerWord - 1) / kPerWord * 4, groups = (p.K + kGroup - 1) / kGroup;
  const int64_t chunks = (row_bytes + kChunkBytes - 1) / kChunkBytes, full = row_bytes / kChunkBytes;
  const int64_t blocks = full / kScaleBlock;  // blocks of whole chunks; the rest one chunk at a time
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* w = reinterpret_cast<const uint8_t*>(static_cast<const uint32_t*>(p.w) + n * p.ldw);
    const uint16_t* s = p.group_scale + n * p.lds;
    __m512 total[MT][2];
    for (int t = 0; t < MT; ++t) total[t][0] = total[t][1] = _mm512_setzero_ps();
    __m512i q[4];
    for (int64_t b = 0; b < blocks; ++b) {
      const __m512 scales = load_scales(s + 16 * b, groups - 16 * b);
      for (int i = 0; i < kScaleBlock; ++i) {
        const int64_t c = b * kScaleBlock + i;
        decode(_mm512_loadu_si512(w + c * kChunkBytes), table, q);
        const __m512 scale = chunk_scale(scales, i);
        for (int t = 0; t < MT; ++t) total[t][i & 1] = chunk_dot(q, xp + t * ld + c * kChunkWeights, scale, total[t][i & 1]);
      }
    }
    for (int64_t c = blocks * kScaleBlock; c < chunks; ++c) {
      const __m512 scales = load_scales(s + 16 * blocks, groups - 16 * blocks);
      const int64_t left = row_bytes - c * kChunkBytes;
      const __m512i raw = left >= kChunkBytes ? _mm512_loadu_si512(w + c * kChunkBytes)
                                              : _mm512_maskz_loadu_epi8(__mmask64((1ull << left) - 1), w + c * kChunkBytes);
      decode(raw, table, q);
      const __m512 scale = chunk_scale(scales, int(c % kScaleBlock));
      for (int t = 0; t < MT; ++t) total[t][0] = chunk_dot(q, xp + t * ld + c * kChunkWeights, scale, total[t][0]);
    }
    for (int t = 0; t < MT; ++t) p.y[(m0 + t) * p.ldy + n] = _mm512_reduce_add_ps(_mm512_add_ps(total[t][0], total[t][1]));
  }
}

}  // namespace

int64_t int4_x_elems_avx512_bf16(int64_t K) { return prepared_k(K); }

// Per 128 inputs (four vectors a0..a3 of 32): output vector j takes input 4·i + j at slot i, i.e. from a0/a1 for
// slots 0-15 and from a2/a3 for slots 16-31 (one two-source permute each, the halves blended).
void int4_prepare_x_avx512_bf16(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, uint16_t* out) {
  const int64_t ld = prepared_k(K);
  alignas(64) uint16_t four_i[32];  // 4 · (slot % 16): input 4·i of the source pair, i = slot % 16
  for (int i = 0; i < 32; ++i) four_i[i] = uint16_t(4 * (i % 16));
  const __m512i slots = _mm512_load_si512(four_i);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k0 = 0; k0 < ld; k0 += kChunkWeights) {
      __m512i a[4];
      for (int v = 0; v < 4; ++v) {
        const int64_t left = K - k0 - 32 * v;
        const uint16_t* src = x + m * ldx + k0 + 32 * v;
        a[v] = left >= 32 ? _mm512_loadu_si512(src)
                          : _mm512_maskz_loadu_epi16(left > 0 ? __mmask32((1ull << left) - 1) : 0, src);
      }
      for (int j = 0; j < 4; ++j) {
        const __m512i idx = _mm512_add_epi16(slots, _mm512_set1_epi16(int16_t(j)));
        const __m512i lo = _mm512_permutex2var_epi16(a[0], idx, a[1]);
        const __m512i hi = _mm512_permutex2var_epi16(a[2], idx, a[3]);
        _mm512_storeu_si512(out + m * ld + k0 + 32 * j, _mm512_mask_blend_epi16(0xFFFF0000u, lo, hi));
      }
    }
}

void int4_rows_avx512_bf16(const GemmProblem& p, const uint16_t* xprep, int64_t n0, int64_t n1) {
  const int64_t ld = prepared_k(p.K);
  if (!xprep) {  // prepared here, for this call's tokens only
    uint16_t* buf = reinterpret_cast<uint16_t*>(thread_floats((p.M * ld + 1) / 2));
    int4_prepare_x_avx512_bf16(p.x, p.ldx, p.M, p.K, buf);
    xprep = buf;
  }
  for (int64_t m0 = 0; m0 < p.M; m0 += kTokens) {
    const uint16_t* xp = xprep + m0 * ld;
    switch (p.M - m0 < kTokens ? p.M - m0 : kTokens) {
      case 1: rows<1>(p, xp, ld, m0, n0, n1); break;
      case 2: rows<2>(p, xp, ld, m0, n0, n1); break;
      case 3: rows<3>(p, xp, ld, m0, n0, n1); break;
      default: rows<4>(p, xp, ld, m0, n0, n1);
    }
  }
}

}  // namespace hybrid
