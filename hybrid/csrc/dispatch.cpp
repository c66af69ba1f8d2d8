#include "dispatch.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>

#include "cpu_features.h"
#include "gemm_amx.h"
#include "gemm_int4.h"

#ifndef HYBRID_AMX_BUILT
#define HYBRID_AMX_BUILT 0
#endif

namespace hybrid {
namespace {

const char* kAvx512Bf16Needs[] = {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vbmi"};
const char* kAvx512Needs[] = {"avx512f", "avx512bw", "avx512vl", "avx512_vbmi"};
const char* kAvx2Needs[] = {"avx2", "fma", "f16c"};
const char* kAmxNeeds[] = {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vbmi", "amx_tile", "amx_bf16"};

// "" when the CPU has every feature, else "needs <the missing ones>, which this CPU lacks".
template <size_t N>
std::string missing(const char* const (&needs)[N]) {
  const auto f = cpu_features();
  std::string out;
  for (const char* n : needs)
    if (!f.at(n)) out += (out.empty() ? "" : ", ") + std::string(n);
  return out.empty() ? out : "needs " + out + ", which this CPU lacks";
}

// Linux hands out AMX tile data only on request (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), once per
// process, for every thread. "" when granted, else why not.
std::string amx_permission() {
  static const std::string why = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0) return std::string();
    return "the OS refused AMX tile data (arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA): " +
           std::string(std::strerror(errno)) + "; Linux grants it from 5.16 on)";
  }();
  return why;
}

// "" when variant amx can run here, else why not.
std::string amx_unavailable() {
  if (!HYBRID_AMX_BUILT) return "was not built: the compiler lacked -mamx-tile -mamx-bf16 (GCC >= 11, Clang >= 12)";
  const std::string lacks = missing(kAmxNeeds);
  return lacks.empty() ? amx_permission() : lacks;
}

}  // namespace

bool amx_built() { return HYBRID_AMX_BUILT; }

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::amx: return "amx";
    case Isa::amx_emulated: return "amx_emulated";
    case Isa::avx512_bf16: return "avx512_bf16";
    case Isa::avx512: return "avx512";
    case Isa::avx2: return "avx2";
    default: return "generic";
  }
}

Isa best_isa() {
  static const Isa best = amx_unavailable().empty()           ? Isa::amx
                          : missing(kAvx512Bf16Needs).empty() ? Isa::avx512_bf16
                          : missing(kAvx512Needs).empty()     ? Isa::avx512
                          : missing(kAvx2Needs).empty()       ? Isa::avx2
                                                              : Isa::generic;
  return best;
}

Isa resolve_isa(const std::string& name) {
  if (name == "auto") return best_isa();
  if (name == "generic") return Isa::generic;
  if (name == "amx_emulated") return Isa::amx_emulated;  // the AMX tiling on any CPU, for tests
  std::string why;
  Isa isa;
  if (name == "amx") {
    why = amx_unavailable();
    isa = Isa::amx;
  } else if (name == "avx512_bf16") {
    why = missing(kAvx512Bf16Needs);
    isa = Isa::avx512_bf16;
  } else if (name == "avx512") {
    why = missing(kAvx512Needs);
    isa = Isa::avx512;
  } else if (name == "avx2") {
    why = missing(kAvx2Needs);
    isa = Isa::avx2;
  } else {
    throw std::invalid_argument("unknown CPU kernel '" + name + "' (auto, amx, avx512_bf16, avx512, avx2 or generic)");
  }
  if (!why.empty()) throw std::invalid_argument("CPU kernel '" + name + "' " + why);
  return isa;
}

XLayout x_layout(Isa isa, const GemmProblem& p) {
  if (p.wt == WeightType::int4) return XLayout::plain;  // the INT4 kernels read bf16 activations as they are
  switch (isa) {
    case Isa::amx: return amx_tiles(p) ? XLayout::amx : XLayout::avx512;
    case Isa::amx_emulated: return amx_tiles(p) ? XLayout::amx : XLayout::plain;
    case Isa::avx512_bf16:
    case Isa::avx512: return XLayout::avx512;
    default: return XLayout::plain;
  }
}

void prepare_x_rows(Isa isa, XLayout layout, const GemmProblem& p, uint16_t* out) {
  if (layout == XLayout::amx) prepare_x_amx(p, out);
  else if (layout == XLayout::avx512 && isa == Isa::avx512) prepare_x_avx512_nobf16(p, out);
  else if (layout == XLayout::avx512) prepare_x_avx512(p, out);  // avx512_bf16, amx below its tile size
}

int64_t x_rows(XLayout layout, int64_t M) { return layout == XLayout::amx ? amx_rows_padded(M) : M; }

int64_t scratch_elems(Isa isa, int64_t K) {
  switch (isa) {
    case Isa::amx: return std::max(kAmxBufElems, tile_buf_elems(K));
    case Isa::amx_emulated: return kAmxBufElems;
    case Isa::avx512_bf16:
    case Isa::avx512: return tile_buf_elems(K);
    default: return 0;
  }
}

void gemm_rows(Isa isa, const GemmProblem& p, const uint16_t* xprep, int64_t n0, int64_t n1, uint16_t* tile) {
  if (p.wt == WeightType::int4) return int4_rows(isa, p, xprep, n0, n1);
  switch (isa) {
    case Isa::amx:
#if HYBRID_AMX_BUILT
      if (amx_tiles(p)) return gemm_rows_amx(p, xprep, n0, n1, tile);
#endif
      return gemm_rows_avx512(p, xprep, n0, n1, tile);
    case Isa::amx_emulated:
      if (amx_tiles(p)) return gemm_rows_amx_emulated(p, xprep, n0, n1, tile);
      return gemm_rows_generic(p, n0, n1);
    case Isa::avx512_bf16: return gemm_rows_avx512(p, xprep, n0, n1, tile);
    case Isa::avx512: return gemm_rows_avx512_nobf16(p, xprep, n0, n1, tile);
    case Isa::avx2: return gemm_rows_avx2(p, n0, n1);
    default: return gemm_rows_generic(p, n0, n1);
  }
}

}  // namespace hybrid
