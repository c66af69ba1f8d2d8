"""Batch-invariant MLA decode attention on the GPU (absorbed form): each sequence's attention over its own cached
positions, in chunks of a fixed size, combined in a fixed order.

Why: a request's greedy tokens must not depend on its batch mates. The einsum path attends over the batch's
longest context (its KV-length bucket under CUDA graphs) and runs batched GEMMs whose kernels cuBLAS picks by
shape, so a sequence's reductions — over the latent dimension, over its positions — change with the batch around
it, and the last bits of its attention with them; a near-tie some tokens later then flips. Here every quantity a
sequence gets is computed from its own positions with shapes that do not depend on the batch or the bucket:

- `_chunk` (grid: sequence, head block, chunk of CHUNK positions): the chunk's block id read once from the block
  table, then the chunk's scores q_lat·kv + q_pe·pe in FP32 over the latent dimension in fixed steps, masked past
  the sequence's length, their max m, sum of exponentials l and the chunk's weighted latents o. A chunk wholly
  past the sequence's length does nothing: how far the grid reaches (the bucket) changes no value.
- `_combine` (grid: sequence, head block): the sequence's chunks merged one after another in chunk order (the
  usual running max rescaling), up to its own last chunk.

q_lat / the output's projection through kv_b stay GEMMs (rows padded by the caller's GEMM object). FP32 models run
the products in IEEE FP32 (no TF32). Tests run the kernels under Triton's interpreter on the CPU.

The cache is paged: pools of N blocks of P positions, a block table [S, M] of block ids per slot; sequence b reads
slot slots_B[b], its position t at kv_NPC[table_SM[slots_B[b], t // P], t % P]. A chunk lies inside one block: P a
multiple of CHUNK, or the grid's reach within one block (the unpaged cache [S, T, C]: P = T, table arange(S)).

Legend: B sequences, H heads, C latent (kv_lora_rank), R rotary dims, N cache blocks, P positions per block,
S cache slots, M blocks per slot.
"""
from __future__ import annotations

import torch

from hybrid.kernels import triton_device

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the einsum path serves
    triton = None

CHUNK = 256  # positions per chunk: fixed, so a sequence's chunks are the same whatever the bucket or batch
HEADS_PER_BLOCK = 16


def available(device: torch.device) -> bool:
    """Whether this path can run on `device` (Triton, a GPU; or Triton's interpreter, which tests use)."""
    return triton_device.runs(device)


def mla_decode(q_lat_BHC: torch.Tensor, q_pe_BHR: torch.Tensor, kv_NPC: torch.Tensor, pe_NPR: torch.Tensor,
               table_SM: torch.Tensor, slots_B: torch.Tensor, lengths_B: torch.Tensor, kv_len: int,
               scale: float) -> torch.Tensor:
    """softmax(scale · (q_lat·kvᵀ + q_pe·peᵀ)) · kv for each sequence b over positions [0, lengths_B[b]) of cache
    slot slots_B[b], read through the block table table_SM (int64) -> o_lat [B, H, C] in FP32. kv_len: the most
    positions any sequence may have (the grid's reach; a CUDA graph's bucket), at least max(lengths_B), at most
    M*P; past P only with P a multiple of CHUNK. Slots, lengths and block ids are read on the device, unchecked."""
    b, h, c = q_lat_BHC.shape
    r = q_pe_BHR.shape[-1]
    if c % 64 or r % 16 or kv_NPC.shape[-1] != c or pe_NPR.shape[-1] != r:
        raise ValueError(f"mla_decode: latent {c} (a multiple of 64), rotary {r} (of 16); the cache holds "
                         f"{kv_NPC.shape[-1]} + {pe_NPR.shape[-1]}")
    if kv_NPC.dim() != 3 or pe_NPR.shape[:2] != kv_NPC.shape[:2]:
        raise ValueError(f"mla_decode: kv [N, P, C] and pe [N, P, R] share N and P; got {tuple(kv_NPC.shape)}, "
                         f"{tuple(pe_NPR.shape)}")
    if table_SM.dim() != 2 or table_SM.dtype != torch.int64:
        raise ValueError(f"mla_decode: table [slots, blocks per slot] is 2-D int64; got {table_SM.dtype} "
                         f"{tuple(table_SM.shape)}")
    p, m_ = kv_NPC.shape[1], table_SM.shape[1]
    if not 1 <= kv_len <= m_ * p:
        raise ValueError(f"mla_decode: kv_len {kv_len} outside 1..{m_ * p} cached positions ({m_} blocks of {p})")
    if kv_len > p and p % CHUNK:
        raise ValueError(f"mla_decode: kv_len {kv_len} spans several blocks of {p} positions: past the first block "
                         f"P must be a multiple of {CHUNK}")
    q_lat_BHC, q_pe_BHR = q_lat_BHC.contiguous(), q_pe_BHR.contiguous()
    chunks = triton.cdiv(kv_len, CHUNK)
    dev = q_lat_BHC.device
    m = torch.empty(b, h, chunks, dtype=torch.float32, device=dev)
    l_ = torch.empty_like(m)
    o = torch.empty(b, h, chunks, c, dtype=torch.float32, device=dev)
    out = torch.empty(b, h, c, dtype=torch.float32, device=dev)
    ieee = kv_NPC.dtype == torch.float32  # FP32 models: IEEE FP32 products (no TF32)
    blocks = triton.cdiv(h, HEADS_PER_BLOCK)  # the last block's heads past h are masked
    _chunk[(b, blocks, chunks)](
        q_lat_BHC, q_pe_BHR, kv_NPC, pe_NPR, table_SM, slots_B, lengths_B, m, l_, o, h, chunks, scale, p,
        q_lat_BHC.stride(0), q_lat_BHC.stride(1), q_pe_BHR.stride(0), q_pe_BHR.stride(1),
        kv_NPC.stride(0), kv_NPC.stride(1), pe_NPR.stride(0), pe_NPR.stride(1), table_SM.stride(0),
        table_SM.stride(1), C=c, R=r, HB=HEADS_PER_BLOCK, CH=CHUNK, BC=64, IEEE=ieee)
    _combine[(b, blocks)](m, l_, o, lengths_B, out, h, chunks, C=c, HB=HEADS_PER_BLOCK, CH=CHUNK)
    return out


if triton is not None:
    @triton.jit
    def _dot(a, b, IEEE: tl.constexpr):
        if IEEE:
            return tl.dot(a, b, input_precision="ieee")
        return tl.dot(a, b)

    @triton.jit
    def _chunk(q_ptr, qpe_ptr, kv_ptr, pe_ptr, table_ptr, slots_ptr, lens_ptr, m_ptr, l_ptr, o_ptr, H, n_chunks,
               scale, P, sqb, sqh, spb, sph, skvn, skvt, spen, spet, stabs, stabm,
               C: tl.constexpr, R: tl.constexpr, HB: tl.constexpr, CH: tl.constexpr, BC: tl.constexpr,
               IEEE: tl.constexpr):
        b = tl.program_id(0)
        heads = tl.program_id(1) * HB + tl.arange(0, HB)
        j = tl.program_id(2)
        live = heads < H
        length = tl.load(lens_ptr + b)
        if j * CH < length:  # a chunk past the sequence's end: nothing (the combine stops before it)
            slot = tl.load(slots_ptr + b).to(tl.int64)
            t0 = j.to(tl.int64) * CH  # the chunk lies inside one block: its id read once
            block = tl.load(table_ptr + slot * stabs + (t0 // P) * stabm)
            i = tl.arange(0, CH)  # positions from the chunk's start
            valid = t0 + i < length
            kv_base = kv_ptr + block * skvn + (t0 % P) * skvt
            pe_base = pe_ptr + block * spen + (t0 % P) * spet
            s = tl.zeros((HB, CH), dtype=tl.float32)
            for c0 in tl.static_range(0, C, BC):  # over the latent dimension, in fixed steps
                cc = c0 + tl.arange(0, BC)
                q = tl.load(q_ptr + b * sqb + heads[:, None] * sqh + cc[None, :], mask=live[:, None], other=0.0)
                k = tl.load(kv_base + i[None, :] * skvt + cc[:, None], mask=valid[None, :], other=0.0)
                s += _dot(q.to(k.dtype), k, IEEE)
            rr = tl.arange(0, R)
            qp = tl.load(qpe_ptr + b * spb + heads[:, None] * sph + rr[None, :], mask=live[:, None], other=0.0)
            kp = tl.load(pe_base + i[None, :] * spet + rr[:, None], mask=valid[None, :], other=0.0)
            s += _dot(qp.to(kp.dtype), kp, IEEE)
            s = tl.where(valid[None, :], s * scale, float("-inf"))
            m = tl.max(s, 1)
            p = tl.exp(s - m[:, None])
            row = (b * H + heads) * n_chunks + j
            tl.store(m_ptr + row, m, mask=live)
            tl.store(l_ptr + row, tl.sum(p, 1), mask=live)
            for c0 in tl.static_range(0, C, BC):
                cc = c0 + tl.arange(0, BC)
                v = tl.load(kv_base + i[:, None] * skvt + cc[None, :], mask=valid[:, None], other=0.0)
                tl.store(o_ptr + row[:, None] * C + cc[None, :], _dot(p.to(v.dtype), v, IEEE), mask=live[:, None])

    @triton.jit
    def _combine(m_ptr, l_ptr, o_ptr, lens_ptr, out_ptr, H, n_chunks,
                 C: tl.constexpr, HB: tl.constexpr, CH: tl.constexpr):
        b = tl.program_id(0)
        heads = tl.program_id(1) * HB + tl.arange(0, HB)
        cc = tl.arange(0, C)
        live = heads < H
        length = tl.load(lens_ptr + b)
        mm = tl.full((HB,), float("-inf"), dtype=tl.float32)
        ll = tl.zeros((HB,), dtype=tl.float32)
        acc = tl.zeros((HB, C), dtype=tl.float32)
        # This sequence's chunks, in order, up to its own last one. A `while` on a scalar condition, not a `range`:
        # the interpreter of Triton <= 3.6 holds every non-constexpr scalar (a loaded one, an int argument such as
        # n_chunks) as a 1-element array, which `range` cannot take (int() of it fails) but a condition can.
        j = tl.zeros_like(length)
        while j * CH < length:
            row = (b * H + heads) * n_chunks + j
            mj = tl.load(m_ptr + row, mask=live, other=0.0)
            new = tl.maximum(mm, mj)
            keep, add = tl.exp(mm - new), tl.exp(mj - new)
            acc = acc * keep[:, None] + tl.load(o_ptr + row[:, None] * C + cc[None, :], mask=live[:, None],
                                                other=0.0) * add[:, None]
            ll = ll * keep + tl.load(l_ptr + row, mask=live, other=1.0) * add
            mm = new
            j += 1
        tl.store(out_ptr + (b * H + heads[:, None]) * C + cc[None, :], acc / ll[:, None], mask=live[:, None])
