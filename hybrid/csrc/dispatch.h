// Which kernel variant runs: the best the CPU has, or one forced by name (config or environment).
#pragma once
#include <string>

#include "gemm.h"

namespace hybrid {

Isa best_isa();
// "auto" -> best_isa(); a named variant the CPU lacks -> std::invalid_argument naming the missing features.
Isa resolve_isa(const std::string& name);
const char* isa_name(Isa isa);

// Rows [n0, n1) of one problem on `isa`. xprep: activations prepared for AVX-512 (ignored by the others);
// tile: the thread's scratch for the AVX-512 prefill path.
void gemm_rows(Isa isa, const GemmProblem& p, const uint16_t* xprep, int64_t n0, int64_t n1, uint16_t* tile);

}  // namespace hybrid
