"""The FP8 block-scaled linear: the dequantising path everywhere, the Triton GEMM on a GPU, against float64."""
from __future__ import annotations

import pytest
import torch

from hybrid.kernels import fp8_linear as fl
from hybrid.quant import fp8


def _case(m: int, n: int, k: int, device="cpu"):
    g = torch.Generator().manual_seed(m * 7 + n)
    q, s = fp8.quantize(torch.randn(n, k, generator=g) * 0.05, (128, 128))
    x = torch.randn(m, k, generator=g).bfloat16()
    ref = x.double() @ fp8.dequantize(q, s, (128, 128), torch.float64).t()
    return x.to(device), q.to(device), s.to(device), ref


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double().cpu() - ref).norm() / ref.norm())


def test_cpu_takes_the_dequantising_path_and_matches_float64():
    x, q, s, ref = _case(5, 300, 260)
    for backend in fl.BACKENDS:
        assert fl.Fp8Gemm(backend).path(x, (128, 128), 5) == "torch"
    y = fl.DEFAULT_GEMM.linear(x, q, s, (128, 128))
    assert y.shape == (5, 300) and y.dtype == torch.bfloat16
    assert _rel_err(y, ref) < 1e-2  # BF16 output rounding


def test_stored_weights_go_through_the_gemm_given():
    x, q, s, ref = _case(3, 256, 128)
    blocks = []

    class Spy:
        def linear(self, *args, **kwargs):
            blocks.append(args[3])
            return fl.DEFAULT_GEMM.linear(*args, **kwargs)

        def dense_linear(self, x, w):
            blocks.append(None)
            return fl.DEFAULT_GEMM.dense_linear(x, w)

    assert _rel_err(fl.stored_linear(x, q, s, (128, 128), Spy()), ref) < 1e-2 and blocks == [(128, 128)]
    dense = fp8.dequantize(q, s, (128, 128), torch.bfloat16)
    assert torch.equal(fl.stored_linear(x, dense, None, None, Spy()), x @ dense.t()) and blocks == [(128, 128), None]


def test_dequantise_into_a_buffer_of_the_wrong_shape_is_refused():
    _, q, s, _ = _case(1, 300, 260)
    into = torch.empty(300, 260, dtype=torch.bfloat16)
    assert fl.dequantize(q, s, (128, 128), out=into) is into
    assert torch.equal(into, fp8.dequantize(q, s, (128, 128), torch.bfloat16))
    with pytest.raises(ValueError, match="out is"):
        fl.dequantize(q, s, (128, 128), out=torch.empty(260, 300, dtype=torch.bfloat16))


def test_tiles_parse_and_pick_by_rows():
    assert str(fl.Tile.parse("128x256x64/8/4")) == "128x256x64/8/4"
    for bad in ("128x128/8/3", "128x128x32/8/3", "96x128x128/8/3", "128x128x128/6/3", "128x128x128/8/0", "big"):
        with pytest.raises(ValueError, match="tile"):
            fl.Tile.parse(bad)
    gemm = fl.DEFAULT_GEMM
    assert gemm.tile_for(1).bm == 16 and gemm.tile_for(200).bm == 64 and gemm.tile_for(5000) == gemm.large_tile
    assert gemm.large_tile == fl.TILES[-1][1] and gemm.tile_for(16).bm == 16 and gemm.tile_for(17).bm == 64
    assert not gemm.uses_large_tile(256) and gemm.uses_large_tile(257)
    other = gemm.with_("dequant", fl.Tile.parse("64x256x64/4/4"))
    assert other.tile_for(5000) == fl.Tile(64, 256, 64, 4, 4) and other.tile_for(200).bm == 64
    assert other.backend == "dequant" and other.dequant_from_rows == gemm.dequant_from_rows
    assert gemm == fl.Fp8Gemm() and gemm.backend == "triton", "a variant leaves the one it came from as it was"
    assert gemm.with_() == gemm and other != gemm


def test_unknown_backend_bad_row_threshold_and_unordered_tiles_are_refused():
    with pytest.raises(ValueError, match=r"policy\.gpu\.fp8_gemm"):
        fl.Fp8Gemm("cublas")
    with pytest.raises(ValueError, match=r"policy\.gpu\.fp8_dequant_rows"):
        fl.Fp8Gemm("auto", 0)
    with pytest.raises(ValueError, match=r"policy\.gpu\.fp8_gemm"):
        fl.DEFAULT_GEMM.with_(backend="cublas")
    tile = fl.Tile.parse("64x128x128/4/3")
    for tiles in ((), ((16, tile),), ((256, tile), (16, tile), (None, tile)),
                  ((16, tile), (None, tile), (None, tile))):
        with pytest.raises(ValueError, match="tiles"):
            fl.Fp8Gemm(tiles=tiles)
    assert fl.Fp8Gemm(tiles=((None, tile),)).tile_for(1) == tile


def test_auto_takes_the_fp8_gemm_for_few_rows_and_dequantises_for_many(monkeypatch):
    class Cuda:  # what path() reads of a CUDA BF16 activation
        device, dtype = torch.device("cuda"), torch.bfloat16

    # the choice as made where Triton is installed
    monkeypatch.setattr(fl.triton_device, "triton", fl.triton_device.triton or object())
    auto = fl.Fp8Gemm("auto", 512)
    assert [auto.path(Cuda, (128, 128), m) for m in (1, 511, 512, 9000)] == ["triton"] * 2 + ["dequant"] * 2
    assert auto.path(Cuda, (64, 64), 1) == "torch"
    assert fl.Fp8Gemm("triton").path(Cuda, (128, 128), 9000) == "triton"
    assert fl.Fp8Gemm("dequant").path(Cuda, (128, 128), 1) == "dequant"


@pytest.mark.skipif(not torch.cuda.is_available() or fl.triton is None, reason="needs CUDA and Triton")
@pytest.mark.parametrize("tile", ["128x128x64/8/3", "128x256x64/8/3", "64x128x128/4/4"])
def test_other_large_row_tiles_compute_the_same(tile):
    x, q, s, ref = _case(700, 128 * 3 + 5, 128 * 4 + 70, "cuda")
    gemm = fl.DEFAULT_GEMM.with_(large_tile=fl.Tile.parse(tile))
    assert _rel_err(gemm.linear(x, q, s, (128, 128)), ref) < 5e-3


@pytest.mark.skipif(not torch.cuda.is_available() or fl.triton is None, reason="needs CUDA and Triton")
@pytest.mark.parametrize("m,n,k", [(1, 2048, 7168), (7, 300, 260), (64, 7168, 2048), (700, 2048, 7168),
                                   (3, 128 * 3 + 5, 128 * 2 + 70)])
def test_triton_gemm_matches_float64_and_the_dequantising_path(m, n, k):
    x, q, s, ref = _case(m, n, k, "cuda")
    gemm = fl.Fp8Gemm("triton")
    assert gemm.path(x, (128, 128), m) == "triton"
    y = gemm.linear(x[None], q, s, (128, 128))[0]  # leading dims kept
    assert _rel_err(y, ref) < 5e-3
    gemm = fl.Fp8Gemm("dequant")
    assert gemm.path(x, (128, 128), m) == "dequant"
    assert _rel_err(gemm.linear(x, q, s, (128, 128)), ref) < 1e-2
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    assert gemm.linear(x, q, s, (128, 128), out=out) is out and _rel_err(out, ref) < 1e-2


@pytest.mark.skipif(not torch.cuda.is_available() or fl.triton is None, reason="needs CUDA and Triton")
@pytest.mark.parametrize("n,k", [(4096, 7168), (300, 260), (128 * 3 + 5, 128 * 2 + 70)])
def test_triton_dequantise_is_bit_identical_to_torch(n, k):
    _, q, s, _ = _case(1, n, k, "cuda")
    assert torch.equal(fl.dequantize(q, s, (128, 128)), fp8.dequantize(q, s, (128, 128), torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_rows_make_a_row_independent_of_its_batch(dtype):
    """pad_rows (batch-invariant decode): products of fewer rows run over pad_rows rows, so a row's result is the
    same bits whatever the number of rows beside it; the results stay the products."""
    g = torch.Generator().manual_seed(3)
    gemm = fl.Fp8Gemm(pad_rows=8)
    x = torch.randn(8, 200, generator=g).to(dtype)
    w = torch.randn(72, 200, generator=g).to(dtype)
    q, s = fp8.quantize(torch.randn(256, 256, generator=g), (128, 128))
    xq = torch.randn(8, 256, generator=g).to(dtype)
    for way, args in ((gemm.dense_linear, (w,)), (gemm.fp32_linear, (w,)), (gemm.linear, (q, s, (128, 128)))):
        xs = xq if way.__name__ == "linear" else x
        full = way(xs, *args)
        for m in range(1, 8):
            part = way(xs[:m], *args)
            assert part.shape[0] == m and torch.equal(part, full[:m]), (way.__name__, m)
        ref = fl.DEFAULT_GEMM.__getattribute__(way.__name__)(xs, *args)
        torch.testing.assert_close(full, ref, rtol=2e-2, atol=2e-2)
    out = torch.empty(3, 256, dtype=dtype)
    assert gemm.linear(xq[:3], q, s, (128, 128), out=out) is out and torch.equal(out, full[:3])
    with pytest.raises(ValueError, match="pad_rows"):
        fl.Fp8Gemm(pad_rows=-1)
