"""y = x · wᵀ on the CPU with FP8 (128x128 block-scaled, post-scaling), packed INT4 (bf16 scale per group of 32,
post-scaling: csrc/gemm_int4.cpp) or BF16 weights (csrc/gemm.cpp)."""
from __future__ import annotations

from typing import Optional

import torch

from hybrid import _native
from hybrid.kernels.dispatch import kernel_name
from hybrid.kernels.view import view


def gemm(x: torch.Tensor, w: torch.Tensor, scale: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
         kernel: str = "auto") -> torch.Tensor:
    """x [M, K] bf16; w [N, K] float8_e4m3fn with scale [ceil(N/128), ceil(K/128)] f32, or w [N, ceil(K/8)] int32
    (INT4 as hybrid/quant/int4.py packs it) with scale [N, ceil(K/32)] bf16, or bf16; -> [M, N] f32."""
    if out is None:
        out = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32)
    _native.gemm(view(x), view(w), None if scale is None else view(scale), view(out), kernel_name(kernel))
    return out


# policy.cpu.gemm_tile_tokens' null, by the form the converted tiles take (hybrid.engine.build.gemm_tile_tokens).
# AMD Zen 4, 2 cores, one MoE layer of 32 experts (docs/perf/journal.md): avx512_bf16's outer-product form against
# streaming 1.11x at 16 tokens per expert, 1.14-1.25x at 24-48, a tie at 12, 0.8-0.9x at 8; the lane-form tiles
# (variant avx512, and avx512_bf16 under batch invariance) behind streaming below 64.
OUTER_MIN_TOKENS = 16
TILE_MIN_TOKENS = 64


def set_tile_min_tokens(m: int) -> None:
    """From `m` tokens on, each FP8 weight tile is converted to BF16 once and reused (policy.cpu.gemm_tile_tokens)."""
    _native.set_tile_min_m(m)


# Variant amx's default threshold (the native one, and policy.cpu.amx_min_tokens' null): on the H200 test machine's
# Xeon AMX is ahead of the AVX-512 kernel from 4 tokens per expert (conf/policy/default.yaml has the figures).
AMX_MIN_TOKENS = 4


def set_amx_min_tokens(m: int) -> None:
    """Variant amx: from `m` tokens on, an FP8 GEMM runs on AMX tiles (policy.cpu.amx_min_tokens)."""
    _native.set_amx_min_m(m)


def set_batch_invariant(on: bool) -> None:
    """Every output of the CPU kernels by the same operations whatever its batch (policy.decode.batch_invariant):
    avx512_bf16's converted tiles (from gemm_tile_tokens tokens) then keep the streaming form's sums instead of the
    faster outer-product form's. (Variant amx's threshold is the plan's: 1 under it.)"""
    _native.set_batch_invariant(on)


def set_amx_prefetch(bytes_ahead: int) -> None:
    """Variant amx: where each FP8 load's prefetch into L2 points: -1 the same spot of the next 32-row group (the
    default), 0 none (the hardware prefetchers alone), n > 0 n bytes further along the row."""
    _native.set_amx_prefetch(bytes_ahead)


def set_amx_overlap(on: bool) -> None:
    """Variant amx: the next weight slab converted while this one's tiles multiply (True, the default), or after
    them (False: the order before the overlap, for side-by-side timing). The results are the same bits."""
    _native.set_amx_overlap(bool(on))


def set_avx2_stream(how: str) -> None:
    """The AVX2 kernel's conversion of streaming FP8 rows (1-4 tokens): "registers" (fp32 in registers; subnormal
    codes become fp32 subnormals: fast where FMAs take those at full speed, AMD Zen) or "fp16" (through a small
    FP16 buffer; the default on other CPUs, where each subnormal input costs a microcode assist)."""
    _native.set_avx2_stream(how)


def avx2_stream() -> str:
    return _native.avx2_stream()
