// The column-wise loop of the batched-head kernels (y[:, h, o] = x[:, h] · w[h, o] for w rows [O, I]), shared by
// the ISA files: each includes this inside its anonymous namespace after defining its `dot_group<R, MT>`,
// `widen_x_paired` and `kAheadGroups` (head_round: head_gemm.h), so every copy is compiled with that file's -m
// flags and has internal linkage (no other file can pick it up).
//
// Rows [o, o + R) of head h for every token, MT at a time (the group's rows are read from memory once, again from
// L1 for later tokens).
template <int R, int MT>
void by_columns_group(const HeadProblem& p, int64_t h, int64_t o, const float* xf, int64_t ldx, const char* pf) {
  const uint16_t* w = p.w + h * p.swh + o * p.swr;
  int64_t m = 0;
  for (; m + MT <= p.M; m += MT, pf = nullptr) {
    float out[R][MT];
    dot_group<R, MT>(w, p.swr, p.I, xf + m * ldx, ldx, pf, out);
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < MT; ++t) p.y[(m + t) * p.sym + h * p.syh + o + r] = head_round(out[r][t]);
  }
  for (; m < p.M; ++m, pf = nullptr) {
    float out[R][1];
    dot_group<R, 1>(w, p.swr, p.I, xf + m * ldx, ldx, pf, out);
    for (int r = 0; r < R; ++r) p.y[m * p.sym + h * p.syh + o + r] = head_round(out[r][0]);
  }
}

template <int R, int MT>
void by_columns(const HeadProblem& p, int64_t h0, int64_t h1, float* scratch) {
  const int64_t ldx = head_pad(p.I);
  for (int64_t h = h0; h < h1; ++h) {
    widen_x_paired(p, h, scratch, ldx);
    int64_t o = 0;
    for (; o + R <= p.O; o += R) {
      const char* pf = reinterpret_cast<const char*>(p.w + h * p.swh + (o + kAheadGroups * R) * p.swr);
      by_columns_group<R, MT>(p, h, o, scratch, ldx, pf);
    }
    for (; o < p.O; ++o) by_columns_group<1, MT>(p, h, o, scratch, ldx, nullptr);
  }
}
