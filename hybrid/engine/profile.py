"""Step profiler for hybrid decode: where a step's time goes, per layer.

Hooks are attached from outside (model code is untouched): CUDA events (or host clocks on the CPU) around each
layer's attention, router, shared experts and dense MLP give device-busy time; the CPU expert layers report host
times for staging (copy out + the synchronisation), the CPU MoE itself and the time the caller waited for it.
"""
from __future__ import annotations

import time
from collections import defaultdict

import torch
from torch import nn

from hybrid.engine.placement import cpu_experts
from hybrid.model.moe import MoE
from hybrid.model.transformer import Block


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
        self.layers = cpu_experts(model)
        for layer in self.layers:
            layer.timings = defaultdict(float)

    def _around(self, module: nn.Module, name: str) -> None:
        def pre(mod, args):
            self.timer.open[id(mod)] = self.timer.mark()

        def post(mod, args, out):
            self.timer.pairs[name].append((self.timer.open.pop(id(mod)), self.timer.mark()))

        self.handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]

    def reset(self) -> None:
        self.timer.pairs.clear()
        for layer in self.layers:
            layer.timings.clear()
            layer.experts_read = 0

    def summary(self) -> dict[str, float]:
        """Seconds summed over the layers since the last reset."""
        out = {name: self.timer.spans(name) for name in list(self.timer.pairs)}
        for key in ("stage", "cpu_moe", "wait", "to_device"):
            out[key] = sum(layer.timings[key] for layer in self.layers)
        out["experts_read"] = sum(layer.experts_read for layer in self.layers)
        return out

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        for layer in self.layers:
            layer.timings = None



