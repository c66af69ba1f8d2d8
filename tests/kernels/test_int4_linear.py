"""The W4A16 linear (hybrid/kernels/int4_linear.py): the dequantising path everywhere, the Triton GEMM and
dequantise pass on a GPU, against float64 at the FP8 GEMM tests' shapes and row counts (their kernels' logic also
runs on the CPU under Triton's interpreter: tests/kernels/test_triton_interpreted.py)."""
from __future__ import annotations

import pytest
import torch

from hybrid.kernels import int4_linear as il
from hybrid.kernels.fp8_linear import Fp8Gemm, Tile
from hybrid.quant import int4

CUDA = torch.cuda.is_available() and il.triton is not None


def _case(m: int, n: int, k: int, device="cpu", dtype=torch.bfloat16):
    """Random nibbles (a ragged row's padding nibbles random too), group scales putting the weights' RMS near
    1/sqrt(K), BF16 activations; the float64 product of x and the exact weights."""
    g = torch.Generator().manual_seed(m * 7 + n + k)
    packed = int4.pack(torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8))
    if k % 8:
        packed[:, -1] |= torch.randint(0, 16, (n,), generator=g, dtype=torch.int32) << 28
    scale = ((torch.rand(int4.scale_shape((n, k)), generator=g) + 0.5) / (4.6 * k ** 0.5)).bfloat16()
    x = torch.randn(m, k, generator=g).to(dtype)
    ref = x.double() @ int4.dequantize(packed, scale, (n, k), torch.float64).t()
    return x.to(device), packed.to(device), scale.to(device), ref


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double().cpu() - ref).norm() / ref.norm())


def test_cpu_takes_the_dequantising_path_and_matches_float64():
    for dtype, bound in ((torch.bfloat16, 1e-2), (torch.float32, 1e-6)):
        x, packed, scale, ref = _case(5, 300, 260, dtype=dtype)
        for backend in ("triton", "dequant", "auto"):
            assert il.path(Fp8Gemm(backend), x, 5) == "torch"
        y = il.linear(x[None], packed, scale, 260)[0]  # leading dims kept
        assert y.shape == (5, 300) and y.dtype == dtype and _rel_err(y, ref) < bound
        out = torch.full((5, 300), float("nan"), dtype=dtype)
        assert il.linear(x, packed, scale, 260, out=out) is out and torch.equal(out, y)


def test_the_ways_follow_the_fp8_policy(monkeypatch):
    class Cuda:  # what path() reads of a CUDA activation
        device, dtype = torch.device("cuda"), torch.bfloat16

    monkeypatch.setattr(il.triton_device, "triton", il.triton_device.triton or object())
    auto = Fp8Gemm("auto", 512)
    assert [il.path(auto, Cuda, m) for m in (1, 511, 512, 9000)] == ["triton"] * 2 + ["dequant"] * 2
    assert il.path(Fp8Gemm("triton"), Cuda, 9000) == "triton" and il.path(Fp8Gemm("dequant"), Cuda, 1) == "dequant"
    Cuda.dtype = torch.float16
    assert il.path(auto, Cuda, 1) == "torch", "the kernels take BF16 and FP32 activations"


def test_a_wrong_layout_and_a_wrong_buffer_are_refused():
    _, packed, scale, _ = _case(1, 64, 100)
    il._check_layout(packed, scale, 100, 32)
    for args in ((packed, scale, 96, 32), (packed, scale, 100, 64), (packed.to(torch.int64), scale, 100, 32),
                 (packed.t().contiguous().t(), scale, 100, 32)):
        with pytest.raises(ValueError, match="row-major int32"):
            il._check_layout(*args)
    with pytest.raises(ValueError, match="out is"):
        il.dequantize(packed, scale, 100, out=torch.empty(100, 64))
    into = torch.empty(64, 100, dtype=torch.bfloat16)
    assert il.dequantize(packed, scale, 100, out=into) is into
    assert torch.equal(into, int4.dequantize(packed, scale, (64, 100), torch.bfloat16))


def test_padded_rows_make_a_row_independent_of_its_batch():
    """pad_rows (batch-invariant decode): fewer rows go through pad_rows rows, so a row's bits do not depend on the
    rows beside it."""
    gemm = Fp8Gemm(pad_rows=8)
    x, packed, scale, ref = _case(8, 72, 200)
    full = il.linear(x, packed, scale, 200, gemm=gemm)
    for m in range(1, 8):
        assert torch.equal(il.linear(x[:m], packed, scale, 200, gemm=gemm), full[:m]), m
    out = torch.empty(3, 72, dtype=torch.bfloat16)
    assert il.linear(x[:3], packed, scale, 200, gemm=gemm, out=out) is out and torch.equal(out, full[:3])
    assert _rel_err(full, ref) < 1e-2


@pytest.mark.skipif(not CUDA, reason="needs CUDA and Triton")
@pytest.mark.parametrize("m,n,k", [(1, 2048, 7168), (7, 300, 260), (64, 7168, 2048), (700, 2048, 7168),
                                   (3, 128 * 3 + 5, 128 * 2 + 70)])
def test_triton_gemm_matches_float64_and_the_dequantising_path(m, n, k):
    x, packed, scale, ref = _case(m, n, k, "cuda")
    gemm = Fp8Gemm("triton")
    assert il.path(gemm, x, m) == "triton"
    assert _rel_err(il.linear(x[None], packed, scale, k, gemm=gemm)[0], ref) < 5e-3
    gemm = Fp8Gemm("dequant")
    assert il.path(gemm, x, m) == "dequant"
    assert _rel_err(il.linear(x, packed, scale, k, gemm=gemm), ref) < 1e-2
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    assert il.linear(x, packed, scale, k, gemm=gemm, out=out) is out and _rel_err(out, ref) < 1e-2
    x32, ref32 = x.float(), x.double().cpu() @ int4.dequantize(packed.cpu(), scale.cpu(), (n, k), torch.float64).t()
    assert _rel_err(il.linear(x32, packed, scale, k, gemm=Fp8Gemm("triton")), ref32) < 1e-5, "IEEE FP32 products"


@pytest.mark.skipif(not CUDA, reason="needs CUDA and Triton")
@pytest.mark.parametrize("tile", ["128x128x64/8/3", "128x256x64/8/3", "64x128x128/4/4"])
def test_other_large_row_tiles_compute_the_same(tile):
    x, packed, scale, ref = _case(700, 128 * 3 + 5, 128 * 4 + 70, "cuda")
    gemm = Fp8Gemm("triton").with_(large_tile=Tile.parse(tile))
    assert _rel_err(il.linear(x, packed, scale, 128 * 4 + 70, gemm=gemm), ref) < 5e-3


@pytest.mark.skipif(not CUDA, reason="needs CUDA and Triton")
@pytest.mark.parametrize("n,k", [(4096, 7168), (300, 260), (7168, 2048)])
def test_triton_dequantise_is_bit_identical_to_torch(n, k):
    _, packed, scale, _ = _case(1, n, k, "cuda")
    for dtype in (torch.bfloat16, torch.float32):
        assert torch.equal(il.dequantize(packed, scale, k, dtype=dtype),
                           int4.dequantize(packed, scale, (n, k), dtype))


@pytest.mark.skipif(not CUDA, reason="needs CUDA and Triton")
def test_every_weight_read_back_on_the_gpu():
    """Identity rows read each weight back exactly (one product per output; distinct power-of-two scales per row
    and group, a ragged last group): the GPU's BF16 and FP32 products, both ways."""
    n, k = 19, 72
    q = ((torch.arange(n)[:, None] * 5 + torch.arange(k)[None, :] * 3) % 16 - 8).to(torch.int8)
    s = (2.0 ** (torch.arange(n * 3).view(n, 3) % 23 - 11)).bfloat16()
    packed = int4.pack(q)
    want = int4.dequantize(packed, s, (n, k), torch.float32).t()
    for dtype in (torch.bfloat16, torch.float32):
        for backend in ("triton", "dequant"):
            y = il.linear(torch.eye(k, dtype=dtype, device="cuda"), packed.cuda(), s.cuda(), k,
                          gemm=Fp8Gemm(backend))
            assert torch.equal(y.float().cpu(), want), (dtype, backend)
