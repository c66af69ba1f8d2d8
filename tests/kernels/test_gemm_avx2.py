"""Properties of the AVX2 kernel (csrc/gemm_avx2.cpp) beyond the accuracy sweep of test_gemm.py, with each of its
two conversions of streaming FP8 rows (1-4 tokens: "registers", "fp16"; Tunables::avx2_stream_fp16).

* Batch invariance: every output is the same sequence of fp32 operations whichever path computes it (streaming
  rows for 1-4 tokens, a converted tile for 5 or more), so a token's row of y is bitwise the same alone and in
  any batch.
* FP8 subnormal codes decode exactly with denormals flushed on the calling thread (torch.set_flush_denormal sets
  MXCSR FTZ/DAZ): the decoding turns them into fp32 subnormals, so the kernel clears DAZ while it runs and puts
  the caller's MXCSR back.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from hybrid.kernels import dispatch
from hybrid.kernels.gemm import avx2_stream, gemm, set_avx2_stream
from hybrid.kernels.thread_pool import set_threads, threads
from tests.kernels.common import FP8, VALID_CODES, bf16, block_scales, fp8_codes, rng_for, seed_note

pytestmark = pytest.mark.skipif("avx2" not in dispatch.available(), reason="this CPU lacks the avx2 variant")


@pytest.fixture(params=["registers", "fp16"])
def stream(request):
    before = avx2_stream()
    set_avx2_stream(request.param)
    yield request.param
    set_avx2_stream(before)


@pytest.mark.parametrize("M", [1, 2, 3, 4])
def test_stream_conversions_agree_bitwise(M):
    # Products 2^-24 x w·x (registers) and 2^-8 x w·x (FP16), block scales 2^24 and 2^8: the same roundings.
    N, K = 300, 1000
    rng = rng_for("avx2-conversions", M)
    w, s, x = fp8_codes(rng, (N, K)), block_scales(rng, (N, K)), bf16(rng, (M, K))
    before = avx2_stream()
    try:
        set_avx2_stream("registers")
        y_reg = gemm(x, w, s, kernel="avx2")
        set_avx2_stream("fp16")
        y_fp16 = gemm(x, w, s, kernel="avx2")
    finally:
        set_avx2_stream(before)
    assert torch.equal(y_reg, y_fp16), f"M={M}: the two conversions differ; {seed_note()}"


def test_stream_conversion_default_follows_the_vendor():
    # Registers only where FMAs take subnormal inputs at full speed (AMD/Hygon); the brand string names the vendor.
    from hybrid.kernels.cpu_features import cpu_brand
    amd = any(v in cpu_brand() for v in ("AMD", "Hygon"))
    assert (avx2_stream() == "registers") == amd, f"default {avx2_stream()!r} on {cpu_brand()!r}"


def test_stream_conversion_name_checked():
    with pytest.raises(ValueError, match="'fp16' or 'registers'"):
        set_avx2_stream("fp32")


@pytest.mark.parametrize("wtype", ["fp8", "bf16"])
def test_batch_invariant(wtype, stream):
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


def test_subnormal_codes_exact_with_denormals_flushed(stream):
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
        tiny = torch.tensor([1e-40], dtype=torch.float32)
        assert (tiny * 1.0).item() == 0.0, "the caller's flush-to-zero did not survive the kernel"
    finally:
        torch.set_flush_denormal(False)
        set_threads(before)


@pytest.mark.parametrize("M", [1, 3, 8])
@pytest.mark.parametrize("shift", [-40, 20])
def test_activation_scale_passes_through_exactly(M, shift, stream):
    # The streaming path multiplies activations by 2^96 and reads weights as 2^-120 x their value; the tile path
    # reads them as 2^-8 x. Inside the range the file's header states, scaling x by a power of two scales y by it
    # exactly on every path (no product leaves fp32's normal range).
    N, K = 136, 300
    rng = rng_for("avx2-scale", M, shift)
    w, s, x = fp8_codes(rng, (N, K)), block_scales(rng, (N, K)), bf16(rng, (M, K))
    y = gemm(x, w, s, kernel="avx2")
    ys = gemm((x.float() * 2.0 ** shift).to(torch.bfloat16), w, s, kernel="avx2")
    assert torch.equal(ys, y * 2.0 ** shift), f"M={M}: y(x * 2^{shift}) != y(x) * 2^{shift}; {seed_note()}"
