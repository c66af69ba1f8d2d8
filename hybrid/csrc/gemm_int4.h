// INT4 weights as compressed-tensors packs them (hybrid/quant/int4.py): W[n, k] = q · s, q = nibble - 8 with element
// k at bit 4·(k % 8) of int32 word k / 8 of row n, s = bf16 scale of group k / 32 (ragged at the row's end).
// Y[m, n] = Σ_g s[n, g] · Σ_{k in g} q[n, k] · x[m, k]: each group's dot product in fp32, then its scale applied
// once (post-scaling, as the FP8 kernels do per 128x128 block).
// One row-range kernel per ISA, each with its own -m flags (no inline or template code shared, see gemm.h); the
// variants without one of their own use another's (int4_rows, gemm_int4.cpp).
#pragma once
#include <cstdint>

#include "gemm.h"
#include "tensor_view.h"

namespace hybrid {

constexpr int64_t kGroup = 32;   // inputs per scale
constexpr int64_t kPerWord = 8;  // 4-bit values per int32 word

// x [M, K] bf16; w [N, ceil(K/8)] int32; scale [N, ceil(K/32)] bf16; y [M, N] f32.
GemmProblem make_int4_problem(const View& x, const View& w, const View* scale, const View& y);
// Checks one INT4 weight of N x K and its scale (names in the messages).
void check_int4(const View& w, const View* scale, const std::string& w_name, const std::string& s_name, int64_t N,
                int64_t K);
// Activations as `isa`'s INT4 kernel reads them, prepared once and shared by every call over the same tokens (the
// MoE op's tasks): rows of int4_x_elems(isa, K) uint16 elements (0: the kernel reads x as it is).
int64_t int4_x_elems(Isa isa, int64_t K);
void int4_prepare_x(Isa isa, const uint16_t* x, int64_t ldx, int64_t M, int64_t K, uint16_t* out);
// Rows [n0, n1) of an INT4 problem, on `isa`'s INT4 kernel (the fallback table in gemm_int4.cpp). xprep: p's M
// activation rows from int4_prepare_x (row stride int4_x_elems), or null (the kernel prepares them per call).
void int4_rows(Isa isa, const GemmProblem& p, const uint16_t* xprep, int64_t n0, int64_t n1);

void int4_rows_generic(const GemmProblem& p, int64_t n0, int64_t n1);
int64_t int4_x_elems_avx2(int64_t K);  // fp32, 2 elements each
void int4_prepare_x_avx2(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, float* out);
void int4_rows_avx2(const GemmProblem& p, const float* xprep, int64_t n0, int64_t n1);
int64_t int4_x_elems_avx512_bf16(int64_t K);
void int4_prepare_x_avx512_bf16(const uint16_t* x, int64_t ldx, int64_t M, int64_t K, uint16_t* out);
void int4_rows_avx512_bf16(const GemmProblem& p, const uint16_t* xprep, int64_t n0, int64_t n1);

}  // namespace hybrid
