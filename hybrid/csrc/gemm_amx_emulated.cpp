// The AMX kernel on any CPU: the tiling loop of gemm_amx_tiling.h with the tile registers and tdpbf16ps emulated
// in plain C++ (as the instruction reference defines them: per C element, the pairs' products added in order, fp32,
// BF16 inputs with denormals read as zero) and the weights converted through a table into the same lane order.
// It checks the layouts, the tiling and the post-scaling of the AMX path where no AMX CPU is at hand.
// Also here, for both: the activations' packing into the B layout.
#include <algorithm>
#include <cstring>

#include "gemm_amx_tiling.h"

namespace hybrid {
namespace {

struct Bf16Table {
  uint16_t v[256];
  Bf16Table() {
    for (int c = 0; c < 256; ++c) v[c] = float_to_bf16(fp8_to_float(uint8_t(c)));  // exact: 3 mantissa bits
  }
};
const Bf16Table kBf16;

float bf16_daz(uint16_t v) { return (v & 0x7F80) ? bf16_to_float(v) : 0.f; }

thread_local uint8_t regs[8][1024];  // 8 tiles of 16 rows x 64 bytes

struct Tiles {
  static void convert(const GemmProblem& p, int64_t n, int64_t count, int64_t c0, int64_t c1, uint16_t* buf,
                      int64_t ld) {
    for (int64_t r = 0; r < count; ++r) {
      const uint8_t* w = static_cast<const uint8_t*>(p.w) + (n + r) * p.ldw;
      uint16_t* out = buf + r * ld - c0 * kChunk;
      for (int64_t k = c0 * kChunk; k < c1 * kChunk; ++k) out[fp8_lane(k)] = k < p.K ? kBf16.v[w[k]] : 0;
    }
  }
  template <int T>
  static void zero() {
    std::memset(regs[T], 0, 1024);
  }
  template <int T>
  static void load(const void* ptr, int64_t stride) {
    for (int r = 0; r < 16; ++r) std::memcpy(regs[T] + 64 * r, static_cast<const uint8_t*>(ptr) + r * stride, 64);
  }
  template <int C>
  static void store(void* ptr, int64_t stride) {
    for (int r = 0; r < 16; ++r) std::memcpy(static_cast<uint8_t*>(ptr) + r * stride, regs[C] + 64 * r, 64);
  }
  template <int C>
  static void dp() {
    float c[16][16];
    uint16_t a[16][32], b[16][32];
    std::memcpy(c, regs[C], 1024);
    std::memcpy(a, regs[4 + C / 2], 1024);
    std::memcpy(b, regs[6 + C % 2], 1024);
    for (int m = 0; m < 16; ++m)
      for (int k = 0; k < 16; ++k)
        for (int n = 0; n < 16; ++n) {
          c[m][n] += bf16_daz(a[m][2 * k]) * bf16_daz(b[k][2 * n]);
          c[m][n] += bf16_daz(a[m][2 * k + 1]) * bf16_daz(b[k][2 * n + 1]);
        }
    std::memcpy(regs[C], c, 1024);
  }
};

}  // namespace

bool amx_tiles(const GemmProblem& p) { return p.wt == WeightType::fp8 && p.M >= tunables().amx_min_m; }

void prepare_x_amx(const GemmProblem& p, uint16_t* xv) {
  // Inputs k, k+1 (k even) stay side by side (lanes w, w+1 of lane_of_k), so they move as one 32-bit pair. Per
  // 64-chunk, pair j of token m goes to 32-bit slot at[j] + m of its token tile's chunk (amx_x_index = token part
  // + lane part): the 16 tokens of a tile fill one 64-byte line per pair, written in order. Whole chunks take
  // that loop; the chunk K ends in (and tiles' rows past M) the element-wise one. 16 tokens x 7168: 43 against 76 us
  // for the per-element loop before it (one Zen 4 core); the packing's share of the T = 512 layer on the H200 test
  // machine's Xeon went from 2.6-2.8 % to 1.4-1.5 % of each thread's time (V1, V2).
  const int64_t kp = padded_k(p.K), mp = amx_rows_padded(p.M), full = p.K / kChunk;
  int64_t at[kChunk / 2];
  for (int64_t j = 0; j < kChunk / 2; ++j) at[j] = amx_x_index(0, lane_of_k(2 * j), kp) / 2;
  for (int64_t m0 = 0; m0 < mp; m0 += kAmxTokens) {
    const int64_t tokens = std::min(kAmxTokens, p.M - m0);
    uint32_t* tile = reinterpret_cast<uint32_t*>(xv + amx_x_index(m0, 0, kp));
    for (int64_t c = 0; c < full; ++c) {
      uint32_t* out = tile + c * (kChunk * kAmxTokens / 2);
      for (int64_t j = 0; j < kChunk / 2; ++j) {
        uint32_t* o = out + at[j];
        for (int64_t m = 0; m < tokens; ++m) std::memcpy(o + m, p.x + (m0 + m) * p.ldx + c * kChunk + 2 * j, 4);
        for (int64_t m = tokens; m < kAmxTokens; ++m) o[m] = 0;
      }
    }
    for (int64_t m = m0; m < m0 + kAmxTokens; ++m) {  // the chunks from K's on: element by element, zeros past K
      uint16_t* out = xv + amx_x_index(m, 0, kp);
      for (int64_t k = full * kChunk; k < kp; ++k)
        out[amx_x_index(0, fp8_lane(k), kp)] = m < p.M && k < p.K ? p.x[m * p.ldx + k] : 0;
    }
  }
}

void gemm_rows_amx_emulated(const GemmProblem& p, const uint16_t* xv, int64_t n0, int64_t n1, uint16_t* buf) {
  amx_rows<Tiles>(p, xv, n0, n1, buf, thread_floats((p.M + 31) / 32 * 1024 + 1024));
}

}  // namespace hybrid
