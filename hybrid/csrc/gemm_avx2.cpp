// AVX2 + FMA + F16C kernel (compiled with -mavx2 -mfma -mf16c): fp32 arithmetic, 8 weights per vector.
//
// FP8 E4M3 -> fp32, two exact ways, both scaled by a power of two that each 128x128 block's scale takes back
// when it is applied, once per block dot product ("post-scaling"):
// * Streaming rows (1-4 tokens), in registers, three instructions per 8 weights: the code sign-extended to 32
//   bits and shifted left by 20 has its sign at bit 31 and its other seven bits at bits 26..20; masking bits
//   30..27 away leaves an fp32 number worth exactly 2^-120 times the code's value (exponent field = the code's,
//   mantissa on top; subnormal codes become fp32 subnormals, again exactly 2^-120 times their value). The
//   activations are multiplied by 2^96 as they are converted to fp32 (exact while |x| < 2^32), so each product
//   is 2^-24 x w·x, inside fp32's normal range. MXCSR's DAZ would flush the subnormal codes (|w| < 2^-6 before
//   the block scale) to zero, so the kernel clears DAZ while it runs (DazOff) and puts the caller's MXCSR back.
//   AMD Zen takes subnormal FMA inputs at full speed; Intel cores take a microcode assist for each (~17x slower
//   with one code in 16 subnormal), so there streaming rows go through FP16 as the tiles do
//   (Tunables::avx2_stream_fp16, set from the cpuid vendor).
// * Prefill tiles (5 tokens and more), converted once into an L1 buffer: the code's sign moved to bit 15 and its
//   other seven bits to bits 13..7 of a 16-bit lane is an FP16 number worth exactly 2^-8 times the code's value
//   (one byte shuffle, one shift and one mask per 16 weights), which vcvtph2ps widens exactly, subnormals too,
//   whatever MXCSR says; products are 2^-8 x w·x. (An fp32 tile from the register conversion ran ~20 % slower
//   on Zen 3 at 32-128 tokens: it doubles the tile's bytes.)
// The two paths' products differ by exactly 2^16 and so do their block scales: every FMA rounds the same, and
// a token's result is bitwise the same whichever path its batch takes (per block: 8-column FMAs in column
// order, then one FMA with the block scale; one horizontal sum at the end). The NaN codes 0x7F/0xFF would read
// as the finite 480: the weight loader rejects checkpoints that contain them.
//
// Up to 4 tokens, R rows stream from memory (the next row group prefetched in address order, see Prefetch),
// each 8 weights converted in registers and multiplied with every token, no buffer and no store (or, through
// FP16, each row converted a block ahead into a small ring buffer). From 5 tokens on,
// a tile of 18 rows x 512 columns is converted once and every token is multiplied against it, 3 rows x up to 4
// tokens at a time.
#include <immintrin.h>

#include <cstring>

#include "gemm.h"

namespace hybrid {
namespace {

inline int64_t lo(int64_t a, int64_t b) { return a < b ? a : b; }

constexpr int64_t kStep = 16;       // columns per step: two fp32 vectors
constexpr int kPanelRows = 18;      // prefill tile: rows ...
constexpr int64_t kPanelK = 512;    // ... x columns (four scale blocks): 18 KB of FP16
constexpr int kPanelR = 3;          // prefill: rows per multiply (x 4 tokens: 12 accumulators)
constexpr int kStreamMaxM = 4;      // up to this many tokens, FP8 rows stream (converted in registers)
constexpr float kStreamX = 0x1p96f; // streaming FP8: activations x 2^96 ...
constexpr float kStreamPost = 0x1p24f;  // ... times weights read as 2^-120 x their value: products 2^-24 x w·x
constexpr float kFp16Post = 256.0f; // FP16-coded FP8 weights (tiles, the FP16 ring) read 2^-8 of their value

// 8 E4M3 codes at p -> 2^-120 x their values (see the top of the file).
inline __m256 fp8x8(const uint8_t* p) {
  const __m256i c = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(c, 20), _mm256_set1_epi32(int(0x87F00000u))));
}

// The n codes at p (n <= 0: none), zero-padded to 8 (n >= 8: the first 8).
inline __m256 fp8x8_tail(const uint8_t* p, int64_t n) {
  if (n >= 8) return fp8x8(p);
  alignas(8) uint8_t t[8] = {};
  if (n > 0) std::memcpy(t, p, size_t(n));
  return fp8x8(t);
}

// 16 E4M3 codes at p -> FP16 codes of 2^-8 x their values at h (32-byte aligned), natural order: the code's
// sign to bit 15, its other seven bits to bits 13..7 (vcvtph2ps widens FP16 subnormals exactly, whatever MXCSR).
inline void fp8_to_fp16(const uint8_t* p, uint16_t* h) {
  const __m256i spread = _mm256_setr_epi8(-128, 0, -128, 1, -128, 2, -128, 3, -128, 4, -128, 5, -128, 6, -128, 7,
                                          -128, 8, -128, 9, -128, 10, -128, 11, -128, 12, -128, 13, -128, 14, -128, 15);
  const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i hi = _mm256_shuffle_epi8(v, spread);  // code j in the high byte of lane j
  _mm256_store_si256(reinterpret_cast<__m256i*>(h),
                     _mm256_and_si256(_mm256_srai_epi16(hi, 1), _mm256_set1_epi16(int16_t(0xBF80))));
}

// The n < 16 codes at p (zero-padded to 16) -> h.
inline void fp8_to_fp16_tail(const uint8_t* p, int64_t n, uint16_t* h) {
  alignas(16) uint8_t t[kStep] = {};
  std::memcpy(t, p, size_t(n));
  fp8_to_fp16(t, h);
}

inline __m256 fp16x8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(p)));
}

inline __m256 bf16x8(__m128i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16)); }

// Weight views for the multiply: get(r, k) = row r, columns k..k+7 as fp32; get_tail the same where fewer than
// 8 columns (n, possibly <= 0) are left, the rest zero.
struct Fp8Rows {  // FP8 weights converted in registers as they stream by
  const uint8_t* w;
  int64_t ldw;
  __m256 get(int r, int64_t k) const { return fp8x8(w + r * ldw + k); }
  __m256 get_tail(int r, int64_t k, int64_t n) const { return fp8x8_tail(w + r * ldw + k, n); }
};

struct Fp16Tile {  // converted rows: row r, column k at buf[r * ld + k - k0], zero-padded to whole steps
  const uint16_t* buf;
  int64_t ld, k0;
  __m256 get(int r, int64_t k) const { return fp16x8(buf + r * ld + (k - k0)); }
  __m256 get_tail(int r, int64_t k, int64_t) const { return get(r, k); }
  Fp16Tile from(int r) const { return {buf + r * ld, ld, k0}; }
};

constexpr int64_t kRing = 2 * kBlock;  // columns a streaming row keeps converted: the block in use and the next

struct Fp16Ring {  // streaming rows: row r, column k at buf[r * kRing + k % kRing], zero-padded to whole steps
  const uint16_t* buf;
  __m256 get(int r, int64_t k) const { return fp16x8(buf + r * kRing + (k & (kRing - 1))); }
  __m256 get_tail(int r, int64_t k, int64_t) const { return get(r, k); }
};

struct Bf16Rows {  // BF16 weights read in place
  const uint16_t* w;
  int64_t ldw;
  __m256 get(int r, int64_t k) const {
    return bf16x8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + r * ldw + k)));
  }
  __m256 get_tail(int r, int64_t k, int64_t n) const {
    alignas(16) uint16_t t[8] = {};
    if (n > 0) std::memcpy(t, w + r * ldw + k, size_t(n) * sizeof(uint16_t));
    return bf16x8(_mm_load_si128(reinterpret_cast<const __m128i*>(t)));
  }
  Bf16Rows from(int r) const { return {w + r * ldw, ldw}; }
};

inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// Columns [k, k + 16) of rows 0..R-1 against tokens 0..MT-1 (x: fp32, zero-padded): blk[r][m] += w[r] x[m], 8
// columns at a time. Fewer tokens than rows: the tokens' activations sit in registers and each row's weights
// stream through one; otherwise the other way round. `left`: columns left before K (tail steps only).
template <int R, int MT, bool kTail, class W>
inline void step(const W& w, const float* x, int64_t ldx, int64_t k, int64_t left, __m256 (&blk)[R][MT]) {
  for (int64_t kh = k; kh < k + kStep; kh += 8) {
    auto get = [&](int r) { return kTail && kh + 8 > k + left ? w.get_tail(r, kh, k + left - kh) : w.get(r, kh); };
    if (MT < R) {
      __m256 xv[MT];
      for (int m = 0; m < MT; ++m) xv[m] = _mm256_load_ps(x + m * ldx + kh);
      for (int r = 0; r < R; ++r) {
        const __m256 wv = get(r);
        for (int m = 0; m < MT; ++m) blk[r][m] = _mm256_fmadd_ps(wv, xv[m], blk[r][m]);
      }
    } else {
      __m256 wv[R];
      for (int r = 0; r < R; ++r) wv[r] = get(r);
      for (int m = 0; m < MT; ++m) {
        const __m256 xv = _mm256_load_ps(x + m * ldx + kh);
        for (int r = 0; r < R; ++r) blk[r][m] = _mm256_fmadd_ps(wv[r], xv, blk[r][m]);
      }
    }
  }
}

// After a block: tot[r * ldt + m] += blk[r][m] * the block's scale.
template <int R, int MT>
inline void post_scale(__m256 (&blk)[R][MT], float scale, __m256* tot, int64_t ldt) {
  const __m256 s = _mm256_set1_ps(scale);
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) tot[r * ldt + m] = _mm256_fmadd_ps(blk[r][m], s, tot[r * ldt + m]);
}

template <int R, int MT>
inline void zero(__m256 (&blk)[R][MT]) {
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) blk[r][m] = _mm256_setzero_ps();
}

// Scale blocks [kb0, kb1) of rows 0..R-1 against tokens 0..MT-1, into tot.
template <int R, int MT, class W>
inline void multiply(const W& w, const float* x, int64_t ldx, int64_t K, int64_t kb0, int64_t kb1,
                     const float* srow, float post, __m256* tot, int64_t ldt) {
  for (int64_t kb = kb0; kb < kb1; ++kb) {
    const int64_t k0 = kb * kBlock, k1 = lo(K, k0 + kBlock), full = k0 + (k1 - k0) / kStep * kStep;
    __m256 blk[R][MT];
    zero(blk);
    for (int64_t k = k0; k < full; k += kStep) step<R, MT, false>(w, x, ldx, k, 0, blk);
    if (full < k1) step<R, MT, true>(w, x, ldx, full, k1 - full, blk);
    post_scale(blk, srow ? srow[kb] * post : 1.0f, tot, ldt);
  }
}

struct Job {
  const GemmProblem& p;
  const float* x;  // activations in fp32, [M, ldx], zero-padded to whole steps
  int64_t ldx;
  uint16_t* buf;   // FP16 conversion buffer: a prefill tile, or a streaming row group's ring
  __m256* tot;     // prefill block totals, [kPanelRows, M]
  bool fp16_stream;  // streaming FP8 rows go through the FP16 ring (else: converted in registers)
  bool fp8() const { return p.wt == WeightType::fp8; }
  const float* srow(int64_t n) const { return p.scale ? p.scale + (n / kBlock) * p.lds : nullptr; }
  const uint8_t* w8(int64_t n) const { return static_cast<const uint8_t*>(p.w) + n * p.ldw; }
  const uint16_t* w16(int64_t n) const { return static_cast<const uint16_t*>(p.w) + n * p.ldw; }
};

// Software prefetch of the next row group while a group streams: at each cache line of columns (c, a multiple
// of 64) one line per row, the line for (c, r) at w + ahead + (c / 64) * per_line + r * per_row. Rows stored back
// to back (ldw == K) take the group's bytes in address order (per_line = R * 64, per_row = 64): one sequential
// stream, which memory serves faster than R streams one row apart, most of all for short rows (the down
// projection's 2 KB: see docs/perf/journal.md); other strides the same columns of the next rows (64, ldw).
// ahead = 0: none.
struct Prefetch {
  int64_t ahead, per_line, per_row;
  void at(const uint8_t* w, int64_t c, int r) const {
    _mm_prefetch(reinterpret_cast<const char*>(w + ahead + (c >> 6) * per_line + r * per_row), _MM_HINT_T1);
  }
};

template <int R>
Prefetch next_group(int64_t ldw, int64_t K) {
  return ldw == K ? Prefetch{R * ldw, R * 64, 64} : Prefetch{R * ldw, 64, ldw};
}

// Columns [c, c + 16) of rows 0..R-1 into the ring, with the prefetch at each cache line.
template <int R, bool kTail>
inline void convert_step(const uint8_t* w, int64_t ldw, int64_t K, int64_t c, uint16_t* ring, const Prefetch& pf) {
  for (int r = 0; r < R; ++r) {
    const uint8_t* p = w + r * ldw + c;
    uint16_t* h = ring + r * kRing + (c & (kRing - 1));
    if (pf.ahead && (c & 63) == 0) pf.at(w, c, r);
    if (kTail && c + kStep > K) fp8_to_fp16_tail(p, K - c, h);
    else fp8_to_fp16(p, h);
  }
}

// Columns [c, c + 16) of rows 0..R-1 (full, c a multiple of 16) into the ring at h (the columns' place in it);
// kLine: c starts a cache line, so the prefetch goes with it (with Prefetch{} it touches this group's first
// line: harmless).
template <int R, bool kLine>
inline void convert_rows(const uint8_t* w, int64_t ldw, int64_t c, uint16_t* h, const Prefetch& pf) {
  for (int r = 0; r < R; ++r) {
    if (kLine) pf.at(w, c, r);
    fp8_to_fp16(w + r * ldw + c, h + r * kRing);
  }
}

template <int R>
void convert_block(const uint8_t* w, int64_t ldw, int64_t K, int64_t k0, uint16_t* ring, const Prefetch& pf) {
  for (int64_t c = k0; c < lo(K, k0 + kBlock); c += kStep) convert_step<R, true>(w, ldw, K, c, ring, pf);
}

// Decode, FP8, through FP16 (Tunables::avx2_stream_fp16): rows w[0..R-1] (one scale row, `srow`) against tokens
// x[0..MT-1], into tot[r * MT + m]; each row converted one block ahead of the multiply, in the same loop, so
// conversion and FMAs overlap. Everything comes by value: the ring's stores may alias any memory, so fields read
// through a pointer would be read again after each of them.
template <int R, int MT>
void stream_fp16(const uint8_t* w, int64_t ldw, int64_t K, const float* srow, const float* x, int64_t ldx,
                uint16_t* buf, const Prefetch pf, __m256* tot) {
  const Fp16Ring ring{buf};
  const int64_t blocks = (K + kBlock - 1) / kBlock;
  convert_block<R>(w, ldw, K, 0, buf, pf);
  for (int64_t kb = 0; kb < blocks; ++kb) {
    const int64_t k0 = kb * kBlock, k1 = lo(K, k0 + kBlock);
    const bool next_full = k1 + kBlock <= K;
    if (!next_full && k1 < K) convert_block<R>(w, ldw, K, k1, buf, pf);
    __m256 blk[R][MT];
    zero(blk);
    if (next_full) {
      // 64 columns (one cache line of each row) per pass: one prefetch per row, then three steps without.
      // Ring offsets fixed per pass (64 columns never wrap the ring).
      for (int64_t k = k0; k < k1; k += 4 * kStep) {
        const Fp16Tile cur{buf + (k & (kRing - 1)), kRing, k};
        const int64_t c = k + kBlock;
        uint16_t* dst = buf + (c & (kRing - 1));
        convert_rows<R, true>(w, ldw, c, dst, pf);
        step<R, MT, false>(cur, x, ldx, k, 0, blk);
        convert_rows<R, false>(w, ldw, c + kStep, dst + kStep, pf);
        step<R, MT, false>(cur, x, ldx, k + kStep, 0, blk);
        convert_rows<R, false>(w, ldw, c + 2 * kStep, dst + 2 * kStep, pf);
        step<R, MT, false>(cur, x, ldx, k + 2 * kStep, 0, blk);
        convert_rows<R, false>(w, ldw, c + 3 * kStep, dst + 3 * kStep, pf);
        step<R, MT, false>(cur, x, ldx, k + 3 * kStep, 0, blk);
      }
    } else {
      for (int64_t k = k0; k < k1; k += kStep) step<R, MT, false>(ring, x, ldx, k, 0, blk);
    }
    post_scale(blk, srow[kb] * kFp16Post, tot, MT);
  }
}

// Decode, FP8, converted in registers: rows w[0..R-1] (one scale row, `srow`) against tokens x[0..MT-1] (x 2^96),
// into tot[r * MT + m]; 64 columns (one cache line of each row) per pass, with one prefetch per row of the next
// group.
template <int R, int MT>
void stream_registers(const uint8_t* w, int64_t ldw, int64_t K, const float* srow, const float* x, int64_t ldx,
                const Prefetch pf, __m256* tot) {
  const Fp8Rows rows{w, ldw};
  const int64_t blocks = (K + kBlock - 1) / kBlock;
  for (int64_t kb = 0; kb < blocks; ++kb) {
    const int64_t k0 = kb * kBlock, k1 = lo(K, k0 + kBlock), lines = k0 + (k1 - k0) / 64 * 64;
    __m256 blk[R][MT];
    zero(blk);
    for (int64_t k = k0; k < lines; k += 4 * kStep) {
      if (pf.ahead)
        for (int r = 0; r < R; ++r) pf.at(w, k, r);
      step<R, MT, false>(rows, x, ldx, k, 0, blk);
      step<R, MT, false>(rows, x, ldx, k + kStep, 0, blk);
      step<R, MT, false>(rows, x, ldx, k + 2 * kStep, 0, blk);
      step<R, MT, false>(rows, x, ldx, k + 3 * kStep, 0, blk);
    }
    for (int64_t k = lines; k < k1; k += kStep) {
      if (pf.ahead && (k & 63) == 0)
        for (int r = 0; r < R; ++r) pf.at(w, k, r);
      if (k + kStep <= k1) step<R, MT, false>(rows, x, ldx, k, 0, blk);
      else step<R, MT, true>(rows, x, ldx, k, k1 - k, blk);
    }
    post_scale(blk, srow[kb] * kStreamPost, tot, MT);
  }
}

// Decode: rows n..n+R-1 (one scale row) against all M = MT tokens.
template <int R, int MT>
void stream_rows(const Job& j, int64_t n, const Prefetch& pf) {
  const GemmProblem& p = j.p;
  __m256 tot[R * MT];
  for (int i = 0; i < R * MT; ++i) tot[i] = _mm256_setzero_ps();
  const int64_t blocks = (p.K + kBlock - 1) / kBlock;
  if (j.fp8()) {
    if (j.fp16_stream) stream_fp16<R, MT>(j.w8(n), p.ldw, p.K, j.srow(n), j.x, j.ldx, j.buf, pf, tot);
    else stream_registers<R, MT>(j.w8(n), p.ldw, p.K, j.srow(n), j.x, j.ldx, pf, tot);
  } else {
    multiply<R, MT>(Bf16Rows{j.w16(n), p.ldw}, j.x, j.ldx, p.K, 0, blocks, nullptr, 1.0f, tot, MT);
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MT; ++m) p.y[m * p.ldy + n + r] = hsum(tot[r * MT + m]);
}

// Rows [n0, n1): R at a time where they share a scale row (prefetching the next R), else 2 or 1.
template <int R, int MT>
void stream(const Job& j, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1;) {
    const int64_t fit = lo(n1 - n, kBlock - n % kBlock);
    if (fit >= R) {
      stream_rows<R, MT>(j, n, next_group<R>(j.p.ldw, j.p.K));
      n += R;
    } else if (R > 2 && fit >= 2) {
      stream_rows<2, MT>(j, n, Prefetch{});
      n += 2;
    } else {
      stream_rows<1, MT>(j, n, Prefetch{});
      n += 1;
    }
  }
}

template <int R, class W>
void tile_rows(const Job& j, const W& w, const float* x, int64_t mt, int64_t kb0, int64_t kb1, const float* srow,
               float post, __m256* tot) {
  const GemmProblem& p = j.p;
  switch (mt) {
    case 4: return multiply<R, 4>(w, x, j.ldx, p.K, kb0, kb1, srow, post, tot, p.M);
    case 3: return multiply<R, 3>(w, x, j.ldx, p.K, kb0, kb1, srow, post, tot, p.M);
    case 2: return multiply<R, 2>(w, x, j.ldx, p.K, kb0, kb1, srow, post, tot, p.M);
    default: return multiply<R, 1>(w, x, j.ldx, p.K, kb0, kb1, srow, post, tot, p.M);
  }
}

// Every token against `rows` converted rows, scale blocks [kb0, kb1): tokens in near-equal groups of up to 4.
template <class W>
void tile_tokens(const Job& j, const W& w, int rows, int64_t kb0, int64_t kb1, const float* srow, float post) {
  const int64_t M = j.p.M, groups = (M + 3) / 4;
  for (int64_t g = 0, m = 0; g < groups; ++g) {
    const int64_t mt = M / groups + (g < M % groups);
    const float* x = j.x + m * j.ldx;
    for (int r = 0; r < rows;) {
      __m256* t = j.tot + r * M + m;
      if (rows - r >= kPanelR) {
        tile_rows<kPanelR>(j, w.from(r), x, mt, kb0, kb1, srow, post, t);
        r += kPanelR;
      } else if (rows - r >= 2) {
        tile_rows<2>(j, w.from(r), x, mt, kb0, kb1, srow, post, t);
        r += 2;
      } else {
        tile_rows<1>(j, w.from(r), x, mt, kb0, kb1, srow, post, t);
        r += 1;
      }
    }
    m += mt;
  }
}

// Prefill: tiles of up to kPanelRows rows (one scale row) x kPanelK columns, each FP8 tile converted once.
void tiles(const Job& j, int64_t n0, int64_t n1) {
  const GemmProblem& p = j.p;
  for (int64_t g = n0; g < n1;) {
    const int rows = int(lo(lo(kPanelRows, n1 - g), kBlock - g % kBlock));
    for (int64_t i = 0; i < rows * p.M; ++i) j.tot[i] = _mm256_setzero_ps();
    for (int64_t kc = 0; kc < p.K; kc += kPanelK) {
      const int64_t kn = lo(kPanelK, p.K - kc), kb0 = kc / kBlock, kb1 = (kc + kn + kBlock - 1) / kBlock;
      if (j.fp8()) {
        const int64_t full = kn / kStep * kStep;
        const bool last = kc + kPanelK >= p.K;
        for (int r = 0; r < rows; ++r) {
          const uint8_t* w = j.w8(g + r) + kc;
          uint16_t* h = j.buf + r * kPanelK;
          // Prefetch what this row's slot converts next: the next columns, or the next tile's first ones.
          const uint8_t* next = last ? (g + rows + r < n1 ? j.w8(g + rows + r) : nullptr) : w + kPanelK;
          if (next)
            for (int64_t k = 0; k < kPanelK; k += 64) _mm_prefetch(reinterpret_cast<const char*>(next + k), _MM_HINT_T1);
          for (int64_t k = 0; k < full; k += kStep) fp8_to_fp16(w + k, h + k);
          if (full < kn) fp8_to_fp16_tail(w + full, kn - full, h + full);
        }
        tile_tokens(j, Fp16Tile{j.buf, kPanelK, kc}, rows, kb0, kb1, j.srow(g), kFp16Post);
      } else {
        tile_tokens(j, Bf16Rows{j.w16(g), p.ldw}, rows, kb0, kb1, nullptr, 1.0f);
      }
    }
    for (int r = 0; r < rows; ++r)
      for (int64_t m = 0; m < p.M; ++m) p.y[m * p.ldy + g + r] = hsum(j.tot[r * p.M + m]);
    g += rows;
  }
}

// MXCSR's denormals-are-zero cleared while the kernel runs (torch.set_flush_denormal sets it on a thread).
struct DazOff {
  unsigned csr = _mm_getcsr();
  DazOff() { if (csr & 0x40u) _mm_setcsr(csr & ~0x40u); }
  ~DazOff() { if (csr & 0x40u) _mm_setcsr(csr); }
};

}  // namespace

void gemm_rows_avx2(const GemmProblem& p, int64_t n0, int64_t n1) {
  // One scratch allocation: activations in fp32 (x 2^96 for streaming FP8 rows), the prefill tile, its block
  // totals.
  const int64_t ldx = (p.K + kStep - 1) / kStep * kStep;
  const int64_t xn = p.M * ldx, bn = kPanelRows * kPanelK / 2, tn = kPanelRows * p.M * 8;
  float* x = thread_floats(xn + bn + tn);
  const DazOff daz;  // before the activations' conversion too: it multiplies them on the register path
  const bool fp16_stream = tunables().avx2_stream_fp16;
  const float xs = p.wt == WeightType::fp8 && p.M <= kStreamMaxM && !fp16_stream ? kStreamX : 1.0f;
  const __m256 xsv = _mm256_set1_ps(xs);
  for (int64_t m = 0; m < p.M; ++m) {
    const uint16_t* src = p.x + m * p.ldx;
    float* xd = x + m * ldx;
    int64_t k = 0;
    for (; k + 8 <= p.K; k += 8)
      _mm256_store_ps(xd + k, _mm256_mul_ps(bf16x8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k))), xsv));
    for (; k < p.K; ++k) xd[k] = bf16_to_float(src[k]) * xs;
    for (; k < ldx; ++k) xd[k] = 0.f;
  }
  const Job j{p, x, ldx, reinterpret_cast<uint16_t*>(x + xn), reinterpret_cast<__m256*>(x + xn + bn), fp16_stream};
  static_assert(kStreamMaxM == 4, "the cases below");
  switch (p.M) {  // rows per streaming pass: 8 to 12 accumulators
    case 1: return stream<8, 1>(j, n0, n1);
    case 2: return stream<4, 2>(j, n0, n1);
    case 3: return stream<3, 3>(j, n0, n1);
    case 4: return stream<3, 4>(j, n0, n1);
    default: return tiles(j, n0, n1);
  }
}

}  // namespace hybrid
