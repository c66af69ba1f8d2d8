"""Step profiler for hybrid decode: where a step's time goes, per layer.

Hooks are attached from outside (model code is untouched): CUDA events (or host clocks on the CPU) around each
layer's attention, router, shared experts and dense MLP give device-busy time; while attached, each MoE layer's
CPU experts are wrapped in `TimedExperts`, whose host clocks give staging (copy out + the synchronisation), the CPU
MoE itself, the time the caller waited for it and the copy back.
"""
from __future__ import annotations

import time
from collections import defaultdict

import torch
from torch import nn

from hybrid.placement.passes import CpuExperts, ExpertsWrapper, swap_experts
from hybrid.model.moe import MoE
from hybrid.model.transformer import Block

HOST_PARTS = ("stage", "cpu_moe", "wait", "to_device")


class TimedExperts(ExpertsWrapper):
    """A layer's CPU experts with host clocks around the hand-off: `seconds` (HOST_PARTS) of staging, the CPU MoE
    from submission to its end, the caller's wait for it and the copy back; `experts_read`, the distinct experts
    the CPU op was given, summed over calls."""

    def __init__(self, layer: CpuExperts):
        super().__init__(layer)
        self.seconds: dict[str, float] = defaultdict(float)
        self.experts_read = 0

    def reset(self) -> None:
        self.seconds.clear()
        self.experts_read = 0

    def start(self, x_TD: torch.Tensor, weights_TK: torch.Tensor, ids_TK: torch.Tensor) -> "_TimedPending":
        t0 = time.perf_counter()
        s = self.layer.stage(x_TD, weights_TK, ids_TK)
        self.seconds["stage"] += time.perf_counter() - t0
        self.experts_read += int(s.ids_h[s.ids_h >= 0].unique().numel())
        submitted = time.perf_counter()
        return _TimedPending(self, self.layer.submit(s), submitted)


class _TimedPending:
    def __init__(self, timed: TimedExperts, pending, submitted: float):
        self.timed, self.pending, self.submitted = timed, pending, submitted

    def result(self) -> torch.Tensor:
        t0 = time.perf_counter()
        self.pending.wait()
        done = time.perf_counter()
        out = self.pending.result()
        seconds = self.timed.seconds
        seconds["wait"] += done - t0
        seconds["cpu_moe"] += done - self.submitted
        seconds["to_device"] += time.perf_counter() - done
        return out


class _Timer:
    """Elapsed device time between two points: CUDA events on a GPU, host clocks otherwise."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.pairs: dict[str, list] = defaultdict(list)
        self.open: dict[int, object] = {}

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def spans(self, name: str) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            return sum(a.elapsed_time(b) / 1e3 for a, b in self.pairs[name])
        return sum(b - a for a, b in self.pairs[name])


class StepProfile:
    """Attached on construction, detached by `close()` (hooks removed, the layers' experts put back)."""

    def __init__(self, model: nn.Module, device: torch.device):
        self.timer = _Timer(device)
        self.handles = []
        for block in (m for m in model.modules() if isinstance(m, Block)):
            self._around(block.self_attn, "attention")
            if isinstance(block.mlp, MoE):
                self._around(block.mlp.gate, "router")
                self._around(block.mlp.shared_experts, "shared_experts")
            else:
                self._around(block.mlp, "dense_mlp")
        self.layers, self._restore = swap_experts(model, TimedExperts)

    def _around(self, module: nn.Module, name: str) -> None:
        def pre(mod, args):
            self.timer.open[id(mod)] = self.timer.mark()

        def post(mod, args, out):
            self.timer.pairs[name].append((self.timer.open.pop(id(mod)), self.timer.mark()))

        self.handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]

    def reset(self) -> None:
        self.timer.pairs.clear()
        for layer in self.layers:
            layer.reset()

    def summary(self) -> dict[str, float]:
        """Seconds summed over the layers since the last reset."""
        out = {name: self.timer.spans(name) for name in list(self.timer.pairs)}
        for key in HOST_PARTS:
            out[key] = sum(layer.seconds[key] for layer in self.layers)
        out["experts_read"] = sum(layer.experts_read for layer in self.layers)
        return out

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
        self._restore()



