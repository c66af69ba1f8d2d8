"""The prefill peer's two commands, as each rank runs them (hybrid/parallel/peer.py): `together`, both ranks on one
prompt, and `alone`, one device's stream-loading prefill; the `Knobs` each command carries from the engine's plan and
the ring it streams through.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import nn

from hybrid.placement.memory import auto_ring_len, free_bytes, ring_budget
from hybrid.parallel.group import Dist
from hybrid.parallel.prefill import Streaming, parallel_prefill
from hybrid.parallel.smallep import shard
from hybrid.plan.plan import PrefillPlan
from hybrid.prefill.ring import expert_tensors, layout
from hybrid.prefill.pipeline import PrefillCancelled
from hybrid.prefill.slp import StreamLoader


@dataclass(frozen=True)
class Knobs:
    """A command's prefill settings, from the engine's plan (so a replan's changes reach the peer): ring slots
    (None: as deep as the device's memory allows), experts computed together, stream-loading chunk (0: the whole
    prompt), how two ranks share the experts (policy.prefill.ep), the device memory budget
    (policy.gpu.memory_budget_gb; None: free memory less a reserve)."""
    ring_len: Optional[int] = None
    group: int = 1
    chunk_tokens: int = 0
    ep: str = "smallep"
    budget_gb: Optional[float] = None
    stream: Optional[bool] = None  # the routed experts streamed through the device; None: on a GPU (on the CPU, the
    # CPU kernels compute them in place, as the CPU engine does)

    @classmethod
    def of(cls, prefill: PrefillPlan, budget_gb: float, stream: Optional[bool] = None) -> "Knobs":
        """The knobs of the engine's plan: plan.prefill (ring_len 0: as deep as memory allows) and
        plan.gpu.memory_budget_gb (0: none)."""
        return cls(ring_len=prefill.ring_len or None, group=prefill.slp_group_experts,
                   chunk_tokens=prefill.slp_chunk_tokens, ep=prefill.ep, budget_gb=budget_gb or None, stream=stream)

    def streams(self, device: torch.device) -> bool:
        return device.type == "cuda" if self.stream is None else self.stream


def streaming(model: nn.Module, device: torch.device, loader: StreamLoader, tokens: int, knobs: Knobs,
              share: Optional[int] = None) -> Streaming:
    """The ring for a prefill of `tokens` tokens on `device`: policy.prefill.ring_len, else as deep as the memory
    left beside the activations allows, over `share` experts per layer (a rank's share; None: all of them)."""
    from hybrid.placement.passes import cpu_experts

    layer = cpu_experts(model)[0]
    slot = layout(expert_tensors(layer.host_experts[0]))[1]
    budget = ring_budget(model.args, free_bytes(device, knobs.budget_gb), loader.kept_ring_bytes(device),
                         knobs.group, tokens)
    n = share if share is not None else len(layer.host_experts)
    return Streaming(knobs.ring_len or auto_ring_len(n, slot, budget), budget, knobs.group, loader)


def chunks(start: int, end: int, size: int, least: int = 1) -> list[tuple[int, int]]:
    """start..end in pieces of `size` tokens (0: one piece), none shorter than `least` (a short tail joins the piece
    before it: a context-parallel piece needs a token per rank)."""
    if not size or end - start <= size:
        return [(start, end)]
    out = [(a, min(end, a + size)) for a in range(start, end, size)]
    if len(out) > 1 and out[-1][1] - out[-1][0] < least:
        out[-2:] = [(out[-2][0], end)]
    return out


def together(model: nn.Module, d: Dist, tokens: Sequence[int], cache, slot: int, start: int, loader: StreamLoader,
             knobs: Knobs) -> torch.Tensor:
    """This rank's side of a two-rank prefill of tokens (at positions start..) into `slot`, in stream-loading chunks:
    the last token's logits (the same on every rank)."""
    n_experts = model.args.n_routed_experts
    owned = len(shard(n_experts, d.rank, d.world))
    logits = None
    for lo, hi in chunks(start, start + len(tokens), knobs.chunk_tokens, least=d.world):
        s = streaming(model, d.device, loader, hi - lo, knobs, owned) if knobs.streams(d.device) else None
        logits = parallel_prefill(model, d, tokens[lo - start:hi - start], cache, slot, start=lo, mode=knobs.ep,
                                  streaming=s)
    return logits


def alone(model: nn.Module, device: torch.device, tokens: Sequence[int], cache, slot: int, loader: StreamLoader,
          knobs: Knobs, cancel=None) -> torch.Tensor:
    """A one-device prefill of tokens (positions 0..) into `slot`, stream-loaded (knobs.streams): the last token's
    logits. `cancel`: once set, the prefill stops at its next expert (PrefillCancelled), or before its next chunk
    where nothing streams."""
    logits = None
    for lo, hi in chunks(0, len(tokens), knobs.chunk_tokens):
        if cancel is not None and cancel.is_set():
            raise PrefillCancelled("prefill cancelled")
        if knobs.streams(device):
            s = streaming(model, device, loader, hi - lo, knobs)
            pipeline = loader.streaming(model, device, s.ring_len, s.budget_bytes, s.group, cancel=cancel)
        else:
            pipeline = contextlib.nullcontext()
        with pipeline as pipe:
            out = model(torch.tensor([list(tokens[lo:hi])], device=device), torch.arange(lo, hi, device=device)[None],
                        cache, torch.tensor([slot], device=device), last_only=True, kv_len=hi,
                        experts=pipe.experts if pipe is not None else None)
        logits = out[0, -1]
    return logits
