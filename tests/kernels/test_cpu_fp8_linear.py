"""CpuFp8Gemm, the CPU path of the FP8 Linears: the native GEMM over the stored FP8 bytes against torch's
dequantising path (the reference the model keeps for float32) and against float64; its fallbacks.

The native kernel multiplies by the exact q·s (each block's scale applied after its dot product, FP32
accumulation: ~1e-7 relative) and rounds y once to BF16, so against float64 every element is within BF16's unit
roundoff 2^-8 of itself: p95 of |err|/|ref| and max|err|/max|ref| <= 4e-3. The torch path also rounds the weights to
BF16 first, which moves outputs near cancellation by far more than 2^-8 of themselves: against it, norm-wise
||Δ||/||ref|| <= 1e-2 and max|Δ|/max|ref| <= 2e-2 (observed up to 4e-3 and 7e-3 over many seeds).
"""
from __future__ import annotations

import pytest
import torch

from hybrid.kernels import fp8_linear as fl
from hybrid.kernels.dispatch import available
from hybrid.quant import fp8
from tests.kernels.common import BLOCK, bf16, block_scales, dense64, fp8_codes, record, rel_errors, rng_for, seed_note

BOUND = 4e-3  # against float64: p95 and max
NORM_VS_TORCH, MAX_VS_TORCH = 1e-2, 2e-2

# (M, N, K): decode rows and a prefill chunk; DeepSeek-V3's kv_a_proj rows (576) and dimensions that are not
# multiples of 128 (the tiny model's 80, 96, 320)
CASES = [(1, 576, 256), (1, 80, 256), (3, 320, 96), (5, 256, 320), (17, 130, 257), (70, 384, 576)]


def _case(m, n, k, *key):
    rng = rng_for("cpu_fp8_linear", m, n, k, *key)
    q, s = fp8_codes(rng, (n, k)), block_scales(rng, (n, k), -3.0, -1.0)
    return bf16(rng, (m, k)), q, s


def _vs_float64(got: torch.Tensor, exact: torch.Tensor, what: str, variant: str) -> None:
    p95, mx = rel_errors(got.float(), exact)
    record("linear", variant, "fp8", p95, mx)
    assert p95 <= BOUND and mx <= BOUND, f"{what}: p95 {p95:.2e}, max {mx:.2e}; {seed_note()}"


def _vs_torch(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    d, ref = got.double() - ref.double(), ref.double()
    norm, mx = float(d.norm() / ref.norm()), float(d.abs().max() / ref.abs().max())
    assert norm <= NORM_VS_TORCH and mx <= MAX_VS_TORCH, f"{what}: norm {norm:.2e}, max {mx:.2e}; {seed_note()}"


@pytest.mark.parametrize("kernel", ["auto"] + available())
@pytest.mark.parametrize("m,n,k", CASES)
def test_native_linear_matches_the_dequantising_path(kernel, m, n, k):
    x, q, s = _case(m, n, k, kernel)
    gemm = fl.CpuFp8Gemm(kernel)
    assert gemm.path(x, BLOCK, m) == "native"
    got = gemm.linear(x, q, s, BLOCK)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    what = f"{kernel} M={m} N={n} K={k}"
    _vs_float64(got, x.double() @ dense64(q, s).t(), what, kernel)
    _vs_torch(got, fl.DEFAULT_GEMM.linear(x, q, s, BLOCK), what)


def test_leading_dims_strided_inputs_and_out():
    x, q, s = _case(6, 200, 256, "shapes")
    gemm = fl.CpuFp8Gemm()
    want = gemm.linear(x, q, s, BLOCK)
    assert torch.equal(gemm.linear(x.view(2, 3, 256), q, s, BLOCK), want.view(2, 3, 200))
    wide = torch.zeros(6, 300, dtype=torch.bfloat16)
    wide[:, 20:276] = x
    assert torch.equal(gemm.linear(wide[:, 20:276], q, s, BLOCK), want), "rows of a wider buffer"
    assert torch.equal(gemm.linear(x.t().contiguous().t(), q, s, BLOCK), want), "column-major x"
    out = torch.empty(6, 200, dtype=torch.bfloat16)
    assert gemm.linear(x, q, s, BLOCK, out=out) is out and torch.equal(out, want)
    assert gemm.linear(x[:0], q, s, BLOCK).shape == (0, 200)


def test_what_the_kernel_does_not_take_goes_through_torch_unchanged():
    x, q, s = _case(4, 256, 256, "fallback")
    gemm = fl.CpuFp8Gemm()
    x32 = x.float()
    assert gemm.path(x32, BLOCK, 4) == "torch"
    assert torch.equal(gemm.linear(x32, q, s, BLOCK), fl.DEFAULT_GEMM.linear(x32, q, s, BLOCK)), \
        "float32 models keep the exact torch path"
    s64 = torch.cat([s, s], dim=1)  # [2, 4]: 128 x 64 blocks
    assert gemm.path(x, (128, 64), 4) == "torch"
    assert torch.equal(gemm.linear(x, q, s64, (128, 64)), fl.DEFAULT_GEMM.linear(x, q, s64, (128, 64)))
    dense = fp8.dequantize(q, s, BLOCK, torch.bfloat16)
    # BF16 weights with BF16 activations take the native BF16 GEMM (FP32 sums, one rounding: the lm_head and the
    # router), whatever torch's own BF16 GEMM does on this CPU; float32 activations keep torch's path exactly
    y = fl.stored_linear(x, dense, None, None, gemm)
    assert torch.equal(y, fl.cpu_gemm(x, dense, None, kernel=gemm.kernel).to(torch.bfloat16)), "BF16 weights: native"
    _vs_float64(y, x.double() @ dense.double().t(), "BF16 weights", "auto")
    assert torch.equal(fl.stored_linear(x32, dense, None, None, gemm), x32 @ dense.float().t()), "float32: torch"
