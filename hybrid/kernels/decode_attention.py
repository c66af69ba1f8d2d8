"""MLA decode attention on the CPU (csrc/decode_attention.cpp), the absorbed form over the BF16 latent cache read in
place: for each sequence its own positions, in fixed chunks of CHUNK positions merged in order, so a sequence's
numbers never depend on its batch mates or the thread count (the same contract as the GPU's mla_decode).
The cache and rope keys are read once per step for all the heads a task holds; split-K over chunks across the
pool's threads for long contexts, heads across threads for short ones.

The cache is paged: pools of N blocks of P positions, a block table [S, M] of block ids per slot; sequence b reads
slot slots_B[b], its position t at kv_NPC[table_SM[slots_B[b], t // P], t % P]. A chunk lies inside one block: P a
multiple of CHUNK, or each sequence within its first block (the unpaged cache [S, T, C]: P = T, table arange(S)).

Legend: B sequences, H heads, C latent (kv_lora_rank), R rotary dims, N cache blocks, P positions per block,
S cache slots, M blocks per slot.
"""
from __future__ import annotations

from typing import Optional

import torch

from hybrid import _native
from hybrid.kernels.dispatch import kernel_name
from hybrid.kernels.view import view

CHUNK = 256  # positions per chunk (csrc: kChunkPositions)
SCHEDULES = {"auto": 0, "split": 1, "heads": 2}


def runs(q_lat_BHC: torch.Tensor, kv_NPC: torch.Tensor) -> bool:
    """Whether the kernel takes these: BF16 queries and cache on the CPU."""
    return (q_lat_BHC.device.type == "cpu" and kv_NPC.device.type == "cpu"
            and q_lat_BHC.dtype == torch.bfloat16 and kv_NPC.dtype == torch.bfloat16)


def decode_attention(q_lat_BHC: torch.Tensor, q_pe_BHR: torch.Tensor, kv_NPC: torch.Tensor, pe_NPR: torch.Tensor,
                     table_SM: torch.Tensor, slots_B: torch.Tensor, lengths_B: torch.Tensor, scale: float,
                     kernel: str = "auto", out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """softmax(scale · (q_lat·kvᵀ + q_pe·peᵀ)) · kv for each sequence b over positions [0, lengths_B[b]) of cache
    slot slots_B[b], read through the block table table_SM (int64) -> [B, H, C] FP32 (`out` when given). BF16
    everywhere else; last dims contiguous. `kernel`: a GEMM variant name (policy.cpu.kernel). ValueError for slots,
    lengths (1..M*P) or the block ids a sequence reads (0..N-1) out of range, and for a sequence past its first
    block unless P is a multiple of CHUNK."""
    b, h, c = q_lat_BHC.shape
    if out is None:
        out = torch.empty(b, h, c, dtype=torch.float32)
    _native.decode_attention(view(q_lat_BHC), view(q_pe_BHR), view(kv_NPC), view(pe_NPR), view(table_SM),
                             view(slots_B.to(torch.int64)), view(lengths_B.to(torch.int64)), view(out),
                             float(scale), kernel_name(kernel))
    return out


def attention_code(kernel: str = "auto") -> str:
    """The code a variant name runs here: avx512_bf16, avx2 or generic (ValueError for features this CPU lacks)."""
    return _native.attention_code(kernel_name(kernel))


def set_schedule(schedule: str) -> None:
    """auto (by the batch and thread count), split or heads: the same numbers either way (tests, benchmarks)."""
    _native.set_attention_schedule(SCHEDULES[schedule])
