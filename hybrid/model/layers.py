"""Basic layers: RMSNorm, a Linear over stored weights (FP8 with block scales, or BF16), the gated MLP.

How they compute on a given device (`fused` kernels, the FP8 `gemm`) is theirs from construction: device-agnostic
defaults, which a placement pass (hybrid/engine/placement.py) replaces with the chosen ones."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from hybrid.kernels.fp8_linear import DEFAULT_GEMM, Fp8Gemm, stored_linear
from hybrid.kernels.pointwise import FUSED, Fused, rms_norm
from hybrid.quant import fp8


def _frozen(shape, dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, fused: Fused = FUSED):
        super().__init__()
        self.eps, self.fused = eps, fused
        self.weight = _frozen((dim,), torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.fused)


class Linear(nn.Module):
    """y = x W^T with W as the checkpoint stores it: FP8 E4M3 + `weight_scale_inv` per block, or BF16."""

    def __init__(self, in_features: int, out_features: int, block: Optional[tuple[int, int]],
                 gemm: Fp8Gemm = DEFAULT_GEMM):
        super().__init__()
        self.in_features, self.out_features, self.block, self.gemm = in_features, out_features, block, gemm
        shape = (out_features, in_features)
        self.weight = _frozen(shape, fp8.FP8 if block else torch.bfloat16)
        if block:
            self.weight_scale_inv = _frozen(fp8.scale_shape(shape, block), torch.float32)

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        if self.block is None:
            return self.weight.to(dtype)
        return fp8.dequantize(self.weight, self.weight_scale_inv, self.block, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return stored_linear(x, self.weight, getattr(self, "weight_scale_inv", None), self.block, self.gemm)


class MLP(nn.Module):
    """down(SiLU(gate(x)) * up(x)): the dense layers, the shared experts and each routed expert."""

    def __init__(self, dim: int, inter: int, block: Optional[tuple[int, int]]):
        super().__init__()
        self.gate_proj = Linear(dim, inter, block)
        self.up_proj = Linear(dim, inter, block)
        self.down_proj = Linear(inter, dim, block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
