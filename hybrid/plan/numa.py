"""policy.cpu.numa resolved (for resolve.py): the NUMA nodes the CPU work runs on, each node's threads and its share
of every MoE layer's routed-expert bytes (docs/design/numa.md)."""
from __future__ import annotations

from typing import NamedTuple, Sequence

from hybrid.config.schema import CpuPolicy
from hybrid.errors import ConfigError

class Numa(NamedTuple):
    on: bool = False
    simulated: int = 0  # N: the nodes are N groups of this machine's CPUs, memory left where it is
    nodes: tuple[tuple[int, ...], ...] = ()  # per node, the CPUs its threads are pinned to
    threads: tuple[int, ...] = ()  # per node, its threads
    split: tuple[float, ...] = ()  # per node, its share of each MoE layer's expert bytes


def resolve_numa(c: CpuPolicy, machine_nodes: Sequence[Sequence[int]], cpus: int, threads: int) -> Numa:
    """cpu.numa on the machine whose NUMA nodes have these CPUs (the probe's; none: one node of `cpus` CPUs; the
    profile's hw.cpu.numa_nodes was checked against it, hybrid/hw/check.py): null = on where it has more than one
    node; cpu.numa_simulated = N: its CPUs in N groups."""
    if c.numa_simulated:
        if c.numa is False:
            raise ConfigError(f"policy.cpu.numa_simulated={c.numa_simulated} contradicts policy.cpu.numa=false")
        every = [cpu for node in machine_nodes for cpu in node] or list(range(cpus))
        n = c.numa_simulated
        if n > len(every):
            raise ConfigError(f"policy.cpu.numa_simulated={n}: this machine has {len(every)} CPU(s) to group")
        nodes = tuple(tuple(every[g * len(every) // n:(g + 1) * len(every) // n]) for g in range(n))
    else:
        many = len(machine_nodes) > 1
        if c.numa and not many:
            raise ConfigError(f"policy.cpu.numa=true needs more than one NUMA node: this machine has 1 (with CPUs "
                              "this process may use); policy.cpu.numa_simulated=2 runs the same paths on two groups of "
                              "its CPUs")
        if c.numa is False or not many:
            return Numa()
        nodes = tuple(tuple(node) for node in machine_nodes)
    return Numa(True, c.numa_simulated, nodes, split_threads(threads, nodes), shares(c.numa_split, len(nodes)))


def split_threads(threads: int, nodes: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """`threads` over the nodes in proportion to their CPUs (largest remainders), at least one each."""
    if threads < len(nodes):
        raise ConfigError(f"policy.cpu.threads={threads} under policy.cpu.numa: at least one per node "
                          f"({len(nodes)} nodes)")
    total = sum(len(n) for n in nodes)
    exact = [threads * len(n) / total for n in nodes]
    out = [max(1, int(x)) for x in exact]
    for i in sorted(range(len(nodes)), key=lambda i: int(exact[i]) - exact[i]):  # largest remainder first
        if sum(out) >= threads:
            break
        out[i] += 1
    while sum(out) > threads:  # the minimum of one took a thread from a larger node
        out[out.index(max(out))] -= 1
    return tuple(out)


def shares(split, n: int) -> tuple[float, ...]:
    """cpu.numa_split normalised to sum to 1, one share per node; null: equal shares."""
    if split is None:
        return tuple(1 / n for _ in range(n))
    if len(split) != n:
        raise ConfigError(f"policy.cpu.numa_split has {len(split)} share(s) for {n} NUMA nodes")
    return tuple(s / sum(split) for s in split)
