"""Routed experts on NUMA nodes (docs/design/numa.md): each MoE layer's experts split across the nodes in contiguous
runs by bytes (CpuPlan.numa_split), the CPU op told each expert's node (its tasks then run on that node's threads),
and on a machine with several nodes each expert's memory bound to its node where it lies: an arena's pages by expert
run (before the arena is page-locked), or each expert's own tensors (the checkpoint's mapped pages, weights made in
memory). Binding moves pages or places them as they are first touched (mbind); nothing is copied, so the machine
holds one copy of every expert. Where binding is refused (a container without the NUMA calls), it says so once and
the experts stay where they are."""
from __future__ import annotations

import sys
from typing import Optional, Sequence

import torch
from torch import nn

from hybrid.kernels import numa
from hybrid.placement.passes import CpuExperts, cpu_experts
from hybrid.prefill.ring import expert_tensors

_SAID: set[str] = set()  # what was said once in this process


def expert_nodes(n: int, split: Sequence[float]) -> list[int]:
    """The node of each of n experts (one layer's, of equal bytes): contiguous runs, node i's from n times the shares
    before it, rounded, so that each node holds its share of the bytes."""
    edges, acc = [0], 0.0
    for share in split:
        acc += share
        edges.append(min(n, round(n * acc)))
    edges[-1] = n
    return [node for node in range(len(split)) for _ in range(edges[node], edges[node + 1])]


def runs(nodes: Sequence[int]) -> list[tuple[int, int, int]]:
    """(node, first expert, end) of each run of experts on one node."""
    out: list[tuple[int, int, int]] = []
    for e, node in enumerate(nodes):
        if out and out[-1][0] == node and out[-1][2] == e:
            out[-1] = (node, out[-1][1], e + 1)
        else:
            out.append((node, e, e + 1))
    return out


def split(model: nn.Module, cpu) -> bool:
    """Every MoE layer on the CPU kernels told each expert's node (cpu: the plan's CpuPlan; cpu.numa_split;
    nothing where NUMA is off); whether their memory is to be bound to the nodes (the machine's own nodes, not
    simulated ones)."""
    if not cpu.numa:
        return False
    for layer in cpu_experts(model):
        layer.set_nodes(expert_nodes(len(layer.host_experts), cpu.numa_split))
    return not cpu.numa_simulated


def bind_arena(layer: CpuExperts, arena: torch.Tensor) -> int:
    """Each run of the layer's expert slots in `arena` (the ring's layout, one slot per expert) bound to its node:
    0, or the first refusal's errno."""
    slot = layer.slot_bytes or len(arena) // len(layer.host_experts)
    for node, first, end in runs(layer.nodes):
        rc = numa.bind(arena.data_ptr() + first * slot, (end - first) * slot, node)
        if rc:
            return _refused(rc)
    return 0


def bind_experts(model: nn.Module) -> int:
    """Every MoE layer's experts bound to their nodes where they lie now (moved): 0, or the first refusal's errno
    (said once; the rest is left as it is)."""
    for layer in cpu_experts(model):
        if layer.arena is not None:
            rc = bind_arena(layer, layer.arena)
        else:
            rc = next((r for e, expert in enumerate(layer.host_experts) for _, t in expert_tensors(expert)
                       if (r := numa.bind_tensor(t, layer.nodes[e]))), 0)
        if rc:
            return _refused(rc)
    return 0


def on_own_node(model: nn.Module, samples: int = 8) -> Optional[float]:
    """The share of the experts' sampled pages that lie on their expert's node (None where this machine does not
    say where pages lie)."""
    on = known = 0
    for layer in cpu_experts(model):
        for e, expert in enumerate(layer.host_experts):
            for _, t in expert_tensors(expert)[:1]:  # the gate weight: every run of pages is sampled by its experts
                where = numa.page_nodes(t.data_ptr(), t.nbytes, samples)
                on += sum(n == layer.nodes[e] for n in where)
                known += sum(n >= 0 for n in where)
    return on / known if known else None


def describe(model: nn.Module, cpu) -> str:
    """The placement's line (cpu: the plan's CpuPlan): a layer's split, and where the experts' pages are."""
    experts = " | ".join(f"node {node}: {first}-{end - 1}" for node, first, end in runs(cpu_experts(model)[0].nodes))
    line = f"routed experts: each MoE layer's split over {len(cpu.numa_nodes)} nodes by bytes ({experts})"
    if cpu.numa_simulated:
        return line + ", memory left where it is (simulated nodes)"
    share = on_own_node(model)
    return line + (f", {share:.0%} of their sampled pages on their own node" if share is not None
                   else ", their pages' nodes unknown here")


def _refused(rc: int) -> int:
    why = numa.why(rc)
    if why not in _SAID:
        _SAID.add(why)
        print(f"note: NUMA binding is not available here ({why}): the routed experts stay where their pages are; "
              "each node's threads still run its own experts", file=sys.stderr)
    return rc
