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
// work(j) runs after chunk j's products are issued: vector work that the core does while the tile unit multiplies.
template <class Ops, int RT, int TT, class Work>
void dot_tiles(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb, int64_t chunks, float* c, Work& work) {
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
    work(j);
  }
  Ops::template store<0>(c, 64);
  if constexpr (TT > 1) Ops::template store<1>(c + 256, 64);
  if constexpr (RT > 1) Ops::template store<2>(c + 512, 64);
  if constexpr (RT > 1 && TT > 1) Ops::template store<3>(c + 768, 64);
}

template <class Ops, class Work>
void dot_tiles(int rt, int tt, const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb, int64_t chunks,
               float* c, Work& work) {
  if (rt == 2 && tt == 2) dot_tiles<Ops, 2, 2>(a, lda, b, ldb, chunks, c, work);
  else if (rt == 2) dot_tiles<Ops, 2, 1>(a, lda, b, ldb, chunks, c, work);
  else if (tt == 2) dot_tiles<Ops, 1, 2>(a, lda, b, ldb, chunks, c, work);
  else dot_tiles<Ops, 1, 1>(a, lda, b, ldb, chunks, c, work);
}

// Y[0:M, g:g+rows] from the accumulators: per 32-token group, tile 2r + t holds [16 weight rows][16 tokens].
inline void store_rows(const GemmProblem& p, int64_t g, int64_t rows, const float* acc) {
  for (int64_t m = 0; m < p.M; ++m) {
    const float* a = acc + (m / 32) * 1024 + ((m % 32) / kAmxTokens) * 256 + m % kAmxTokens;
    float* y = p.y + m * p.ldy + g;
    for (int64_t i = 0; i < rows; ++i) y[i] = a[(i / kAmxTokens) * 512 + (i % kAmxTokens) * kAmxTokens];
  }
}

// Rows [n0, n1) of Y: 32 weight rows at a time, their K one 128-lane block (a slab) at a time, each slab converted
// once into one half of buf and used by every token; per slab, the C tiles are scaled by the block's scale and added
// to acc (per 32 tokens, 4 tiles). acc: round_up(M, 32) * 32 + 1024 floats.
// The slabs form one pipeline over the groups: while a slab's tiles multiply, the next slab (the next block of the
// same rows, or the first block of the next 32 rows) is converted into the other half, a quarter of its rows after
// each 32-lane chunk's products. Converting first and multiplying after left the tile unit idle during the
// conversions and the vector units idle during the products (H200 test machine's Xeon, 16 threads, T = 512
// balanced over 256 experts: 149.5 against 176.7 ms per layer, the two orders side by side; docs/perf/journal.md).
template <class Ops>
void amx_rows(const GemmProblem& p, const uint16_t* xv, int64_t n0, int64_t n1, uint16_t* buf, float* acc) {
  const int64_t kp = padded_k(p.K), groups = (p.M + 31) / 32;
  const int64_t slab = std::min(kp, kAmxSlab), ld = amx_buf_ld(slab), half = kAmxRows * ld;
  float* c = acc + groups * 1024;
  // rows [r0, r1) of slab s0 of the group at g into `into`; a group shorter than its row tiles gets zero rows after
  // it (only the last group can be: rows past n1 would be another matrix's)
  auto convert = [&](int64_t g, int64_t s0, uint16_t* into, int64_t r0, int64_t r1) {
    const int64_t rows = std::min(kAmxRows, n1 - g), padded = rows > kAmxTokens ? 2 * kAmxTokens : kAmxTokens;
    if (r0 == 0 && rows < padded) std::memset(into + rows * ld, 0, (padded - rows) * ld * 2);
    r1 = std::min(r1, rows);
    if (r0 < r1) Ops::convert(p, g + r0, r1 - r0, s0 / kChunk, std::min(kp, s0 + slab) / kChunk, into + r0 * ld, ld);
  };
  const bool overlap = tunables().amx_overlap;
  convert(n0, 0, buf, 0, kAmxRows);
  int h = 0;  // the half that holds the slab being multiplied
  for (int64_t g = n0; g < n1; g += kAmxRows) {
    const int64_t rows = std::min(kAmxRows, n1 - g);
    const int rt = rows > kAmxTokens ? 2 : 1;
    const float* srow[2] = {p.scale + (g / kBlock) * p.lds, p.scale + ((g + (rt - 1) * kAmxTokens) / kBlock) * p.lds};
    std::fill(acc, acc + groups * 1024, 0.f);
    for (int64_t s0 = 0; s0 < kp; s0 += slab) {
      const int64_t chunks = (std::min(kp, s0 + slab) - s0) / kAmxLanes;
      // the next slab: its rows spread over this slab's first token group's chunks, the rest after them
      const int64_t ng = s0 + slab < kp ? g : g + kAmxRows, ns0 = s0 + slab < kp ? s0 + slab : 0;
      uint16_t* now = buf + h * half;
      uint16_t* next = buf + (1 - h) * half;
      int64_t done = ng < n1 ? 0 : kAmxRows;
      auto convert_next = [&](int64_t j) {
        if (!overlap) return;
        const int64_t upto = (j + 1) * kAmxRows / chunks;
        if (done < upto) convert(ng, ns0, next, done, upto);
        done = std::max(done, upto);
      };
      auto nothing = [](int64_t) {};
      for (int64_t m0 = 0; m0 < p.M; m0 += 32) {
        const int tt = p.M - m0 > kAmxTokens ? 2 : 1;
        float* a = acc + (m0 / 32) * 1024;
        const uint16_t* x = xv + m0 * kp + s0 * kAmxTokens;
        if (m0 == 0) dot_tiles<Ops>(rt, tt, now, ld, x, kAmxTokens * kp, chunks, c, convert_next);
        else dot_tiles<Ops>(rt, tt, now, ld, x, kAmxTokens * kp, chunks, c, nothing);
        for (int r = 0; r < rt; ++r) {
          const float s = srow[r][s0 / kBlock];
          for (int t = 0; t < tt; ++t)
            for (int i = 0; i < 256; ++i) a[(2 * r + t) * 256 + i] += s * c[(2 * r + t) * 256 + i];
        }
      }
      if (done < kAmxRows) convert(ng, ns0, next, done, kAmxRows);
      h = 1 - h;
    }
    store_rows(p, g, rows, acc);
  }
}

}  // namespace
}  // namespace hybrid
