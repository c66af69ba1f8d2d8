"""Per-head products with BF16 weights on the CPU (csrc/head_gemm.cpp): for each head h, y[:, h] = x[:, h] · w[h]
(`by_rows`: w[h] is [I, O], the products contract over its rows) or x[:, h] · w[h]ᵀ (w[h] is [O, I]); FP32
accumulation, one rounding to BF16. MLA's absorbed decode products over the kept kv_b halves (a few tokens, 128
heads, 2 × 16 MiB per layer for DeepSeek-V3), threaded over heads on the native pool.

Legend: M rows (tokens), H heads, I inputs per head, O outputs per head.
"""
from __future__ import annotations

from typing import Optional

import torch

from hybrid import _native
from hybrid.kernels.dispatch import kernel_name
from hybrid.kernels.view import view


def head_gemm(x_MHI: torch.Tensor, w: torch.Tensor, by_rows: bool, out: Optional[torch.Tensor] = None,
              kernel: str = "auto") -> torch.Tensor:
    """x [M, H, I] bf16 (last dim contiguous); w [H, I, O] (by_rows) or [H, O, I] bf16, rows contiguous;
    -> [M, H, O] bf16 (`out`, contiguous, when given). `kernel`: a GEMM variant name (policy.cpu.kernel; auto
    takes the AVX-512 code wherever the CPU has AVX-512 F/BW/VL: it needs no BF16 instructions), or "avx512"
    (that code by name; also the GEMM's variant for AVX-512 without BF16, but the head code needs F/BW/VL only)."""
    if x_MHI.dim() != 3 or w.dim() != 3:
        raise ValueError(f"head_gemm: x [M, H, I] and w [H, ., .], got {tuple(x_MHI.shape)} and {tuple(w.shape)}")
    if out is None:
        out = torch.empty(x_MHI.shape[0], x_MHI.shape[1], w.shape[2 if by_rows else 1], dtype=torch.bfloat16)
    _native.head_gemm(view(x_MHI), view(w), view(out), by_rows, kernel_name(kernel))
    return out


def head_code(kernel: str = "auto") -> str:
    """The code a variant name runs here: avx512, avx2 or generic (ValueError for features this CPU lacks)."""
    return _native.head_isa(kernel_name(kernel))
