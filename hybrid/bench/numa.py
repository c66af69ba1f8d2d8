"""NUMA in the benchmarks (docs/design/numa.md): each node's read roof from its own memory (local) and from every
other node's (remote), and the routed-expert bytes each node's threads read, against each node's local roof."""
from __future__ import annotations

from typing import Optional, Sequence

from torch import nn

from hybrid.bench.records import Record
from hybrid.kernels.membw import read_roof_node
from hybrid.plan.plan import CpuPlan

GB = 1e9


def node_roofs(cpu: CpuPlan, gigabytes: float, streams: int, passes: int = 3) -> list[Record]:
    """`node_read_roof` per (reader node, memory node): the reader's workers streaming a buffer on the memory node
    (bound there; a simulated node's memory is where its threads first touched it). None without NUMA."""
    out = []
    for reader in range(len(cpu.numa_nodes) if cpu.numa else 0):
        for memory in range(len(cpu.numa_nodes)):
            gbs, share = read_roof_node(reader, memory, gigabytes, passes, streams, bind=not cpu.numa_simulated)
            where = {"simulated": True} if cpu.numa_simulated else {"pages_on_node": share}  # a real node's share
            out.append(Record("node_read_roof", gbs, "GB/s", extra={
                "reader_node": reader, "memory_node": memory, "local": reader == memory, **where,
                "buffer_gb": gigabytes, "streams": streams}))
    return out


def local_roofs(records: Sequence[Record]) -> list[float]:
    """Each node's local read roof, from node_roofs' records."""
    local = {r.extra["reader_node"]: r.value for r in records if r.name == "node_read_roof" and r.extra["local"]}
    return [local[n] for n in sorted(local)]


def node_bytes(model: nn.Module) -> list[int]:
    """The routed-expert bytes each node's threads read in every MoE layer's last call, summed (a decode step's)."""
    from hybrid.placement.passes import cpu_experts

    out: list[int] = []
    for layer in cpu_experts(model):
        for node, b in enumerate(layer.op.node_bytes):
            out += [0] * (node + 1 - len(out))
            out[node] += b
    return out


def node_bound_s(read: Sequence[float], roofs: Sequence[float]) -> Optional[float]:
    """The time each node's bytes take at its local roof, the slowest node's: the bound of a step split by node."""
    if not roofs or len(read) != len(roofs):
        return None
    return max(b / (r * GB) for b, r in zip(read, roofs))


def node_extra(read: Sequence[float], roofs: Sequence[float], seconds: float) -> dict:
    """A record's per-node fields: each node's MB read, its share of its local roof over `seconds`, the bound."""
    out = {"node_mb": [round(b / 1e6, 4) for b in read]}
    bound = node_bound_s(read, roofs)
    if bound is not None:
        out["node_gbs_vs_local_roof"] = [round(b / seconds / GB / r, 3) for b, r in zip(read, roofs)]
        out["node_bound_ms"] = bound * 1e3
    return out
