"""Context parallelism (CP) for prefill: the prompt split into one contiguous range of positions per rank, each rank
running every layer on its own tokens.

A query at position p sees every key at positions <= p, some of them on other ranks. MLA caches a small latent per
token (kv_lora_rank + qk_rope_head_dim values: 576 for DeepSeek-V3, against 128 heads x 320 expanded), so each
layer's new latents are all-gathered and written into every rank's cache; the attention then reads the keys up to
its own last position and the causal mask (key position <= query position) handles the split. The whole prompt's
latent cache ends up on every rank: decode reads it wherever it runs.

`ContextParallelCache` is a KVCache to the model (its `layers` hold LatentCache's interface), so the model code is
untouched: the communication comes in with the cache object.

Legend: B batch (1), S this rank's tokens, N all ranks' tokens, C latent, R rotary dims.
"""
from __future__ import annotations

from typing import Sequence

import torch

from hybrid.model.kv_cache import KVCache, LatentCache
from hybrid.parallel.group import Dist


def split(start: int, end: int, world: int) -> list[range]:
    """Positions start..end-1 in `world` contiguous ranges, the earlier ranks one longer where they do not divide
    (their queries see fewer keys)."""
    n = end - start
    if n < world:
        raise ValueError(f"a prompt of {n} tokens cannot be split over {world} ranks (one token each at least)")
    base, extra = divmod(n, world)
    out, at = [], start
    for r in range(world):
        size = base + (r < extra)
        out.append(range(at, at + size))
        at += size
    return out


class GatheredLatent:
    """One layer's cache for a context-parallel prefill (LatentCache's interface): the new latents of every rank are
    gathered and written, then the first kv_len positions are read back."""

    def __init__(self, inner: LatentCache, dist: Dist, counts: Sequence[int], pos_N: torch.Tensor):
        self.inner, self.dist, self.counts, self.pos_N = inner, dist, list(counts), pos_N

    def write_and_read(self, slots_B, pos_BS, kv_BSC, pe_BSR, kv_len: int):
        if kv_BSC.shape[0] != 1:
            raise ValueError(f"context-parallel prefill takes one sequence at a time, got {kv_BSC.shape[0]}")
        c = kv_BSC.shape[-1]
        rows_SX = torch.cat([kv_BSC[0], pe_BSR[0].to(kv_BSC.dtype)], dim=-1)  # one collective for both
        rows_NX = self.dist.all_gather_rows(rows_SX, self.counts)
        kv_NC, pe_NR = rows_NX.split([c, rows_NX.shape[-1] - c], dim=-1)
        return self.inner.write_and_read(slots_B, self.pos_N[None], kv_NC[None], pe_NR[None], kv_len)


class ContextParallelCache:
    """A KVCache as the model sees it during a context-parallel prefill of positions pos_N (every rank's, in rank
    order; counts[r] of them on rank r): each layer gathers the ranks' latents into `cache`."""

    def __init__(self, cache: KVCache, dist: Dist, counts: Sequence[int], pos_N: torch.Tensor):
        if sum(counts) != pos_N.numel():
            raise ValueError(f"{pos_N.numel()} positions, counts {list(counts)}")
        self.slots, self.max_context = cache.slots, cache.max_context
        self.layers = [GatheredLatent(layer, dist, counts, pos_N) for layer in cache.layers]
