// y = x · wᵀ over the thread pool (see gemm.h for the kernels).
#pragma once
#include <optional>
#include <string>

#include "dispatch.h"
#include "gemm.h"
#include "scratch.h"
#include "tensor_view.h"

namespace hybrid {

// x [M, K] bf16; w [N, K] float8_e4m3fn (+ scale [ceil(N/128), ceil(K/128)] f32) or bf16; y [M, N] f32.
void gemm(const View& x, const View& w, std::optional<View> scale, const View& y, const std::string& isa);
GemmProblem make_problem(const View& x, const View& w, const View* scale, const View& y);
// Activations in the layout `isa` reads (xprep = null when the kernel reads p.x itself).
void prepare_x(Isa isa, const GemmProblem& p, Scratch<uint16_t>& buf, const uint16_t** xprep);
int64_t row_chunk(int64_t N, int threads);
std::string selected_isa(const std::string& name);
void set_tile_min_m(int64_t m);
void set_amx_min_m(int64_t m);
void set_amx_prefetch(int64_t bytes);
void set_amx_overlap(bool on);
void set_batch_invariant(bool on);
void set_moe_lag_rounds(int64_t rounds);
void set_moe_longest_first(bool on);
// The AVX2 kernel's conversion of streaming FP8 rows (1-4 tokens): "fp16" or "registers" (Tunables).
void set_avx2_stream(const std::string& how);
std::string avx2_stream();

}  // namespace hybrid
