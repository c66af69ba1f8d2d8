// The AMX FP8 GEMM: Y[M,N] = X[M,K] · W[N,K]^T on AMX-BF16 tiles, for FP8 weights with 128x128 block scales.
//
// Operands of tdpbf16ps (C[16x16 fp32] += A[16 rows x 32 bf16] · B[16 pairs x 16 columns x 2 bf16]):
//   A = 16 weight rows x 32 K-lanes: FP8 converted to BF16 exactly with the AVX-512 kernel's conversion (same lane
//       order, see fp8_lane), 32 rows x 128 lanes at a time into one half of a thread buffer while the tiles
//       multiply the other half's;
//   B = 16 tokens x 32 K-lanes in the VNNI layout ("pairs of K interleaved": row j holds, per token, lanes 2j and
//       2j+1), the activations packed once per call (prepare_x_amx);
//   C = 16 weight rows x 16 tokens, one 128-wide K block at a time; each block's scale is applied once to that
//       block's dot products and added to an fp32 accumulator ("post-scaling", as the other kernels).
// Putting the weights in A leaves them in the order the conversion produces: the VNNI interleave (a transpose)
// is paid once per token and K-lane on the activations, not once per weight.
// One tiling loop (gemm_amx_tiling.h) runs on real tiles (gemm_amx.cpp) and on emulated ones (gemm_amx_emulated.cpp).
#pragma once
#include <cstdint>

#include "gemm.h"

namespace hybrid {

constexpr int64_t kAmxTokens = 16;  // tokens per B tile (and C tile columns)
constexpr int64_t kAmxLanes = 32;   // K-lanes per A/B tile
constexpr int64_t kAmxRows = 32;    // weight rows per pass: two A tiles
// K-lanes converted at a time (a multiple of kBlock): one 128-lane block of 32 rows, 8 KB of BF16 that stays in L1
// while every token's tiles read it. As each row's block is converted, the same block of the row 32 rows further
// on (the next group) is prefetched into L2, so the next group's bytes arrive while this group's tiles multiply.
// Measured on the AMX dev VM (2 threads, 32 experts at 16 tokens each): 512-lane slabs prefetching their own
// rows' next slab 108.6 ms; this 89-90 ms; whole-row slabs (8192 lanes, sequential reads) 113-124 ms.
constexpr int64_t kAmxSlab = kBlock;

static inline int64_t amx_rows_padded(int64_t M) { return (M + kAmxTokens - 1) / kAmxTokens * kAmxTokens; }
// Where token m, K-lane w (0 <= w < kp = padded_k(K)) of the activations sits in the B layout: 16-token tiles of
// kp lanes; in a tile, 32-lane chunks of 16 pair rows x 16 tokens x 2.
static inline int64_t amx_x_index(int64_t m, int64_t w, int64_t kp) {
  return (m / kAmxTokens) * kAmxTokens * kp + (w / kAmxLanes) * (kAmxLanes * kAmxTokens) +
         ((w % kAmxLanes) / 2) * (2 * kAmxTokens) + (m % kAmxTokens) * 2 + w % 2;
}

// Whether a problem runs on tiles under variant amx / amx_emulated: FP8 weights, M >= tunables().amx_min_m.
bool amx_tiles(const GemmProblem& p);
// Activations [amx_rows_padded(M)][padded_k(K)] in the B layout, zeros past M and K.
void prepare_x_amx(const GemmProblem& p, uint16_t* xv);
// Scratch per thread, in uint16 elements (the converted weight slab).
// Buffer rows are a slab plus one tile row (64 bytes) apart, so the 16 rows a tile load reads do not all fall in
// one cache set (a stride of 4 KB or a multiple would).
static inline int64_t amx_buf_ld(int64_t slab) { return slab + kAmxLanes; }
// Two halves: the slab being multiplied and the next one being converted (gemm_amx_tiling.h).
constexpr int64_t kAmxBufElems = 2 * kAmxRows * (kAmxSlab + kAmxLanes);

// Rows [n0, n1) (n0 a multiple of 16) with xv from prepare_x_amx; buf: kAmxBufElems of scratch.
void gemm_rows_amx(const GemmProblem& p, const uint16_t* xv, int64_t n0, int64_t n1, uint16_t* buf);
void gemm_rows_amx_emulated(const GemmProblem& p, const uint16_t* xv, int64_t n0, int64_t n1, uint16_t* buf);
// Whether gemm_amx.cpp was compiled (the compiler knew -mamx-tile -mamx-bf16).
bool amx_built();

}  // namespace hybrid
