// The AMX kernel's tiling loop, over a tile backend `Ops` (real tiles in gemm_amx.cpp, emulated ones in
// gemm_amx_emulated.cpp). Everything here is in an unnamed namespace: each including file compiles its own copy
// with its own flags, and nothing is shared between them (see gemm.h on the ISA files).
//
// Ops: convert(p, n, count, c0, c1, buf, ld): FP8 rows [n, n+count), 64-chunks [c0, c1) to BF16 lanes, row r at
// buf + r*ld; zero<T>(), load<T>(ptr, stride_bytes), dp<C>() (tdpbf16ps into C tile C from A tile 4 + C/2 and
// B tile 6 + C%2), store<C>(ptr, stride_bytes). Tiles 0-3: C (weight-row tile r, token tile t at 2r + t), 4-5: A,
// 6-7: B; all 16 rows x 64 bytes.
#pragma once
#include <algorithm>
#include <cstring>

#include "gemm_amx.h"

namespace hybrid {
namespace {

// C tiles of RT weight-row tiles x TT token tiles: zeroed; the products of `chunks` 32-lane chunks added (a, lda
// lanes per row, and b, the B layout with token tiles ldb apart, at the same first lane); stored, C tile 2r + t at
// c + 256 * (2r + t).
template <class Ops, int RT, int TT>
void zero_tiles() {
  Ops::template zero<0>();
  if constexpr (TT > 1) Ops::template zero<1>();
  if constexpr (RT > 1) Ops::template zero<2>();
  if constexpr (RT > 1 && TT > 1) Ops::template zero<3>();
}

template <class Ops, int RT, int TT>
void add_products(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb, int64_t chunks) {
  for (int64_t j = 0; j < chunks; ++j) {
    Ops::template load<4>(a + j * kAmxLanes, lda * 2);
    if constexpr (RT > 1) Ops::template load<5>(a + kAmxTokens * lda + j * kAmxLanes, lda * 2);
    Ops::template load<6>(b + j * kAmxLanes * kAmxTokens, 64);
    if constexpr (TT > 1) Ops::template load<7>(b + ldb + j * kAmxLanes * kAmxTokens, 64);
    Ops::template dp<0>();
    if constexpr (TT > 1) Ops::template dp<1>();
    if constexpr (RT > 1) Ops::template dp<2>();
    if constexpr (RT > 1 && TT > 1) Ops::template dp<3>();
  }
}

template <class Ops, int RT, int TT>
void store_tiles(float* c) {
  Ops::template store<0>(c, 64);
  if constexpr (TT > 1) Ops::template store<1>(c + 256, 64);
  if constexpr (RT > 1) Ops::template store<2>(c + 512, 64);
  if constexpr (RT > 1 && TT > 1) Ops::template store<3>(c + 768, 64);
}

template <class Ops, int RT, int TT>
void dot_tiles(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb, int64_t chunks, float* c) {
  zero_tiles<Ops, RT, TT>();
  add_products<Ops, RT, TT>(a, lda, b, ldb, chunks);
  store_tiles<Ops, RT, TT>(c);
}

template <class Ops>
void dot_tiles(int rt, int tt, const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb, int64_t chunks,
               float* c) {
  if (rt == 2 && tt == 2) dot_tiles<Ops, 2, 2>(a, lda, b, ldb, chunks, c);
  else if (rt == 2) dot_tiles<Ops, 2, 1>(a, lda, b, ldb, chunks, c);
  else if (tt == 2) dot_tiles<Ops, 1, 2>(a, lda, b, ldb, chunks, c);
  else dot_tiles<Ops, 1, 1>(a, lda, b, ldb, chunks, c);
}

// The `tiles` token tiles of xv (the B layout) times the block scales of one 128-row block of weights (srow: its
// row of scales), each as two token tiles at xs: token tile t's hi = bf16(s·x) at 2t, lo = bf16(s·x - hi) at
// 2t + 1. In a token tile the lanes of a 128-lane K block are 2048 consecutive elements, all under one scale.
inline void scale_activations(const float* srow, const uint16_t* xv, int64_t kp, int64_t tiles, uint16_t* xs) {
  constexpr int64_t kPerBlock = kBlock * kAmxTokens;
  const int64_t n = kp * kAmxTokens;  // elements of a token tile
  for (int64_t t = 0; t < tiles; ++t) {
    const uint16_t* x = xv + t * n;
    uint16_t *hi = xs + 2 * t * n, *lo = hi + n;
    for (int64_t i0 = 0; i0 < n; i0 += kPerBlock) {
      const float s = srow[i0 / kPerBlock];
      for (int64_t i = i0; i < std::min(n, i0 + kPerBlock); ++i) {
        const float v = s * bf16_to_float(x[i]);
        hi[i] = float_to_bf16(v);
        lo[i] = float_to_bf16(v - bf16_to_float(hi[i]));
      }
    }
  }
}

// 16 weight rows (a, lda lanes per row: loaded into both A tiles) times four token tiles (b, ldb apart: hi and lo
// of tokens 0-15, then of 16-31) into C tiles 0-3, over `chunks` 32-lane chunks; the B tiles are loaded twice per
// chunk (the tiles hold one A, two B and four C at a time).
template <class Ops>
void add_products_4(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb, int64_t chunks) {
  for (int64_t j = 0; j < chunks; ++j) {
    Ops::template load<4>(a + j * kAmxLanes, lda * 2);
    Ops::template load<5>(a + j * kAmxLanes, lda * 2);
    const uint16_t* bj = b + j * kAmxLanes * kAmxTokens;
    Ops::template load<6>(bj, 64);
    Ops::template load<7>(bj + ldb, 64);
    Ops::template dp<0>();
    Ops::template dp<1>();
    Ops::template load<6>(bj + 2 * ldb, 64);
    Ops::template load<7>(bj + 3 * ldb, 64);
    Ops::template dp<2>();
    Ops::template dp<3>();
  }
}

// Rows [n0, n1) of Y for M <= 32 with the block scales on the activations (Tunables::amx_scaled_x): per 128-row
// block the scaled pairs (hi, lo) of activations are made once (xs: 2 * 16 * kp elements per token tile); the C
// tiles accumulate over all of K, each K slab converted once, and are stored once: per 32 weight rows (C tile 2r
// hi, 2r + 1 lo of weight-row tile r) at up to 16 tokens, per 16 rows (C tiles hi, lo of tokens 0-15, then of
// 16-31) at 17-32. y = hi + lo. n0 must be a multiple of 128 (each row group under one scale row).
template <class Ops>
void amx_rows_scaled_x(const GemmProblem& p, const uint16_t* xv, int64_t n0, int64_t n1, uint16_t* buf, float* c,
                       uint16_t* xs) {
  const int64_t kp = padded_k(p.K), slab = std::min(kp, kAmxSlab), ld = amx_buf_ld(slab);
  const int64_t tiles = (p.M + kAmxTokens - 1) / kAmxTokens, ldb = kAmxTokens * kp;
  const int64_t step = tiles == 1 ? kAmxRows : kAmxTokens;  // weight rows per pass
  int64_t scaled_for = -1;
  for (int64_t g = n0; g < n1; g += step) {
    const int64_t rows = std::min(step, n1 - g);
    const int rt = rows > kAmxTokens ? 2 : 1;
    if (g / kBlock != scaled_for) {
      scaled_for = g / kBlock;
      scale_activations(p.scale + scaled_for * p.lds, xv, kp, tiles, xs);
    }
    if (rows < rt * kAmxTokens) std::memset(buf + rows * ld, 0, (rt * kAmxTokens - rows) * ld * 2);
    if (rt == 2 || tiles == 2) zero_tiles<Ops, 2, 2>();
    else zero_tiles<Ops, 1, 2>();
    for (int64_t s0 = 0; s0 < kp; s0 += slab) {
      const int64_t s1 = std::min(kp, s0 + slab), chunks = (s1 - s0) / kAmxLanes;
      Ops::convert(p, g, rows, s0 / kChunk, s1 / kChunk, buf, ld);
      const uint16_t* b = xs + s0 * kAmxTokens;
      if (tiles == 2) add_products_4<Ops>(buf, ld, b, ldb, chunks);
      else if (rt == 2) add_products<Ops, 2, 2>(buf, ld, b, ldb, chunks);
      else add_products<Ops, 1, 2>(buf, ld, b, ldb, chunks);
    }
    if (rt == 2 || tiles == 2) store_tiles<Ops, 2, 2>(c);
    else store_tiles<Ops, 1, 2>(c);
    for (int64_t m = 0; m < p.M; ++m) {
      float* y = p.y + m * p.ldy + g;
      for (int64_t i = 0; i < rows; ++i) {  // the C tile pair of (row tile, token tile), hi 256 floats before lo
        const int64_t pair = tiles == 2 ? m / kAmxTokens : i / kAmxTokens;
        const float* t = c + pair * 512 + (i % kAmxTokens) * kAmxTokens + m % kAmxTokens;
        y[i] = t[0] + t[256];
      }
    }
  }
}

// Y[0:M, g:g+rows] from the accumulators: per 32-token group, tile 2r + t holds [16 weight rows][16 tokens].
inline void store_rows(const GemmProblem& p, int64_t g, int64_t rows, const float* acc) {
  for (int64_t m = 0; m < p.M; ++m) {
    const float* a = acc + (m / 32) * 1024 + ((m % 32) / kAmxTokens) * 256 + m % kAmxTokens;
    float* y = p.y + m * p.ldy + g;
    for (int64_t i = 0; i < rows; ++i) y[i] = a[(i / kAmxTokens) * 512 + (i % kAmxTokens) * kAmxTokens];
  }
}

// The float scratch amx_rows takes per thread: the accumulators and C tiles, and the scaled activations.
inline int64_t amx_scratch_floats(const GemmProblem& p) {
  const bool scaled_x = tunables().amx_scaled_x && p.M <= 2 * kAmxTokens;
  return (p.M + 31) / 32 * 1024 + 1024 + (scaled_x ? (p.M + 15) / 16 * kAmxTokens * padded_k(p.K) : 0);
}

// Rows [n0, n1) of Y: 32 weight rows at a time, their K in slabs of up to kAmxSlab lanes converted once and used by
// every token; per 128-lane block, the C tiles are scaled by the block's scale and added to acc (per 32 tokens, 4 tiles).
// acc: round_up(M, 32) * 32 + 1024 floats.
template <class Ops>
void amx_rows(const GemmProblem& p, const uint16_t* xv, int64_t n0, int64_t n1, uint16_t* buf, float* acc) {
  const int64_t kp = padded_k(p.K), groups = (p.M + 31) / 32;
  if (tunables().amx_scaled_x && p.M <= 2 * kAmxTokens && n0 % kBlock == 0)
    return amx_rows_scaled_x<Ops>(p, xv, n0, n1, buf, acc + groups * 1024,
                                  reinterpret_cast<uint16_t*>(acc + groups * 1024 + 1024));
  const int64_t slab = std::min(kp, kAmxSlab), ld = amx_buf_ld(slab);
  float* c = acc + groups * 1024;
  for (int64_t g = n0; g < n1; g += kAmxRows) {
    const int64_t rows = std::min(kAmxRows, n1 - g);
    const int rt = rows > kAmxTokens ? 2 : 1;
    if (rows < rt * kAmxTokens) std::memset(buf + rows * ld, 0, (rt * kAmxTokens - rows) * ld * 2);
    const float* srow[2] = {p.scale + (g / kBlock) * p.lds, p.scale + ((g + (rt - 1) * kAmxTokens) / kBlock) * p.lds};
    std::fill(acc, acc + groups * 1024, 0.f);
    for (int64_t s0 = 0; s0 < kp; s0 += slab) {
      const int64_t s1 = std::min(kp, s0 + slab);
      Ops::convert(p, g, rows, s0 / kChunk, s1 / kChunk, buf, ld);
      for (int64_t m0 = 0; m0 < p.M; m0 += 32) {
        const int tt = p.M - m0 > kAmxTokens ? 2 : 1;
        float* a = acc + (m0 / 32) * 1024;
        for (int64_t l0 = s0; l0 < s1; l0 += kBlock) {
          const int64_t chunks = (std::min(s1, l0 + kBlock) - l0) / kAmxLanes;
          dot_tiles<Ops>(rt, tt, buf + (l0 - s0), ld, xv + m0 * kp + l0 * kAmxTokens, kAmxTokens * kp, chunks,
                         c);
          for (int r = 0; r < rt; ++r) {
            const float s = srow[r][l0 / kBlock];
            for (int t = 0; t < tt; ++t)
              for (int i = 0; i < 256; ++i) a[(2 * r + t) * 256 + i] += s * c[(2 * r + t) * 256 + i];
          }
        }
      }
    }
    store_rows(p, g, rows, acc);
  }
}

}  // namespace
}  // namespace hybrid
