"""Build the engine from the configs: load the checkpoint, place it (routed experts on the CPU kernels, the rest on
the compute device), check the KV cache fits, and make the generator. The one place that decides devices."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Optional

import torch

from hybrid import models
from hybrid.config.schema import HwConfig, HybridConfig
from hybrid.engine.generate import Generator
from hybrid.engine.hot_experts import HotExperts
from hybrid.engine.placement import cpu_experts, expert_tensors, experts_to_cpu_kernels, pin_experts, place
from hybrid.engine.staging import Staging
from hybrid.errors import ConfigError
from hybrid.hw.detect import meminfo_bytes
from hybrid.kernels import combine, fp8_linear, pointwise
from hybrid.model.kv_cache import KVCache
from hybrid.model.transformer import Transformer
from hybrid.prefill.ring import auto_ring_len, layout
from hybrid.prefill.slp import group_size, kept_ring_bytes, streaming
from hybrid.tokenizer import Tokenizer

GPU_RESERVE = 2e9  # bytes left free on the GPU for activations and the allocator's slack
CPU_RESERVE = 2e9


@dataclass
class Engine:
    model: Transformer
    tokenizer: Tokenizer
    generator: Generator
    device: torch.device
    staging: Staging


def compute_device(hw: HwConfig) -> torch.device:
    """The GPU when the (resolved) profile has one and torch sees it; else the CPU does the GPU side's work."""
    return torch.device("cuda", 0) if hw.gpus and torch.cuda.is_available() else torch.device("cpu")


def kv_budget_bytes(s: HybridConfig, device: torch.device) -> float:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)  # torch's cache is ours
        if s.policy.gpu_memory_budget_gb:
            return min(free, s.policy.gpu_memory_budget_gb * 1e9 - torch.cuda.memory_allocated(device))
        return free - GPU_RESERVE
    return meminfo_bytes("MemAvailable") - CPU_RESERVE


def check_kv_cache(s: HybridConfig, model: Transformer, device: torch.device) -> int:
    a, p = model.args, s.policy
    per_token = KVCache.bytes_per_token(a.num_hidden_layers, a.kv_lora_rank, a.qk_rope_head_dim, model.dtype)
    need = per_token * p.max_batch * p.max_context
    budget = kv_budget_bytes(s, device)
    if need > budget:
        where = "GPU" if device.type == "cuda" else "host"
        raise ConfigError(
            f"the KV cache for policy.max_batch={p.max_batch} x policy.max_context={p.max_context} needs "
            f"{need / 1e9:.2f} GB ({per_token} bytes per token) but the {where} budget left after the weights is "
            f"{max(budget, 0) / 1e9:.2f} GB: lower policy.max_context or policy.max_batch"
            + (", or raise policy.gpu_memory_budget_gb" if device.type == "cuda" else ""))
    return need


def build(s: HybridConfig, hw: HwConfig, progress: bool = True) -> Engine:
    device = compute_device(hw)
    fp8_linear.set_backend(s.policy.gpu_fp8_gemm, s.policy.gpu_fp8_dequant_rows)
    if device.type == "cuda" and fp8_linear.triton is None:
        print("note: Triton is not installed: FP8 weights on the GPU are dequantised with torch ops before use "
              f"(policy.gpu_fp8_gemm={s.policy.gpu_fp8_gemm} needs it)", file=sys.stderr)
    model, tok = models.load(s.model, progress)
    a = model.args
    staging = Staging(a.hidden_size, a.num_experts_per_tok, pin=device.type == "cuda")
    if s.policy.moe_backend == "native":
        experts_to_cpu_kernels(model, s.policy.cpu_kernel, staging, s.policy.deferred_experts)
        if device.type == "cuda":
            pinned = pin_experts(model)
            print(f"routed experts: {pinned / 1e9:.2f} GB in pinned host memory", file=sys.stderr)
    elif s.policy.deferred_experts:
        raise ConfigError("policy.deferred_experts needs policy.moe_backend=native")
    hot = hot_experts(s, model, device)
    weight_bytes = place(model, device, s.policy.gpu_weights) + sum(h.nbytes for h in hot)
    if device.type == "cuda":
        print(f"GPU side: {weight_bytes / 1e9:.2f} GB of weights", file=sys.stderr)
        pointwise.warm_up(a, device, model.dtype)  # Triton compiles now, not in a first long prompt
    check_kv_cache(s, model, device)
    long_prefill, chunk = None, 0
    if device.type == "cuda" and s.policy.moe_backend == "native":
        group = group_size(s.policy.slp_group_experts, device, model.dtype)
        long_prefill = slp_context(s, model, device, group)
        if a.fp8_block:
            fp8_linear.warm_up(expert_gemm_shapes(a), device)
        combine.warm_up(a.num_experts_per_tok, a.hidden_size, device, model.dtype)
        chunk = s.policy.slp_chunk_tokens or auto_chunk(
            model.args, kv_budget_bytes(s, device) - group_bytes(model.args, group), slot_bytes(model))
    gen = Generator(model, s.policy.max_batch, s.policy.max_context, a.eos_token_id, device, long_prefill,
                    s.policy.slp_cutoff_tokens, chunk)
    if hot:
        gen.after_prefill = lambda: [h.refresh() for h in hot]
    if graphs_apply(s, device):
        from hybrid.engine.cuda_graphs import GraphedDecode  # GPU only: loads the CUDA driver's entry point

        gen.decode_step = GraphedDecode(model, gen.cache, staging, s.policy.cuda_graphs, s.policy.max_batch)
    return Engine(model, tok, gen, device, staging)


def hot_experts(s: HybridConfig, model: Transformer, device: torch.device) -> list[HotExperts]:
    """policy.gpu_experts_per_layer > 0: that many slots per MoE layer for the hottest routed experts on the GPU."""
    n, p = s.policy.gpu_experts_per_layer, s.policy
    if not n:
        return []
    if device.type != "cuda":
        raise ConfigError("policy.gpu_experts_per_layer > 0 keeps hot experts on the GPU: this profile runs "
                          "without one (set it to 0)")
    if p.moe_backend != "native" or p.deferred_experts:
        raise ConfigError("policy.gpu_experts_per_layer > 0 needs policy.moe_backend=native and "
                          "policy.deferred_experts=0")
    layers = cpu_experts(model)
    need = n * len(layers) * slot_bytes(model)
    budget = kv_budget_bytes(s, device)
    if need > budget:
        raise ConfigError(f"policy.gpu_experts_per_layer={n} needs {need / 1e9:.2f} GB of GPU memory for "
                          f"{len(layers)} MoE layers but {max(budget, 0) / 1e9:.2f} GB is free: lower it "
                          "(or raise policy.gpu_memory_budget_gb)")
    for layer in layers:
        layer.attach_hot(HotExperts(layer.host_experts, n, device))
    return [layer.hot for layer in layers]


def expert_gemm_shapes(a) -> list[tuple[int, int]]:
    """The weight shapes [N, K] a streamed expert multiplies by: gate+up fused, gate or up alone, down."""
    i, d = a.moe_intermediate_size, a.hidden_size
    return [(2 * i, d), (i, d), (d, i)]


def graphs_apply(s: HybridConfig, device: torch.device) -> bool:
    """CUDA graphs need a GPU and every MoE layer's experts on the native op without deferral (whose Python-side
    bookkeeping runs between layers); otherwise decode stays eager."""
    p = s.policy
    if p.cuda_graphs == "off" or device.type != "cuda":
        return False
    if p.moe_backend != "native" or p.deferred_experts:
        print("note: decode runs eagerly (policy.cuda_graphs needs policy.moe_backend=native and "
              "policy.deferred_experts=0)", file=sys.stderr)
        return False
    return True


def slot_bytes(model: Transformer) -> int:
    return layout(expert_tensors(cpu_experts(model)[0].host_experts[0]))[1]


def slp_context(s: HybridConfig, model: Transformer, device: torch.device, group: Optional[int] = None):
    """tokens -> the stream-loading context for a chunk that long (ring length from policy.ring_len; experts
    grouped by policy.slp_group_experts unless `group` says otherwise)."""
    slot = slot_bytes(model)
    group = group_size(s.policy.slp_group_experts, device, model.dtype) if group is None else group

    def context(tokens: int):
        budget = (kv_budget_bytes(s, device) + kept_ring_bytes(device) - activation_bytes(model.args, tokens)
                  - group_bytes(model.args, group))
        ring_len = (auto_ring_len(model.args.n_routed_experts, slot, budget)
                    if s.policy.ring_len == "auto" else int(s.policy.ring_len))
        return streaming(model, device, ring_len, budget, group)
    return context


def group_bytes(a, group: int) -> int:
    """The BF16 weight buffer of SLP's expert groups (none when experts go one at a time)."""
    return group * 3 * a.moe_intermediate_size * a.hidden_size * 2 if group > 1 else 0


def auto_chunk(a, budget_bytes: float, slot: int) -> int:
    """The most tokens whose prefill activations fit the budget beside a ping-pong ring (0 = no chunking needed
    below a million tokens)."""
    room = budget_bytes - 2 * slot
    per_token = activation_bytes(a, 1)
    if room <= per_token * 1024:
        raise ConfigError(f"the GPU budget ({budget_bytes / 1e9:.2f} GB) leaves no room for stream-loading prefill "
                          "activations: raise policy.gpu_memory_budget_gb or set policy.slp_chunk_tokens")
    tokens = int(room // per_token)
    return 0 if tokens >= 1_000_000 else tokens // 256 * 256


def activation_bytes(a, tokens: int) -> float:
    """A generous estimate of one MoE layer's prefill activations: hidden states, routing, one expert's
    intermediate, attention scores per head chunk, and the layer's rows grouped by expert (in and out, BF16)."""
    grouped = 2 * a.num_experts_per_tok * a.hidden_size * 2
    return tokens * ((8 * a.hidden_size + 6 * a.moe_intermediate_size + 4 * a.num_experts_per_tok * 3) * 4 + grouped)
