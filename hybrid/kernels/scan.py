"""Scans of a checkpoint's tensors at load time (hybrid/csrc/scan.cpp), on the kernels' thread pool."""
from __future__ import annotations

import torch

from hybrid import _native
from hybrid.kernels.view import view


def fp8_nan_codes(q: torch.Tensor) -> int:
    """FP8 E4M3's NaN codes (0x7F and 0xFF; it has no infinities) in q, counted at memory speed, allocating nothing
    (a copy only of a strided q)."""
    codes = q.view(torch.uint8).contiguous().reshape(-1)  # bytes, held through the call
    return _native.count_fp8_nan(view(codes))
