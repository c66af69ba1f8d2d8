"""Does this machine have what a hardware profile needs? Stop and say what is missing, or adapt the profile."""
from __future__ import annotations

from dataclasses import replace
from typing import Iterable, Sequence

from hybrid.config.schema import DEFAULT_SLP_CUTOFF, CpuSpec, GpuSpec, HwConfig, PolicyConfig
from hybrid.errors import ConfigError
from hybrid.hw.detect import Gpu, Machine

SLACK = 0.95  # memory a machine reports is a little under its nominal size (firmware, kernel, driver reserve)
NO_GPU = "no GPU present: the GPU side (attention, dense layers, shared experts) runs on the CPU"
HOW_TO_PROCEED = (
    "run without +hw to use the detected machine, pick another profile from conf/hw/, "
    "or set policy.adapt_to_hardware=true to adapt"
)


class HardwareMismatch(ConfigError):
    def __init__(self, profile: str, shortfalls: Sequence[str]) -> None:
        self.profile = profile
        self.shortfalls = list(shortfalls)
        lines = "\n".join(f"  - {s}" for s in shortfalls)
        super().__init__(f"this machine lacks what hw profile '{profile}' needs:\n{lines}\n{HOW_TO_PROCEED}")


def check(profile: HwConfig, machine: Machine) -> list[str]:
    """Every way the machine falls short of the profile, one human-readable line each; [] if it fits."""
    return [*_gpu_shortfalls(profile, machine), *_cpu_shortfalls(profile.cpu, machine)]


def resolve(hw: HwConfig, policy: PolicyConfig, machine: Machine) -> tuple[HwConfig, list[str]]:
    """The hardware config to run with, and warnings on how it was adapted to the machine."""
    if hw.name == "auto":
        return machine.as_hw_config(), []
    shortfalls = check(hw, machine)
    if not shortfalls:
        return hw, []
    if not policy.adapt_to_hardware:
        raise HardwareMismatch(hw.name, shortfalls)
    gpus, gpu_notes = _adapt_gpus(hw.gpus, machine.gpus)
    cpu, cpu_notes = _adapt_cpu(hw.cpu, machine)
    description = f"{hw.description} (adapted to {machine.summary()})".lstrip()
    notes = gpu_notes + cpu_notes
    if hw.slp_crossover_tokens is not None:  # measured on the profile's machine, not on this one
        notes.append(f"prefill: the profile's measured CPU/SLP crossover ({hw.slp_crossover_tokens} tokens) is not "
                     f"this machine's: policy.prefill.slp_cutoff_tokens defaults to {DEFAULT_SLP_CUTOFF} "
                     "(bench=prefill measures it)")
    return replace(hw, description=description, cpu=cpu, gpus=gpus, slp_crossover_tokens=None), notes


def _gpu_shortfalls(profile: HwConfig, machine: Machine) -> list[str]:
    need, have = len(profile.gpus), len(machine.gpus)
    out = []
    if have < need:
        have_text = f" ({_describe(machine.gpus)})" if have else ""
        wanted = _describe(profile.gpus)
        out.append(f"GPUs: profile '{profile.name}' needs {need} ({wanted}), this machine has {have}{have_text}")
    for i, spec, gpu in _short_gpus(profile.gpus, machine.gpus):
        out.append(
            f"GPU memory: profile '{profile.name}' needs {_gb(spec.memory_gb)} GB on GPU {i} ({spec.name}), "
            f"this machine's GPU {i} ({gpu.name}) has {_gb(gpu.memory_gb)} GB"
        )
    return out


def _cpu_shortfalls(cpu: CpuSpec, machine: Machine) -> list[str]:
    out = []
    missing = _missing_isa(cpu, machine)
    if missing:
        out.append(f"ISA: needs {', '.join(cpu.isa)}; this CPU ({machine.cpu_model}) lacks {', '.join(missing)}")
    if machine.physical_cores < cpu.cores:
        out.append(f"cores: needs {cpu.cores} physical cores, this machine has {machine.physical_cores}")
    if machine.memory_gb < cpu.memory_gb * SLACK:
        out.append(f"memory: needs {_gb(cpu.memory_gb)} GB, this machine has {_gb(machine.memory_gb)} GB")
    if machine.sockets < cpu.sockets:
        out.append(f"sockets: needs {cpu.sockets}, this machine has {machine.sockets}")
    if machine.numa_nodes < cpu.numa_nodes:
        out.append(f"NUMA: needs {cpu.numa_nodes} NUMA nodes, this machine has {machine.numa_nodes}")
    return out


def _adapt_gpus(specs: Sequence[GpuSpec], gpus: Sequence[Gpu]) -> tuple[list[GpuSpec], list[str]]:
    kept = list(specs[: len(gpus)])
    notes = []
    if specs and not gpus:
        notes.append(NO_GPU)
    elif len(gpus) < len(specs):
        notes.append(f"GPUs: {len(gpus)} of the profile's {len(specs)} present: running on {len(gpus)}")
    for i, spec, gpu in _short_gpus(specs, gpus):
        kept[i] = replace(spec, memory_gb=gpu.memory_gb)
        notes.append(
            f"GPU memory: GPU {i} ({gpu.name}) has {_gb(gpu.memory_gb)} GB, not {_gb(spec.memory_gb)}: "
            f"planning with {_gb(gpu.memory_gb)} GB"
        )
    return kept, notes


def _adapt_cpu(cpu: CpuSpec, machine: Machine) -> tuple[CpuSpec, list[str]]:
    changes, notes = {}, []
    missing = _missing_isa(cpu, machine)
    if missing:
        changes["isa"] = [f for f in cpu.isa if f in machine.isa]
        kept = ", ".join(changes["isa"]) or "none"
        notes.append(f"ISA: this CPU lacks {', '.join(missing)}; the profile's ISA is cut to {kept}")
    if machine.physical_cores < cpu.cores:
        changes["cores"] = have = machine.physical_cores
        notes.append(f"cores: {have} physical cores, not {cpu.cores}: CPU threads capped to {have}")
    if machine.memory_gb < cpu.memory_gb * SLACK:
        changes["memory_gb"] = machine.memory_gb
        have = _gb(machine.memory_gb)
        notes.append(f"memory: {have} GB, not {_gb(cpu.memory_gb)}: planning with {have} GB")
    for knob, what in (("sockets", "sockets"), ("numa_nodes", "NUMA nodes")):
        need, have = getattr(cpu, knob), getattr(machine, knob)
        if have < need:
            changes[knob] = have
            notes.append(f"{what}: {have}, not {need}: threads and memory placed on {have}")
    return replace(cpu, **changes), notes


def _short_gpus(specs: Sequence[GpuSpec], gpus: Sequence[Gpu]) -> Iterable[tuple[int, GpuSpec, Gpu]]:
    return ((i, s, g) for i, (s, g) in enumerate(zip(specs, gpus)) if g.memory_gb < s.memory_gb * SLACK)


def _missing_isa(cpu: CpuSpec, machine: Machine) -> list[str]:
    return [f for f in cpu.isa if f not in machine.isa]


def _describe(gpus: Iterable[GpuSpec | Gpu]) -> str:
    kinds = dict.fromkeys((g.name or "any GPU", g.memory_gb) for g in gpus)
    return "; ".join(f"{name}, {_gb(gb)} GB" if gb else name for name, gb in kinds)


def _gb(x: float) -> str:
    return f"{round(x, 1):g}"
