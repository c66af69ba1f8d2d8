"""Rotary position embedding with YaRN frequency interpolation (DeepSeek-V3's long-context RoPE).

Pairs are adjacent elements (2i, 2i+1), as in DeepSeek's reference code; applying the same pairing to queries and
keys leaves every dot product equal to the reference's, whatever the layout of the rotary dims.
"""
from __future__ import annotations

import math

import torch

from hybrid.kernels.pointwise import FUSED, Fused, rope_angles, rotate_, rotate_reference
from hybrid.model.args import RopeArgs


def _correction_dim(rotations: float, dim: int, base: float, max_pos: int) -> float:
    return dim * math.log(max_pos / (rotations * 2 * math.pi)) / (2 * math.log(base))


def inv_freq(rope: RopeArgs, dim: int, device=None) -> torch.Tensor:
    freqs = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
    if not rope.is_yarn:
        return freqs
    low = max(math.floor(_correction_dim(rope.beta_fast, dim, rope.theta, rope.original_max_position)), 0)
    high = min(math.ceil(_correction_dim(rope.beta_slow, dim, rope.theta, rope.original_max_position)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1 = extrapolate (high frequencies kept), 0 = interpolate (divided by factor)
    return freqs / rope.factor * (1 - keep) + freqs * keep


class Rope:
    """One model's rotary frequencies, computed once per device on first use (the model may be built on the meta
    device, so they cannot be a buffer filled at construction)."""

    def __init__(self, rope: RopeArgs, dim: int):
        self.rope, self.dim = rope, dim
        self._freqs: dict[str, torch.Tensor] = {}

    def freqs(self, device) -> torch.Tensor:
        key = str(device)
        if key not in self._freqs:
            self._freqs[key] = inv_freq(self.rope, self.dim, device)
        return self._freqs[key]

    def apply(self, x: torch.Tensor, pos_BS: torch.Tensor) -> torch.Tensor:
        """x: [B, S, H, R] rotated by its position pos_BS: [B, S]."""
        cos, sin = rope_angles(pos_BS, self.freqs(x.device))
        return rotate_reference(x, cos, sin)

    def apply_(self, x: torch.Tensor, pos_BS: torch.Tensor, fused: Fused = FUSED) -> None:
        """apply in place (x may be a view: the rotary part of each query head)."""
        cos, sin = rope_angles(pos_BS, self.freqs(x.device))
        rotate_(x, cos, sin, fused)
