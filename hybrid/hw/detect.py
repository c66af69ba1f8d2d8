"""What this machine has: CPU, ISA, cores, NUMA nodes, memory, GPUs."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from hybrid.config.schema import CpuSpec, GpuSpec, HwConfig
from hybrid.kernels.cpu_features import cpu_brand, cpu_features

SYS_CPU = Path("/sys/devices/system/cpu")
SYS_NODE = Path("/sys/devices/system/node")
PROC = Path("/proc")


class Gpu(NamedTuple):
    name: str
    memory_gb: float  # GiB, as cards are sized (an H200 reads 140.4, a 32 GB RTX 5090 31.8)


class Node(NamedTuple):
    """A NUMA node as this process sees it."""
    id: int
    cpus: tuple[int, ...]  # the node's CPUs this process may run on, ascending
    memory_gb: float  # its MemTotal in GB of 1e9 bytes


@dataclass(frozen=True)
class Machine:
    cpu_model: str
    isa: frozenset[str]
    logical_cpus: int
    physical_cores: int
    sockets: int
    numa_nodes: int
    memory_gb: float  # MemTotal in GB of 1e9 bytes
    gpus: tuple[Gpu, ...] = ()
    nodes: tuple[Node, ...] = ()  # the NUMA nodes with CPUs this process may run on (sysfs; none where it has no nodes)

    def summary(self) -> str:
        gpus = ", ".join(f"{g.name} {g.memory_gb:.1f} GB" for g in self.gpus) or "no GPU"
        return (
            f"{self.cpu_model}: {self.physical_cores} cores ({self.logical_cpus} threads), "
            f"{self.sockets} socket(s), {self.numa_nodes} NUMA node(s), {self.memory_gb:.1f} GB RAM; {gpus}"
        )

    def as_hw_config(self) -> HwConfig:
        cpu = CpuSpec(
            model=self.cpu_model,
            isa=sorted(self.isa),
            sockets=self.sockets,
            cores=self.physical_cores,
            numa_nodes=self.numa_nodes,
            memory_gb=self.memory_gb,
        )
        gpus = [GpuSpec(name=g.name, memory_gb=g.memory_gb, pcie_gbps=0.0) for g in self.gpus]
        return HwConfig(name="auto", description=f"detected: {self.summary()}", cpu=cpu, gpus=gpus)


def detect() -> Machine:
    logical = os.cpu_count() or 1
    cores, sockets = topology(SYS_CPU)
    return Machine(
        cpu_model=cpu_brand() or cpuinfo_model(PROC / "cpuinfo") or "unknown CPU",
        isa=frozenset(name for name, present in cpu_features().items() if present),
        logical_cpus=logical,
        physical_cores=cores or logical,
        sockets=sockets or 1,
        numa_nodes=max(1, len(list(SYS_NODE.glob("node[0-9]*")))),
        memory_gb=mem_total_gb(PROC / "meminfo"),
        gpus=cuda_gpus(),
        nodes=numa_topology(SYS_NODE, os.sched_getaffinity(0)),
    )


def topology(sys_cpu: Path) -> tuple[int, int]:
    """(physical cores, sockets) from sysfs; (0, 0) where sysfs has no topology."""
    cores = set()
    for topo in sys_cpu.glob("cpu[0-9]*/topology"):
        try:
            package = (topo / "physical_package_id").read_text().strip()
            cores.add((package, (topo / "core_id").read_text().strip()))
        except OSError:
            continue
    return len(cores), len({package for package, _ in cores})


def numa_topology(sys_node: Path, allowed: set[int]) -> tuple[Node, ...]:
    """Each NUMA node's CPUs (of `allowed`) and memory, from sysfs; nodes without an allowed CPU are left out (a
    memory-only node, one outside this process's cpuset)."""
    nodes = []
    for d in sorted(sys_node.glob("node[0-9]*"), key=lambda d: int(d.name[4:])):
        try:
            cpus = tuple(c for c in parse_cpulist((d / "cpulist").read_text()) if c in allowed)
            memory = meminfo_bytes(f"Node {d.name[4:]} MemTotal", d / "meminfo") / 1e9
        except (OSError, RuntimeError, ValueError):
            continue
        if cpus:
            nodes.append(Node(int(d.name[4:]), cpus, memory))
    return tuple(nodes)


def parse_cpulist(text: str) -> list[int]:
    """sysfs's CPU list form, "0-3,8,10-11", as CPU numbers."""
    out = []
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            out += range(int(lo), int(hi or lo) + 1)
    return out


def cpuinfo_model(path: Path) -> str:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return ""
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "")


def meminfo_bytes(key: str, path: Path = PROC / "meminfo") -> int:
    """A /proc/meminfo field (MemTotal, MemAvailable, ...) in bytes."""
    for line in path.read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line[len(key) + 1:].split()[0]) * 1024
    raise RuntimeError(f"no {key} in {path}")


def mem_total_gb(path: Path) -> float:
    return meminfo_bytes("MemTotal", path) / 1e9


def cuda_gpus() -> tuple[Gpu, ...]:
    try:
        import torch
    except ImportError:
        return ()
    if not torch.cuda.is_available():
        return ()
    props = (torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count()))
    return tuple(Gpu(p.name, p.total_memory / 2**30) for p in props)
