"""The MLA latent KV cache, paged: per layer a pool of blocks of P positions (512 latent + 64 rotary values each),
and one block table for all layers mapping each slot's (sequence's) j-th block of positions to a block of the pool.

A slot's position t lives at pool block table[slot, t // P], row t % P. Who assigns blocks is not this file's
business: as made, the table gives every slot blocks of its own (slot s: blocks 1 + s·M .. (s+1)·M), which is the
unpaged cache; the engine's KV manager (hybrid/kv/) hands blocks out, shares them between sequences with a common
prefix, and points a slot's unassigned entries at block 0, kept zero, so that reads past a sequence's end (masked)
meet finite numbers.

Legend: B batch, S new tokens, T cached positions, C latent (kv_lora_rank), R rotary dims, N pool blocks,
P positions per block, M blocks per slot.
"""
from __future__ import annotations

import torch

ZERO_BLOCK = 0  # never written: unassigned table entries point here


class LatentCache:
    """One layer's pool; the engine owns one per layer (see `KVCache`), all sharing its block table."""

    def __init__(self, kv_NPC: torch.Tensor, pe_NPR: torch.Tensor, table_SM: torch.Tensor):
        self.kv, self.pe, self.table = kv_NPC, pe_NPR, table_SM

    @property
    def block_tokens(self) -> int:
        return self.kv.shape[1]

    def _rows(self, slots_B, pos_BS):
        """Pool rows (block · P + offset) of the slots' positions."""
        p = self.block_tokens
        return self.table[slots_B[:, None], pos_BS // p] * p + pos_BS % p

    def write(self, slots_B, pos_BS, kv_BSC, pe_BSR) -> None:
        """Store the new tokens at their positions."""
        rows = self._rows(slots_B, pos_BS)
        self.kv.view(-1, self.kv.shape[-1])[rows] = kv_BSC.to(self.kv.dtype)
        self.pe.view(-1, self.pe.shape[-1])[rows] = pe_BSR.to(self.pe.dtype)

    def read(self, slots_B, kv_len: int):
        """The slots' first kv_len positions (gathered: [B, kv_len, C], [B, kv_len, R])."""
        p = self.block_tokens
        blocks_BM = self.table[slots_B, :(kv_len + p - 1) // p]
        b = blocks_BM.shape[0]
        return (self.kv[blocks_BM].view(b, -1, self.kv.shape[-1])[:, :kv_len],
                self.pe[blocks_BM].view(b, -1, self.pe.shape[-1])[:, :kv_len])

    def write_and_read(self, slots_B, pos_BS, kv_BSC, pe_BSR, kv_len: int):
        """Store the new tokens at their positions, return the first kv_len positions (past the furthest one)."""
        self.write(slots_B, pos_BS, kv_BSC, pe_BSR)
        return self.read(slots_B, kv_len)

    def rows(self, slot: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One slot's positions 0..n-1 (copies: [n, C], [n, R])."""
        kv, pe = self.read(torch.tensor([slot], device=self.kv.device), n)
        return kv[0], pe[0]

    def store(self, slot: int, start: int, kv_TC: torch.Tensor, pe_TR: torch.Tensor) -> None:
        """One slot's positions start.. set from rows computed elsewhere (a peer's prefill)."""
        dev = self.kv.device
        pos = torch.arange(start, start + kv_TC.shape[0], device=dev)[None]
        self.write(torch.tensor([slot], device=dev), pos, kv_TC.to(dev)[None], pe_TR.to(dev)[None])


class KVCache:
    def __init__(self, n_layers: int, slots: int, max_context: int, latent: int, rope: int,
                 dtype=torch.bfloat16, device=None, block_tokens: int = 0, extra_blocks: int = 0):
        """block_tokens: positions per block (0: max_context, one block per slot); extra_blocks: pool blocks beyond
        the slots' own (a prefix cache's room)."""
        if max_context < 1 or slots < 1:
            raise ValueError(f"KV cache needs slots >= 1 and max_context >= 1, got {slots}, {max_context}")
        if block_tokens < 0 or extra_blocks < 0:
            raise ValueError(f"KV cache blocks: block_tokens {block_tokens} and extra_blocks {extra_blocks} >= 0")
        p = min(block_tokens or max_context, max_context)
        self.slots, self.max_context, self.block_tokens = slots, max_context, p
        self.blocks_per_slot = (max_context + p - 1) // p
        self.blocks = 1 + slots * self.blocks_per_slot + extra_blocks
        own = 1 + torch.arange(slots * self.blocks_per_slot, dtype=torch.int64)
        self.table = own.view(slots, self.blocks_per_slot).to(device)
        self.layers = [
            LatentCache(torch.zeros(self.blocks, p, latent, dtype=dtype, device=device),
                        torch.zeros(self.blocks, p, rope, dtype=dtype, device=device), self.table)
            for _ in range(n_layers)
        ]

    @property
    def device(self) -> torch.device:
        return self.table.device

    def zero(self, blocks: torch.Tensor) -> None:
        """Clear these pool blocks in every layer (blocks handed to a new writer)."""
        for layer in self.layers:
            layer.kv[blocks] = 0
            layer.pe[blocks] = 0

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Pool blocks src -> dst in every layer."""
        for layer in self.layers:
            layer.kv[dst] = layer.kv[src]
            layer.pe[dst] = layer.pe[src]

    @staticmethod
    def bytes_per_token(n_layers: int, latent: int, rope: int, dtype=torch.bfloat16) -> int:
        return n_layers * (latent + rope) * torch.empty((), dtype=dtype).element_size()
