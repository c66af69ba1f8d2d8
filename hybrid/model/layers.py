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
from hybrid.quant import fp8, int4


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


class Int4Linear(nn.Module):
    """y = x W^T with W in compressed-tensors' packed INT4 (hybrid/quant/int4.py: `weight_packed`, `weight_scale` per
    group of inputs, `weight_shape`), dequantised for each call: the reference path (the native CPU op reads the
    packed words in place)."""

    def __init__(self, in_features: int, out_features: int, group: int):
        super().__init__()
        self.in_features, self.out_features, self.group = in_features, out_features, group
        shape = (out_features, in_features)
        self.weight_packed = _frozen(int4.packed_shape(shape), torch.int32)
        self.weight_scale = _frozen(int4.scale_shape(shape, group), torch.bfloat16)
        self.weight_shape = _frozen((2,), torch.int64)

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return int4.dequantize(self.weight_packed, self.weight_scale, (self.out_features, self.in_features), dtype,
                               self.group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dense_weight(x.dtype))


class MLP(nn.Module):
    """down(SiLU(gate(x)) * up(x)): the dense layers, the shared experts and each routed expert (`group`: INT4)."""

    def __init__(self, dim: int, inter: int, block: Optional[tuple[int, int]], group: Optional[int] = None):
        super().__init__()
        def linear(i: int, o: int) -> nn.Module:
            return Int4Linear(i, o, group) if group else Linear(i, o, block)
        self.gate_proj = linear(dim, inter)
        self.up_proj = linear(dim, inter)
        self.down_proj = linear(inter, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
