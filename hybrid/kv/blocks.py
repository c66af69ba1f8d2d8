"""Which pool block holds what: the bookkeeping of the paged KV cache (hybrid/model/kv_cache.py), no tensors.

A full block is known by its key, a hash chain over its tokens and every token before it (`keys`), so a key names a
whole prefix. Published blocks are shared: a sequence whose prompt starts with the same prefix takes them (reference
counts), and a block no sequence holds stays cached until its room is needed (least recently used first), at which
point the manager may keep a copy in the host tier. Block 0 is the zero block (kv_cache.ZERO_BLOCK): never handed
out.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional, Sequence

Key = int


def keys(tokens: Sequence[int], block_tokens: int, n_blocks: int, first: int = 0,
         parent: Optional[Key] = None) -> list[Key]:
    """The keys of blocks first..n_blocks-1 of `tokens` (parent: block first-1's key)."""
    out, key = [], parent
    for j in range(first, n_blocks):
        key = hash((key, tuple(tokens[j * block_tokens:(j + 1) * block_tokens])))
        out.append(key)
    return out


@dataclass
class Held:
    """A slot's blocks, in order, and how many of them are published (their keys known)."""
    blocks: list[int] = field(default_factory=list)
    keys: list[Key] = field(default_factory=list)  # of blocks[:len(keys)], each full and published or shared


class BlockPool:
    def __init__(self, blocks: int, block_tokens: int):
        if blocks < 2:
            raise ValueError(f"a block pool needs the zero block and at least one more, got {blocks}")
        self.block_tokens = block_tokens
        self.free: list[int] = list(range(blocks - 1, 0, -1))  # never written since the pool was made
        self.refs = [0] * blocks
        self.key_of: dict[int, Key] = {}  # published block -> its key
        self.block_of: dict[Key, int] = {}
        self.tokens_of: dict[int, tuple[int, ...]] = {}  # published block -> its tokens (a hash match is checked)
        self.idle: OrderedDict[int, None] = OrderedDict()  # published blocks no slot holds, least recent first
        self.held: dict[int, Held] = {}
        self.evictions = 0

    # -- lookups ----------------------------------------------------------------------------------------------
    def find(self, key: Key, tokens: tuple[int, ...]) -> Optional[int]:
        """The published block of this key and tokens, if cached."""
        b = self.block_of.get(key)
        return b if b is not None and self.tokens_of[b] == tokens else None

    def available(self) -> int:
        """Blocks that can be handed out now (free or cached but idle)."""
        return len(self.free) + len(self.idle)

    # -- a slot's blocks --------------------------------------------------------------------------------------
    def share(self, slot: int, block: int, key: Key) -> None:
        """Append a published block to the slot's (a prefix hit)."""
        h = self.held.setdefault(slot, Held())
        assert len(h.keys) == len(h.blocks), "shared blocks come before the slot's own"
        self.refs[block] += 1
        self.idle.pop(block, None)
        h.blocks.append(block)
        h.keys.append(key)

    def grow(self, slot: int, n: int) -> tuple[list[int], list[tuple[int, Key, tuple[int, ...]]]]:
        """Hand the slot n more blocks: (the new blocks, the published blocks their room was taken from, as
        (block, key, tokens), for the host tier to keep a copy of before they are overwritten)."""
        if n > self.available():
            raise MemoryError(f"KV pool: {n} blocks asked, {self.available()} available")
        h = self.held.setdefault(slot, Held())
        new, evicted = [], []
        for _ in range(n):
            if self.free:
                b = self.free.pop()
            else:
                b, _ = self.idle.popitem(last=False)
                evicted.append((b, self.key_of[b], self.tokens_of[b]))
                self._unpublish(b)
                self.evictions += 1
            self.refs[b] = 1
            h.blocks.append(b)
            new.append(b)
        return new, evicted

    def publish(self, slot: int, tokens: Sequence[int], full: int) -> None:
        """The slot's first `full` blocks are written through with these tokens: each not yet known gets its key,
        and is shared from now on (unless the same prefix was published by another slot meanwhile: then this one
        stays the slot's own)."""
        h = self.held.get(slot)
        if h is None:
            return
        full = min(full, len(h.blocks))
        p = self.block_tokens
        new = keys(tokens, p, full, len(h.keys), h.keys[-1] if h.keys else None)
        for j, key in enumerate(new, start=len(h.keys)):
            b = h.blocks[j]
            if key not in self.block_of and b not in self.key_of:
                self.key_of[b], self.block_of[key] = key, b
                self.tokens_of[b] = tuple(tokens[j * p:(j + 1) * p])
            h.keys.append(key)

    def release(self, slot: int) -> None:
        """The slot lets its blocks go: published ones stay cached (idle, the most recent last; of one prefix the tail
        is evicted first), the others are free."""
        h = self.held.pop(slot, None)
        if h is None:
            return
        for b in reversed(h.blocks):  # the tail first: a prefix's head goes out last
            self.refs[b] -= 1
            if self.refs[b]:
                continue
            if b in self.key_of:
                self.idle[b] = None
                self.idle.move_to_end(b)
            else:
                self.free.append(b)

    def blocks(self, slot: int) -> list[int]:
        h = self.held.get(slot)
        return h.blocks if h is not None else []

    def in_use(self) -> int:
        """Blocks some slot holds."""
        return sum(1 for r in self.refs if r)

    def cached(self) -> int:
        """Published blocks no slot holds."""
        return len(self.idle)

    def _unpublish(self, b: int) -> None:
        key = self.key_of.pop(b)
        del self.block_of[key], self.tokens_of[b]
