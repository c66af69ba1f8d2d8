"""The engine's one surface over the paged KV cache: which blocks each slot's positions live in, and the prefix
cache across requests.

- `admit(slot, prompt)`: a new request takes the longest cached prefix of its prompt in whole blocks (from the device
  pool, or copied back from the host tier) and is prefilled from there; at least its last token is left to prefill
  (its logits start the answer).
- `reserve(slot, end)`: blocks for positions up to `end`, before anything writes them (a prefill chunk, a decode
  step); a block's room taken from an idle cached one first keeps a copy in the host tier.
- `publish(slot, tokens, written)`: the slot's full blocks written through become shareable (after each prefill
  chunk, and at the end of a request with its generated tokens too).
- `release(slot, ...)`: at the end of a request.

The cached rows are what an earlier request computed for the same tokens at the same positions; where it cut its
prompt into other chunks, or wrote its answer's rows one decode step at a time, they can differ from a cold
prefill's in the last bits (docs/design/kv-cache.md: tests hold the greedy tokens to a cold request's).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from hybrid.kv.blocks import BlockPool, keys
from hybrid.kv.host import HostTier
from hybrid.model.kv_cache import ZERO_BLOCK, KVCache


@dataclass
class KVStats:
    queried_tokens: int = 0  # prompt tokens of admitted requests
    hit_tokens: int = 0  # of those, served from the cache
    host_hit_tokens: int = 0  # ... of which copied back from the host tier
    evictions: int = 0  # device blocks whose room was reused (kept in the host tier where it has room)
    host_evictions: int = 0
    device_blocks_in_use: int = 0
    device_blocks_cached: int = 0
    host_blocks_cached: int = 0
    device_blocks: int = 0
    host_blocks: int = 0


class KVManager:
    def __init__(self, cache: KVCache, prefix_cache: bool = True, host_blocks: int = 0):
        """prefix_cache: share full blocks between requests by prefix (off: every request starts cold, blocks still
        paged); host_blocks: the host tier's capacity in blocks (0: none)."""
        self.cache, self.prefix = cache, prefix_cache
        self.p = cache.block_tokens
        self.pool = BlockPool(cache.blocks, self.p)
        self.host = HostTier(cache, host_blocks) if prefix_cache and host_blocks else None
        self.table = torch.full_like(cache.table, ZERO_BLOCK, device="cpu")  # the host's copy
        cache.table.copy_(self.table)
        self.queried = self.hit = self.host_hit = 0

    # -- a request's life -------------------------------------------------------------------------------------
    def admit(self, slot: int, prompt: Sequence[int]) -> int:
        """The slot starts the prompt: the tokens it takes from the cache (a multiple of the block size)."""
        self.release(slot)
        self.queried += len(prompt)
        if not self.prefix:
            return 0
        usable = (len(prompt) - 1) // self.p  # whole blocks, at least one token left to prefill
        hosts = []  # the host tier's blocks, after the device pool's
        for j, key in enumerate(keys(prompt, self.p, usable)):
            tokens = tuple(prompt[j * self.p:(j + 1) * self.p])
            b = self.pool.find(key, tokens) if not hosts else None
            if b is not None:
                self.pool.share(slot, b, key)
                continue
            h = self.host.find(key, tokens) if self.host is not None else None
            if h is None:
                break
            hosts.append(h)
        if hosts:
            new = self._grow(slot, len(hosts), keep=frozenset(hosts))
            self.host.get(hosts, new)
            self.pool.publish(slot, prompt, len(self.pool.blocks(slot)))
            self.host_hit += len(hosts) * self.p
        cached = len(self.pool.blocks(slot)) * self.p
        self.hit += cached
        self._sync(slot)
        return cached

    def reserve(self, slot: int, end: int) -> None:
        """Blocks for the slot's positions < end."""
        need = (end + self.p - 1) // self.p - len(self.pool.blocks(slot))
        if need > 0:
            self.cache.zero(torch.tensor(self._grow(slot, need), device=self.cache.device))
            self._sync(slot)

    def publish(self, slot: int, tokens: Sequence[int], written: int) -> None:
        """The slot's positions < written hold these tokens' KV: its full blocks become shareable."""
        if self.prefix:
            self.pool.publish(slot, tokens, written // self.p)

    def release(self, slot: int, tokens: Sequence[int] = (), written: int = 0) -> None:
        """The slot's request ended (tokens: its prompt and output, written: the positions its KV holds)."""
        if not self.pool.blocks(slot):
            return
        self.publish(slot, tokens, written)
        self.pool.release(slot)
        self._sync(slot)

    def hold(self, slot: int) -> None:
        """Blocks for the whole slot (a probe that prefills and decodes a slot directly: benchmarks)."""
        self.release(slot)
        self.reserve(slot, self.cache.max_context)

    # -- state --------------------------------------------------------------------------------------------------
    def stats(self) -> KVStats:
        host = self.host
        return KVStats(self.queried, self.hit, self.host_hit, self.pool.evictions,
                       host.evictions if host else 0, self.pool.in_use(), self.pool.cached(),
                       host.used if host else 0, self.cache.blocks - 1, host.capacity if host else 0)

    def blocks(self, slot: int) -> list[int]:
        return list(self.pool.blocks(slot))

    def _grow(self, slot: int, n: int, keep: frozenset = frozenset()) -> list[int]:
        new, evicted = self.pool.grow(slot, n)
        if evicted and self.host is not None:
            self.host.put(evicted, keep)
        return new

    def _sync(self, slot: int) -> None:
        row = self.table[slot]
        row.fill_(ZERO_BLOCK)
        held = self.pool.blocks(slot)
        if held:
            row[:len(held)] = torch.tensor(held, dtype=row.dtype)
        self.cache.table[slot].copy_(row)


def host_blocks(gb: float, cache: KVCache) -> int:
    """Blocks of the host tier in gb gigabytes."""
    per_block = sum(layer.kv[0].nbytes + layer.pe[0].nbytes for layer in cache.layers)
    return int(gb * 1e9 // per_block) if per_block else 0
