"""Prefill's memory-bound steps around attention in one pass each on a GPU: RMSNorm, RoPE on the query (in place) and
the keys expanded per head. Each has the plain torch form beside it — the reference, and what runs on the CPU, for
small inputs (decode, CUDA graph capture) and without Triton.

Why: at 32K tokens on the H200 the torch forms cost ~15 ms per layer (RMSNorm: an FP32 copy, square, mean, scale,
cast, weight — 6 kernels, ~3 ms per hidden-size norm; RoPE on the query: ~10 kernels, ~6 ms; the key concatenation
with a broadcast ~4 ms) for ~2 ms of memory traffic.

Same arithmetic as the torch forms (FP32 inside, the same roundings to the activation dtype); the norm's sum and the
rotation's products may round differently in the last FP32 bit (summation order, fused multiply-add), so results
can differ from the torch forms by one unit in the last place of the output dtype, rarely.

Whether they run is a `Fused` decision handed to the calls (the model's modules hold one, set where they are placed):
the kernels where they compiled (`warm_up` says), on a GPU, for at least `min_rows` tokens.

Legend: T rows (tokens), D features, H heads, N non-rotary and R rotary head dims, B batch, S sequence.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hybrid.kernels import triton_device
from hybrid.kernels.fallback import compiled

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

MIN_ROWS = 1024  # below this many tokens (decode, short prompts) the torch forms run: the saving is a launch or two


@dataclass(frozen=True)
class Fused:
    """Whether the one-pass kernels may run (False: they failed to compile, see warm_up), and from how many rows."""
    enabled: bool = True
    min_rows: int = MIN_ROWS

    def applies(self, x: torch.Tensor, rows: int) -> bool:
        return (self.enabled and triton_device.runs(x) and rows >= self.min_rows
                and x.dtype in (torch.bfloat16, torch.float32)
                and not (x.device.type == "cuda" and torch.cuda.is_current_stream_capturing()))


FUSED = Fused()  # the kernels wherever they apply


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight.to(x.dtype) * h.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, fused: Fused = FUSED) -> torch.Tensor:
    """weight · x / rms(x) over the last dim, FP32 inside, in x's dtype."""
    D = x.shape[-1]
    rows = x.numel() // D if D else 0
    if not (fused.applies(x, rows) and x.is_contiguous() and D <= 16384):
        return rms_norm_reference(x, weight, eps)
    out = torch.empty_like(x)
    block = triton.next_power_of_2(D)
    _rms_norm[(rows,)](x, weight.to(x.dtype).contiguous(), out, D, eps, BLOCK=block,
                       num_warps=8 if block >= 4096 else 4)
    return out


def rope_angles(pos_BS: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [B, S, R/2] (FP32) of each position times each frequency."""
    angles = pos_BS.to(torch.float32)[..., None] * inv_freq
    return angles.cos(), angles.sin()


def rotate_reference(x_BSHR: torch.Tensor, cos_BSP: torch.Tensor, sin_BSP: torch.Tensor) -> torch.Tensor:
    """Adjacent pairs (2i, 2i+1) of x rotated by the angles whose cos and sin are given, in FP32, as x's dtype."""
    cos, sin = cos_BSP[:, :, None, :], sin_BSP[:, :, None, :]
    xf = x_BSHR.float().unflatten(-1, (-1, 2))
    a, b = xf[..., 0], xf[..., 1]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2).to(x_BSHR.dtype)


def rotate_(x_BSHR: torch.Tensor, cos_BSP: torch.Tensor, sin_BSP: torch.Tensor, fused: Fused = FUSED) -> None:
    """x rotated in place (x may be a strided view, e.g. the rotary part of each query head)."""
    B, S, H, R = x_BSHR.shape
    if not (fused.applies(x_BSHR, B * S) and x_BSHR.stride(-1) == 1 and R % 2 == 0):
        x_BSHR.copy_(rotate_reference(x_BSHR, cos_BSP, sin_BSP))
        return
    cos, sin = (t.expand(B, S, R // 2).contiguous() for t in (cos_BSP, sin_BSP))  # one row per token, as indexed
    st = x_BSHR.stride()
    _rotate[(B * S,)](x_BSHR, cos, sin, S, H, st[0], st[1], st[2], R // 2,
                      BLOCK_H=triton.next_power_of_2(H), BLOCK_R=triton.next_power_of_2(R))


def expand_keys_reference(k_nope_BTHN: torch.Tensor, pe_BTR: torch.Tensor) -> torch.Tensor:
    H = k_nope_BTHN.shape[2]
    return torch.cat([k_nope_BTHN, pe_BTR[:, :, None, :].expand(-1, -1, H, -1)], dim=-1)


def expand_keys(k_nope_BTHN: torch.Tensor, pe_BTR: torch.Tensor, fused: Fused = FUSED) -> torch.Tensor:
    """Keys per head [B, T, H, N + R]: each head's non-rotary part, then the rotary part all heads share."""
    B, T, H, N = k_nope_BTHN.shape
    R = pe_BTR.shape[-1]
    if not (fused.applies(k_nope_BTHN, B * T) and k_nope_BTHN.stride(-1) == 1 and pe_BTR.stride(-1) == 1
            and pe_BTR.dtype == k_nope_BTHN.dtype):
        return expand_keys_reference(k_nope_BTHN, pe_BTR)
    out = torch.empty(B, T, H, N + R, dtype=k_nope_BTHN.dtype, device=k_nope_BTHN.device)
    sk, sp = k_nope_BTHN.stride(), pe_BTR.stride()
    _expand_keys[(B * T,)](k_nope_BTHN, pe_BTR, out, T, H, N, R, sk[0], sk[1], sk[2], sp[0], sp[1],
                           BLOCK_H=triton.next_power_of_2(H), BLOCK_N=triton.next_power_of_2(N),
                           BLOCK_R=triton.next_power_of_2(R))
    return out


def warm_up(a, device, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Compile the kernels for this model's shapes now, so that a first long prompt does not pay Triton's
    compilation (seconds) in its time to first token. Whether they compiled and ran (False, having warned, where
    they failed; False too where they cannot run: no GPU or no Triton) — `Fused(enabled=...)`."""
    if triton is None or torch.device(device).type != "cuda":
        return False
    return compiled("RMSNorm, RoPE and key expansion", lambda: _warm_up(a, device, dtype))


def _warm_up(a, device, dtype: torch.dtype) -> None:
    n, h, nope, rope = MIN_ROWS, a.num_attention_heads, a.qk_nope_head_dim, a.qk_rope_head_dim
    for d in {a.hidden_size, a.q_lora_rank or a.hidden_size}:  # (kv_a_layernorm's input is a strided view: torch)
        rms_norm(torch.zeros(1, n, d, dtype=dtype, device=device), torch.ones(d, dtype=torch.bfloat16,
                                                                              device=device), 1e-6)
    q = torch.zeros(1, n, h, nope + rope, dtype=dtype, device=device)
    ones = torch.ones(1, n, rope // 2, device=device)
    rotate_(q[..., nope:], ones, ones)
    kv = torch.zeros(1, n, h, nope + a.v_head_dim, dtype=dtype, device=device)
    expand_keys(kv[..., :nope], torch.zeros(1, n, rope, dtype=dtype, device=device))
    torch.cuda.synchronize(device)


if triton is not None:
    @triton.jit
    def _rms_norm(x, w, out, D, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        keep = cols < D
        h = tl.load(x + row * D + cols, mask=keep, other=0.0).to(tl.float32)
        n = (h * tl.rsqrt(tl.sum(h * h, axis=0) / D + eps)).to(out.dtype.element_ty)
        wt = tl.load(w + cols, mask=keep, other=0.0)
        tl.store(out + row * D + cols, (wt.to(tl.float32) * n.to(tl.float32)).to(out.dtype.element_ty), mask=keep)

    @triton.jit(do_not_specialize=["S"])  # one compiled variant whatever the prompt's length
    def _rotate(x, cos, sin, S, H, sb, ss, sh, P, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr):
        # one token's rotary dims of every head, read and written whole rows at a time (coalesced): element r pairs
        # with r ^ 1; even r: a·cos − b·sin, odd r: b·cos + a·sin (a, b = the pair's even and odd elements)
        bs = tl.program_id(0).to(tl.int64)
        b, s = bs // S, bs % S
        heads = tl.arange(0, BLOCK_H)[:, None]
        r = tl.arange(0, BLOCK_R)[None, :]
        keep = (heads < H) & (r < 2 * P)
        c = tl.load(cos + bs * P + r // 2, mask=r < 2 * P, other=0.0)
        sn = tl.load(sin + bs * P + r // 2, mask=r < 2 * P, other=0.0)
        sign = tl.where(r % 2 == 0, -1.0, 1.0)
        row = x + b * sb + s * ss + heads * sh
        v = tl.load(row + r, mask=keep, other=0.0).to(tl.float32)
        u = tl.load(row + (r ^ 1), mask=keep, other=0.0).to(tl.float32)
        tl.debug_barrier()  # every pair read before any is overwritten (a pair may span threads)
        tl.store(row + r, (v * c + sign * (u * sn)).to(x.dtype.element_ty), mask=keep)

    @triton.jit(do_not_specialize=["T"])
    def _expand_keys(k, pe, out, T, H, N, R, kb, kt, kh, pb, pt,
                     BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
        bt = tl.program_id(0).to(tl.int64)
        b, t = bt // T, bt % T
        heads = tl.arange(0, BLOCK_H)[:, None]
        dn = tl.arange(0, BLOCK_N)[None, :]
        dr = tl.arange(0, BLOCK_R)[None, :]
        row = out + bt * H * (N + R) + heads * (N + R)
        nope = tl.load(k + b * kb + t * kt + heads * kh + dn, mask=(heads < H) & (dn < N), other=0.0)
        tl.store(row + dn, nope, mask=(heads < H) & (dn < N))
        shared = tl.load(pe + b * pb + t * pt + dr, mask=dr < R, other=0.0)  # [1, BLOCK_R], every head's
        tl.store(row + N + dr, tl.broadcast_to(shared, (BLOCK_H, BLOCK_R)), mask=(heads < H) & (dr < R))
