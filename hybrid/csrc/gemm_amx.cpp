// AMX tiles (compiled with -mamx-tile -mamx-bf16 and the AVX-512 kernel's flags): the tiling loop of
// gemm_amx_tiling.h on the real tile registers. Called only after dispatch.cpp checked the CPU and obtained the
// OS's permission for tile data.
#include <immintrin.h>

#include "gemm_amx_tiling.h"

namespace hybrid {
namespace {

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  TileConfig() {
    for (int t = 0; t < 8; ++t) colsb[t] = 64, rows[t] = 16;
  }
};

// The intrinsics take tile numbers as literals, hence one branch per tile.
struct Tiles {
  static void convert(const GemmProblem& p, int64_t n, int64_t count, int64_t c0, int64_t c1, uint16_t* buf,
                      int64_t ld) {
    // prefetched into L2 as each row is converted: by default the same spot of the next 32-row group, so that
    // group's bytes arrive while this one's tiles are multiplied (tunables().amx_prefetch)
    const int64_t ahead = tunables().amx_prefetch;
    convert_rows_avx512(p, n, count, c0, c1, ahead < 0 ? kAmxRows * p.ldw : ahead, buf, ld);
  }
  template <int T>
  static void zero() {
    if constexpr (T == 0) _tile_zero(0);
    else if constexpr (T == 1) _tile_zero(1);
    else if constexpr (T == 2) _tile_zero(2);
    else _tile_zero(3);
  }
  template <int T>
  static void load(const void* ptr, int64_t stride) {
    if constexpr (T == 4) _tile_loadd(4, ptr, stride);
    else if constexpr (T == 5) _tile_loadd(5, ptr, stride);
    else if constexpr (T == 6) _tile_loadd(6, ptr, stride);
    else _tile_loadd(7, ptr, stride);
  }
  template <int C>
  static void dp() {
    if constexpr (C == 0) _tile_dpbf16ps(0, 4, 6);
    else if constexpr (C == 1) _tile_dpbf16ps(1, 4, 7);
    else if constexpr (C == 2) _tile_dpbf16ps(2, 5, 6);
    else _tile_dpbf16ps(3, 5, 7);
  }
  template <int C>
  static void store(void* ptr, int64_t stride) {
    if constexpr (C == 0) _tile_stored(0, ptr, stride);
    else if constexpr (C == 1) _tile_stored(1, ptr, stride);
    else if constexpr (C == 2) _tile_stored(2, ptr, stride);
    else _tile_stored(3, ptr, stride);
  }
};

}  // namespace

void gemm_rows_amx(const GemmProblem& p, const uint16_t* xv, int64_t n0, int64_t n1, uint16_t* buf) {
  // Configured on every call, and the thread's previous configuration put back after: the calling thread also
  // runs other libraries' AMX code (oneDNN, under torch), which may keep its own configuration loaded between
  // its calls and not load it again. Without one before, the tiles are released (no 8 KB of tile state saved
  // and restored at the thread's context switches). A few hundred cycles against a call's 32 x K x M products.
  static const TileConfig config;
  alignas(64) uint8_t before[64];
  _tile_storeconfig(before);  // all zero when no configuration is loaded
  _tile_loadconfig(&config);
  amx_rows<Tiles>(p, xv, n0, n1, buf, thread_floats((p.M + 31) / 32 * 1024 + 1024));
  if (before[0] != 0) {
    _tile_loadconfig(before);
  } else {
    _tile_release();
  }
}

}  // namespace hybrid
