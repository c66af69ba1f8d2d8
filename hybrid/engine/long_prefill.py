"""Stream-loading prefill as the engine runs it: for a prompt chunk of T tokens, the ring as deep as the memory plan
leaves beside the chunk's activations (or policy.prefill.ring_len), the experts grouped as the plan says, through the
engine's StreamLoader (hybrid/prefill/slp.py). Benchmarks vary ring length, group size and FP8 GEMM per call."""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import ContextManager, Optional

import torch

from hybrid.placement.memory import auto_ring_len, free_bytes, ring_budget
from hybrid.kernels.fp8_linear import Fp8Gemm
from hybrid.model.transformer import Transformer
from hybrid.prefill.slp import StreamLoader
from hybrid.prefill.throttle import Throttle


@dataclass(frozen=True)
class LongPrefill:
    model: Transformer
    device: torch.device
    loader: StreamLoader
    slot_bytes: int
    group: int  # experts computed together (plan.prefill.slp_group_experts)
    ring_len: Optional[int] = None  # None: as deep as memory allows, per chunk
    budget_gb: Optional[float] = None  # policy.gpu.memory_budget_gb (None: the device's free memory less a reserve)

    def __call__(self, tokens: int, ring_len: Optional[int] = None, group: Optional[int] = None,
                 gemm: Optional[Fp8Gemm] = None, throttle: Optional[Throttle] = None,
                 cancel: Optional[threading.Event] = None) -> ContextManager:
        """The context in which a chunk of `tokens` tokens is prefilled with the experts streamed (the pipeline's
        `experts` go to the model call); ring_len, group and gemm replace the plan's for this call; `throttle`
        paces the copies and `cancel` stops the prefill at its next expert (a prefill beside decode)."""
        a = self.model.args
        group = self.group if group is None else group
        budget = ring_budget(a, free_bytes(self.device, self.budget_gb), self.loader.kept_ring_bytes(self.device),
                             group, tokens)
        ring_len = ring_len or self.ring_len or auto_ring_len(a.n_routed_experts, self.slot_bytes, budget)
        return self.loader.streaming(self.model, self.device, ring_len, budget, group, gemm, throttle, cancel)
