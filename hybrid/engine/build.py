"""Build the engine from the configs: probe the machine, resolve the plan (hybrid/plan/resolve.py: every `null`
decided there), set the native kernels' process-wide settings from it, load and place the checkpoint (routed experts
on the CPU kernels, the rest on the compute device), plan the device's memory and make the `Engine`.

`replan` makes a new Engine around an already placed model for another policy, as long as the plan's fields that
placement read (marked `placed` in hybrid/plan/plan.py) stay the same: the tuner's trials change the others without
loading the model again."""
from __future__ import annotations

import dataclasses
import functools
import sys
from dataclasses import dataclass
from typing import Optional

import torch

from hybrid import models
from hybrid.config.schema import HwConfig, HybridConfig, ModelConfig
from hybrid.engine.engine import Engine
from hybrid.engine.long_prefill import LongPrefill
from hybrid.engine.probe import probe
from hybrid.errors import ConfigError
from hybrid.kernels import combine, fp8_linear, int4_linear, pointwise, thread_pool
from hybrid.kernels.gemm import set_amx_min_tokens, set_amx_overlap, set_batch_invariant, set_tile_min_tokens
from hybrid.model.transformer import Transformer
from hybrid.placement import numa
from hybrid.placement.hot_experts import HotExperts
from hybrid.placement.memory import check_kv_cache, extra_blocks, free_bytes, kv_cache_bytes
from hybrid.placement.passes import (chunk_prefill_attention, cpu_experts, experts_to_cpu_kernels,
                                     hot_experts_to_device, pin_experts, place)
from hybrid.placement.staging import Staging
from hybrid.plan.plan import CpuPlan, Plan, placed_changes
from hybrid.plan.resolve import resolve, resolve_memory
from hybrid.prefill.ring import expert_tensors, layout
from hybrid.prefill.slp import StreamLoader


def plan_for(s: HybridConfig, hw: HwConfig, cpu_peer: bool = False) -> Plan:
    """The plan of s.policy on the (resolved) profile hw, for s.model, on this machine. cpu_peer: the two-GPU mode's
    stand-in on the CPU (the tests'): the prefill peer process on the CPU too, the processes joined over gloo."""
    return resolve(s.policy, hw, models.args_of(s.model), probe(hw, _dtype(s.model), cpu_peer))


def configure_cpu(cpu: CpuPlan) -> None:
    """The native kernels' process-wide settings (one thread pool per process) and torch's intra-op threads, from
    the plan, once per engine build. One count for both: without a GPU they take turns within a step (placement
    runs the routed experts synchronously, the shared experts after them), and torch keeps every core for what stays
    its own (the BF16 lm_head, attention's score products). Under NUMA the pool's threads are in node groups
    (cpu.numa_threads each), the rest of the step's CPU work on all of them as without."""
    torch.set_num_threads(cpu.threads)
    thread_pool.set_groups(cpu.numa_nodes, cpu.numa_threads)  # per NUMA node (none: one plain pool)
    thread_pool.set_threads(cpu.threads)
    set_tile_min_tokens(cpu.gemm_tile_tokens)
    set_amx_min_tokens(cpu.amx_min_tokens)
    set_batch_invariant(cpu.batch_invariant)
    set_amx_overlap(cpu.amx_overlap)


@dataclass(frozen=True)
class Placed:
    """The loaded, placed model and what placement made for it: what `replan` keeps."""
    plan: Plan  # the plan it was placed with
    model: Transformer
    tokenizer: object
    staging: Staging
    gemm: fp8_linear.Fp8Gemm
    fused: pointwise.Fused
    weight_bytes: int
    loader: Optional[StreamLoader]  # stream-loading prefill's (GPU, native experts only)
    arenas: Optional[list] = None  # the routed experts' one shared copy, when a prefill peer will attach to it

    @property
    def device(self) -> torch.device:
        return torch.device(self.plan.device)


def build(s: HybridConfig, hw: HwConfig, progress: bool = True, cpu_peer: bool = False) -> Engine:
    """The engine for the settings on the (resolved) profile hw: plan, native settings, placement, engine."""
    plan = plan_for(s, hw, cpu_peer)
    for note in plan.notes:
        print(f"note: {note}", file=sys.stderr)
    configure_cpu(plan.cpu)
    return assemble(place_model(s.model, plan, progress), s, plan)


def replan(engine: Engine, s: HybridConfig, hw: HwConfig) -> Engine:
    """A new Engine for policy s.policy around `engine`'s placed model (its KV cache, stream loader and, where they
    still apply, hot experts and captured graphs kept). The plan's placed fields must not change; `engine` must be
    idle and is not used after."""
    placed: Placed = engine.placed
    old = placed.plan
    cpu_peer = old.prefill.gpus > 1 and not old.cuda
    plan = resolve(s.policy, hw, placed.model.args, probe(hw, placed.model.dtype, cpu_peer))
    changed = placed_changes(old, plan)
    if changed:
        raise ConfigError(f"policy.{changed[0]} changed: it needs the model placed again (build, not replan)")
    if engine.has_work():
        raise RuntimeError("replan: the engine still has requests")
    configure_cpu(plan.cpu)
    return assemble(placed, s, plan, engine)


def device_gemm(plan: Plan) -> fp8_linear.Fp8Gemm:
    """The compute device's GEMM object (plan.gpu) for the engine's process and a prefill peer alike (rows padded
    for batch-invariant decode: gpu.pad_rows)."""
    g = plan.gpu
    return fp8_linear.Fp8Gemm(g.fp8_gemm, g.fp8_dequant_rows, pad_rows=g.pad_rows)


def place_model(cfg: ModelConfig, plan: Plan, progress: bool = True) -> Placed:
    """Load the checkpoint and place it: routed experts on the CPU kernels (pinned for a GPU; in one shared-memory
    copy when a prefill peer will stream from it too), the rest on the compute device; the FP8 GEMM and fused
    kernels warmed up."""
    device, c = torch.device(plan.device), plan.cpu
    gemm = device_gemm(plan)
    if plan.cuda and fp8_linear.triton is None:
        print("note: Triton is not installed: FP8 weights on the GPU are dequantised with torch ops before use "
              f"(policy.gpu.fp8_gemm={plan.gpu.fp8_gemm} needs it)", file=sys.stderr)
    model, tok = models.load(cfg, progress)
    a = model.args
    staging = Staging(a.hidden_size, a.num_experts_per_tok, pin=plan.cuda)
    native = c.moe_backend == "native"
    arenas = None
    if native:
        experts_to_cpu_kernels(model, c.kernel, staging, c.deferred_experts)
        bind = numa.split(model, c)  # each expert's node; bound there below (before any page-locking)
        if plan.prefill.gpus > 1:  # the one copy both processes stream from (and this one's CPU kernels read)
            from hybrid.parallel.shared import pin_shared, share_experts

            arenas = share_experts(model)
            if bind:
                numa.bind_experts(model)
            if plan.cuda:
                pin_shared(arenas)
            print(f"routed experts: {sum(a.numel() for a in arenas) / 1e9:.2f} GB in shared host memory"
                  + (" (pinned)" if plan.cuda else ""), file=sys.stderr)
        elif plan.cuda:
            pinned = pin_experts(model, prepare=numa.bind_arena if bind else None)
            print(f"routed experts: {pinned / 1e9:.2f} GB in pinned host memory", file=sys.stderr)
        elif bind:  # in place: the checkpoint's mapped pages, or weights made in memory
            numa.bind_experts(model)
        if c.numa:
            print(numa.describe(model, c), file=sys.stderr)
    # Triton compiles now, not in a first long prompt; where it fails, the torch forms run
    fused = pointwise.Fused(pointwise.warm_up(a, device, model.dtype))
    weight_bytes = place(model, device, plan.gpu.weights, gemm, fused, c.kernel if native else None, c.lm_head)
    loader = None
    if plan.cuda and native:
        warm_up_experts(a, device, gemm)
        loader = StreamLoader(gemm, combine.warm_up(a.num_experts_per_tok, a.hidden_size, device, model.dtype))
    return Placed(plan, model, tok, staging, gemm, fused, weight_bytes, loader, arenas)


def assemble(placed: Placed, s: HybridConfig, plan: Plan, previous: Optional[Engine] = None) -> Engine:
    """The Engine for the plan around a placed model: hot experts, KV cache, memory ledger, stream-loading prefill,
    decode graphs. `previous`: the engine it replaces (its cache, hot experts and graphs are reused where the plan
    leaves them as they were)."""
    model, device = placed.model, placed.device
    a = model.args
    chunk_prefill_attention(model, plan.prefill.attention_chunk_tokens)
    same_hot = previous is not None and previous.plan.gpu.experts_per_layer == plan.gpu.experts_per_layer
    if same_hot:
        hot = previous.hot
        for h in hot:  # each engine starts cold: a trial's hot set is its own traffic's, not earlier trials'
            h.reset()
    else:
        if previous is not None and previous.hot:
            hot_experts_to_device(model, 0, device)  # the old slots go before the new are counted against the budget
        hot = hot_experts(plan, model, placed.gemm)
    hot_bytes = sum(h.nbytes for h in hot)
    if plan.cuda and previous is None:
        print(f"GPU side: {(placed.weight_bytes + hot_bytes) / 1e9:.2f} GB of weights", file=sys.stderr)
    k = plan.kv
    cache = previous.cache if previous is not None else None
    held = kv_cache_bytes(a, model.dtype, cache.blocks * cache.block_tokens) if cache is not None else 0
    if placed.loader is not None:  # the last prefill's ring, kept: the next one reuses or frees it
        held += placed.loader.kept_ring_bytes(device)
    budget = free_bytes(device, plan.gpu.memory_budget_gb or None) + held
    extra = extra_blocks(a, model.dtype, k.cache_gb, k.block_tokens)
    kv = check_kv_cache(a, model.dtype, k.max_batch, k.max_context, k.block_tokens, extra, budget, device)
    cache = cache or model.new_cache(k.max_batch, k.max_context, device, k.block_tokens, extra)
    streams = plan.prefill.slp and placed.loader is not None and bool(cpu_experts(model))
    slot = slot_bytes(model) if streams else 0
    host_free = free_bytes(torch.device("cpu")) - (kv if device.type == "cpu" else 0)
    plan = resolve_memory(plan, a, budget, placed.weight_bytes, kv, hot_bytes, slot,
                          host_cache_gb=s.policy.kv.host_cache_gb, host_free=host_free)
    long_prefill = None
    if streams:
        long_prefill = LongPrefill(model, device, placed.loader, slot, plan.prefill.slp_group_experts,
                                   plan.prefill.ring_len or None, plan.gpu.memory_budget_gb or None)
    d = plan.decode
    placed.staging.mapped = d.mapped_outputs
    decode = None
    if d.cuda_graphs != "off":
        # graphs captured with these slots and the same hand-off of the CPU experts (their join and outputs)
        old = previous.plan.decode if previous is not None else None
        same_handoff = old is not None and (old.mapped_outputs, old.cpu_join) == (d.mapped_outputs, d.cpu_join)
        decode = previous.decoder(d.cuda_graphs) if same_hot and same_handoff else None
        if decode is None:
            from hybrid.engine.cuda_graphs import GraphedDecode  # GPU only: loads the CUDA driver's entry point

            decode = GraphedDecode(model, cache, placed.staging, d.cuda_graphs, plan.kv.max_batch, d.cpu_join)
    print(plan.describe(), file=sys.stderr)
    after = functools.partial(_refresh, hot) if hot else None
    return Engine(model, plan, placed.tokenizer, cache, decode, long_prefill, after, placed=placed, hot=hot,
                  peer=start_peer(placed, s) if previous is None else previous.peer)


def start_peer(placed: Placed, s: HybridConfig):
    """The prefill peer process for the second device (hybrid/parallel/peer.py), when placement shared the experts
    for one; None otherwise. A peer that cannot start stops the build."""
    if placed.arenas is None:
        return None
    from hybrid.parallel.peer import Peer

    plan = placed.plan
    threads = max(1, plan.cpu.threads // 2)
    loader = placed.loader or StreamLoader(placed.gemm)  # rank 0's share streams (the CPU stand-in: on the CPU)
    peer = Peer.start(peer_model, (s.model, plan, threads), placed.arenas, placed.device, plan.kv.max_context,
                      loader, threads=threads)
    print(f"prefill peer: process {peer.pid} on {peer.device} (policy.prefill.gpus={plan.prefill.gpus}, experts "
          f"by {plan.prefill.ep})", file=sys.stderr)
    return peer


def peer_model(device: torch.device, cfg: ModelConfig, plan: Plan, threads: int) -> tuple[Transformer, StreamLoader]:
    """In the peer process: the model loaded and placed on its device as place_model does (the routed experts on
    the CPU kernels, attached to the engine's shared copy after), and its stream loader."""
    c = plan.cpu
    configure_cpu(dataclasses.replace(c, threads=threads))
    model, _ = models.load(cfg, progress=False)
    a = model.args
    cuda = device.type == "cuda"
    experts_to_cpu_kernels(model, c.kernel, Staging(a.hidden_size, a.num_experts_per_tok, pin=cuda))
    numa.split(model, c)  # the engine's process binds the shared copy
    gemm = device_gemm(plan)
    fused = pointwise.Fused(pointwise.warm_up(a, device, model.dtype))
    place(model, device, plan.gpu.weights, gemm, fused, c.kernel, c.lm_head)
    chunk_prefill_attention(model, plan.prefill.attention_chunk_tokens)
    if not cuda:
        return model, StreamLoader(gemm)
    warm_up_experts(a, device, gemm)
    return model, StreamLoader(gemm, combine.warm_up(a.num_experts_per_tok, a.hidden_size, device, model.dtype))


def shared_experts(cfg: ModelConfig, plan: Plan, progress: bool = True) -> list:
    """Without an engine (bench=prefill on two GPUs, a process per rank, each placed by peer_model): the routed
    experts on the CPU kernels as place_model puts them, in the one shared-memory copy the ranks attach to; the rest
    of the model is not placed."""
    from hybrid.parallel.shared import share_experts

    model, _ = models.load(cfg, progress)
    experts_to_cpu_kernels(model, plan.cpu.kernel)
    arenas = share_experts(model)
    print(f"routed experts: {sum(a.numel() for a in arenas) / 1e9:.2f} GB in shared host memory", file=sys.stderr)
    return arenas


def _refresh(hot: list[HotExperts]) -> None:
    for h in hot:
        h.refresh()


def hot_experts(plan: Plan, model: Transformer,
                gemm: fp8_linear.Fp8Gemm = fp8_linear.DEFAULT_GEMM) -> list[HotExperts]:
    """gpu.experts_per_layer > 0: that many slots per MoE layer for the hottest routed experts on the GPU."""
    n = plan.gpu.experts_per_layer
    if not n:
        return []
    device = torch.device(plan.device)
    layers = cpu_experts(model)
    need = n * len(layers) * slot_bytes(model)
    budget = free_bytes(device, plan.gpu.memory_budget_gb or None)
    if need > budget:
        raise ConfigError(f"policy.gpu.experts_per_layer={n} needs {need / 1e9:.2f} GB of GPU memory for "
                          f"{len(layers)} MoE layers but {max(budget, 0) / 1e9:.2f} GB is free: lower it "
                          "(or raise policy.gpu.memory_budget_gb)")
    return hot_experts_to_device(model, n, device, gemm)


def expert_gemm_shapes(a) -> list[tuple[int, int]]:
    """The weight shapes [N, K] a streamed expert multiplies by: gate+up fused, gate or up alone, down."""
    i, d = a.moe_intermediate_size, a.hidden_size
    return [(2 * i, d), (i, d), (d, i)]


def warm_up_experts(a, device: torch.device, gemm: fp8_linear.Fp8Gemm) -> None:
    """The streamed and resident experts' GEMMs compiled now (FP8 or INT4 weights; BF16 ones need none)."""
    if a.fp8_block:
        fp8_linear.warm_up(expert_gemm_shapes(a), device, gemm)
    elif a.expert_group:
        int4_linear.warm_up(expert_gemm_shapes(a), device, gemm, a.expert_group)


def slot_bytes(model: Transformer) -> int:
    return layout(expert_tensors(cpu_experts(model)[0].host_experts[0]))[1]


def _dtype(cfg: ModelConfig) -> torch.dtype:
    return getattr(torch, cfg.dtype.value)
