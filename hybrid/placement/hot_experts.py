"""Hot routed experts resident on the GPU (`policy.gpu.experts_per_layer` = N per MoE layer).

The CPU reads the weights of every routed expert a token picks. The experts picked most often can stay in GPU memory
instead, so that the CPU reads fewer bytes per token. Per MoE layer, N fixed GPU slots hold copies of the hottest
experts (weights as the checkpoint stores them: FP8 + block scales through hybrid/kernels/fp8_linear.py, or INT4's
packed words + group scales through the W4A16 GEMM, hybrid/kernels/int4_linear.py); a table on the device maps an
expert id to its slot (-1: on the CPU). In a step, every slot runs over all the layer's tokens, weighted by the
routing weight where the token picked it (0 elsewhere) — static shapes, so CUDA graphs capture it — and the CPU op
gets those picks as id -1 (skip).

Which experts are hot comes from routing counts gathered on the device as the engine runs (decayed, so the set
follows the traffic); `refresh()` (after each prefill) moves the hottest into the slots. Slot addresses never change,
so captured graphs stay valid.

Legend: T tokens, D hidden, I expert intermediate, K experts per token, N hot slots, E routed experts.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybrid.kernels import int4_linear
from hybrid.kernels.fp8_linear import DEFAULT_GEMM, Fp8Gemm, stored_linear
from hybrid.model.layers import Int4Linear
from hybrid.model.moe import RoutedExperts

PROJ = ("gate_proj", "up_proj", "down_proj")
DECAY = 0.5  # routing counts kept at each refresh


class HotExperts(nn.Module):
    def __init__(self, host_experts: RoutedExperts, n: int, device: torch.device, gemm: Fp8Gemm = DEFAULT_GEMM):
        super().__init__()
        if not 0 < n <= len(host_experts):
            raise ValueError(f"policy.gpu.experts_per_layer={n} must be between 1 and the {len(host_experts)} "
                             "routed experts of a layer")
        self._host = (host_experts,)  # in a tuple, not a submodule: they stay on the host
        self.gemm = gemm
        first = host_experts[0]
        # INT4: the group size, the packed words and group scales resident (else FP8 or BF16: block, weight, scale)
        self.int4 = first.gate_proj.group if isinstance(first.gate_proj, Int4Linear) else None
        self.block = None if self.int4 else first.gate_proj.block
        self.stored = ("weight_packed", "weight_scale") if self.int4 else ("weight", "weight_scale_inv")
        self.inputs = {p: getattr(first, p).in_features for p in PROJ}
        for p in PROJ:
            w, s = (getattr(getattr(first, p), name, None) for name in self.stored)
            self.register_buffer(f"{p}_w", torch.zeros(n, *w.shape, dtype=w.dtype, device=device))
            if s is not None:
                self.register_buffer(f"{p}_s", torch.zeros(n, *s.shape, dtype=s.dtype, device=device))
        e = len(host_experts)
        self.register_buffer("slot_of", torch.full((e,), -1, dtype=torch.long, device=device))
        self.register_buffer("counts", torch.zeros(e, dtype=torch.float32, device=device))
        self.resident: list[int] = [-1] * n  # expert id in each slot

    @property
    def host_experts(self) -> RoutedExperts:
        return self._host[0]

    @property
    def n(self) -> int:
        return len(self.resident)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers())

    def reset(self) -> None:
        """Cold again: no routing counted, no expert resident (the slot buffers stay where they are, so graphs
        captured with them stay valid)."""
        self.counts.zero_()
        self.slot_of.fill_(-1)
        self.resident = [-1] * self.n

    def observe(self, ids_TK: torch.Tensor) -> None:
        """Count the routing (on the device, no synchronisation)."""
        flat = ids_TK.flatten().to(self.counts.device)
        self.counts.index_add_(0, flat, torch.ones_like(flat, dtype=self.counts.dtype))

    def observe_counts(self, counts_E: torch.Tensor) -> None:
        """Count picks already counted per expert (stream-loading prefill counts them anyway)."""
        self.counts.add_(counts_E.to(self.counts.device))

    def _linear(self, x: torch.Tensor, proj: str, j: int) -> torch.Tensor:
        w = getattr(self, f"{proj}_w")[j]
        if self.int4:
            return int4_linear.linear(x, w, getattr(self, f"{proj}_s")[j], self.inputs[proj], self.int4, self.gemm)
        scale = getattr(self, f"{proj}_s")[j] if self.block is not None else None
        return stored_linear(x, w, scale, self.block, self.gemm)

    def route(self, weights_TK: torch.Tensor, ids_TK: torch.Tensor):
        """(each token's weight on each slot [T, N], 0 where not picked; the ids left for the CPU, resident picks
        as -1). Counts the routing too."""
        self.observe(ids_TK)
        slot_TK = self.slot_of[ids_TK]
        hit_TK = slot_TK >= 0
        w_TN = torch.zeros(ids_TK.shape[0], self.n, dtype=torch.float32, device=ids_TK.device)
        w_TN.scatter_add_(1, slot_TK.clamp(min=0), torch.where(hit_TK, weights_TK.float(), 0.0))
        return w_TN, torch.where(hit_TK, -1, ids_TK)

    def forward(self, x_TD: torch.Tensor, w_TN: torch.Tensor) -> torch.Tensor:
        """The resident experts' weighted sum [T, D] (fp32): every slot over every token."""
        y_TD = torch.zeros(x_TD.shape, dtype=torch.float32, device=x_TD.device)
        for j in range(self.n):
            h = F.silu(self._linear(x_TD, "gate_proj", j)) * self._linear(x_TD, "up_proj", j)
            y_TD += w_TN[:, j:j + 1] * self._linear(h, "down_proj", j).float()
        return y_TD

    def refresh(self) -> list[int]:
        """Move the hottest experts into the slots (those already resident stay put); returns the resident ids."""
        counts, ids = self.counts.topk(self.n)
        hottest = [e for c, e in zip(counts.tolist(), ids.tolist()) if c > 0]  # never a cold expert
        self.counts.mul_(DECAY)
        incoming = [e for e in hottest if e not in self.resident]
        free = [j for j, e in enumerate(self.resident) if e not in hottest]
        for j, e in zip(free, incoming):
            if self.resident[j] >= 0:
                self.slot_of[self.resident[j]] = -1
            expert = self.host_experts[e]
            for p in PROJ:
                lin = getattr(expert, p)
                getattr(self, f"{p}_w")[j].copy_(getattr(lin, self.stored[0]), non_blocking=True)
                if self.int4 or self.block is not None:
                    getattr(self, f"{p}_s")[j].copy_(getattr(lin, self.stored[1]), non_blocking=True)
            self.slot_of[e] = j
            self.resident[j] = e
        return list(self.resident)
