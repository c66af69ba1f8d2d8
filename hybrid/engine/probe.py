"""What `resolve` (hybrid/plan/resolve.py) needs to know of this machine, found out once per build: cores, NUMA
nodes, the CPU kernels' ISA variants, the GPU (its SMs, green contexts, stream waits on host memory, a grouped GEMM)."""
from __future__ import annotations

import os
from dataclasses import replace
from typing import Optional

import torch
from omegaconf import OmegaConf

from hybrid import _native
from hybrid.config.schema import HwConfig, PolicyConfig
from hybrid.hw.detect import detect
from hybrid.kernels.dispatch import ENV, VARIANTS
from hybrid.plan.plan import Plan
from hybrid.plan.resolve import Probe, resolve
from hybrid.prefill.slp import grouped_gemm_missing
from hybrid.engine.streams import green_contexts


NUMA_SIMULATED_ENV = "HYBRID_NUMA_SIMULATED"  # N: every plan's policy.cpu.numa_simulated defaults to N (test runs)


def probe(hw: HwConfig, dtype: torch.dtype = torch.bfloat16, cpu_peer: bool = False) -> Probe:
    """This machine as a plan on profile hw needs it (the CUDA checks only where a GPU computes), for a model
    computing in dtype. cpu_peer: the two-GPU mode's stand-in on the CPU (the tests')."""
    cuda = bool(hw.gpus) and torch.cuda.is_available()
    machine = detect()
    out = Probe(physical_cores=machine.physical_cores, cpu_missing={v: _missing(v) for v in VARIANTS},
                kernel_env=os.environ.get(ENV), cuda=cuda, cpu_peer=cpu_peer,
                grouped_gemm=grouped_gemm_missing(torch.device("cuda" if cuda else "cpu"), dtype) is None,
                numa_nodes=tuple(node.cpus for node in machine.nodes),
                numa_simulated=int(os.environ.get(NUMA_SIMULATED_ENV) or 0))
    if not cuda:
        return out
    device = torch.device("cuda", 0)
    from hybrid.engine.capture import stream_waits  # loads the CUDA driver's entry point

    return replace(out, gpu_count=torch.cuda.device_count(), green_contexts=green_contexts(),
                   stream_waits=stream_waits(device),
                   sms=torch.cuda.get_device_properties(device).multi_processor_count)


def _missing(variant: str):
    try:
        _native.selected_isa(variant)
    except ValueError as e:
        return str(e)
    return None


def local_plan(knobs: Optional[dict] = None, hw: Optional[HwConfig] = None, args=None) -> Plan:
    """The plan of the default policy with `knobs` (dotted policy path -> value) for a model of these args on this
    machine (hw: the profile; default, no GPU): for tools and tests that make an Engine around a model of their own."""
    node = OmegaConf.structured(PolicyConfig)
    for path, value in (knobs or {}).items():
        OmegaConf.update(node, path, value, merge=False)
    p, hw = OmegaConf.to_object(node), hw or HwConfig()
    return resolve(p, hw, args, probe(hw))
