"""resolve: the one place a `null` knob is decided and knobs are checked against each other. Every hardware profile
with the default policy resolves to a fully concrete plan, on a machine with its GPUs and on one without."""
from __future__ import annotations

from dataclasses import fields, is_dataclass, replace

import pytest

from hybrid.config.compose import CONF_DIR, compose, to_settings
from hybrid.config.schema import PolicyConfig
from hybrid.errors import ConfigError
from hybrid.plan.resolve import AUTO_GROUP, AUTO_SMS_LEFT, resolve, resolve_memory
from tests import plans
from tests.plans import ARGS, CPU, GPU, NUMA2, NUMA2_GPU, hw as _hw

PROFILES = sorted(p.stem for p in (CONF_DIR / "hw").glob("*.yaml"))


def policy(**knobs) -> PolicyConfig:
    return plans.policy({path.replace("__", "."): value for path, value in knobs.items()})


def nulls(obj, prefix: str = "") -> list[str]:
    out = []
    for f in fields(obj):
        v = getattr(obj, f.name)
        out += nulls(v, f"{prefix}{f.name}.") if is_dataclass(v) else [prefix + f.name] if v is None else []
    return out


@pytest.mark.parametrize("probe", [CPU, GPU], ids=["cpu", "gpu"])
@pytest.mark.parametrize("hw", PROFILES)
def test_every_profile_resolves_to_a_concrete_plan(hw, probe):
    s = to_settings(compose([f"+hw={hw}"]))
    plan = resolve(s.policy, s.hw, ARGS, probe)
    plan = resolve_memory(plan, ARGS, budget=60e9, weights=12e9, kv_cache=4e9, hot_experts=0, slot=44 << 20)
    assert nulls(plan) == [], hw
    assert plan.cuda == bool(s.hw.gpus and probe.cuda)
    assert plan.cpu.threads == (s.hw.cpu.cores or probe.physical_cores)
    assert plan.prefill.slp == plan.cuda and (plan.prefill.slp_chunk_tokens > 0) == plan.prefill.slp
    assert plan.decode.cuda_graphs == ("hostfn" if plan.cuda else "off")
    assert plan.decode.dual_batch == plan.decode.dual_stagger == plan.cuda
    assert plan.prefill.gpus == (min(2, len(s.hw.gpus)) if plan.cuda else 1)
    assert "policy" not in plan.describe() and plan.params()["ledger.free"] == plan.ledger.free


def test_the_cpu_kernel_is_the_best_this_cpu_runs_unless_asked():
    assert resolve(policy(), _hw(), ARGS, CPU).cpu.kernel == "avx512_bf16"
    assert resolve(policy(cpu__kernel="avx2"), _hw(), ARGS, CPU).cpu.kernel == "avx2"
    assert resolve(policy(), _hw(), ARGS, replace(CPU, kernel_env="generic")).cpu.kernel == "generic"
    with pytest.raises(ConfigError, match=r"policy.cpu.kernel=amx: this CPU lacks amx_tile"):
        resolve(policy(cpu__kernel="amx"), _hw(), ARGS, CPU)
    with pytest.raises(ConfigError, match=r"HYBRID_CPU_KERNEL='sse'"):
        resolve(policy(), _hw(), ARGS, replace(CPU, kernel_env="sse"))


def test_tile_and_amx_thresholds_follow_the_kernel_and_batch_invariance():
    plan = resolve(policy(), _hw(), ARGS, CPU)
    assert (plan.cpu.gemm_tile_tokens, plan.cpu.amx_min_tokens) == (16, 4)
    inv = resolve(policy(decode__batch_invariant=True), _hw(), ARGS, CPU)
    assert (inv.cpu.gemm_tile_tokens, inv.cpu.amx_min_tokens, inv.cpu.batch_invariant) == (64, 1, True)
    assert resolve(policy(cpu__kernel="avx2"), _hw(), ARGS, CPU).cpu.gemm_tile_tokens == 64
    with pytest.raises(ConfigError, match=r"amx_min_tokens=4 contradicts policy.decode.batch_invariant"):
        resolve(policy(decode__batch_invariant=True, cpu__amx_min_tokens=4), _hw(), ARGS, CPU)


@pytest.mark.parametrize("knobs, match", [
    ({"decode.batch_cap": 9}, r"batch_cap \(9\) exceeds policy.kv.max_batch \(8\)"),
    ({"cpu.deferred_experts": 2, "cpu.moe_backend": "torch"}, r"deferred_experts needs policy.cpu.moe_backend"),
    ({"gpu.experts_per_layer": 2}, r"experts_per_layer > 0 keeps hot experts on the GPU"),
])
def test_contradicting_knobs_are_named(knobs, match):
    with pytest.raises(ConfigError, match=match):
        resolve(policy(**{k.replace(".", "__"): v for k, v in knobs.items()}), _hw(), ARGS, CPU)


def test_prefill_gpus_and_the_peer():
    two = _hw(gpus=2)
    assert resolve(policy(), two, ARGS, GPU).prefill.gpus == 2
    one_seen = resolve(policy(), two, ARGS, replace(GPU, gpu_count=1))
    assert one_seen.prefill.gpus == 1 and "torch sees 1" in one_seen.notes[0]
    with pytest.raises(ConfigError, match=r"gpus=2 needs a peer process on a second GPU"):
        resolve(policy(prefill__gpus=2), two, ARGS, replace(GPU, gpu_count=1))
    with pytest.raises(ConfigError, match=r"gpus=2 but the hw profile has 1"):
        resolve(policy(prefill__gpus=2), _hw(gpus=1), ARGS, GPU)
    assert resolve(policy(), _hw(), ARGS, replace(CPU, cpu_peer=True)).prefill.gpus == 2


def test_sms_left_to_decode_beside_a_prefill():
    beside = policy(prefill__beside_decode=True)
    plan = resolve(beside, _hw(gpus=1), ARGS, GPU)
    assert plan.prefill.beside_sms == AUTO_SMS_LEFT and plan.prefill_sms == 132 - AUTO_SMS_LEFT
    no_green = resolve(beside, _hw(gpus=1), ARGS, replace(GPU, green_contexts=False))
    assert no_green.prefill.beside_sms == 0 and no_green.prefill_sms is None
    with pytest.raises(ConfigError, match="green context"):
        resolve(policy(prefill__beside_decode=True, prefill__beside_sms=8), _hw(gpus=1), ARGS,
                replace(GPU, green_contexts=False))
    with pytest.raises(ConfigError, match="leaves the prefill no SM"):
        resolve(policy(prefill__beside_decode=True, prefill__beside_sms=132), _hw(gpus=1), ARGS, GPU)


def test_graphs_and_their_join():
    gpu = _hw(gpus=1)
    assert resolve(policy(), gpu, ARGS, replace(GPU, stream_waits=False)).decode.cpu_join == "host"
    eager = resolve(policy(cpu__moe_backend="torch"), gpu, ARGS, GPU)
    assert eager.decode.cuda_graphs == "off" and not eager.decode.dual_batch and "eagerly" in eager.notes[0]
    seg = resolve(policy(decode__cuda_graphs="segments"), gpu, ARGS, GPU).decode
    assert (seg.dual_batch, seg.dual_stagger, seg.cpu_join) == (False, False, "host")
    with pytest.raises(ConfigError, match="cpu_join=signal needs CUDA stream memory operations"):
        resolve(policy(decode__cpu_join="signal"), gpu, ARGS, replace(GPU, stream_waits=False))


def test_experts_go_in_groups_where_a_grouped_gemm_applies():
    gpu = _hw(gpus=1)
    assert resolve(policy(), gpu, ARGS, GPU).prefill.slp_group_experts == AUTO_GROUP > 1
    assert resolve(policy(), gpu, ARGS, replace(GPU, grouped_gemm=False)).prefill.slp_group_experts == 1
    asked = policy(prefill__slp_group_experts=5)  # kept, warned of at the first prefill where none applies
    assert resolve(asked, gpu, ARGS, replace(GPU, grouped_gemm=False)).prefill.slp_group_experts == 5
    assert resolve(policy(), _hw(), ARGS, CPU).prefill.slp_group_experts == 1  # nothing streams on the CPU


def test_memory_decides_the_chunk_unless_set():
    gpu = _hw(gpus=1)
    plan = resolve_memory(resolve(policy(), gpu, ARGS, GPU), ARGS, 60e9, 12e9, 4e9, 0, 44 << 20)
    assert plan.ledger.group_buffer > 0 and plan.ledger.free == 60e9 - 4e9 - plan.ledger.group_buffer
    set_ = resolve_memory(resolve(policy(prefill__slp_chunk_tokens=4096), gpu, ARGS, GPU), ARGS, 60e9, 12e9, 4e9,
                          0, 44 << 20)
    assert set_.prefill.slp_chunk_tokens == 4096 and plan.prefill.slp_chunk_tokens % 256 == 0
    with pytest.raises(ConfigError, match="no room for stream-loading prefill"):
        resolve_memory(resolve(policy(), gpu, ARGS, GPU), ARGS, 5e9, 1e9, 4e9, 0, 44 << 20)


def test_the_kv_blocks_and_the_host_tier():
    plan = resolve(policy(kv__max_context=200), _hw(), ARGS, CPU)
    assert plan.kv.block_tokens == 200 and plan.kv.prefix_cache and plan.kv.host_cache_gb == 0.0
    auto = resolve_memory(resolve(policy(), _hw(), ARGS, CPU), ARGS, 60e9, 12e9, 4e9, 0, 0, host_cache_gb=None,
                          host_free=37.04e9)
    assert auto.kv.block_tokens == 256 and auto.kv.host_cache_gb == 37.0  # what the host has left
    assert "host tier 37.0 GB" in auto.describe()
    set_ = resolve_memory(resolve(policy(kv__host_cache_gb=5.0), _hw(), ARGS, CPU), ARGS, 60e9, 12e9, 4e9, 0, 0,
                          host_cache_gb=5.0, host_free=37e9)
    assert set_.kv.host_cache_gb == 5.0
    off = resolve(policy(kv__prefix_cache=False, kv__host_cache_gb=5.0), _hw(), ARGS, CPU)
    assert off.kv.host_cache_gb == 0.0 and "prefix cache off" in off.describe()
    with pytest.raises(ConfigError, match="block_tokens=100: a multiple of 256"):
        policy(kv__block_tokens=100)


def test_the_plan_is_frozen_and_named_as_the_policy():
    plan = resolve(policy(), _hw(), ARGS, CPU)
    with pytest.raises(Exception):
        plan.kv.max_batch = 2  # type: ignore[misc]
    knobs = {f"{group}.{f.name}" for group in ("cpu", "kv", "prefill", "decode", "gpu")
             for f in fields(getattr(PolicyConfig(), group))}
    assert knobs <= set(plan.params()), sorted(knobs - set(plan.params()))




def test_amx_overlap_reaches_the_kernels(monkeypatch):
    """A knob from the schema through resolve to its one consumer, the native settings (build.configure_cpu)."""
    from hybrid.engine import build

    assert resolve(policy(), _hw(), ARGS, CPU).cpu.amx_overlap is True  # null: on
    off = resolve(policy(cpu__amx_overlap=False), _hw(), ARGS, CPU).cpu
    set_to = {}
    for name in ("set_amx_overlap", "set_amx_min_tokens", "set_tile_min_tokens", "set_batch_invariant"):
        monkeypatch.setattr(build, name, lambda v, name=name: set_to.setdefault(name, v))
    monkeypatch.setattr(build.thread_pool, "set_threads", lambda n: set_to.setdefault("threads", n))
    monkeypatch.setattr(build.torch, "set_num_threads", lambda n: None)
    build.configure_cpu(off)
    assert set_to == {"set_amx_overlap": False, "set_amx_min_tokens": 4, "set_tile_min_tokens": 16,
                      "set_batch_invariant": False, "threads": 8}


@pytest.mark.parametrize("probe", [NUMA2, NUMA2_GPU], ids=["cpu", "gpu"])
def test_numa_resolves_on_for_the_two_socket_profile_on_a_two_node_machine(probe):
    s = to_settings(compose(["+hw=epyc2x_5090x2"]))
    plan = resolve(s.policy, s.hw, ARGS, probe)
    c = plan.cpu
    assert (c.numa, c.numa_simulated, c.threads) == (True, 0, 64)
    assert c.numa_nodes == NUMA2.numa_nodes and c.numa_threads == (32, 32) and c.numa_split == (0.5, 0.5)
    line = plan.describe().splitlines()[1]
    assert line == ("  NUMA: 2 nodes (CPUs 0-31 | 32-63), a thread pool per node of 32 + 32 threads; each MoE layer's "
                    "experts split by bytes 50% / 50%, each bound to its node, run by their node's threads")
    assert plan.params()["cpu.numa_threads"] == (32, 32)
    off = resolve(policy(cpu__numa=False), s.hw, ARGS, probe).cpu
    assert (off.numa, off.numa_nodes, off.numa_threads) == (False, (), ())
    assert "NUMA" not in resolve(policy(cpu__numa=False), s.hw, ARGS, probe).describe()


def test_numa_null_follows_the_machines_nodes_and_true_on_one_node_is_refused():
    assert not resolve(policy(), _hw(), ARGS, CPU).cpu.numa  # the probe saw one node
    assert resolve(policy(), _hw(), ARGS, NUMA2).cpu.numa  # two: whatever profile (cpu_only requires one, at least)
    with pytest.raises(ConfigError, match=r"policy.cpu.numa=true needs more than one NUMA node: this machine has 1"):
        resolve(policy(cpu__numa=True), _hw(), ARGS, CPU)


def test_numa_threads_and_split_follow_the_nodes():
    s = to_settings(compose(["+hw=epyc2x_5090x2"]))
    c = resolve(policy(cpu__threads=7, cpu__numa_split=[3, 1]), s.hw, ARGS, NUMA2).cpu
    assert c.numa_threads == (4, 3) and c.numa_split == (0.75, 0.25)
    uneven = replace(NUMA2, numa_nodes=(tuple(range(48)), tuple(range(48, 64))))
    assert resolve(policy(), s.hw, ARGS, uneven).cpu.numa_threads == (48, 16)
    with pytest.raises(ConfigError, match=r"numa_split has 3 share\(s\) for 2 NUMA nodes"):
        resolve(policy(cpu__numa_split=[1, 1, 1]), s.hw, ARGS, NUMA2)
    with pytest.raises(ConfigError, match=r"threads=1 under policy.cpu.numa: at least one per node"):
        resolve(policy(cpu__threads=1), s.hw, ARGS, NUMA2)
    with pytest.raises(ConfigError, match=r"numa_split: a positive share per node"):
        policy(cpu__numa_split=[1, 0])


def test_simulated_numa_groups_this_machines_cpus():
    plan = resolve(policy(cpu__numa_simulated=2, cpu__threads=4), _hw(), ARGS, CPU)
    c = plan.cpu
    assert (c.numa, c.numa_simulated, c.numa_nodes, c.numa_threads) == (True, 2, ((0, 1, 2, 3), (4, 5, 6, 7)), (2, 2))
    assert "2 CPU groups as nodes (CPUs 0-3 | 4-7)" in plan.describe()
    assert "memory left where it is (simulated)" in plan.describe()
    three = resolve(policy(cpu__numa_simulated=3), _hw(), ARGS, NUMA2).cpu  # over the machine's own nodes' CPUs
    assert [len(n) for n in three.numa_nodes] == [21, 21, 22] and three.numa_threads == (21, 21, 22)
    with pytest.raises(ConfigError, match=r"numa_simulated=2 contradicts policy.cpu.numa=false"):
        resolve(policy(cpu__numa_simulated=2, cpu__numa=False), _hw(), ARGS, CPU)
    with pytest.raises(ConfigError, match=r"numa_simulated=9: this machine has 8 CPU\(s\)"):
        resolve(policy(cpu__numa_simulated=9), _hw(), ARGS, CPU)
    with pytest.raises(ConfigError, match=r"numa_simulated must be 0 \(off\) or >= 2"):
        policy(cpu__numa_simulated=1)
    # HYBRID_NUMA_SIMULATED (the probe's numa_simulated): every plan's default, a whole test run on N groups
    env = replace(CPU, numa_simulated=2)
    assert resolve(policy(cpu__threads=4), _hw(), ARGS, env).cpu.numa_nodes == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert not resolve(policy(cpu__numa=False), _hw(), ARGS, env).cpu.numa  # the policy's false still wins
