"""Plans for tests, made as the engine makes them: through resolve, on made-up machines where a test needs one this
machine is not (a GPU's banner, knobs only a GPU resolves)."""
from __future__ import annotations

from dataclasses import replace

from omegaconf import OmegaConf

from hybrid.config.schema import GpuSpec, HwConfig, PolicyConfig
from hybrid.model.args import ModelArgs
from hybrid.plan.plan import Plan
from hybrid.plan.resolve import Probe, resolve
from hybrid.weights.presets import DEEPSEEK_V3

CPU = Probe(physical_cores=8, cpu_missing={"amx": "amx_tile", "avx512_bf16": None, "avx512": None, "avx2": None,
                                           "generic": None}, kernel_env=None, cuda=False)
GPU = replace(CPU, cuda=True, gpu_count=2, sms=132, green_contexts=True, stream_waits=True, grouped_gemm=True)
# two NUMA nodes of 32 CPUs each, without and with the GPUs (the two-socket epyc2x_5090x2 box)
NUMA2 = replace(CPU, physical_cores=64, numa_nodes=(tuple(range(32)), tuple(range(32, 64))))
NUMA2_GPU = replace(GPU, physical_cores=64, numa_nodes=NUMA2.numa_nodes)
ARGS = ModelArgs.from_hf_config(DEEPSEEK_V3)  # DeepSeek-V3's shape


def policy(knobs: dict | None = None) -> PolicyConfig:
    """The default policy with knobs (dotted path -> value)."""
    node = OmegaConf.structured(PolicyConfig)
    for path, value in (knobs or {}).items():
        OmegaConf.update(node, path, value, merge=False)
    return OmegaConf.to_object(node)


def hw(gpus: int = 0) -> HwConfig:
    return HwConfig(name="test", gpus=[GpuSpec(name="test GPU", memory_gb=80) for _ in range(gpus)])


def gpu_plan(knobs: dict | None = None, probe: Probe = GPU) -> Plan:
    """The plan on a made-up one-GPU machine (nothing is built with it: banners, resolution)."""
    return resolve(policy(knobs), hw(1), ARGS, probe)
