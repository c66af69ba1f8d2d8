// Which kernel variant runs: the best the CPU has, or one forced by name (config or environment).
#pragma once
#include <string>

#include "gemm.h"

namespace hybrid {

Isa best_isa();
// "auto" -> best_isa(); a named variant the CPU lacks -> std::invalid_argument naming the missing features.
Isa resolve_isa(const std::string& name);
const char* isa_name(Isa isa);

// The activations a problem's kernel reads: p.x as is, prepared by prepare_x_avx512, or by prepare_x_amx.
enum class XLayout { plain, avx512, amx };
XLayout x_layout(Isa isa, const GemmProblem& p);
// Writes p's activations in `layout` to out (x_rows(layout, p.M) rows of padded_k(p.K)) with isa's code; plain:
// nothing to do.
void prepare_x_rows(Isa isa, XLayout layout, const GemmProblem& p, uint16_t* out);
// Rows of prepared activations a problem of M tokens needs (the AMX layout pads M to 16).
int64_t x_rows(XLayout layout, int64_t M);
// Per-thread scratch a variant's kernels need for a reduction length K, in uint16 elements (0: none).
int64_t scratch_elems(Isa isa, int64_t K);

// Rows [n0, n1) of one problem on `isa`. xprep: activations in x_layout(isa, p) (ignored when plain; INT4
// weights: int4_prepare_x's rows or null);
// tile: the thread's scratch_elems(isa, K).
void gemm_rows(Isa isa, const GemmProblem& p, const uint16_t* xprep, int64_t n0, int64_t n1, uint16_t* tile);

}  // namespace hybrid
