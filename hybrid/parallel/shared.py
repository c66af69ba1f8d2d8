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

from hybrid.placement.pinned import page_lock
from hybrid.placement.passes import CpuExperts, cpu_experts, move_into_arena
from hybrid.prefill.ring import expert_tensors, layout


def share_experts(model: nn.Module) -> list[torch.Tensor]:
    """Every MoE layer's routed experts (placed on the CPU kernels) copied into one shared-memory arena per layer
    and read from there from now on; returns the arenas, layer by layer (for attach_experts elsewhere)."""
    arenas = []
    for layer in cpu_experts(model):
        slot = layout(expert_tensors(layer.host_experts[0]))[1]
        arena = torch.empty(len(layer.host_experts) * slot, dtype=torch.uint8).share_memory_()
        move_into_arena(layer, arena)
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
    slot = layout(expert_tensors(layer.host_experts[0]))[1]
    if arena.dtype != torch.uint8 or arena.numel() != len(layer.host_experts) * slot:
        raise ValueError(f"MoE layer {index}: an arena of {arena.numel()} bytes for {len(layer.host_experts)} "
                         f"experts of {slot} bytes (another checkpoint?)")
    move_into_arena(layer, arena, copy=False)


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
