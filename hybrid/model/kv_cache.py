"""The MLA latent KV cache: per layer, per slot (sequence), per position: 512 latent + 64 rotary values.

Legend: B batch, S new tokens, T cached positions, C latent (kv_lora_rank), R rotary dims.
"""
from __future__ import annotations

import torch


class LatentCache:
    """One layer's cache; the engine owns one per layer (see `KVCache`)."""

    def __init__(self, kv_CTC: torch.Tensor, pe_CTR: torch.Tensor):
        self.kv, self.pe = kv_CTC, pe_CTR  # [slots, T, C], [slots, T, R]

    def write(self, slots_B, pos_BS, kv_BSC, pe_BSR) -> None:
        """Store the new tokens at their positions."""
        self.kv[slots_B[:, None], pos_BS] = kv_BSC.to(self.kv.dtype)
        self.pe[slots_B[:, None], pos_BS] = pe_BSR.to(self.pe.dtype)

    def read(self, slots_B, kv_len: int):
        """The slots' first kv_len positions (gathered: [B, kv_len, C], [B, kv_len, R])."""
        return self.kv[slots_B, :kv_len], self.pe[slots_B, :kv_len]

    def write_and_read(self, slots_B, pos_BS, kv_BSC, pe_BSR, kv_len: int):
        """Store the new tokens at their positions, return the first kv_len positions (past the furthest one)."""
        self.write(slots_B, pos_BS, kv_BSC, pe_BSR)
        return self.read(slots_B, kv_len)


class KVCache:
    def __init__(self, n_layers: int, slots: int, max_context: int, latent: int, rope: int,
                 dtype=torch.bfloat16, device=None):
        if max_context < 1 or slots < 1:
            raise ValueError(f"KV cache needs slots >= 1 and max_context >= 1, got {slots}, {max_context}")
        self.slots, self.max_context = slots, max_context
        self.layers = [
            LatentCache(
                torch.zeros(slots, max_context, latent, dtype=dtype, device=device),
                torch.zeros(slots, max_context, rope, dtype=dtype, device=device),
            )
            for _ in range(n_layers)
        ]

    @staticmethod
    def bytes_per_token(n_layers: int, latent: int, rope: int, dtype=torch.bfloat16) -> int:
        return n_layers * (latent + rope) * torch.empty((), dtype=dtype).element_size()
