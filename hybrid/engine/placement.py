"""Placement passes, applied to a loaded model from outside, so the model code stays device-agnostic.

- `experts_to_cpu_kernels`: every MoE layer's routed experts run on the native fused CPU op (csrc/moe.cpp),
  whatever device the rest of the model is on. Their weights stay in host memory: they are kept out of the module
  tree, so moving the model leaves them where they are.
- `place`: the rest of the model (attention, dense layers, shared experts, router, embeddings, lm_head) moves to
  the compute device; on a GPU its FP8 weights are dequantised once to the compute dtype (`gpu_weights=dense`) or
  kept in FP8 and dequantised per use (`fp8`: half the memory).
- `pin_experts`: the routed experts' weights move into one pinned host arena per layer (fast copies to the GPU for
  stream-loading prefill); the mmap'd checkpoint pages are then no longer referenced.

Legend: T tokens, D hidden, K experts per token.
"""
from __future__ import annotations

import time
from typing import Optional

import torch
from torch import nn

from hybrid.kernels.moe import CpuMoE
from hybrid.model.layers import Linear
from hybrid.model.moe import MoE, RoutedExperts
from hybrid.engine.hot_experts import PROJ, HotExperts
from hybrid.engine.staging import Deferral, Staging, record_wait
from hybrid.prefill.ring import layout



def _cpu_op(experts: RoutedExperts, kernel: str) -> CpuMoE:
    fp8 = experts[0].gate_proj.block is not None
    weights = [[getattr(e, p).weight for e in experts] for p in PROJ]
    scales = [[getattr(e, p).weight_scale_inv for e in experts] for p in PROJ] if fp8 else [[], [], []]
    return CpuMoE(*weights, *scales, kernel=kernel)


class CpuExperts(nn.Module):
    """RoutedExperts' interface over the native CPU op. `start` hands the layer to the CPU threads and returns at
    once (the caller computes the shared experts meanwhile); the handle's `result()` joins and hands the output back
    on the caller's device."""

    def __init__(self, experts: RoutedExperts, staging: Staging, kernel: str = "auto",
                 deferral: Optional[Deferral] = None, last: bool = False):
        super().__init__()
        object.__setattr__(self, "host_experts", experts)  # not a submodule: stays in host memory
        self.kernel, self.staging, self.deferral, self.last = kernel, staging, deferral, last
        self.op = _cpu_op(experts, kernel)
        self.timings: Optional[dict] = None  # set by a profiler: seconds of stage / cpu_moe / wait / to_device
        self.experts_read = 0
        self.arena: Optional[torch.Tensor] = None  # pin_experts: every expert's weights, slot_bytes apart
        self.slot_bytes = 0
        object.__setattr__(self, "hot", None)  # HotExperts on the compute device (set by the engine; not a
        # submodule: its slots are not checkpoint weights and are allocated where they live)

    def attach_hot(self, hot: Optional[HotExperts]) -> None:
        """Experts of this layer resident on the compute device (kept out of the module tree)."""
        object.__setattr__(self, "hot", hot)

    def rebuild(self) -> None:
        """After the expert weights moved (pinning), point the native op at them."""
        self.op = _cpu_op(self.host_experts, self.kernel)

    def start(self, x_TD: torch.Tensor, weights_TK: torch.Tensor, ids_TK: torch.Tensor):
        w_TN = None
        if self.hot is not None:  # resident experts leave the CPU's ids as -1; computed below, overlapping it
            w_TN, ids_TK = self.hot.route(weights_TK, ids_TK)
        capture = self.staging.capture
        if capture is not None:  # being recorded into a CUDA graph: no synchronisation, the graph hands off
            x_h, w_h, ids_h = self.staging.to_host(x_TD, weights_TK, ids_TK, sync=False)
            out_h = self.staging.out(x_h.shape[0], fixed=True)
            handoff = capture.handoff_start(self.op, x_h, ids_h, w_h, out_h)
            return _Captured(self, handoff, out_h, x_TD, self._hot(x_TD, w_TN))
        t0 = time.perf_counter()
        x_h, w_h, ids_h = self.staging.to_host(x_TD, weights_TK, ids_TK)
        if self.timings is not None:
            self.timings["stage"] += time.perf_counter() - t0
            self.experts_read += int(ids_h[ids_h >= 0].unique().numel())
            self.submitted = time.perf_counter()
        if self.deferral is not None:
            return self.deferral.start(self, x_h, w_h, ids_h, x_TD)
        out_h = self.staging.out(x_h.shape[0])
        self.op.submit(x_h, ids_h, w_h, out_h)
        return _Pending(self, out_h, x_TD, self._hot(x_TD, w_TN))

    def _hot(self, x_TD: torch.Tensor, w_TN: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None if w_TN is None else self.hot(x_TD, w_TN)

    def join(self, out_h: torch.Tensor, like: torch.Tensor, hot_TD: Optional[torch.Tensor]) -> torch.Tensor:
        """The CPU op's output on the caller's device (plus the resident experts')."""
        if hot_TD is None:
            return self.staging.to_device(out_h, like)
        return (self.staging.to_device(out_h, hot_TD) + hot_TD).to(like.dtype)

    def forward(self, x_TD, weights_TK, ids_TK) -> torch.Tensor:
        return self.start(x_TD, weights_TK, ids_TK).result()


class _Pending:
    def __init__(self, layer: CpuExperts, out_h: torch.Tensor, like: torch.Tensor, hot_TD=None):
        self.layer, self.out_h, self.like, self.hot_TD = layer, out_h, like, hot_TD

    def result(self) -> torch.Tensor:
        t0 = time.perf_counter()
        self.layer.op.wait()
        t1 = time.perf_counter()
        out = self.layer.join(self.out_h, self.like, self.hot_TD)
        record_wait(self.layer, t0, t1)
        return out


class _Captured:
    def __init__(self, layer: CpuExperts, handoff, out_h: torch.Tensor, like: torch.Tensor, hot_TD=None):
        self.layer, self.handoff, self.out_h, self.like, self.hot_TD = layer, handoff, out_h, like, hot_TD

    def result(self) -> torch.Tensor:
        self.layer.staging.capture.handoff_end(self.handoff)
        return self.layer.join(self.out_h, self.like, self.hot_TD)


def experts_to_cpu_kernels(model: nn.Module, kernel: str = "auto", staging: Optional[Staging] = None,
                           deferred_experts: int = 0) -> int:
    """Returns the number of MoE layers placed."""
    moes = [m for m in model.modules() if isinstance(m, MoE) and isinstance(m.experts, RoutedExperts)]
    if not moes:
        return 0
    args = moes[0].gate.args
    staging = staging or Staging(args.hidden_size, args.num_experts_per_tok)
    deferral = Deferral(deferred_experts, staging) if deferred_experts else None
    for i, m in enumerate(moes):
        m.experts = CpuExperts(m.experts, staging, kernel, deferral, last=i == len(moes) - 1)
    return len(moes)


def cpu_experts(model: nn.Module) -> list[CpuExperts]:
    return [m for m in model.modules() if isinstance(m, CpuExperts)]


def place(model: nn.Module, device: torch.device, gpu_weights: str = "dense") -> int:
    """Moves everything but the routed experts to `device`; returns the bytes of weights now on it."""
    model.to(device)
    if device.type == "cuda" and gpu_weights == "dense":
        for lin in [m for m in model.modules() if isinstance(m, Linear) and m.block is not None]:
            lin.weight = nn.Parameter(lin.dense_weight(model.dtype), requires_grad=False)
            del lin.weight_scale_inv
            lin.block = None
    return sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))


def expert_tensors(expert: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """One expert's tensors in slot order: gate and up weights side by side (one GEMM can read them as one [2I, D]
    matrix), then their scales, then down's weight and scale."""
    names = ["gate_proj.weight", "up_proj.weight", "gate_proj.weight_scale_inv", "up_proj.weight_scale_inv",
             "down_proj.weight", "down_proj.weight_scale_inv"]
    out = []
    for name in names:
        proj, attr = name.split(".")
        t = getattr(getattr(expert, proj), attr, None)
        if t is not None:
            out.append((name, t))
    return out


def pin_experts(model: nn.Module, pin: bool = True) -> int:
    """Copies each layer's routed-expert weights into one arena (pinned for fast copies to a GPU), expert after
    expert in the stream-loading ring's slot layout, so one copy moves an expert; returns the arena bytes."""
    total = 0
    for layer in cpu_experts(model):
        fields, slot = layout(expert_tensors(layer.host_experts[0]))
        arena = torch.empty(len(layer.host_experts) * slot, dtype=torch.uint8, pin_memory=pin)
        for e, expert in enumerate(layer.host_experts):
            for name, t in expert_tensors(expert):
                start = e * slot + fields[name].offset
                view = arena[start:start + t.nbytes].view(t.dtype).view(t.shape)
                view.copy_(t)
                proj, attr = name.split(".")
                setattr(getattr(expert, proj), attr, nn.Parameter(view, requires_grad=False))
        layer.arena, layer.slot_bytes = arena, slot
        layer.rebuild()
        total += arena.numel()
    return total
