// Y[M,N] (fp32) = X[M,K] (bf16) · W[N,K]^T, W in FP8 E4M3 with one fp32 scale per 128x128 block ("post-scaling":
// each block's scale is applied once to that block's dot product), in packed INT4 with one bf16 scale per group of
// 32 inputs (gemm_int4.h, the same post-scaling per group), or in BF16.
// One row-range entry point per ISA; threads split N in 128-row-aligned ranges (see gemm.cpp).
// The ISA files are compiled with their own -m flags: they define no inline or template code that other files
// could share (the linker could pick their copy and run it on a CPU without that ISA).
#pragma once
#include <cstdint>

namespace hybrid {

enum class WeightType { fp8, bf16, int4 };
// amx: the AVX-512 kernel below amx_min_m tokens, AMX tiles from there on (gemm_amx.h); amx_emulated: the same
// tiling with the tile operations emulated in plain C++ (any CPU; it checks the AMX path's layouts, not its speed).
// avx512: the avx512_bf16 kernel for AVX-512 CPUs without BF16 instructions (vdpbf16ps emulated with FP32 FMAs).
enum class Isa { generic = 0, avx2 = 1, avx512_bf16 = 2, amx = 3, amx_emulated = 4, avx512 = 5 };

constexpr int kBlock = 128;  // FP8 scale block (both dims)

struct GemmProblem {
  const uint16_t* x;  // [M, K] bf16, row stride ldx (elements)
  int64_t ldx;
  const void* w;  // [N, K] fp8 or bf16, or int4: [N, ceil(K/8)] int32 words; row stride ldw (elements, words)
  int64_t ldw;
  const float* scale;  // [ceil(N/128), ceil(K/128)] fp32, row stride lds; null for bf16
  int64_t lds;
  float* y;  // [M, N] fp32, row stride ldy
  int64_t ldy;
  int64_t M, N, K;
  WeightType wt;
  const uint16_t* group_scale = nullptr;  // int4: [N, ceil(K/32)] bf16, row stride lds (scale stays null)
};

// Activations prepared once per call for the AVX-512 kernel: bf16, K padded to 64-wide chunks with zeros, and
// for FP8 weights in the lane order the kernel's weight conversion produces (see lane_of_k).
constexpr int64_t kChunk = 64;
static inline int64_t padded_k(int64_t K) { return (K + kChunk - 1) / kChunk * kChunk; }
// Where k (0..63 within a chunk) sits in the AVX-512 FP8 lane order, and back.
static inline int64_t lane_of_k(int64_t k) { return ((k % 16) / 8) * 32 + (k / 16) * 8 + k % 8; }
static inline int64_t k_of_lane(int64_t w) { return 16 * ((w % 32) / 8) + 8 * (w / 32) + w % 8; }
// Where input column k sits in a row of activations prepared for the FP8 kernels (64-chunks in lane order).
static inline int64_t fp8_lane(int64_t k) { return k / kChunk * kChunk + lane_of_k(k % kChunk); }

// Compute rows [n0, n1) of Y. n0 must be a multiple of 4 (and of 128 when splitting across threads).
void gemm_rows_generic(const GemmProblem& p, int64_t n0, int64_t n1);
void gemm_rows_avx2(const GemmProblem& p, int64_t n0, int64_t n1);
void gemm_rows_avx512(const GemmProblem& p, const uint16_t* xprep, int64_t n0, int64_t n1, uint16_t* tile_buf);

// AVX-512: activations in the kernel's lane order (fp8 path) or natural order (bf16 path).
void prepare_x_avx512(const GemmProblem& p, uint16_t* xprep);
// Rows [n, n+count), 64-chunks [c0, c1) of FP8 weights -> BF16 in the kernel's lane order, row r chunk c at
// buf + r*ld + (c-c0)*64 (zeros past K); `prefetch`: bytes ahead of each load to prefetch (0: none).
void convert_rows_avx512(const GemmProblem& p, int64_t n, int64_t count, int64_t c0, int64_t c1, int64_t prefetch,
                         uint16_t* buf, int64_t ld);
// The same three for variant avx512 (gemm_avx512.cpp compiled without -mavx512bf16, gemm_avx512_nobf16.cpp): the
// same activation layout (XLayout::avx512), tile buffer and results up to the FP32 summation order.
void gemm_rows_avx512_nobf16(const GemmProblem& p, const uint16_t* xprep, int64_t n0, int64_t n1,
                             uint16_t* tile_buf);
void prepare_x_avx512_nobf16(const GemmProblem& p, uint16_t* xprep);
void convert_rows_avx512_nobf16(const GemmProblem& p, int64_t n, int64_t count, int64_t c0, int64_t c1,
                                int64_t prefetch, uint16_t* buf, int64_t ld);
// Scratch the AVX-512 prefill path needs per thread (a converted weight tile), in uint16 elements.
constexpr int64_t kTileRows = 16;
// The avx512_bf16 outer-product form's slabs: one 128-wide K block of 32 rows, as 32-bit BF16 pairs; two of them
// (one multiplied while the next is built).
constexpr int64_t kOuterSlabElems = 2 * 2 * 32 * 64;
static inline int64_t tile_buf_elems(int64_t K) {
  return kTileRows * padded_k(K) > kOuterSlabElems ? kTileRows * padded_k(K) : kOuterSlabElems;
}

// Kernel tunables: one small record the kernels read and the tuner sweeps.
struct Tunables {
  // From this many tokens on, the AVX-512 FP8 path converts each weight tile to BF16 once and reuses it for every
  // token (on avx512_bf16 in the outer-product form, unless batch_invariant); below it, weights are converted as
  // they stream by (shared across up to 8 tokens on the AVX-512 BF16 kernel, 4 on the others).
  int64_t tile_min_m = 64;  // hybrid/kernels/gemm.py TILE_MIN_TOKENS (policy.cpu.gemm_tile_tokens resolves it)
  // Every output by the same operations whatever its batch (policy.decode.batch_invariant): avx512_bf16's
  // converted tiles then keep the streaming form's sums, not the faster outer-product form's.
  bool batch_invariant = false;
  // Variant amx: from this many tokens on, an FP8 GEMM runs on AMX tiles; below, on the AVX-512 kernel.
  // H200 test machine's Xeon, one layer of 256 experts, 16 threads: AMX ahead at 4 tokens per expert (108 against
  // 153 ms), a tie at 3, AVX-512 ahead at 2 (docs/perf/journal.md, V1-V2). policy.cpu.amx_min_tokens sets it.
  int64_t amx_min_m = 4;  // hybrid/kernels/gemm.py AMX_MIN_TOKENS
  // Variant amx: where each FP8 load's prefetch into L2 points: -1 = the same spot of the next 32-row group (whose
  // bytes then arrive while this group's tiles multiply), 0 = no prefetch (the hardware prefetchers alone),
  // n > 0 = n bytes further along the same row.
  int64_t amx_prefetch = -1;
  // Variant amx: the next slab converted while this one's tiles multiply (true), or after them (false: convert,
  // then multiply, one slab at a time). The same products in the same order either way.
  bool amx_overlap = true;
  // MoE layer: how many rounds of tasks (one per thread) an expert's down tasks are queued behind its gate/up
  // tasks (moe.cpp's schedule).
  int64_t moe_lag_rounds = 2;
  // MoE layer: experts' tasks queued by token count, most first (true), or in expert order (false). The layer's
  // last tasks are then the cheapest, so the threads run out of work closer together (moe.cpp's schedule).
  bool moe_longest_first = true;
  // AVX2 kernel, 1-4 tokens: FP8 rows converted to FP16 in a small buffer (true) or to fp32 in registers, which
  // turns subnormal codes into fp32 subnormals (false: ~1.2x faster where FMAs take those at full speed, ~17x
  // slower where each takes a microcode assist). Default: registers on CPUs known to take them at full speed.
  bool avx2_stream_fp16 = true;
};
Tunables& tunables();

// FP8 E4M3 code -> float (exact; NaN for 0x7F/0xFF).
float fp8_to_float(uint8_t code);
static inline float bf16_to_float(uint16_t v) {
  union { uint32_t u; float f; } c{uint32_t(v) << 16};
  return c.f;
}
static inline uint16_t float_to_bf16(float f) {  // round to nearest even
  union { float f; uint32_t u; } c{f};
  return uint16_t((c.u + 0x7FFF + ((c.u >> 16) & 1)) >> 16);
}
// A thread's float scratch (the AVX2 kernel's fp32 activations), kept out of the ISA-specific files.
float* thread_floats(int64_t n);

}  // namespace hybrid
