// Scans of a checkpoint's tensors at load time, on the kernels' thread pool.
#pragma once
#include <cstdint>

#include "tensor_view.h"

namespace hybrid {

// FP8 E4M3 NaN codes (0x7F, 0xFF: the format has no infinities) in a contiguous 1-D run of codes.
int64_t count_fp8_nan(const View& codes);

}  // namespace hybrid
