"""W4A16 linear on the GPU: y = x · (q ⊙ s)ᵀ with W in compressed-tensors' packed INT4 (hybrid/quant/int4.py:
`weight_packed` int32 [N, ceil(K/8)], element k at bit 4·(k % 8) of word k // 8, stored as q + 8; `weight_scale`
[N, ceil(K/group)], the last group ragged where K is not a whole number of groups).

The ways are the FP8 weights' (`policy.gpu.fp8_gemm`, the caller's `Fp8Gemm`: backend, row threshold, tiles,
pad_rows), so one policy chooses for both:
- `triton`: a Triton GEMM that reads the packed words and scales once each, dequantises each [BN, BK] tile in
  registers (the nibbles interleaved back into K order; q·s formed in FP32, one rounding to the activations' dtype:
  the weights compressed-tensors dequantises to) and multiplies it with one `tl.dot` over the whole BK step, FP32
  accumulation. Not post-scaled per group as the CPU
  kernels are: a group is 32 inputs, so post-scaling would split each step into BK/32 shallow products and rescale
  the [BM, BN] accumulator after each, on the CUDA cores; dequantising first keeps one full-depth product per step,
  and the per-expert and grouped forms of stream-loading prefill then multiply by the same BF16 weights. BF16
  activations on the tensor cores; FP32 ones in IEEE FP32 (no TF32) on a small tile of their own (tests).
- `dequant`: the weights expanded to the activations' dtype by one Triton pass (bit-identical to
  int4.dequantize), then torch's matmul; the pass also fills stream-loading prefill's grouped-GEMM buffer.
- elsewhere (no Triton, the CPU, other dtypes) int4.dequantize with torch ops, then torch's matmul.

Legend: M rows of x (tokens), N output features, K input features.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from hybrid.kernels import triton_device
from hybrid.kernels.fp8_linear import DEFAULT_GEMM, Fp8Gemm, Tile
from hybrid.quant import int4

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

DTYPES = (torch.bfloat16, torch.float32)  # activations the Triton kernels take
FP32_TILE = Tile(32, 64, 32, 4, 2)  # FP32 operands: CUDA-core products, small tiles
DEQUANT_BLOCK = (64, 128)  # rows x columns of W per program of the dequantise pass


def path(gemm: Fp8Gemm, x: torch.Tensor, m: int) -> str:
    """How m rows of x go through INT4 weights: `triton` (the W4A16 GEMM), `dequant` (the Triton dequantise pass,
    then torch's matmul) or `torch` (torch ops dequantise: the CPU, other dtypes, no Triton); by `gemm`'s backend
    and row threshold, as for FP8 weights."""
    if not triton_device.runs(x) or x.dtype not in DTYPES:
        return "torch"
    if gemm.backend == "triton" or (gemm.backend == "auto" and m < gemm.dequant_from_rows):
        return "triton"
    return "dequant"


def linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, k: int, group: int = int4.GROUP,
           gemm: Fp8Gemm = DEFAULT_GEMM, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [..., K] through the packed weight -> [..., N] in x's dtype; `out` (2-D [M, N], rows contiguous) receives it
    when given. Fewer rows than gemm.pad_rows are computed over pad_rows rows (batch-invariant decode)."""
    n = packed.shape[0]
    m = x.numel() // k if k else 0
    if 0 < m < gemm.pad_rows:
        xp = x.new_zeros(gemm.pad_rows, k)
        xp[:m] = x.reshape(m, k)
        y = linear(xp, packed, scale, k, group, gemm)[:m]
        return out.copy_(y) if out is not None else y.view(*x.shape[:-1], n)
    how = path(gemm, x, m)
    if how != "triton":
        w = (dequantize(packed, scale, k, group, x.dtype) if how == "dequant"
             else int4.dequantize(packed, scale, (n, k), x.dtype, group))
        if out is not None and out.is_contiguous():
            return torch.mm(x.reshape(m, k), w.t(), out=out)
        y = F.linear(x, w)
        return out.copy_(y.view(out.shape)) if out is not None else y
    _check_layout(packed, scale, k, group)
    x_MK = x.reshape(m, k)
    if x_MK.stride(-1) != 1:
        x_MK = x_MK.contiguous()
    y_MN = out if out is not None and out.stride(-1) == 1 else torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        t = gemm.tile_for(m) if x.dtype == torch.bfloat16 else FP32_TILE
        if t.bk % group:
            raise ValueError(f"int4_linear: a tile's BK ({t.bk}) must hold whole groups of {group}")
        grid = (triton.cdiv(m, t.bm), triton.cdiv(n, t.bn))
        _int4_mm[grid](x_MK, packed, scale, y_MN, m, n, k, x_MK.stride(0), packed.stride(0), scale.stride(0),
                       y_MN.stride(0), GROUP=group, BM=t.bm, BN=t.bn, BK=t.bk, IEEE=x.dtype == torch.float32,
                       num_warps=t.warps, num_stages=t.stages)
    if out is not None:
        return out if y_MN is out else out.copy_(y_MN)
    return y_MN.view(*x.shape[:-1], n)


def dequantize(packed: torch.Tensor, scale: torch.Tensor, k: int, group: int = int4.GROUP,
               dtype: torch.dtype = torch.bfloat16, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """q·s [N, K] as `dtype` (int4.dequantize's arithmetic: the product in FP32, one rounding); one Triton pass where
    the kernels run. `out` ([N, K], rows contiguous) receives it when given."""
    n = packed.shape[0]
    if out is not None and tuple(out.shape) != (n, k):
        raise ValueError(f"dequantize: out is {tuple(out.shape)}, the weights {(n, k)}")
    if not triton_device.runs(packed) or (out is not None and out.stride(1) != 1):
        w = int4.dequantize(packed, scale, (n, k), dtype if out is None else out.dtype, group)
        return w if out is None else out.copy_(w)
    _check_layout(packed, scale, k, group)
    w = torch.empty(n, k, dtype=dtype, device=packed.device) if out is None else out
    if w.numel():
        bn, bk = DEQUANT_BLOCK
        _int4_dequant[(triton.cdiv(n, bn), triton.cdiv(k, bk))](packed, scale, w, n, k, packed.stride(0),
                                                                scale.stride(0), w.stride(0), GROUP=group, BN=bn,
                                                                BK=bk, num_warps=4)
    return w


def _check_layout(packed: torch.Tensor, scale: torch.Tensor, k: int, group: int) -> None:
    n = packed.shape[0]
    want_w, want_s = int4.packed_shape((n, k)), int4.scale_shape((n, k), group)
    if (packed.dtype != torch.int32 or tuple(packed.shape) != want_w or tuple(scale.shape) != want_s
            or packed.stride(1) != 1 or scale.stride(1) != 1):
        raise ValueError(f"int4_linear: packed {packed.dtype} {tuple(packed.shape)} and scales {tuple(scale.shape)} "
                         f"for K={k}: need row-major int32 {want_w} and {want_s} (one scale per group of {group})")


def warm_up(shapes, device, gemm: Fp8Gemm = DEFAULT_GEMM, group: int = int4.GROUP) -> None:
    """Compile the GEMM's variants (one per row tile of `gemm`) and the dequantise pass for these weight shapes
    [N, K] now, so that a first prefill does not pay Triton's compilation in its time to first token."""
    if triton is None or torch.device(device).type != "cuda":
        return
    limits = [limit for limit, _ in gemm.tiles[:-1]]
    rows = limits + [limits[-1] + 1 if limits else 1]  # one row count per tile
    for n, k in shapes:
        packed = torch.zeros(int4.packed_shape((n, k)), dtype=torch.int32, device=device)
        scale = torch.ones(int4.scale_shape((n, k), group), dtype=torch.bfloat16, device=device)
        for m in rows:
            linear(torch.zeros(m, k, dtype=torch.bfloat16, device=device), packed, scale, k, group,
                   gemm.with_(backend="triton"))
        dequantize(packed, scale, k, group)
    torch.cuda.synchronize(device)


if triton is not None:
    @triton.jit
    def _tile(q_ptr, s_ptr, rn, kb, N, K, sqn, ssn, GROUP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        """W[rn, kb·BK : (kb + 1)·BK] in FP32 (q·s, exact) as [BN, BK], zero outside [N, K]: each word and scale
        loaded once, the words' 8 nibbles interleaved back into K order in registers."""
        rw = kb * (BK // 8) + tl.arange(0, BK // 8)
        rg = kb * (BK // GROUP) + tl.arange(0, BK // GROUP)
        rows = rn[:, None] < N
        words = tl.load(q_ptr + rn[:, None] * sqn + rw[None, :], mask=rows & (rw[None, :] < tl.cdiv(K, 8)), other=0)
        scales = tl.load(s_ptr + rn[:, None] * ssn + rg[None, :], mask=rows & (rg[None, :] < tl.cdiv(K, GROUP)),
                         other=0.0)
        n0, n1, n2, n3 = words & 0xF, (words >> 4) & 0xF, (words >> 8) & 0xF, (words >> 12) & 0xF
        n4, n5, n6, n7 = (words >> 16) & 0xF, (words >> 20) & 0xF, (words >> 24) & 0xF, (words >> 28) & 0xF
        # interleave(a, b) puts a at even and b at odd places: three levels leave nibble j of word w at 8·w + j
        even = tl.interleave(tl.interleave(n0, n4), tl.interleave(n2, n6))
        odd = tl.interleave(tl.interleave(n1, n5), tl.interleave(n3, n7))
        q = (tl.interleave(even, odd) - 8).to(tl.float32)
        w = tl.reshape(tl.reshape(q, (BN, BK // GROUP, GROUP)) * scales.to(tl.float32)[:, :, None], (BN, BK))
        kk = kb * BK + tl.arange(0, BK)
        return tl.where(rows & (kk[None, :] < K), w, 0.0)

    @triton.jit(do_not_specialize=["M"])
    def _int4_mm(x_ptr, q_ptr, s_ptr, y_ptr, M, N, K, sxm, sqn, ssn, sym, GROUP: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr):
        rm = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)  # row offsets can pass 2^31 elements
        rn = (tl.program_id(1) * BN + tl.arange(0, BN)).to(tl.int64)
        rk = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for kb in range(0, tl.cdiv(K, BK)):
            kk = kb * BK + rk
            a = tl.load(x_ptr + rm[:, None] * sxm + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K),
                        other=0.0)
            w = tl.trans(_tile(q_ptr, s_ptr, rn, kb, N, K, sqn, ssn, GROUP, BN, BK).to(x_ptr.dtype.element_ty))
            if IEEE:
                acc = tl.dot(a, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, w, acc)
        tl.store(y_ptr + rm[:, None] * sym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))

    @triton.jit
    def _int4_dequant(q_ptr, s_ptr, w_ptr, N, K, sqn, ssn, swn, GROUP: tl.constexpr, BN: tl.constexpr,
                      BK: tl.constexpr):
        """One BN x BK block of W per program: q·s (FP32 product, one rounding to w's dtype)."""
        rn = (tl.program_id(0) * BN + tl.arange(0, BN)).to(tl.int64)
        kb = tl.program_id(1)
        kk = kb * BK + tl.arange(0, BK)
        w = _tile(q_ptr, s_ptr, rn, kb, N, K, sqn, ssn, GROUP, BN, BK)
        tl.store(w_ptr + rn[:, None] * swn + kk[None, :], w.to(w_ptr.dtype.element_ty),
                 mask=(rn[:, None] < N) & (kk[None, :] < K))
