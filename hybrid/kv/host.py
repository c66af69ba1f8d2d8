"""The host tier of the prefix cache: published KV blocks evicted from the device pool, kept in (pinned, where the
pool is on a GPU) host memory and copied back on a hit. Room is taken in slabs as blocks arrive, up to `capacity`
blocks; when full, the least recently used block goes.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Optional

import torch

from hybrid.kv.blocks import Key
from hybrid.model.kv_cache import KVCache

SLAB_BLOCKS = 64  # host blocks allocated at a time


class HostTier:
    def __init__(self, cache: KVCache, capacity: int):
        self.cache, self.capacity = cache, capacity
        self.pin = cache.device.type == "cuda"
        self.slabs: list[list[tuple[torch.Tensor, torch.Tensor]]] = []  # per slab, per layer: (kv, pe)
        self.free: list[int] = []
        self.slot_of: OrderedDict[Key, int] = OrderedDict()  # least recently used first
        self.tokens_of: dict[int, tuple[int, ...]] = {}
        self.evictions = 0

    @property
    def used(self) -> int:
        return len(self.slot_of)

    def find(self, key: Key, tokens: tuple[int, ...]) -> Optional[int]:
        h = self.slot_of.get(key)
        if h is None or self.tokens_of[h] != tokens:
            return None
        self.slot_of.move_to_end(key)
        return h

    def put(self, blocks: list[tuple[int, Key, tuple[int, ...]]], keep: frozenset = frozenset()) -> None:
        """Copies of these device blocks (block, key, tokens), before their room is reused; `keep`: host blocks not
        to give up for them (a hit being copied back)."""
        todo = [(b, k, t) for b, k, t in blocks if k not in self.slot_of]
        room = self.capacity - len(keep)
        todo = todo[:max(0, room)]
        if not todo:
            return
        dst = [self._room(keep) for _ in todo]
        for (b, key, tokens), h in zip(todo, dst):
            self.slot_of[key], self.tokens_of[h] = h, tokens
        self._copy([b for b, _, _ in todo], dst, to_host=True)

    def get(self, hosts: list[int], blocks: list[int]) -> None:
        """Host blocks -> device pool blocks (queued on the current stream from pinned memory)."""
        self._copy(blocks, hosts, to_host=False)

    def _room(self, keep: frozenset) -> int:
        allocated = sum(kv.shape[0] for kv, _ in (slab[0] for slab in self.slabs))
        if not self.free and allocated < self.capacity:
            n = min(SLAB_BLOCKS, self.capacity - allocated)
            first = len(self.slabs) * SLAB_BLOCKS
            self.slabs.append([(self._empty(n, layer.kv), self._empty(n, layer.pe)) for layer in self.cache.layers])
            self.free = list(range(first + n - 1, first - 1, -1))
        if self.free:
            return self.free.pop()
        key = next(k for k, h in self.slot_of.items() if h not in keep)  # the least recently used
        h = self.slot_of.pop(key)
        del self.tokens_of[h]
        self.evictions += 1
        return h

    def _empty(self, n: int, like: torch.Tensor) -> torch.Tensor:
        return torch.empty((n, *like.shape[1:]), dtype=like.dtype, pin_memory=self.pin)

    def _copy(self, blocks: list[int], hosts: list[int], to_host: bool) -> None:
        by_slab: dict[int, tuple[list[int], list[int]]] = {}
        for b, h in zip(blocks, hosts):
            s = by_slab.setdefault(h // SLAB_BLOCKS, ([], []))
            s[0].append(b)
            s[1].append(h % SLAB_BLOCKS)
        dev = self.cache.device
        for s, (bs, hs) in by_slab.items():
            b_dev, h_idx = torch.tensor(bs, device=dev), torch.tensor(hs)
            for layer, (hkv, hpe) in zip(self.cache.layers, self.slabs[s]):
                for pool, host in ((layer.kv, hkv), (layer.pe, hpe)):
                    if to_host:
                        host[h_idx] = pool[b_dev].to("cpu")
                    else:
                        rows = host[h_idx]
                        pool[b_dev] = rows.pin_memory().to(dev, non_blocking=True) if self.pin else rows
