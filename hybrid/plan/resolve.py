"""Resolve first, then build: the only place a `null` knob of the policy is decided and the only place knobs are
checked against each other. `resolve(policy, hw, model_args, probe)` is pure — it reads what the machine probe found
(hybrid/engine/probe.py, or a test's made-up one) and constructs nothing; `resolve_memory` adds the ledger once
placement has measured the bytes. Both raise ConfigError naming the knob.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from hybrid.config.schema import DEFAULT_SLP_CUTOFF, HwConfig, PolicyConfig
from hybrid.errors import ConfigError
from hybrid.kernels.dispatch import VARIANTS
from hybrid.kernels.gemm import AMX_MIN_TOKENS, OUTER_MIN_TOKENS, TILE_MIN_TOKENS
from hybrid.placement.memory import auto_chunk, group_bytes
from hybrid.plan.numa import resolve_numa
from hybrid.plan.plan import CpuPlan, DecodePlan, GpuPlan, KvPlan, Ledger, Plan, PrefillPlan

AUTO_GROUP = 16  # experts stream-loading prefill computes together where a grouped GEMM applies (docs/perf/prefill.md)
AUTO_SMS_LEFT = 32  # SMs a prefill beside decode leaves decode where green contexts exist (docs/perf/concurrency.md)


@dataclass(frozen=True)
class Probe:
    """What resolving needs to know of the machine."""
    physical_cores: int
    cpu_missing: dict  # each ISA variant -> None where this CPU runs it, else what it lacks
    kernel_env: Optional[str]  # HYBRID_CPU_KERNEL
    cuda: bool  # torch sees a GPU
    gpu_count: int = 0
    sms: int = 0
    green_contexts: bool = False  # torch can put kernels in a green context of fewer SMs
    stream_waits: bool = False  # a stream (also in a graph) can wait for a word of pinned host memory
    grouped_gemm: bool = False  # torch has a grouped GEMM for the model's activations on the device
    cpu_peer: bool = False  # the two-GPU mode's stand-in on the CPU (tests): the prefill peer on the CPU too
    numa_nodes: tuple[tuple[int, ...], ...] = ()  # each NUMA node's CPUs this process may use (none: one node)
    numa_simulated: int = 0  # HYBRID_NUMA_SIMULATED: policy.cpu.numa_simulated's default (a whole test run on N groups)


def resolve(p: PolicyConfig, hw: HwConfig, args, probe: Probe) -> Plan:
    """The plan for policy p on the (resolved) hardware profile hw, for a model of these args (hybrid/model's
    ModelArgs), on the machine the probe saw."""
    notes: list[str] = []
    device = "cuda:0" if hw.gpus and probe.cuda else "cpu"
    cuda, native = device != "cpu", p.cpu.moe_backend == "native"
    check(p)
    if p.gpu.experts_per_layer and not cuda:
        raise ConfigError("policy.gpu.experts_per_layer > 0 keeps hot experts on the GPU: this profile runs without "
                          "one (set it to 0)")
    kernel = cpu_kernel(p.cpu.kernel, probe)
    threads = p.cpu.threads or hw.cpu.cores or probe.physical_cores
    cpu_policy = p.cpu
    if probe.numa_simulated and not cpu_policy.numa_simulated and cpu_policy.numa is not False:
        cpu_policy = replace(cpu_policy, numa_simulated=probe.numa_simulated)
    numa = resolve_numa(cpu_policy, probe.numa_nodes, probe.physical_cores, threads)
    cpu = CpuPlan(threads=threads, kernel=kernel,
                  moe_backend=p.cpu.moe_backend, gemm_tile_tokens=gemm_tile_tokens(p, kernel),
                  amx_min_tokens=amx_min_tokens(p), batch_invariant=p.decode.batch_invariant,
                  deferred_experts=p.cpu.deferred_experts, lm_head=p.cpu.lm_head if not cuda and native else "bf16",
                  amx_overlap=p.cpu.amx_overlap is not False, numa=numa.on, numa_simulated=numa.simulated,
                  numa_nodes=numa.nodes, numa_threads=numa.threads, numa_split=numa.split)
    graphs = graphs_mode(p, cuda, native, notes)
    hostfn = graphs == "hostfn"
    d = p.decode
    decode = DecodePlan(batch_cap=d.batch_cap, cuda_graphs=graphs,
                        dual_batch=hostfn if d.dual_batch is None else d.dual_batch,
                        dual_stagger=d.dual_stagger and hostfn, batch_invariant=d.batch_invariant,
                        mapped_outputs=cuda and d.mapped_outputs,
                        cpu_join=cpu_join(d.cpu_join, probe.stream_waits) if hostfn else "host")
    g = p.gpu
    gpu = GpuPlan(memory_budget_gb=g.memory_budget_gb or 0.0, weights=g.weights, fp8_gemm=g.fp8_gemm,
                  fp8_dequant_rows=g.fp8_dequant_rows, experts_per_layer=g.experts_per_layer,
                  pad_rows=max(16, p.kv.max_batch) if d.batch_invariant and cuda else 0,
                  sms=probe.sms if cuda else 0)
    prefill = prefill_plan(p, hw, args, probe, cuda, native, notes)
    k = p.kv
    kv = KvPlan(k.max_batch, k.max_context, min(k.block_tokens, k.max_context), k.prefix_cache, k.cache_gb,
                k.host_cache_gb if k.host_cache_gb is not None and k.prefix_cache else 0.0)
    return Plan(device, cpu, kv, prefill, decode, gpu, None, tuple(notes))


def resolve_memory(plan: Plan, args, budget: float, weights: float, kv_cache: float, hot_experts: float, slot: int,
                   *, host_cache_gb: Optional[float] = 0.0, host_free: float = 0.0) -> Plan:
    """The plan with its device-memory ledger (bytes measured at placement: the budget beside the weights, the
    weights, KV cache and hot experts; slot: one streamed expert's bytes), stream-loading prefill's chunk
    (slp_chunk_tokens null: as the free memory fits a prompt's activations beside a ping-pong ring) and the
    prefix cache's host tier (host_cache_gb, the policy's kv.host_cache_gb; null: what the host has left after the
    experts and a reserve, host_free bytes)."""
    if host_cache_gb is None and plan.kv.prefix_cache:
        plan = replace(plan, kv=replace(plan.kv, host_cache_gb=round(max(0.0, host_free) / 1e9, 1)))
    p = plan.prefill
    group = group_bytes(args, p.slp_group_experts) if p.slp else 0
    ledger = Ledger(budget, weights, kv_cache, hot_experts, group)
    chunk = p.slp_chunk_tokens
    if p.slp and not chunk:
        chunk = auto_chunk(args, ledger.free, slot)
    return replace(plan, ledger=ledger, prefill=replace(p, slp_chunk_tokens=chunk))


def check(p: PolicyConfig) -> None:
    """The knobs that contradict each other, named (what contradicts the machine: resolve)."""
    if p.decode.batch_invariant and (p.cpu.amx_min_tokens or 1) > 1:
        raise ConfigError(
            f"policy.cpu.amx_min_tokens={p.cpu.amx_min_tokens} contradicts policy.decode.batch_invariant=true: on an "
            "AMX CPU an expert with fewer tokens would run on the AVX-512 kernel, which rounds differently from the "
            "tiles, so a token's numbers would depend on how many batch mates share its experts; leave it null (1 "
            "under batch_invariant) or set 1")
    if p.decode.batch_cap > p.kv.max_batch:
        raise ConfigError(f"policy.decode.batch_cap ({p.decode.batch_cap}) exceeds policy.kv.max_batch "
                          f"({p.kv.max_batch}), the number of KV-cache slots")
    native = p.cpu.moe_backend == "native"
    if p.cpu.deferred_experts and not native:
        raise ConfigError("policy.cpu.deferred_experts needs policy.cpu.moe_backend=native")
    if p.gpu.experts_per_layer and (not native or p.cpu.deferred_experts):
        raise ConfigError("policy.gpu.experts_per_layer > 0 needs policy.cpu.moe_backend=native and "
                          "policy.cpu.deferred_experts=0")


def cpu_kernel(requested: Optional[str], probe: Probe) -> str:
    """The ISA variant that runs: policy.cpu.kernel, else HYBRID_CPU_KERNEL, else the best this CPU runs."""
    want = requested or probe.kernel_env or "auto"
    if want == "auto":
        return next(v for v in VARIANTS if probe.cpu_missing.get(v) is None)
    if want not in VARIANTS:
        raise ConfigError(f"HYBRID_CPU_KERNEL={want!r}: one of auto, {', '.join(VARIANTS)}")
    if probe.cpu_missing.get(want) is not None:
        src = "policy.cpu.kernel" if requested else "HYBRID_CPU_KERNEL"
        raise ConfigError(f"{src}={want}: this CPU lacks {probe.cpu_missing[want]}")
    return want


def gemm_tile_tokens(p: PolicyConfig, kernel: str) -> int:
    """policy.cpu.gemm_tile_tokens, else where the converted tiles pay: from OUTER_MIN_TOKENS where avx512_bf16
    multiplies them in the outer-product form, TILE_MIN_TOKENS where they keep the streaming form's sums (avx512;
    avx512_bf16 under decode.batch_invariant; the other variants do not read it)."""
    if p.cpu.gemm_tile_tokens is not None:
        return p.cpu.gemm_tile_tokens
    return OUTER_MIN_TOKENS if kernel == "avx512_bf16" and not p.decode.batch_invariant else TILE_MIN_TOKENS


def amx_min_tokens(p: PolicyConfig) -> int:
    """policy.cpu.amx_min_tokens, else 1 under decode.batch_invariant (the AMX tiles and the AVX-512 kernel round
    differently, so with a threshold above 1 a token's expert outputs would depend on its batch mates), else
    AMX_MIN_TOKENS."""
    if p.cpu.amx_min_tokens is not None:
        return p.cpu.amx_min_tokens
    return 1 if p.decode.batch_invariant else AMX_MIN_TOKENS


def graphs_mode(p: PolicyConfig, cuda: bool, native: bool, notes: list[str]) -> str:
    """decode.cuda_graphs where it applies: graphs need a GPU and every MoE layer on the native op without deferral
    (whose Python-side bookkeeping runs between layers); `off` elsewhere."""
    if p.decode.cuda_graphs == "off" or not cuda:
        return "off"
    if not native or p.cpu.deferred_experts:
        notes.append("decode runs eagerly (policy.decode.cuda_graphs needs policy.cpu.moe_backend=native and "
                     "policy.cpu.deferred_experts=0)")
        return "off"
    return p.decode.cuda_graphs


def cpu_join(wanted: Optional[str], supported: bool) -> str:
    """decode.cpu_join under hostfn graphs: null = `signal` where streams can wait for host memory, else `host`."""
    if wanted is None:
        return "signal" if supported else "host"
    if wanted == "signal" and not supported:
        raise ConfigError("policy.decode.cpu_join=signal needs CUDA stream memory operations (cuStreamWaitValue32 "
                          "on pinned host memory), which this driver refused; set it to host or null")
    return wanted


def prefill_plan(p: PolicyConfig, hw: HwConfig, args, probe: Probe, cuda: bool, native: bool,
                 notes: list[str]) -> PrefillPlan:
    f = p.prefill
    slp = cuda and native and bool(getattr(args, "n_routed_experts", 0))  # a dense model has no experts to stream
    cutoff = f.slp_cutoff_tokens
    if cutoff is None:
        cutoff = hw.slp_crossover_tokens if hw.slp_crossover_tokens is not None else DEFAULT_SLP_CUTOFF
    group = f.slp_group_experts or (AUTO_GROUP if slp and probe.grouped_gemm else 1)
    return PrefillPlan(chunk_tokens=f.chunk_tokens, attention_chunk_tokens=f.attention_chunk_tokens,
                       slp_cutoff_tokens=cutoff, slp=slp, ring_len=f.ring_len or 0,
                       slp_chunk_tokens=(f.slp_chunk_tokens or 0) if slp else 0, slp_group_experts=group,
                       gpus=prefill_gpus(p, hw, probe, cuda, native, notes), ep=f.ep, beside_decode=f.beside_decode,
                       beside_cores=f.beside_cores, stream_cap_gbps=f.stream_cap_gbps or 0.0,
                       stream_queue_mb=f.stream_queue_mb, stream_duty=f.stream_duty or 1.0,
                       cores_back_in_rests=f.cores_back_in_rests,
                       beside_sms=beside_sms(f.beside_sms, probe) if cuda and f.beside_decode else 0)


def prefill_gpus(p: PolicyConfig, hw: HwConfig, probe: Probe, cuda: bool, native: bool, notes: list[str]) -> int:
    """prefill.gpus: null = min(2, the profile's GPUs); 2 means a prefill peer process streams its share of the
    experts from the one shared copy of the CPU kernels' host weights (moe_backend=native) on a second GPU torch
    sees. Where null asked for two and one of those is missing, one device with a note; an explicit 2, an error."""
    want = p.prefill.gpus
    if not cuda:
        gpus = (1 if want == 1 else 2) if probe.cpu_peer else 1
    elif want is None:
        gpus = max(1, min(2, len(hw.gpus)))
    elif want > len(hw.gpus):
        raise ConfigError(f"policy.prefill.gpus={want} but the hw profile has {len(hw.gpus)} GPU(s)")
    else:
        gpus = want
    if gpus < 2:
        return gpus
    why = None
    if not native:
        why = "the peer streams the experts from the CPU kernels' host weights: policy.cpu.moe_backend=native"
    elif cuda and probe.gpu_count < 2:
        why = f"a peer process on a second GPU, and torch sees {probe.gpu_count}"
    if why is None:
        return gpus
    if want == 2:
        raise ConfigError(f"policy.prefill.gpus=2 needs {why} (or set policy.prefill.gpus=1)")
    notes.append(f"prefill on one GPU (policy.prefill.gpus=null would take two, but that needs {why})")
    return 1


def beside_sms(leave: Optional[int], probe: Probe) -> int:
    """prefill.beside_sms: the SMs a prefill beside decode leaves to decode. null: AUTO_SMS_LEFT, at most a quarter
    of the GPU, where green contexts exist, else 0 (the prefill on every SM)."""
    if leave is None:
        return min(AUTO_SMS_LEFT, probe.sms // 4) if probe.green_contexts else 0
    if leave and not probe.green_contexts:
        raise ConfigError(f"policy.prefill.beside_sms={leave} runs the prefill in a CUDA green context, which this "
                          "torch does not provide (torch 2.11+ built with CUDA 12.4+); set it to 0")
    if leave and leave >= probe.sms:
        raise ConfigError(f"policy.prefill.beside_sms={leave} leaves the prefill no SM: this GPU has {probe.sms}")
    return leave
