// Entry point of the GEMM/GEMV: checks the tensors, prepares activations once, splits N over the thread pool.
#include "gemm_op.h"

#include <algorithm>
#include <atomic>
#include <stdexcept>

#include "cpu_features.h"
#include "dispatch.h"
#include "gemm_amx.h"
#include "gemm_int4.h"
#include "scratch.h"
#include "thread_pool.h"

namespace hybrid {

namespace {
void fail(const std::string& msg) { throw std::invalid_argument(msg); }
}  // namespace

void check_view(const View& v, const char* name, std::initializer_list<const char*> dtypes, int ndim) {
  bool ok = false;
  std::string allowed;
  for (const char* d : dtypes) {
    ok |= v.dtype == d;
    allowed += (allowed.empty() ? "" : " or ") + std::string(d);
  }
  if (!ok) fail(std::string(name) + ": dtype " + v.dtype + ", expected " + allowed);
  if (int(v.shape.size()) != ndim) fail(std::string(name) + ": expected " + std::to_string(ndim) + " dimensions, got " + std::to_string(v.shape.size()));
  if (!v.ptr && !v.shape.empty() && v.shape[0] > 0) fail(std::string(name) + ": null data pointer");
  if (ndim >= 1 && v.shape.back() > 1 && v.strides.back() != 1) fail(std::string(name) + ": last dimension must be contiguous (stride 1)");
  if (ndim == 2 && v.shape[0] > 1 && v.strides[0] < v.shape[1]) fail(std::string(name) + ": rows overlap (row stride < row length)");
}

void check_shape(const View& v, const char* name, std::initializer_list<int64_t> shape) {
  if (!std::equal(v.shape.begin(), v.shape.end(), shape.begin(), shape.end())) {
    std::string want, got;
    for (auto s : shape) want += (want.empty() ? "" : ", ") + std::to_string(s);
    for (auto s : v.shape) got += (got.empty() ? "" : ", ") + std::to_string(s);
    fail(std::string(name) + ": shape [" + got + "], expected [" + want + "]");
  }
}

GemmProblem make_problem(const View& x, const View& w, const View* scale, const View& y) {
  if (w.dtype == "int32") return make_int4_problem(x, w, scale, y);
  check_view(x, "x", {"bfloat16"}, 2);
  check_view(w, "w", {"float8_e4m3fn", "bfloat16", "int32"}, 2);
  check_view(y, "y", {"float32"}, 2);
  const int64_t M = x.dim(0), K = x.dim(1), N = w.dim(0);
  check_shape(w, "w", {N, K});
  check_shape(y, "y", {M, N});
  GemmProblem p{x.data<const uint16_t>(), x.strides[0], w.data<const void>(), w.strides[0], nullptr, 0,
                y.data<float>(), y.strides[0], M, N, K, w.dtype == "bfloat16" ? WeightType::bf16 : WeightType::fp8};
  if (p.wt == WeightType::fp8) {
    if (!scale) fail("scale: FP8 weights need their weight_scale_inv");
    check_view(*scale, "scale", {"float32"}, 2);
    check_shape(*scale, "scale", {(N + kBlock - 1) / kBlock, (K + kBlock - 1) / kBlock});
    p.scale = scale->data<const float>();
    p.lds = scale->strides[0];
  } else if (scale) {
    fail("scale: BF16 weights take no scale");
  }
  return p;
}

Tunables& tunables() {
  static Tunables t = [] {
    Tunables d;
    d.avx2_stream_fp16 = !subnormal_inputs_at_full_speed();
    return d;
  }();
  return t;
}

void set_avx2_stream(const std::string& how) {
  if (how != "fp16" && how != "registers")
    fail("avx2 stream conversion must be 'fp16' or 'registers', got '" + how + "'");
  tunables().avx2_stream_fp16 = how == "fp16";
}

std::string avx2_stream() { return tunables().avx2_stream_fp16 ? "fp16" : "registers"; }

void set_tile_min_m(int64_t m) {
  if (m < 1) fail("tile_min_m must be >= 1");
  tunables().tile_min_m = m;
}

float* thread_floats(int64_t n) {
  thread_local Scratch<float> buf;
  return buf.get(n);
}

uint16_t* thread_tile(int64_t elems) {
  thread_local Scratch<uint16_t> buf;
  return buf.get(elems);
}

void set_amx_min_m(int64_t m) {
  if (m < 1) fail("amx_min_tokens must be >= 1");
  tunables().amx_min_m = m;
}

void set_amx_prefetch(int64_t bytes) {
  if (bytes < -1) fail("amx_prefetch must be -1 (the next row group), 0 (none) or a byte distance > 0");
  tunables().amx_prefetch = bytes;
}

void set_amx_overlap(bool on) { tunables().amx_overlap = on; }

void set_batch_invariant(bool on) { tunables().batch_invariant = on; }
void set_moe_longest_first(bool on) { tunables().moe_longest_first = on; }

void set_moe_lag_rounds(int64_t rounds) {
  if (rounds < 0) fail("moe_lag_rounds must be >= 0");
  tunables().moe_lag_rounds = rounds;
}

void prepare_x(Isa isa, const GemmProblem& p, Scratch<uint16_t>& buf, const uint16_t** xprep) {
  *xprep = nullptr;
  const XLayout layout = x_layout(isa, p);
  if (layout == XLayout::plain) return;
  uint16_t* out = buf.get(x_rows(layout, p.M) * padded_k(p.K));
  prepare_x_rows(isa, layout, p, out);
  *xprep = out;
}

int64_t row_chunk(int64_t N, int threads) {
  const int64_t want = (N + 4 * threads - 1) / (4 * threads);
  return std::max<int64_t>(16, (want + 15) / 16 * 16);
}

void gemm(const View& x, const View& w, std::optional<View> scale, const View& y, const std::string& isa_name) {
  const GemmProblem p = make_problem(x, w, scale ? &*scale : nullptr, y);
  const Isa isa = resolve_isa(isa_name);
  thread_local Scratch<uint16_t> xbuf;
  const uint16_t* xprep;
  prepare_x(isa, p, xbuf, &xprep);
  ThreadPool& tp = pool();
  const int64_t chunk = row_chunk(p.N, tp.size());
  std::atomic<int64_t> next{0};
  tp.run([&](int) {
    const int64_t scratch = scratch_elems(isa, p.K);
    uint16_t* tile = scratch ? thread_tile(scratch) : nullptr;
    for (int64_t n0; (n0 = next.fetch_add(chunk)) < p.N;) gemm_rows(isa, p, xprep, n0, std::min(p.N, n0 + chunk), tile);
  });
}

std::string selected_isa(const std::string& name) { return isa_name(resolve_isa(name)); }

}  // namespace hybrid
