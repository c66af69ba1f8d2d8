// MLA decode attention in the absorbed form on the CPU: for each sequence b and head h,
//   out[b, h] = softmax_t(scale · (q_lat[b, h] · kv(b, t) + q_pe[b, h] · pe(b, t))) · kv(b, t)
// over its own positions t < lengths[b], reading the BF16 latent cache and rope keys in place, once per step for
// all the heads a task holds (not once per head). FP32 scores, softmax and sums; the latent output in FP32.
//
// The cache is paged: pools kv [N blocks, P positions, C] and pe [N, P, R], a block table [S slots, M blocks];
// sequence b reads slot slots[b], its position t at kv(b, t) = kv[table[slots[b], t / P], t % P] (the unpaged
// cache [S, T, C] is P = T, N = S, table = arange(S)[:, None]). A chunk lies inside one block: P a multiple of
// kChunkPositions, or the whole sequence in its first block (lengths[b] <= P, any P).
//
// Every sequence's positions are cut into chunks of kChunkPositions from position 0, whatever the batch. A chunk's kernel
// gives, per head, its scores' max m_j, the sum of exponentials l_j and the weighted latents o_j (relative to
// m_j); the chunks are merged in order, one after the other (`fold`). Two schedules, picked by the entry point
// from the batch and the thread count, give the same numbers bit for bit (so a sequence's output never depends
// on its batch mates or the pool):
// - split-K (many chunks): one task per (sequence, chunk) with all heads, partials in scratch, then one merge
//   pass per (sequence, group of heads);
// - heads (few chunks: short contexts): one task per (sequence, group of heads) walking its chunks in order and
//   folding each one as it is done.
//
// The ISA files are compiled with their own -m flags and define nothing other files could share (everything but
// their chunk kernel sits in an anonymous namespace). Fallback table (`attention_code`): amx, avx512_bf16 ->
// the avx512_bf16 code (vdpbf16ps); avx512 (no BF16), avx2 -> the avx2 code (FP32 FMAs); generic, amx_emulated
// -> the reference.
#pragma once
#include <cstdint>
#include <string>

#include "tensor_view.h"

namespace hybrid {

constexpr int64_t kChunkPositions = 256;  // positions per chunk: fixed, so a sequence's sums are the same in any batch

struct AttentionProblem {
  const uint16_t* q;  // [B, H, C] bf16, strides (sqb, sqh, 1)
  int64_t sqb, sqh;
  const uint16_t* qpe;  // [B, H, R] bf16, strides (spb, sph, 1)
  int64_t spb, sph;
  const uint16_t* kv;  // [N, P, C] bf16, strides (skvn, skvt, 1)
  int64_t skvn, skvt;
  const uint16_t* pe;  // [N, P, R] bf16, strides (spen, spet, 1)
  int64_t spen, spet;
  const int64_t* table;  // [S, M], row stride stab: block ids 0..N-1 where a sequence reads
  int64_t stab, P;
  const int64_t* slots;    // [B], 0 <= slots[b] < S
  const int64_t* lengths;  // [B], 1 <= lengths[b] <= M * P
  float* out;              // [B, H, C] fp32, contiguous
  int64_t B, H, C, R;
  float scale;
};

// Where sequence b's chunk from position t0 (a multiple of kChunkPositions) lies: position t0 + i's latent
// at kv + i * skvt, its rope key at pe + i * spet. The block is looked up once per chunk.
struct ChunkRows {
  const uint16_t* kv;
  const uint16_t* pe;
};
static inline ChunkRows chunk_rows(const AttentionProblem& p, int64_t b, int64_t t0) {
  const int64_t block = p.table[p.slots[b] * p.stab + t0 / p.P], at = t0 % p.P;
  return {p.kv + block * p.skvn + at * p.skvt, p.pe + block * p.spen + at * p.spet};
}

// One chunk's partials for heads [h0, h1) of sequence b over positions [t0, t1) (t1 - t0 <= kChunkPositions): m[h - h0],
// l[h - h0], o[(h - h0) * C + c]. scratch: the thread's chunk_scratch_floats(p, h1 - h0) floats, 64-byte aligned.
using ChunkKernel = void (*)(const AttentionProblem& p, int64_t b, int64_t t0, int64_t t1, int64_t h0, int64_t h1,
                             float* m, float* l, float* o, float* scratch);
void attention_chunk_generic(const AttentionProblem& p, int64_t b, int64_t t0, int64_t t1, int64_t h0, int64_t h1,
                             float* m, float* l, float* o, float* scratch);
void attention_chunk_avx2(const AttentionProblem& p, int64_t b, int64_t t0, int64_t t1, int64_t h0, int64_t h1,
                          float* m, float* l, float* o, float* scratch);
void attention_chunk_avx512_bf16(const AttentionProblem& p, int64_t b, int64_t t0, int64_t t1, int64_t h0,
                                 int64_t h1, float* m, float* l, float* o, float* scratch);

// Scratch floats a chunk kernel needs for `heads` heads: scores [heads, kChunkPositions + 32] and the variant's staging
// (the AVX2 code's widened rows and queries), rounded up to whole cache lines.
static inline int64_t chunk_scratch_floats(const AttentionProblem& p, int64_t heads) {
  const int64_t row = (p.C + p.R + 31) / 32 * 32;
  return heads * (kChunkPositions + 32) + 16 * row + heads * row + 64;
}

// out = the attention above; `isa`: a GEMM variant name (policy.cpu.kernel), dispatched by the fallback table.
void decode_attention(const View& q, const View& qpe, const View& kv, const View& pe, const View& table,
                      const View& slots, const View& lengths, const View& out, double scale, const std::string& isa);
// The code a variant name runs here: "avx512_bf16", "avx2" or "generic" (ValueError for features the CPU lacks).
std::string attention_code(const std::string& isa);
// Schedule knob for tests and benchmarks: 0 picks by the batch (the default), 1 forces split-K, 2 forces heads.
void set_attention_schedule(int schedule);

}  // namespace hybrid
