"""One copy of the routed experts' host weights for every process of a multi-device prefill.

The process that loads the model moves each MoE layer's routed experts into one arena in shared memory
(`share_experts`), expert after expert in the stream-loading ring's slot layout (as placement's pin_experts lays
them out, so one copy moves an expert). The other processes receive the arenas — torch.multiprocessing passes a
shared tensor by handle, nothing is copied — and point their own experts at them (`attach_experts`). On a GPU each
process then page-locks the arenas in place (`pin_shared`: cudaHostRegister), so its ring's copies run at the
pinned host-to-device rate (H200 host: 55 GB/s pinned against 7 GB/s pageable) from the one copy in DRAM.
"""
from __future__ import annotations

import torch
from torch import nn

from hybrid.engine.pinned import page_lock, trim_heap
from hybrid.engine.placement import CpuExperts, cpu_experts
from hybrid.prefill.ring import expert_tensors, layout


def share_experts(model: nn.Module) -> list[torch.Tensor]:
    """Every MoE layer's routed experts (placed on the CPU kernels) copied into one shared-memory arena per layer
    and read from there from now on; returns the arenas, layer by layer (for attach_experts elsewhere)."""
    arenas = []
    for i, layer in enumerate(cpu_experts(model)):
        fields, slot = layout(expert_tensors(layer.host_experts[0]))
        arena = torch.empty(len(layer.host_experts) * slot, dtype=torch.uint8).share_memory_()
        for e, expert in enumerate(layer.host_experts):
            for name, t in expert_tensors(expert):
                _view(arena, e * slot + fields[name].offset, t).copy_(t)
        _attach(layer, arena, i)
        trim_heap()  # the layer's old copies, freed: their pages to the next layer's arena
        arenas.append(arena)
    return arenas


def attach_experts(model: nn.Module, arenas: list[torch.Tensor]) -> None:
    """Every MoE layer's routed experts (placed on the CPU kernels) pointed at `arenas` (share_experts' of the same
    checkpoint): views, no copy."""
    layers = cpu_experts(model)
    if len(layers) != len(arenas):
        raise ValueError(f"{len(arenas)} expert arenas for {len(layers)} MoE layers on the CPU kernels")
    for i, (layer, arena) in enumerate(zip(layers, arenas)):
        _attach(layer, arena, i)


def _attach(layer: CpuExperts, arena: torch.Tensor, index: int) -> None:
    fields, slot = layout(expert_tensors(layer.host_experts[0]))
    if arena.dtype != torch.uint8 or arena.numel() != len(layer.host_experts) * slot:
        raise ValueError(f"MoE layer {index}: an arena of {arena.numel()} bytes for {len(layer.host_experts)} "
                         f"experts of {slot} bytes (another checkpoint?)")
    for e, expert in enumerate(layer.host_experts):
        for name, t in expert_tensors(expert):
            proj, attr = name.split(".")
            view = _view(arena, e * slot + fields[name].offset, t)
            setattr(getattr(expert, proj), attr, nn.Parameter(view, requires_grad=False))
    layer.arena, layer.slot_bytes = arena, slot
    layer.rebuild()


def _view(arena: torch.Tensor, start: int, like: torch.Tensor) -> torch.Tensor:
    return arena[start:start + like.nbytes].view(like.dtype).view(like.shape)


def pin_shared(arenas: list[torch.Tensor]) -> None:
    """The arenas page-locked in place for this process's GPU copies (cudaHostRegister; no copy); those this process
    has already locked are left as they are."""
    for arena in arenas:
        if arena.is_pinned():
            continue
        err = page_lock(arena)
        if err:
            raise RuntimeError(f"cudaHostRegister of a {arena.numel() / 1e9:.2f} GB expert arena failed: cudaError "
                               f"{err} (is the locked-memory limit, ulimit -l, high enough?)")
