"""Properties of the AVX2 kernel (csrc/gemm_avx2.cpp) beyond the accuracy sweep of test_gemm.py.

* Batch invariance: every output is the same sequence of fp32 operations whichever path computes it (streaming
  rows for 1-4 tokens, a converted tile for 5 or more), so a token's row of y is bitwise the same alone and in
  any batch.
* FP8 subnormal codes decode exactly with denormals flushed on the calling thread (torch.set_flush_denormal sets
  MXCSR FTZ/DAZ): the FP16 step of the decoding yields FP16 subnormals, and vcvtph2ps widens them exactly
  whatever MXCSR says.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from hybrid.kernels import dispatch
from hybrid.kernels.gemm import gemm
from hybrid.kernels.thread_pool import set_threads, threads
from tests.kernels.common import FP8, VALID_CODES, bf16, block_scales, fp8_codes, rng_for, seed_note

pytestmark = pytest.mark.skipif("avx2" not in dispatch.available(), reason="this CPU lacks the avx2 variant")


@pytest.mark.parametrize("wtype", ["fp8", "bf16"])
def test_batch_invariant(wtype):
    N, K = 300, 1000  # ragged 128-row blocks, row groups, 128-column blocks and 16-column steps
    rng = rng_for("avx2-batch", wtype)
    if wtype == "fp8":
        w, s = fp8_codes(rng, (N, K)), block_scales(rng, (N, K))
    else:
        w, s = bf16(rng, (N, K)), None
    x = bf16(rng, (40, K))
    alone = torch.cat([gemm(x[t:t + 1], w, s, kernel="avx2") for t in range(x.shape[0])])
    for M in [2, 3, 4, 5, 6, 7, 8, 9, 13, 16, 33, 40]:
        y = gemm(x[:M], w, s, kernel="avx2")
        diff = (y != alone[:M]).nonzero()
        assert diff.numel() == 0, (f"{wtype} M={M}: token {diff[0, 0].item()} row {diff[0, 1].item()} differs from "
                                   f"the token alone; {seed_note()}")


def test_subnormal_codes_exact_with_denormals_flushed():
    N, K = len(VALID_CODES), 130
    codes = np.array(VALID_CODES, dtype=np.uint8)
    w = torch.from_numpy(codes[(np.arange(N)[:, None] + np.arange(K)[None, :] * 7) % N]).view(FP8)
    s = torch.ones(2, 2)
    exact = w.to(torch.float32)
    eye = torch.eye(K, dtype=torch.bfloat16)
    before = threads()
    try:
        set_threads(1)  # the calling thread, whose MXCSR torch sets, runs the kernel
        torch.set_flush_denormal(True)
        for rows in (np.arange(K), np.array([3]), np.array([0, 17, 64, 100, 129])):
            y = gemm(eye[torch.from_numpy(rows)], w, s, kernel="avx2")
            want = exact[:, torch.from_numpy(rows)].T
            assert torch.equal(y, want), f"{len(rows)} tokens: decoded codes differ with denormals flushed"
    finally:
        torch.set_flush_denormal(False)
        set_threads(before)
