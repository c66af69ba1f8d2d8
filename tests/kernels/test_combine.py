"""The routed experts' outputs summed into their tokens (hybrid/kernels/combine.py) against float64."""
from __future__ import annotations

import pytest
import torch

from hybrid.kernels import combine as cb


def _case(T: int, K: int, D: int, E: int, device="cpu"):
    g = torch.Generator().manual_seed(T * 31 + D)
    ids_TK = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    order = ids_TK.flatten().argsort(stable=True)  # rows expert by expert, as stream-loading lays them out
    row = torch.empty_like(order)
    row[order] = torch.arange(T * K)
    y_RD = torch.randn(T * K, D, generator=g).bfloat16()
    w_TK = torch.rand(T, K, generator=g)
    picked = y_RD.double()[row.view(T, K)]  # [T, K, D]
    ref = (picked * w_TK.double()[:, :, None]).sum(1)
    return y_RD.to(device), row.view(T, K).to(device), w_TK.to(device), ref


@pytest.mark.parametrize("T,K,D", [(1, 1, 5), (37, 8, 300), (64, 4, 2048 + 3)])
def test_combine_matches_float64(T, K, D):
    y, row, w, ref = _case(T, K, D, 16)
    out = cb.combine(y, row, w, torch.bfloat16)
    assert out.shape == (T, D) and out.dtype == torch.bfloat16
    err = (out.double() - ref).abs().max() / ref.abs().max()
    assert err <= 2 ** -8  # the BF16 output's rounding, nothing more
    out32 = cb.combine(y, row, w, torch.float32)  # the FP32 sum itself
    assert (out32.double() - ref).abs().max() / ref.abs().max() < 1e-6


def test_combine_in_slices_equals_one_slice(monkeypatch):
    y, row, w, _ = _case(50, 8, 96, 32)
    whole = cb.combine(y, row, w, torch.float32)
    monkeypatch.setattr(cb, "SLICE_BYTES", 7 * 8 * 96 * 4)  # 7 tokens a slice, the last one short
    assert torch.equal(cb.combine(y, row, w, torch.float32), whole)


def test_combine_refuses_mismatched_shapes():
    y, row, w, _ = _case(10, 4, 8, 8)
    with pytest.raises(ValueError, match="40 rows of y"):
        cb.combine(y[:39], row, w, torch.float32)
    with pytest.raises(ValueError, match="weights"):
        cb.combine(y, row, w[:, :3], torch.float32)


def test_no_tokens_give_an_empty_result():
    out = cb.combine(torch.empty(0, 6), torch.empty(0, 2, dtype=torch.long), torch.empty(0, 2), torch.bfloat16)
    assert out.shape == (0, 6)


@pytest.mark.skipif(not torch.cuda.is_available() or cb.triton is None, reason="needs CUDA and Triton")
@pytest.mark.parametrize("T,K,D", [(1, 8, 7168), (333, 8, 7168), (40, 6, 1000)])
def test_triton_combine_matches_float64_and_the_torch_way(T, K, D):
    y, row, w, ref = _case(T, K, D, 64, "cuda")
    out = cb.combine(y, row, w, torch.bfloat16)
    assert (out.double().cpu() - ref).abs().max() / ref.abs().max() <= 2 ** -8
    out32 = cb.combine(y, row, w, torch.float32)
    torch_way = cb.combine(y.cpu(), row.cpu(), w.cpu(), torch.float32)
    assert (out32.cpu() - torch_way).abs().max() <= 1e-5 * torch_way.abs().max()
    unfused = cb.combine(y, row, w, torch.float32, fused=False)  # the torch way on the GPU (kernel failed)
    assert (out32 - unfused).abs().max() <= 1e-5 * unfused.abs().max()
