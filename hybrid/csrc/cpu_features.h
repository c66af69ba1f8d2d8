// CPU instruction-set features read with cpuid (and xgetbv: the OS must save the wider register state).
#pragma once
#include <map>
#include <string>

namespace hybrid {

// Feature name -> present. Names: sse4_2 avx avx2 fma f16c avx512f avx512bw avx512vl avx512dq avx512cd
// avx512_vnni avx512_bf16 avx512_vbmi avx512_fp16 amx_tile amx_bf16 amx_int8.
std::map<std::string, bool> cpu_features();

// Whether FMAs take subnormal inputs at full speed (AMD Zen and its Hygon derivatives: vendor ids AuthenticAMD
// and HygonGenuine). Intel cores take a microcode assist per such input unless MXCSR's DAZ flushes it: measured
// ~17x slower on the H200 test machine's Xeon with one weight code in 16 subnormal (docs/perf/journal.md).
bool subnormal_inputs_at_full_speed();

// The processor's brand string, e.g. "AMD EPYC 9355 32-Core Processor".
std::string cpu_brand();

}  // namespace hybrid
