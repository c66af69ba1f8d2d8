"""The routed experts' outputs summed into their tokens: out[t] = Σ_k w[t, k] · y[row[t, k]], in FP32, stored in
out's dtype (as the plain forward does: each expert's output times its FP32 weight, summed in FP32).

y holds one row per (token, pick), grouped expert by expert as stream-loading prefill computes them; row[t, k] is
where token t's k-th pick landed. On a GPU one Triton pass reads each y row once and writes each token once — no
FP32 temporary the size of y, no atomics (an FP32 index_add_ over the rows cost ~24 ms per MoE layer at 32K tokens
on the H200, this ~1); elsewhere torch ops, a slice of tokens at a time.

Whether the Triton pass may run is the caller's `fused` (False where it failed to compile: `warm_up` says).

Legend: T tokens, K picks per token, R = T·K rows, D hidden.
"""
from __future__ import annotations

import torch

from hybrid.kernels import triton_device
from hybrid.kernels.fallback import compiled

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

BLOCK_D = 1024  # hidden features per Triton program
SLICE_BYTES = 1 << 28  # FP32 temporary of the torch way, per slice of tokens


def combine(y_RD: torch.Tensor, row_TK: torch.Tensor, w_TK: torch.Tensor, dtype: torch.dtype,
            fused: bool = True) -> torch.Tensor:
    """Σ_k w_TK[t, k] · y_RD[row_TK[t, k]] for every token t, as `dtype` [T, D]; the Triton pass on a GPU when
    `fused`."""
    T, K = row_TK.shape
    if w_TK.shape != (T, K) or y_RD.dim() != 2 or y_RD.shape[0] != T * K:
        raise ValueError(f"combine: {T}x{K} picks need {T * K} rows of y and weights [{T}, {K}]; got y "
                         f"{tuple(y_RD.shape)}, weights {tuple(w_TK.shape)}")
    D = y_RD.shape[1]
    out_TD = torch.empty(T, D, dtype=dtype, device=y_RD.device)
    if T == 0:
        return out_TD
    if fused and triton_device.runs(y_RD):
        grid = (T, triton.cdiv(D, BLOCK_D))
        _combine[grid](y_RD.contiguous(), row_TK.contiguous(), w_TK.float().contiguous(), out_TD, D, K=K,
                       BLOCK=BLOCK_D)
        return out_TD
    step = max(1, SLICE_BYTES // (K * D * 4))
    for t in range(0, T, step):
        picked = y_RD[row_TK[t:t + step]].float()  # [slice, K, D]
        out_TD[t:t + step] = (picked * w_TK[t:t + step, :, None].float()).sum(1)
    return out_TD


def warm_up(k: int, d: int, device, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Compile the kernel for k picks per token and d features now (not in a first long prompt's time). Whether it
    compiled and ran (False, having warned, where it failed; False too where it cannot run: no GPU or no Triton)
    — combine's `fused`."""
    if triton is None or torch.device(device).type != "cuda":
        return False

    def run():
        combine(torch.zeros(k, d, dtype=dtype, device=device), torch.arange(k, device=device)[None],
                torch.ones(1, k, device=device), dtype)
        torch.cuda.synchronize(device)
    return compiled("the experts' combine", run)


if triton is not None:
    @triton.jit
    def _combine(y, row, w, out, D, K: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        keep = cols < D
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for k in tl.static_range(K):
            r = tl.load(row + t * K + k).to(tl.int64)
            acc += tl.load(w + t * K + k) * tl.load(y + r * D + cols, mask=keep, other=0.0).to(tl.float32)
        tl.store(out + t * D + cols, acc.to(out.dtype.element_ty), mask=keep)
