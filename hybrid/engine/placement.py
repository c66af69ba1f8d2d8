"""Placement passes: applied to a loaded model from outside, so the model code stays device-agnostic.

`experts_to_cpu_kernels` swaps every MoE layer's routed experts for the native fused CPU op, over the same
memory-mapped checkpoint weights (no copy).
"""
from __future__ import annotations

import torch
from torch import nn

from hybrid.kernels.moe import CpuMoE
from hybrid.model.moe import MoE, RoutedExperts


class NativeExperts(nn.Module):
    """RoutedExperts' interface over the native op (csrc/moe.cpp). Legend: T tokens, D hidden, K experts/token."""

    def __init__(self, experts: RoutedExperts, kernel: str = "auto"):
        super().__init__()
        fp8 = experts[0].gate_proj.block is not None

        def weights(proj: str, attr: str):
            return [getattr(getattr(e, proj), attr) for e in experts] if (fp8 or attr == "weight") else []

        self.op = CpuMoE(*(weights(p, "weight") for p in ("gate_proj", "up_proj", "down_proj")),
                         *(weights(p, "weight_scale_inv") for p in ("gate_proj", "up_proj", "down_proj")),
                         kernel=kernel)
        self.experts = experts  # keeps the weights (and their names) with the module

    def forward(self, x_TD: torch.Tensor, weights_TK: torch.Tensor, ids_TK: torch.Tensor) -> torch.Tensor:
        return self.op(x_TD, ids_TK, weights_TK).to(x_TD.dtype)


def experts_to_cpu_kernels(model: nn.Module, kernel: str = "auto") -> int:
    """Returns the number of MoE layers placed."""
    placed = 0
    for module in model.modules():
        if isinstance(module, MoE) and isinstance(module.experts, RoutedExperts):
            module.experts = NativeExperts(module.experts, kernel)
            placed += 1
    return placed
