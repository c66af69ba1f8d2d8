"""Machine detection on the machine the tests run on, and its sysfs/procfs parsing on fake trees."""
from dataclasses import FrozenInstanceError

import pytest
from omegaconf import OmegaConf

from hybrid.config.schema import HwConfig
from hybrid.hw import Machine, detect
from hybrid.hw.detect import Node, cpuinfo_model, mem_total_gb, numa_topology, parse_cpulist, topology
from hybrid.kernels.cpu_features import cpu_brand, cpu_features

IMPLIED = [  # (feature, a feature it implies)
    ("avx512f", "avx2"),
    ("avx512bw", "avx512f"),
    ("avx512vl", "avx512f"),
    ("avx512_bf16", "avx512f"),
    ("avx512_fp16", "avx512bw"),
    ("avx2", "avx"),
    ("fma", "avx"),
    ("amx_bf16", "amx_tile"),
    ("amx_int8", "amx_tile"),
]


@pytest.fixture(scope="module")
def machine() -> Machine:
    return detect()


def test_counts_are_sane(machine):
    assert 1 <= machine.physical_cores <= machine.logical_cpus
    assert 1 <= machine.sockets <= machine.physical_cores
    assert machine.numa_nodes >= 1
    assert machine.memory_gb > 0
    assert machine.cpu_model


def test_isa_is_what_cpuid_reports(machine):
    features = cpu_features()
    assert set(features) >= {"avx2", "avx512f", "avx512_bf16", "amx_bf16"}
    assert machine.isa == {name for name, present in features.items() if present}
    for feature, implied in IMPLIED:
        assert feature not in machine.isa or implied in machine.isa, f"{feature} without {implied}"


def test_wrapper_is_cached_and_copies():
    first = cpu_features()
    first["avx2"] = "tampered"
    assert cpu_features()["avx2"] in (True, False)
    assert cpu_brand() == cpu_brand()


def test_gpus_have_names_and_memory(machine):
    for gpu in machine.gpus:
        assert gpu.name and gpu.memory_gb > 0


def test_machine_is_frozen(machine):
    with pytest.raises(FrozenInstanceError):
        machine.memory_gb = 1.0


def test_as_hw_config(machine):
    hw = machine.as_hw_config()
    assert hw.name == "auto" and hw.description.startswith("detected: ")
    assert hw.cpu.isa == sorted(machine.isa)
    assert (hw.cpu.cores, hw.cpu.sockets, hw.cpu.numa_nodes) == (
        machine.physical_cores,
        machine.sockets,
        machine.numa_nodes,
    )
    assert [(g.name, g.memory_gb, g.pcie_gbps) for g in hw.gpus] == [(n, m, 0.0) for n, m in machine.gpus]
    OmegaConf.merge(OmegaConf.structured(HwConfig), OmegaConf.structured(hw))


def test_summary_is_one_line(machine):
    summary = machine.summary()
    assert "\n" not in summary and machine.cpu_model in summary


def _fake_cpu(root, cpu, package, core):
    topo = root / f"cpu{cpu}" / "topology"
    topo.mkdir(parents=True)
    (topo / "physical_package_id").write_text(f"{package}\n")
    (topo / "core_id").write_text(f"{core}\n")


def test_topology_counts_cores_not_threads(tmp_path):
    for cpu in range(8):  # 2 sockets x 2 cores x 2 threads; core ids repeat across sockets
        _fake_cpu(tmp_path, cpu, package=cpu // 4, core=cpu % 2)
    (tmp_path / "cpufreq").mkdir()
    assert topology(tmp_path) == (4, 2)


def test_topology_without_sysfs(tmp_path):
    assert topology(tmp_path / "missing") == (0, 0)


def test_meminfo_and_cpuinfo(tmp_path):
    (tmp_path / "meminfo").write_text("MemTotal:       24684084 kB\nMemFree:         1000 kB\n")
    assert mem_total_gb(tmp_path / "meminfo") == pytest.approx(25.2765, abs=1e-3)
    (tmp_path / "cpuinfo").write_text("processor\t: 0\nmodel name\t: AMD EPYC 9355 32-Core Processor\n")
    assert cpuinfo_model(tmp_path / "cpuinfo") == "AMD EPYC 9355 32-Core Processor"
    assert cpuinfo_model(tmp_path / "missing") == ""


def test_numa_nodes_their_allowed_cpus_and_memory(tmp_path):
    """Two sockets' nodes as sysfs lists them (SMT siblings after the cores), a memory-only node left out, this
    process allowed only some CPUs."""
    for node, cpus, kb in ((0, "0-3,8-11", 67108864), (1, "4-7,12-15", 33554432), (2, "", 8388608)):
        d = tmp_path / f"node{node}"
        d.mkdir()
        (d / "cpulist").write_text(f"{cpus}\n")
        (d / "meminfo").write_text(f"Node {node} MemTotal:       {kb} kB\nNode {node} MemFree:        1 kB\n")
    (tmp_path / "possible").write_text("0-2\n")
    nodes = numa_topology(tmp_path, allowed=set(range(16)) - {9})
    assert nodes == (Node(0, (0, 1, 2, 3, 8, 10, 11), 67108864 * 1024 / 1e9), Node(1, (4, 5, 6, 7, 12, 13, 14, 15),
                                                                                  33554432 * 1024 / 1e9))
    assert numa_topology(tmp_path / "missing", allowed={0}) == ()
    assert parse_cpulist("0-2,7,9-10\n") == [0, 1, 2, 7, 9, 10] and parse_cpulist("\n") == []


def test_this_machines_nodes_hold_its_allowed_cpus(machine):
    import os

    cpus = [c for node in machine.nodes for c in node.cpus]
    assert len(cpus) == len(set(cpus)) and set(cpus) <= os.sched_getaffinity(0)
    assert all(node.memory_gb >= 0 for node in machine.nodes) and len(machine.nodes) <= machine.numa_nodes
