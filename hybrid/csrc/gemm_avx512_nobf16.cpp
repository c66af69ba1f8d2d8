// Variant avx512: the AVX-512 kernel of gemm_avx512.cpp for CPUs with AVX-512 F/BW/VL/VBMI but no BF16
// instructions (compiled with -mavx512f -mavx512bw -mavx512vl -mavx512vbmi; vdpbf16ps emulated with FP32 FMAs).
// One source: this file only compiles gemm_avx512.cpp a second time, its entry points named *_avx512_nobf16.
#define HYBRID_AVX512_NO_BF16 1
#include "gemm_avx512.cpp"
