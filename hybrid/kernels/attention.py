"""Long prefill attention in query chunks, each chunk as two mask-free fused-attention calls merged by their
log-sum-exps, so that GPU work of higher priority (decode's steps beside a long prefill) gets onto the SMs between
kernels instead of waiting behind one causal kernel over the whole prompt.

Why two calls per chunk: a query chunk of a causal attention sees every key before it (no mask) and its own keys
causally (a square, plain causal mask). One call with a lower-right causal mask would say the same, but a mask takes
the fastest kernel (cuDNN) out: on the H200, DeepSeek-V3's attention over 32K tokens took 74 ms as one cuDNN call,
321 ms as 2048-query masked chunks (mem-efficient kernel), and 84 ms as 2048-query split chunks, with a
priority stream's step held at most 8 ms instead of 65-74 (docs/perf/journal.md, J3).

Each part's output is exact attention over its keys; the merge weighs them by exp(lse - max) in FP32, so the result
differs from one call over all keys by the rounding of the merged output to the activation dtype.

Legend: B batch, H heads, S queries, T keys, K query/key head dim, V value head dim.
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

_warned: set = set()


def attention_lse(q_BHSK: torch.Tensor, k_BHTK: torch.Tensor, v_BHTV: torch.Tensor, causal: bool,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention (mask-free, or square causal) and the log-sum-exp of each query's scaled scores [B, H, S], in FP32
    (FP64 for FP64 inputs).
    CUDA: cuDNN, else the mem-efficient kernel; CPU: the flash kernel (values zero-padded to the key dim, which it
    requires)."""
    S = q_BHSK.shape[2]
    if q_BHSK.device.type == "cuda":
        o, lse = _cuda_lse(q_BHSK, k_BHTK, v_BHTV, causal, scale)
        if lse.dim() == 4:  # cuDNN: [B, H, S, 1]; mem-efficient: [B, H, S rounded up]
            lse = lse.squeeze(-1)
        return o, lse[..., :S].to(_merge_dtype(q_BHSK))
    K, V = q_BHSK.shape[-1], v_BHTV.shape[-1]
    v = v_BHTV if V == K else F.pad(v_BHTV, (0, K - V))
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q_BHSK, k_BHTK, v, 0.0, causal,
                                                                       scale=scale)
    return o[..., :V], lse.to(_merge_dtype(q_BHSK))


def _cuda_lse(q, k, v, causal: bool, scale: float):
    """cuDNN; if it refuses these strides, cuDNN on packed copies; else the mem-efficient kernel (~4x slower at
    DeepSeek-V3's shapes on the H200), said once."""
    cudnn = torch.ops.aten._scaled_dot_product_cudnn_attention
    try:
        return cudnn(q, k, v, None, True, 0.0, causal, False, scale=scale)[:2]
    except RuntimeError as e:
        why = str(e).splitlines()[0][:200]
    try:
        return cudnn(q.contiguous(), k.contiguous(), v.contiguous(), None, True, 0.0, causal, False, scale=scale)[:2]
    except RuntimeError as e:
        why = str(e).splitlines()[0][:200]
    key = (q.dtype, q.shape[-1], v.shape[-1])
    if key not in _warned:
        _warned.add(key)
        warnings.warn(f"prefill attention in query chunks: cuDNN refused {q.dtype} head dims {q.shape[-1]}/"
                      f"{v.shape[-1]} ({why}); the mem-efficient kernel runs instead (slower)", stacklevel=3)
    return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)[:2]


def _one_batch_stride(t: torch.Tensor) -> torch.Tensor:
    """A batch of one with its (unused) batch stride set to 1. cuDNN builds an execution plan per shape and strides,
    and a prompt's length enters the batch stride of every chunk's views: a prompt of a new length would build one
    per chunk (1.0-1.9 s at 32K tokens in 2048-token chunks on the H200), where with the stride fixed only its last,
    shorter chunk's shapes are new (0-70 ms more than a second call; docs/perf/journal.md, K6-K7)."""
    return t.as_strided(t.shape, (1,) + t.stride()[1:], t.storage_offset())


def _merge_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def causal_in_chunks(q_BHSK: torch.Tensor, k_BHTK: torch.Tensor, v_BHTV: torch.Tensor, scale: float,
                     chunk: int) -> torch.Tensor:
    """Causal attention of S queries that are the last S of the T keys' positions (a prompt, or a prompt's chunk
    after the ones before it), in query chunks of `chunk`: per chunk, one call against the keys before it and one
    causal call against its own keys, merged by their log-sum-exps. Returns [B, H, S, V] in q's dtype."""
    B, H, S, _ = q_BHSK.shape
    T, V = k_BHTK.shape[2], v_BHTV.shape[-1]
    if S > T:
        raise ValueError(f"{S} queries but {T} keys: the queries must be the last of the keys' positions")
    if B == 1 and q_BHSK.device.type == "cuda":
        q_BHSK, k_BHTK, v_BHTV = (_one_batch_stride(t) for t in (q_BHSK, k_BHTK, v_BHTV))
    out = q_BHSK.new_empty(B, H, S, V)
    first = T - S  # the position of query 0
    for s0 in range(0, S, chunk):
        s1 = min(S, s0 + chunk)
        q = q_BHSK[:, :, s0:s1]
        o_own, lse_own = attention_lse(q, k_BHTK[:, :, first + s0:first + s1], v_BHTV[:, :, first + s0:first + s1],
                                       True, scale)
        if first + s0 == 0:
            out[:, :, s0:s1] = o_own
            continue
        o_before, lse_before = attention_lse(q, k_BHTK[:, :, :first + s0], v_BHTV[:, :, :first + s0], False, scale)
        top = torch.maximum(lse_own, lse_before)
        w_own, w_before = (lse_own - top).exp()[..., None], (lse_before - top).exp()[..., None]
        acc = w_own.dtype
        out[:, :, s0:s1] = (o_own.to(acc) * w_own + o_before.to(acc) * w_before) / (w_own + w_before)
    return out
