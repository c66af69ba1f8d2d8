"""One prompt prefilled over `dist.world` processes, one per device: context-parallel attention (cp.py), the routed
experts shared out by SmallEP or EP (smallep.py), each rank's share streamed through its device (`Streaming`) or
computed by the plain torch experts.

Every rank calls `parallel_prefill` with the same prompt and gets the same logits back; each rank's KV cache then
holds the prompt's latents, so decode may run on any of them.

    logits = parallel_prefill(model, dist, prompt, cache, slot, mode="smallep", streaming=Streaming(ring_len, budget))
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import nn

from hybrid.model.kv_cache import KVCache
from hybrid.parallel.cp import ContextParallelCache, split
from hybrid.parallel.group import Dist
from hybrid.parallel.smallep import PhaseClock, owned_streaming, sharded_moe
from hybrid.prefill.slp import StreamLoader


@dataclass(frozen=True)
class Streaming:
    """Each rank's share of the routed experts streamed through its device: the ring's slots and memory budget,
    experts computed together, the loader that keeps the ring between prefills (None: a new one)."""
    ring_len: int
    budget_bytes: float
    group: int = 1
    loader: Optional[StreamLoader] = None


def parallel_prefill(model: nn.Module, dist: Dist, tokens: Sequence[int], cache: KVCache, slot: int,
                     start: int = 0, mode: str = "smallep", streaming: Optional[Streaming] = None,
                     last_only: bool = True, clock: Optional[PhaseClock] = None) -> torch.Tensor:
    """`tokens` at positions start.. into KV slot `slot` of every rank's `cache` (positions before `start` already
    there, on every rank: an earlier parallel_prefill of the same prompt). Returns the last token's logits [V]
    (`last_only`), or every token's [n, V], the same on every rank."""
    end = start + len(tokens)
    ranges = split(start, end, dist.world)
    counts = [len(r) for r in ranges]
    mine = ranges[dist.rank]
    dev = dist.device
    offset = mine.start - start
    tokens_BS = torch.tensor([list(tokens[offset:offset + len(mine)])], device=dev)
    pos_BS = torch.arange(mine.start, mine.stop, device=dev)[None]
    cp_cache = ContextParallelCache(cache, dist, counts, torch.arange(start, end, device=dev))
    with sharded_moe(model, dist, mode, counts, clock) as wrappers:
        with _streamed(wrappers, dev, streaming):
            logits_BSV = model(tokens_BS, pos_BS, cp_cache, torch.tensor([slot], device=dev), last_only=last_only,
                               kv_len=mine.stop)
    if last_only:
        return dist.broadcast(logits_BSV[0, -1], src=dist.world - 1)  # the last rank holds the last token
    return dist.all_gather_rows(logits_BSV[0], counts)


def _streamed(wrappers, device: torch.device, streaming: Optional[Streaming]):
    if streaming is None:
        return contextlib.nullcontext()
    s = streaming
    return owned_streaming(wrappers, device, s.ring_len, s.budget_bytes, s.group, s.loader)
