#include "dispatch.h"

#include <stdexcept>

#include "cpu_features.h"

namespace hybrid {
namespace {

const char* kAvx512Needs[] = {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vbmi"};
const char* kAvx2Needs[] = {"avx2", "fma", "f16c"};

template <size_t N>
std::string missing(const char* const (&needs)[N]) {
  const auto f = cpu_features();
  std::string out;
  for (const char* n : needs)
    if (!f.at(n)) out += (out.empty() ? "" : ", ") + std::string(n);
  return out;
}

}  // namespace

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::avx512_bf16: return "avx512_bf16";
    case Isa::avx2: return "avx2";
    default: return "generic";
  }
}

Isa best_isa() {
  static const Isa best = missing(kAvx512Needs).empty() ? Isa::avx512_bf16
                          : missing(kAvx2Needs).empty() ? Isa::avx2 : Isa::generic;
  return best;
}

Isa resolve_isa(const std::string& name) {
  if (name == "auto") return best_isa();
  if (name == "generic") return Isa::generic;
  std::string lacks;
  Isa isa;
  if (name == "avx512_bf16") {
    lacks = missing(kAvx512Needs);
    isa = Isa::avx512_bf16;
  } else if (name == "avx2") {
    lacks = missing(kAvx2Needs);
    isa = Isa::avx2;
  } else {
    throw std::invalid_argument("unknown CPU kernel '" + name + "' (auto, avx512_bf16, avx2 or generic)");
  }
  if (!lacks.empty()) throw std::invalid_argument("CPU kernel '" + name + "' needs " + lacks + ", which this CPU lacks");
  return isa;
}

void gemm_rows(Isa isa, const GemmProblem& p, const uint16_t* xprep, int64_t n0, int64_t n1, uint16_t* tile) {
  switch (isa) {
    case Isa::avx512_bf16: return gemm_rows_avx512(p, xprep, n0, n1, tile);
    case Isa::avx2: return gemm_rows_avx2(p, n0, n1);
    default: return gemm_rows_generic(p, n0, n1);
  }
}

}  // namespace hybrid
