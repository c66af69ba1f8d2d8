// AVX-512 BF16 kernel (compiled with -mavx512f -mavx512bw -mavx512vl -mavx512bf16 -mavx512vbmi).
//
// FP8 -> BF16 is exact and costs ~6 vector ops per 64 weights: the 7 magnitude bits index two 128-entry byte
// tables (vpermi2b: the high and the low byte of the BF16 value), the sign bit is merged with one vpternlog, and
// two byte unpacks form the 16-bit lanes. The unpacks leave the 64 weights in a fixed lane order, so activations
// are prepared once per call in that same order. Products go through vdpbf16ps into fp32 block accumulators; each
// 128-wide K block's scale is applied once ("post-scaling"), to four accumulators' lane sums at a time (QuadSums).
// From tile_min_m tokens the avx512_bf16 kernel converts each weight once into an L1 slab laid out for the
// outer-product form (outer_rows: lanes are weight rows, the activations broadcast), unless batch-invariant.
//
// Variant avx512 (AVX-512 F/BW/VL/VBMI without BF16 instructions) compiles this same file a second time, from
// gemm_avx512_nobf16.cpp with HYBRID_AVX512_NO_BF16 set and without -mavx512bf16: vdpbf16ps is emulated with two
// FP32 FMAs over the odd and the even BF16 halves of each 32-bit lane (a BF16 value is the top half of its FP32
// value), and the entry points get the suffix _avx512_nobf16 (gemm.h) so the two objects never share a symbol.
#include <immintrin.h>

#include <cstring>
#include <type_traits>

#include "gemm.h"

#ifndef HYBRID_AVX512_NO_BF16
#define HYBRID_AVX512_NO_BF16 0
#endif
#if HYBRID_AVX512_NO_BF16
#define HYBRID_AVX512_FN(name) name##_avx512_nobf16
#else
#define HYBRID_AVX512_FN(name) name##_avx512
#endif

namespace hybrid {
namespace {

inline int64_t lo(int64_t a, int64_t b) { return a < b ? a : b; }
inline int64_t hi(int64_t a, int64_t b) { return a > b ? a : b; }

struct Tables {
  __m512i hi0, hi1, lo0, lo1, sign;
  Tables() {
    alignas(64) uint8_t hi[128], lo[128];
    for (int c = 0; c < 128; ++c) {
      const float f = fp8_to_float(uint8_t(c));
      uint32_t bits;
      std::memcpy(&bits, &f, 4);
      const uint16_t b = c == 0x7F ? 0x7FC0 : uint16_t(bits >> 16);  // exact: E4M3 has 3 mantissa bits
      hi[c] = uint8_t(b >> 8);
      lo[c] = uint8_t(b & 0xFF);
    }
    hi0 = _mm512_load_si512(hi);
    hi1 = _mm512_load_si512(hi + 64);
    lo0 = _mm512_load_si512(lo);
    lo1 = _mm512_load_si512(lo + 64);
    sign = _mm512_set1_epi8(char(0x80));
  }
};

inline void fp8_to_bf16(const Tables& t, __m512i v, __m512i& a, __m512i& b) {
  __m512i hi = _mm512_permutex2var_epi8(t.hi0, v, t.hi1);
  const __m512i lo = _mm512_permutex2var_epi8(t.lo0, v, t.lo1);
  hi = _mm512_ternarylogic_epi32(hi, v, t.sign, 0xF8);  // hi | (v & 0x80)
  a = _mm512_unpacklo_epi8(lo, hi);
  b = _mm512_unpackhi_epi8(lo, hi);
}

inline __mmask64 tail_mask(int64_t n) { return n >= 64 ? ~__mmask64(0) : (__mmask64(1) << n) - 1; }

struct Fp8Rows {  // FP8 weights straight from the checkpoint, converted as they are read
  const uint8_t* w;
  int64_t ldw, K;
  const Tables* t;
  int64_t prefetch;  // bytes ahead to prefetch: the same spot of the next row tile
  void load(int r, int64_t c, __m512i& a, __m512i& b) const {
    const uint8_t* p = w + r * ldw + c * kChunk;
    if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(p + prefetch), _MM_HINT_T1);
    const int64_t left = K - c * kChunk;
    const __m512i v = left >= kChunk ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi8(tail_mask(left), p);
    fp8_to_bf16(*t, v, a, b);
  }
};

struct Bf16Rows {  // BF16 weights from the checkpoint, natural lane order
  const uint16_t* w;
  int64_t ldw, K;
  void load(int r, int64_t c, __m512i& a, __m512i& b) const {
    const uint16_t* p = w + r * ldw + c * kChunk;
    const int64_t left = K - c * kChunk;
    if (left >= kChunk) {
      a = _mm512_loadu_si512(p);
      b = _mm512_loadu_si512(p + 32);
    } else {
      a = _mm512_maskz_loadu_epi16(__mmask32(tail_mask(lo(left, 32))), p);
      b = _mm512_maskz_loadu_epi16(__mmask32(tail_mask(hi(left - 32, 0))), p + 32);
    }
  }
};

struct Bf16Tile {  // FP8 weights converted once into a buffer (kernel lane order), reused across tokens
  const uint16_t* buf;
  int64_t ld;
  void load(int r, int64_t c, __m512i& a, __m512i& b) const {
    const uint16_t* p = buf + r * ld + c * kChunk;
    a = _mm512_load_si512(p);
    b = _mm512_load_si512(p + 32);
  }
};

// acc + a_odd * b_odd + a_even * b_even over the BF16 pairs of each 32-bit lane (vdpbf16ps, or its emulation).
inline __m512 dot(__m512 acc, __m512i a, __m512i b) {
#if HYBRID_AVX512_NO_BF16
  const __m512i odd = _mm512_set1_epi32(int(0xFFFF0000u));
  acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(a, odd)), _mm512_castsi512_ps(_mm512_and_si512(b, odd)),
                        acc);
  return _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(a, 16)), _mm512_castsi512_ps(_mm512_slli_epi32(b, 16)),
                         acc);
#else
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
#endif
}

const Tables& tables() {
  static const Tables t;
  return t;
}

// The scaled sums of a tile's N outputs: add(blk, s) takes one K block's accumulators (blk[i] for output i, 16
// lanes of partial sums each) and that block's scale; sums(out) writes the N outputs at the end. Each output's sum
// takes the same operations whatever the tile's shape, so its bits do not depend on the tokens and rows it shares a
// tile with. (Both keep the partial sums in registers: as members of a struct that also held an array, GCC put them
// in memory, 8 % slower.)
//
// QuadSums (avx512_bf16): each accumulator's lanes are summed in pairs within each 128-bit lane (lanes 0+2 and 1+3,
// then the two), four accumulators to a register, before the scale: N/4 FMAs a block with unpacks and adds, where
// vdpbf16ps shares its pipes with FMAs and stores but not with those (a zmm store costs ~1.5 of its cycles). AMD
// Zen 4, 2 cores, one layer of 32 experts side by side with LaneSums: 1.15-1.18x faster at 8-32 tokens per expert,
// the same at 1-4 (docs/perf/journal.md).
template <int N>
struct QuadSums {
  static constexpr int kBlk = (N + 3) / 4 * 4;  // accumulators, padded with zeros to whole registers of sums
  __m512 acc[kBlk / 4];
  QuadSums() {
    for (auto& a : acc) a = _mm512_setzero_ps();
  }
  void add(const __m512 (&blk)[kBlk], __m512 s) {
    for (int k = 0; k < kBlk / 4; ++k) {
      __m512 t[2];
      for (int j = 0; j < 2; ++j) {
        const __m512 a = blk[4 * k + 2 * j], b = blk[4 * k + 2 * j + 1];
        t[j] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));  // a0+a2 b0+b2 a1+a3 b1+b3
      }
      const __m512d lo = _mm512_castps_pd(t[0]), hi = _mm512_castps_pd(t[1]);
      const __m512 q = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(lo, hi)),
                                     _mm512_castpd_ps(_mm512_unpackhi_pd(lo, hi)));  // 4 sums per 128-bit lane
      acc[k] = _mm512_fmadd_ps(q, s, acc[k]);
    }
  }
  void sums(float (&out)[N]) const {
    alignas(64) float part[kBlk / 4][16];  // part[k][4 * lane + t]: 128-bit lane `lane`'s share of sum 4k + t
    for (int k = 0; k < kBlk / 4; ++k) _mm512_store_ps(part[k], acc[k]);
    for (int i = 0; i < N; ++i) {
      const float* q = part[i / 4] + i % 4;
      out[i] = (q[0] + q[4]) + (q[8] + q[12]);
    }
  }
};

// LaneSums (variant avx512, vdpbf16ps emulated with two FMAs): one FMA per accumulator and block, the lanes summed
// at the end; in registers up to 8 outputs, in an L1-resident array beyond. FMAs bound that variant, yet QuadSums
// was 8-12 % slower in it (Zen 4, the same layer), so it keeps these.
template <int N>
struct LaneSums {
  static constexpr int kBlk = N;
  static constexpr bool kInRegs = N <= 8;
  __m512 acc[kInRegs ? N : 1];
  alignas(64) float mem[kInRegs ? 1 : N * 16];
  LaneSums() {
    if constexpr (kInRegs) {
      for (auto& a : acc) a = _mm512_setzero_ps();
    } else {
      for (int i = 0; i < N; ++i) _mm512_store_ps(mem + 16 * i, _mm512_setzero_ps());
    }
  }
  void add(const __m512 (&blk)[kBlk], __m512 s) {
    for (int i = 0; i < N; ++i) {
      if constexpr (kInRegs) acc[i] = _mm512_fmadd_ps(blk[i], s, acc[i]);
      else _mm512_store_ps(mem + 16 * i, _mm512_fmadd_ps(blk[i], s, _mm512_load_ps(mem + 16 * i)));
    }
  }
  void sums(float (&out)[N]) const {
    for (int i = 0; i < N; ++i) out[i] = _mm512_reduce_add_ps(kInRegs ? acc[i] : _mm512_load_ps(mem + 16 * i));
  }
};

template <int N>
using Sums = std::conditional_t<HYBRID_AVX512_NO_BF16, LaneSums<N>, QuadSums<N>>;

// Y[m0:m0+MT, n:n+R] for one tile: R rows share one scale row (they lie in one 128-row block).
template <int R, int MT, class Load>
void tile(const Load& L, const uint16_t* xp, int64_t ldxp, int64_t K, const float* srow, float* y, int64_t ldy) {
  Sums<R * MT> sums;
  __m512 blk[Sums<R * MT>::kBlk];  // one K block's accumulators, blk[r * MT + m]
  auto chunk = [&](int64_t c) {    // 64 columns
    __m512i wa[R], wb[R];
    for (int r = 0; r < R; ++r) L.load(r, c, wa[r], wb[r]);
    for (int m = 0; m < MT; ++m) {
      const __m512i xa = _mm512_loadu_si512(xp + m * ldxp + c * kChunk);
      const __m512i xb = _mm512_loadu_si512(xp + m * ldxp + c * kChunk + 32);
      for (int r = 0; r < R; ++r) {
        blk[r * MT + m] = dot(blk[r * MT + m], wa[r], xa);
        blk[r * MT + m] = dot(blk[r * MT + m], wb[r], xb);
      }
    }
  };
  const int64_t n_chunks = (K + kChunk - 1) / kChunk;
  for (int64_t kb = 0; kb * kBlock < K; ++kb) {
    for (auto& b : blk) b = _mm512_setzero_ps();
    chunk(2 * kb);
    if (2 * kb + 1 < n_chunks) chunk(2 * kb + 1);
    sums.add(blk, _mm512_set1_ps(srow ? srow[kb] : 1.0f));
  }
  float out[R * MT];
  sums.sums(out);
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) y[m * ldy + r] = out[r * MT + m];
}

// All tokens for rows [n0, n1) with loader factory `at(n)` giving a loader whose row 0 is row n.
// Y for a tile of R rows and every token: MT tokens at a time, then four (when MT = 8), then pairs, then singles.
template <int R, int MT, class Load>
void token_tiles(const GemmProblem& p, const Load& L, const uint16_t* xp, int64_t ldxp, const float* srow,
                 float* y) {
  int64_t m = 0;
  for (; m + MT <= p.M; m += MT) tile<R, MT>(L, xp + m * ldxp, ldxp, p.K, srow, y + m * p.ldy, p.ldy);
  if constexpr (MT > 4) {
    if (m + 4 <= p.M) {
      tile<R, 4>(L, xp + m * ldxp, ldxp, p.K, srow, y + m * p.ldy, p.ldy);
      m += 4;
    }
  }
  if (MT > 2 && m + 2 <= p.M) {
    tile<R, 2>(L, xp + m * ldxp, ldxp, p.K, srow, y + m * p.ldy, p.ldy);
    m += 2;
  }
  for (; m < p.M; ++m) tile<R, 1>(L, xp + m * ldxp, ldxp, p.K, srow, y + m * p.ldy, p.ldy);
}

// All tokens for rows [n0, n1) with loader factory `at(n)` giving a loader whose row 0 is row n.
template <int R, int MT, class At>
void rows(const GemmProblem& p, const uint16_t* xp, int64_t n0, int64_t n1, At at) {
  const int64_t ldxp = padded_k(p.K);
  int64_t n = n0;
  for (; n + R <= n1; n += R)
    token_tiles<R, MT>(p, at(n), xp, ldxp, p.scale ? p.scale + (n / kBlock) * p.lds : nullptr, p.y + n);
  for (; n < n1; ++n)
    token_tiles<1, MT>(p, at(n), xp, ldxp, p.scale ? p.scale + (n / kBlock) * p.lds : nullptr, p.y + n);
}

// The outputs of rows<R, MT>, each by the same operations (the same bits), token groups outermost: a group's
// activations stay in cache while the rows of a converted tile pass by, where rows<> reads every token again for
// each R rows (from L3 or memory once M x K no longer fits L2).
template <int R, int MT, class At>
void rows_tokens_outer(const GemmProblem& p, const uint16_t* xp, int64_t n0, int64_t n1, At at) {
  const int64_t ldxp = padded_k(p.K);
  auto group = [&](auto tokens, int64_t m) {
    constexpr int T = decltype(tokens)::value;
    const uint16_t* x = xp + m * ldxp;
    float* y = p.y + m * p.ldy;
    auto srow = [&](int64_t n) { return p.scale ? p.scale + (n / kBlock) * p.lds : nullptr; };
    int64_t n = n0;
    for (; n + R <= n1; n += R) tile<R, T>(at(n), x, ldxp, p.K, srow(n), y + n, p.ldy);
    for (; n < n1; ++n) tile<1, T>(at(n), x, ldxp, p.K, srow(n), y + n, p.ldy);
  };
  int64_t m = 0;
  for (; m + MT <= p.M; m += MT) group(std::integral_constant<int, MT>{}, m);
  if (MT > 2 && m + 2 <= p.M) {
    group(std::integral_constant<int, 2>{}, m);
    m += 2;
  }
  for (; m < p.M; ++m) group(std::integral_constant<int, 1>{}, m);
}

#if !HYBRID_AVX512_NO_BF16
// The outer-product form (avx512_bf16, from tile_min_m tokens): a zmm's lanes are 16 weight rows, and one
// vdpbf16ps adds one K pair of each of them for one token, whose pair is broadcast: no lane sums. One 128-wide K
// block of 32 rows at a time is transposed and converted (as the streaming form converts) into an L1 slab, one
// zmm per K pair and 16 rows (the VNNI layout); then every token multiplies it, 8 at a time, and each block's sums
// are scaled into y (y = s * block, then y += s * block). Each output is one chain over its block's pairs in lane
// order whatever tokens share its tile, so the form is batch-invariant within itself, but it sums in another order
// than the streaming form: under batch invariance (Tunables) the converted tiles keep the streaming form's sums.
// Rows are taken 32 at a time from n0, a multiple of 16 (both callers split rows so), so that each group of 16
// lies in one 128-row scale block.
// AMD Zen 4 (dev machine, docs/perf/journal.md): the multiply loop runs at ~0.85-0.95 vdpbf16ps per cycle against
// ~0.6-0.67 for the streaming form's; building a slab costs ~0.3-0.37 cycles per weight (~220 vector operations per
// 16 rows x 64 K), so the next block's slab is built in steps between the current block's products (SlabBuilder).
// One MoE layer of 32 experts against streaming: 1.11x at 16 tokens per expert, 1.14-1.26x at 24-48, 0.83-0.85x
// at 8 (policy.cpu.gemm_tile_tokens' null: 16 here); GEMMs at 512 tokens 1.4-1.5x the lane-form tiles.
constexpr int kOuterRows = 32;                         // rows per pass: two groups of 16
constexpr int64_t kOuterPairs = kBlock / 2;            // K pairs per block
static_assert(kOuterSlabElems == 2 * kOuterPairs * kOuterRows * 2, "gemm.h's slab size");

// Builds one block's slab: rows [n, n + rows) (rows <= 32), K block kb, into slab[pair][32 rows] (32-bit BF16
// pairs, pairs in the activations' lane order; missing rows zero), in steps small enough to run between the
// previous slab's products (a step uses ~10 registers beside the products' 19). The FP8 bytes are transposed
// before the conversion, at half the size: 4-byte units (K 4j .. 4j + 3) of 16 rows into one register per j, each
// 128-bit lane's 4 rows reordered so that the conversion's byte unpacks give pair (4j, 4j + 1) of the 16 rows in
// one register and (4j + 2, 4j + 3) in the other. Per 16 rows and 64 K: steps 0-3 load 4 rows each and interleave
// them within 128-bit lanes (into L1), steps 4-7 gather 4 registers each across the lanes, convert and store them.
struct SlabBuilder {
  const uint8_t* w;
  int64_t ldw, K, prefetch, n_chunks;
  int rows;
  const Tables* t;
  int64_t kb = 0;
  uint32_t* slab = nullptr;
  int step_ = 0, steps = 0, chunks = 0;
  alignas(64) uint32_t stage[16][16];

  void start(int64_t block, uint32_t* to) {
    kb = block, slab = to, step_ = 0;
    chunks = int(lo(2 * kb + 2, n_chunks) - 2 * kb);
    steps = kOuterRows / 16 * chunks * 8;
  }
  void finish() {
    while (step_ < steps) step();
  }
  void step() {
    if (step_ >= steps) return;
    const int part = step_ % 8, combo = step_ / 8, g = combo / chunks;
    const int64_t c = 2 * kb + combo % chunks;
    ++step_;
    if (part < 4) {  // rows 4 part .. 4 part + 3: element 4L + e of the 4 rows in 128-bit lane L of stage[4 part + e]
      __m512i v[4];
      const int64_t left = K - c * kChunk;
      for (int i = 0; i < 4; ++i) {
        const int r = g * 16 + 4 * part + i;
        const uint8_t* p = w + r * ldw + c * kChunk;
        if (r >= rows) {
          v[i] = _mm512_setzero_si512();
          continue;
        }
        if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(p + prefetch), _MM_HINT_T1);
        v[i] = left >= kChunk ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi8(tail_mask(left), p);
      }
      const __m512i t0 = _mm512_unpacklo_epi32(v[0], v[1]), t1 = _mm512_unpackhi_epi32(v[0], v[1]);
      const __m512i t2 = _mm512_unpacklo_epi32(v[2], v[3]), t3 = _mm512_unpackhi_epi32(v[2], v[3]);
      _mm512_store_si512(stage[4 * part], _mm512_unpacklo_epi64(t0, t2));
      _mm512_store_si512(stage[4 * part + 1], _mm512_unpackhi_epi64(t0, t2));
      _mm512_store_si512(stage[4 * part + 2], _mm512_unpacklo_epi64(t1, t3));
      _mm512_store_si512(stage[4 * part + 3], _mm512_unpackhi_epi64(t1, t3));
      return;
    }
    // e = part - 4: K units j = e, 4 + e, 8 + e, 12 + e (128-bit lane L of every row from stage[4 i + e], i = L)
    const int e = part - 4;
    const __m512i s0 = _mm512_load_si512(stage[e]), s1 = _mm512_load_si512(stage[4 + e]);
    const __m512i s2 = _mm512_load_si512(stage[8 + e]), s3 = _mm512_load_si512(stage[12 + e]);
    const __m512i a = _mm512_shuffle_i32x4(s0, s1, 0x44), b = _mm512_shuffle_i32x4(s0, s1, 0xEE);
    const __m512i cc = _mm512_shuffle_i32x4(s2, s3, 0x44), d = _mm512_shuffle_i32x4(s2, s3, 0xEE);
    const __m512i u[4] = {_mm512_shuffle_i32x4(a, cc, 0x88), _mm512_shuffle_i32x4(a, cc, 0xDD),
                          _mm512_shuffle_i32x4(b, d, 0x88), _mm512_shuffle_i32x4(b, d, 0xDD)};
    // per 128-bit lane: [r0 k0 k1, r1 k0 k1, r2 k0 k1, r3 k0 k1, r0 k2 k3, ...] from [r0 k0..k3, r1 k0..k3, ...]
    const __m512i pairs_first = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11,
                                                                      14, 15));
    uint32_t* out = slab + (c - 2 * kb) * 32 * kOuterRows + g * 16;
    for (int i = 0; i < 4; ++i) {
      const int j = 4 * i + e;
      __m512i lo16, hi16;
      fp8_to_bf16(*t, _mm512_shuffle_epi8(u[i], pairs_first), lo16, hi16);
      _mm512_store_si512(out + lane_of_k(4 * j) / 2 * kOuterRows, lo16);
      _mm512_store_si512(out + lane_of_k(4 * j + 2) / 2 * kOuterRows, hi16);
    }
  }
};

// MT tokens (x: token 0's pairs of this block, ldx apart) against the slab's `pairs` pairs, a step of the next
// slab's build every 4 pairs; each block's sums scaled into y's 32 rows (valid: a mask per group; s: each group's
// scale), `first`: the call's first block.
template <int MT>
void outer_tile(const uint32_t* slab, int64_t pairs, const uint32_t* x, int64_t ldx, const __mmask16 (&valid)[2],
                const __m512 (&s)[2], bool first, float* y, int64_t ldy, SlabBuilder& next) {
  __m512 acc[2][MT];
  for (auto& row : acc)
    for (auto& a : row) a = _mm512_setzero_ps();
  for (int64_t q = 0; q < pairs; ++q) {
    const __m512i w0 = _mm512_load_si512(slab + q * kOuterRows), w1 = _mm512_load_si512(slab + q * kOuterRows + 16);
    for (int m = 0; m < MT; ++m) {
      const __m512i b = _mm512_set1_epi32(int(x[m * ldx + q]));
      acc[0][m] = _mm512_dpbf16_ps(acc[0][m], (__m512bh)w0, (__m512bh)b);
      acc[1][m] = _mm512_dpbf16_ps(acc[1][m], (__m512bh)w1, (__m512bh)b);
    }
    if ((q & 3) == 3) next.step();
  }
  for (int g = 0; g < 2; ++g) {
    if (!valid[g]) continue;
    for (int m = 0; m < MT; ++m) {
      float* out = y + m * ldy + g * 16;
      const __m512 v = first ? _mm512_mul_ps(acc[g][m], s[g])
                             : _mm512_fmadd_ps(acc[g][m], s[g], _mm512_maskz_loadu_ps(valid[g], out));
      _mm512_mask_storeu_ps(out, valid[g], v);
    }
  }
}

void outer_rows(const GemmProblem& p, const uint16_t* xp, int64_t n0, int64_t n1, uint32_t* slabs) {
  const auto* w = static_cast<const uint8_t*>(p.w);
  const int64_t ldx = padded_k(p.K) / 2, n_chunks = (p.K + kChunk - 1) / kChunk;
  const int64_t n_blocks = (p.K + kBlock - 1) / kBlock;
  const auto* x = reinterpret_cast<const uint32_t*>(xp);
  for (int64_t n = n0; n < n1; n += kOuterRows) {
    const int rows = int(lo(kOuterRows, n1 - n));
    // prefetch: the next pass's same spot
    SlabBuilder next{w + n * p.ldw, p.ldw, p.K, kOuterRows * p.ldw, n_chunks, rows, &tables()};
    __mmask16 valid[2];
    for (int g = 0; g < 2; ++g) valid[g] = __mmask16(tail_mask(hi(0, lo(16, rows - 16 * g))));
    next.start(0, slabs);
    next.finish();
    for (int64_t kb = 0; kb < n_blocks; ++kb) {
      const uint32_t* slab = slabs + (kb & 1) * kOuterPairs * kOuterRows;
      if (kb + 1 < n_blocks) next.start(kb + 1, slabs + ((kb + 1) & 1) * kOuterPairs * kOuterRows);
      const int64_t pairs = (lo(2 * kb + 2, n_chunks) - 2 * kb) * 32;
      __m512 s[2];
      for (int g = 0; g < 2; ++g) {
        const int64_t r = lo(n + 16 * g, n1 - 1);  // a group's rows lie in one 128-row block (n is a multiple of 16)
        s[g] = _mm512_set1_ps(p.scale ? p.scale[(r / kBlock) * p.lds + kb] : 1.0f);
      }
      auto tokens = [&, xb = x + kb * kOuterPairs, yb = p.y + n](auto mt, int64_t m) {  // tokens m .. m + mt
        outer_tile<decltype(mt)::value>(slab, pairs, xb + m * ldx, ldx, valid, s, kb == 0, yb + m * p.ldy, p.ldy,
                                        next);
        return m + decltype(mt)::value;
      };
      int64_t m = 0;
      while (m + 8 <= p.M) m = tokens(std::integral_constant<int, 8>{}, m);
      if (m + 4 <= p.M) m = tokens(std::integral_constant<int, 4>{}, m);
      if (m + 2 <= p.M) m = tokens(std::integral_constant<int, 2>{}, m);
      if (m < p.M) tokens(std::integral_constant<int, 1>{}, m);
      next.finish();  // the rest of the next slab (the last block's start left none)
    }
  }
}
#endif

}  // namespace

void HYBRID_AVX512_FN(convert_rows)(const GemmProblem& p, int64_t n, int64_t count, int64_t c0, int64_t c1,
                                    int64_t prefetch, uint16_t* buf, int64_t ld) {
  const Fp8Rows L{static_cast<const uint8_t*>(p.w) + n * p.ldw, p.ldw, p.K, &tables(), prefetch};
  for (int r = 0; r < count; ++r)
    for (int64_t c = c0; c < c1; ++c) {
      __m512i a, b;
      L.load(r, c, a, b);
      _mm512_store_si512(buf + r * ld + (c - c0) * kChunk, a);
      _mm512_store_si512(buf + r * ld + (c - c0) * kChunk + 32, b);
    }
}

void HYBRID_AVX512_FN(prepare_x)(const GemmProblem& p, uint16_t* xprep) {
  const int64_t kp = padded_k(p.K);
  const bool permute = p.wt == WeightType::fp8;
  for (int64_t m = 0; m < p.M; ++m) {
    const uint16_t* x = p.x + m * p.ldx;
    uint16_t* out = xprep + m * kp;
    for (int64_t c = 0; c < kp; c += kChunk)
      for (int64_t w = 0; w < kChunk; ++w) {
        const int64_t k = c + (permute ? k_of_lane(w) : w);
        out[c + w] = k < p.K ? x[k] : 0;
      }
  }
}

void HYBRID_AVX512_FN(gemm_rows)(const GemmProblem& p, const uint16_t* xp, int64_t n0, int64_t n1, uint16_t* tile_buf) {
  if (p.wt == WeightType::bf16) {
    const auto* w = static_cast<const uint16_t*>(p.w);
    rows<4, 2>(p, xp, n0, n1, [&](int64_t n) { return Bf16Rows{w + n * p.ldw, p.ldw, p.K}; });
    return;
  }
  const auto* w = static_cast<const uint8_t*>(p.w);
  auto fp8_rows = [&](int64_t r) {
    return [&, r](int64_t n) { return Fp8Rows{w + n * p.ldw, p.ldw, p.K, &tables(), r * p.ldw}; };
  };
  if (p.M < tunables().tile_min_m) {
    if (p.M == 1) rows<4, 1>(p, xp, n0, n1, fp8_rows(4));
    else if (p.M == 2) rows<4, 2>(p, xp, n0, n1, fp8_rows(4));
    else if (p.M == 3) rows<2, 3>(p, xp, n0, n1, fp8_rows(2));
#if HYBRID_AVX512_NO_BF16
    else rows<2, 4>(p, xp, n0, n1, fp8_rows(2));
#else
    // 8 tokens per pass over each converted weight from M = 8 on: half the conversions per product. AMD Zen 4 (dev
    // machine, 2 cores; one MoE layer of 32 experts, 8-32 tokens each, the two ways side by side, the same bits):
    // 3-6 % faster than 4 per pass with LaneSums, 10-13 % with QuadSums (gate/up GEMMs of 8-32 tokens); the
    // emulated-BF16 variant (two FMAs a product) was 5-9 % slower, so keeps 4.
    else if (p.M < 8) rows<2, 4>(p, xp, n0, n1, fp8_rows(2));
    else rows<2, 8>(p, xp, n0, n1, fp8_rows(2));
#endif
    return;
  }
#if !HYBRID_AVX512_NO_BF16
  if (!tunables().batch_invariant) return outer_rows(p, xp, n0, n1, reinterpret_cast<uint32_t*>(tile_buf));
#endif
  const int64_t ld = padded_k(p.K);
  for (int64_t g = n0; g < n1; g += kTileRows) {
    const int64_t count = lo(kTileRows, n1 - g);
    HYBRID_AVX512_FN(convert_rows)(p, g, count, 0, ld / kChunk, kTileRows * p.ldw, tile_buf, ld);
    auto tile_rows = [&](int64_t n) { return Bf16Tile{tile_buf + (n - g) * ld, ld}; };
#if HYBRID_AVX512_NO_BF16
    // Measured on an Emerald Rapids VM (docs/perf/journal.md, 2026-12-01): tokens outermost beat rows<2, 4> by
    // ~1.2-1.7x at M = 512; a tile kept in FP32 (no odd/even split in the loop, twice the scratch) was no faster.
    rows_tokens_outer<3, 4>(p, xp, g, g + count, tile_rows);
#else
    // Under batch invariance: the streaming form's sums, the conversions spared (Zen 4, 2 cores, gate/up GEMMs of
    // 64 and 128 tokens: 8 tokens per pass over the tile 1.16-1.36x faster than 4, as fast as streaming).
    rows<2, 8>(p, xp, g, g + count, tile_rows);
#endif
  }
}

}  // namespace hybrid
