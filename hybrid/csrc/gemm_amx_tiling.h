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

// C tiles of RT weight-row tiles x TT token tiles over `chunks` 32-lane chunks: a (lda lanes per row) and b (the
// B layout, token tiles ldb apart) at the same first lane; C tile 2r + t stored at c + 256 * (2r + t).
template <class Ops, int RT, int TT>
void dot_tiles(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb, int64_t chunks, float* c) {
  Ops::template zero<0>();
  if constexpr (TT > 1) Ops::template zero<1>();
  if constexpr (RT > 1) Ops::template zero<2>();
  if constexpr (RT > 1 && TT > 1) Ops::template zero<3>();
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
  Ops::template store<0>(c, 64);
  if constexpr (TT > 1) Ops::template store<1>(c + 256, 64);
  if constexpr (RT > 1) Ops::template store<2>(c + 512, 64);
  if constexpr (RT > 1 && TT > 1) Ops::template store<3>(c + 768, 64);
}

template <class Ops>
void dot_tiles(int rt, int tt, const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb, int64_t chunks,
               float* c) {
  if (rt == 2 && tt == 2) dot_tiles<Ops, 2, 2>(a, lda, b, ldb, chunks, c);
  else if (rt == 2) dot_tiles<Ops, 2, 1>(a, lda, b, ldb, chunks, c);
  else if (tt == 2) dot_tiles<Ops, 1, 2>(a, lda, b, ldb, chunks, c);
  else dot_tiles<Ops, 1, 1>(a, lda, b, ldb, chunks, c);
}

// Y[0:M, g:g+rows] from the accumulators: per 32-token group, tile 2r + t holds [16 weight rows][16 tokens].
inline void store_rows(const GemmProblem& p, int64_t g, int64_t rows, const float* acc) {
  for (int64_t m = 0; m < p.M; ++m) {
    const float* a = acc + (m / 32) * 1024 + ((m % 32) / kAmxTokens) * 256 + m % kAmxTokens;
    float* y = p.y + m * p.ldy + g;
    for (int64_t i = 0; i < rows; ++i) y[i] = a[(i / kAmxTokens) * 512 + (i % kAmxTokens) * kAmxTokens];
  }
}

// Rows [n0, n1) of Y: 32 weight rows at a time, their K in slabs of up to kAmxSlab lanes converted once and used by
// every token; per 128-lane block, the C tiles are scaled by the block's scale and added to acc (per 32 tokens, 4 tiles).
// acc: round_up(M, 32) * 32 + 1024 floats.
template <class Ops>
void amx_rows(const GemmProblem& p, const uint16_t* xv, int64_t n0, int64_t n1, uint16_t* buf, float* acc) {
  const int64_t kp = padded_k(p.K), groups = (p.M + 31) / 32;
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
