"""Profiles from conf/hw/ checked against synthetic machines: what is reported missing, what stops, what adapts."""
import copy
from dataclasses import replace

import pytest
from omegaconf import OmegaConf

from hybrid.config import CONF_DIR, compose, to_settings
from hybrid.config.schema import HwConfig, PolicyConfig
from hybrid.hw import Gpu, HardwareMismatch, Machine, check, resolve
from hybrid.hw.check import HOW_TO_PROCEED, NO_GPU

PROFILES = ["epyc2x_5090x2", "xeon8452y_a100", "xeon8452y_4080", "h200_xeon16", "cpu_only"]
AVX512 = frozenset({"sse4_2", "avx", "fma", "f16c", "avx2", "avx512f", "avx512bw", "avx512vl", "avx512_bf16"})
AMX = frozenset({"avx512_fp16", "amx_tile", "amx_bf16", "amx_int8"})
RTX5090 = Gpu("NVIDIA GeForce RTX 5090", 31.8)
ADAPT, STRICT = PolicyConfig(adapt_to_hardware=True), PolicyConfig()

SMALL = Machine("AMD EPYC", AVX512, logical_cpus=2, physical_cores=2, sockets=1, numa_nodes=1, memory_gb=24.3)
EPYC_BOX = Machine("AMD EPYC 9355 32-Core Processor", AVX512, 128, 64, 2, 2, 1620.0, (RTX5090, RTX5090))
H200_BOX = Machine("INTEL(R) XEON(R) PLATINUM 8580", AVX512 | AMX, 16, 16, 1, 1, 134.5, (Gpu("NVIDIA H200", 140.4),))


def load(name: str) -> HwConfig:
    yaml = OmegaConf.load(CONF_DIR / "hw" / f"{name}.yaml")
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(HwConfig), yaml))


def test_profiles_exist_and_are_named_after_their_files():
    assert sorted(p.stem for p in (CONF_DIR / "hw").glob("*.yaml")) == sorted(PROFILES)
    for name in PROFILES:
        hw = load(name)
        assert hw.name == name and hw.description


@pytest.mark.parametrize("name", PROFILES)
def test_profiles_compose_through_conf(name):
    assert to_settings(compose([f"+hw={name}"])).hw == load(name)


@pytest.mark.parametrize("name, machine", [("epyc2x_5090x2", EPYC_BOX), ("h200_xeon16", H200_BOX)])
def test_profile_fits_its_own_box(name, machine):
    assert check(load(name), machine) == []


def test_zero_and_empty_mean_no_requirement():
    assert check(load("cpu_only"), SMALL) == []


def test_every_shortfall_named():
    assert check(load("epyc2x_5090x2"), SMALL) == [
        "GPUs: profile 'epyc2x_5090x2' needs 2 (NVIDIA GeForce RTX 5090, 32 GB), this machine has 0",
        "cores: needs 64 physical cores, this machine has 2",
        "memory: needs 1536 GB, this machine has 24.3 GB",
        "sockets: needs 2, this machine has 1",
        "NUMA: needs 2 NUMA nodes, this machine has 1",
    ]


def test_isa_shortfall():
    assert check(load("xeon8452y_a100"), EPYC_BOX)[1] == (
        "ISA: needs avx2, fma, avx512f, avx512bw, avx512vl, avx512_bf16, amx_tile, amx_bf16, amx_int8; "
        "this CPU (AMD EPYC 9355 32-Core Processor) lacks amx_tile, amx_bf16, amx_int8"
    )


def test_fewer_gpus():
    one = replace(EPYC_BOX, gpus=(RTX5090,))
    assert check(load("epyc2x_5090x2"), one) == [
        "GPUs: profile 'epyc2x_5090x2' needs 2 (NVIDIA GeForce RTX 5090, 32 GB), "
        "this machine has 1 (NVIDIA GeForce RTX 5090, 31.8 GB)"
    ]


def test_gpu_memory_with_slack():
    xeon = replace(H200_BOX, physical_cores=72, sockets=2, numa_nodes=2, memory_gb=1080.0)
    a100 = load("xeon8452y_a100")
    assert check(a100, replace(xeon, gpus=(Gpu("NVIDIA A100-PCIE-40GB", 38.1),))) == []
    assert check(a100, replace(xeon, gpus=(Gpu("NVIDIA GeForce RTX 4080", 15.99),))) == [
        "GPU memory: profile 'xeon8452y_a100' needs 40 GB on GPU 0 (NVIDIA A100-PCIE-40GB), "
        "this machine's GPU 0 (NVIDIA GeForce RTX 4080) has 16 GB"
    ]


def test_auto_is_the_detected_machine():
    assert resolve(HwConfig(), STRICT, SMALL) == (SMALL.as_hw_config(), [])


def test_fitting_profile_is_kept():
    hw = load("h200_xeon16")
    assert resolve(hw, STRICT, H200_BOX) == (hw, [])


def test_mismatch_stops_and_lists_everything():
    hw = load("xeon8452y_4080")
    with pytest.raises(HardwareMismatch) as err:
        resolve(hw, STRICT, SMALL)
    message = str(err.value)
    assert "'xeon8452y_4080'" in message.splitlines()[0]
    assert err.value.shortfalls == check(hw, SMALL) and len(err.value.shortfalls) == 6
    assert all(f"  - {s}" in message.splitlines() for s in err.value.shortfalls)
    assert message.endswith(HOW_TO_PROCEED) and "policy.adapt_to_hardware=true" in HOW_TO_PROCEED


def test_adapt_without_gpu():
    hw = load("epyc2x_5090x2")
    original = copy.deepcopy(hw)
    adapted, warnings = resolve(hw, ADAPT, SMALL)
    assert hw == original
    assert adapted.gpus == [] and warnings[0] == NO_GPU
    assert (adapted.cpu.cores, adapted.cpu.memory_gb, adapted.cpu.sockets, adapted.cpu.numa_nodes) == (2, 24.3, 1, 1)
    assert adapted.cpu.isa == hw.cpu.isa and adapted.cpu.mem_bw_gbps == hw.cpu.mem_bw_gbps
    assert "cores: 2 physical cores, not 64: CPU threads capped to 2" in warnings
    assert "memory: 24.3 GB, not 1536: planning with 24.3 GB" in warnings


def test_adapt_isa_and_gpu_count():
    hw = load("xeon8452y_a100")
    adapted, warnings = resolve(replace(hw, gpus=hw.gpus * 2), ADAPT, replace(EPYC_BOX, gpus=(RTX5090,)))
    assert adapted.gpus == [replace(hw.gpus[0], memory_gb=31.8)]
    assert adapted.cpu.isa == ["avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16"]
    assert warnings == [
        "GPUs: 1 of the profile's 2 present: running on 1",
        "GPU memory: GPU 0 (NVIDIA GeForce RTX 5090) has 31.8 GB, not 40: planning with 31.8 GB",
        "ISA: this CPU lacks amx_tile, amx_bf16, amx_int8; "
        "the profile's ISA is cut to avx2, fma, avx512f, avx512bw, avx512vl, avx512_bf16",
        "cores: 64 physical cores, not 72: CPU threads capped to 64",
    ]


def test_a_measured_crossover_holds_only_on_its_machine():
    hw = load("h200_xeon16")
    assert hw.slp_crossover_tokens == 512
    kept, warnings = resolve(hw, ADAPT, H200_BOX)  # its own box: nothing adapted, the measurement stands
    assert kept is hw and warnings == []
    adapted, warnings = resolve(hw, ADAPT, SMALL)
    assert adapted.slp_crossover_tokens is None and hw.slp_crossover_tokens == 512
    assert any("crossover (512 tokens) is not this machine's" in w for w in warnings)


@pytest.mark.parametrize("name", PROFILES)
@pytest.mark.parametrize("machine", [SMALL, EPYC_BOX, H200_BOX], ids=["small", "epyc", "h200"])
def test_adapted_profile_fits_and_validates(name, machine):
    adapted, _ = resolve(load(name), ADAPT, machine)
    assert check(adapted, machine) == []
    assert OmegaConf.to_object(OmegaConf.structured(adapted)) == adapted
