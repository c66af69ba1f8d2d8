// Batched-head products with BF16 weights: for each head h, Y[:, h] = X[:, h] · W[h] (or · W[h]ᵀ), a few rows
// (decode tokens) per head, FP32 accumulation, one rounding to BF16 at the end.
//
// What it is for: MLA's absorbed decode (hybrid/model/attention.py) multiplies each head's query by that head's
// key half of kv_b, and each head's latent output by its value half: per token and layer 2 x 16 MiB of BF16
// weights (DeepSeek-V3) read once, a handful of FLOPs per byte. torch runs them as a batched GEMM with one row per
// head, well below the memory-read roof; here each thread streams whole heads in address order.
//
// Two forms, both reading W in place (no copy, no transposed duplicate):
// - by columns ("nt"): W[h] is [O, I], Y[m, h, o] = Σ_i X[m, h, i] W[h, o, i] (the value half w_uv_HVC);
//   each output is a dot product over a row of W.
// - by rows ("nn"): W[h] is [I, O], Y[m, h, o] = Σ_i X[m, h, i] W[h, i, o] (the key half w_uk_HNC, which the
//   product contracts over kv_b's rows); rows of W are added, scaled by X, into an FP32 row of O accumulators
//   (an axpy per row of W), in row order. Why contract over the rows in place rather than keep w_uk transposed
//   as a second copy: the copy would cost another 16 MiB per layer (1 GB for DeepSeek-V3's 61 layers, next to
//   the 2 GB the kept halves already take) for one product out of the two; the in-place form costs an
//   L1-resident accumulator row per token and more instructions per weight (an accumulator load and store per
//   group of rows). Measured (docs/perf/journal.md), it reads the key half at 16-17 GB/s where the by-columns form
//   reads a transposed one at 20-21 (AVX-512, 2 threads, roof 20-24): storing the key half transposed only,
//   viewed back for torch's paths, would take that without the copy (open).
// The ISA files are compiled with their own -m flags and, like the GEMM's, define nothing that other files could
// share (everything but their entry point sits in an anonymous namespace).
#pragma once
#include <cstdint>
#include <string>

#include "gemm.h"
#include "tensor_view.h"

namespace hybrid {

struct HeadProblem {
  const uint16_t* x;  // [M, H, I] bf16, strides (sxm, sxh, 1)
  int64_t sxm, sxh;
  const uint16_t* w;  // [H, O, I] (by columns) or [H, I, O] (by rows) bf16, strides (swh, swr, 1)
  int64_t swh, swr;
  uint16_t* y;  // [M, H, O] bf16, strides (sym, syh, 1)
  int64_t sym, syh;
  int64_t M, H, I, O;
  bool by_rows;
};

// Heads [h0, h1). scratch: the thread's head_scratch_floats(p) floats, 64-byte aligned.
void head_rows_generic(const HeadProblem& p, int64_t h0, int64_t h1, float* scratch);
void head_rows_avx2(const HeadProblem& p, int64_t h0, int64_t h1, float* scratch);
void head_rows_avx512(const HeadProblem& p, int64_t h0, int64_t h1, float* scratch);

// FP32 scratch per thread: the head's activations widened ([M, head_pad(I)], zero-padded), then, by rows, its
// accumulator rows ([M, head_pad(O)]); rows padded to whole 32-float steps (the AVX-512 code's).
static inline int64_t head_pad(int64_t n) { return (n + 31) / 32 * 32; }
static inline int64_t head_scratch_floats(const HeadProblem& p) {
  return p.M * (head_pad(p.I) + (p.by_rows ? head_pad(p.O) : 0));
}
// FP32 -> BF16 as torch rounds: to nearest even, NaN to the quiet 0x7FC0.
static inline uint16_t head_round(float f) {
  union { float f; uint32_t u; } c{f};
  if (f != f) return 0x7FC0;
  return uint16_t((c.u + 0x7FFF + ((c.u >> 16) & 1)) >> 16);
}

// y = per-head products of x and w (see above); `isa`: a GEMM variant name (policy.cpu.kernel: the same
// dispatch; "auto" takes the AVX-512 code on any CPU with AVX-512 F/BW/VL, since it needs no BF16 instructions),
// or "avx512", that code by name (tests and benchmarks on CPUs where the GEMM's AVX-512 variant cannot run).
void head_gemm(const View& x, const View& w, const View& y, bool by_rows, const std::string& isa);
// The code a variant name runs here: "avx512", "avx2" or "generic" (ValueError, as the GEMM's, for missing
// features).
std::string head_isa(const std::string& isa);

}  // namespace hybrid
