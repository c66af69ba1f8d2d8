"""The compute device's memory arithmetic: what the budget is, what the KV cache, hot experts and the SLP group buffer
take from it (the plan's `Ledger`, hybrid/plan/plan.py, fixed at build), and how the stream-loading ring and a prompt's
activations share what is left (per prompt: the ring as deep as that allows, or the prompt in chunks).

Legend: T tokens, D hidden, I expert intermediate, K experts per token.
"""
from __future__ import annotations

from typing import Optional

import torch

from hybrid.errors import ConfigError
from hybrid.hw.detect import meminfo_bytes
from hybrid.model.kv_cache import KVCache

GPU_RESERVE = 2e9  # bytes left free on the GPU for activations and the allocator's slack
CPU_RESERVE = 2e9


def free_bytes(device: torch.device, budget_gb: Optional[float] = None) -> float:
    """What the engine may still take on `device`: on a GPU, its free memory plus torch's cache (ours), capped by
    policy.gpu.memory_budget_gb (less what torch holds) when set, else less a reserve; on the CPU, available RAM
    less a reserve."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        if budget_gb:
            return min(free, budget_gb * 1e9 - torch.cuda.memory_allocated(device))
        return free - GPU_RESERVE
    return meminfo_bytes("MemAvailable") - CPU_RESERVE


def kv_cache_bytes(a, dtype: torch.dtype, tokens: int) -> int:
    return KVCache.bytes_per_token(a.num_hidden_layers, a.kv_lora_rank, a.qk_rope_head_dim, dtype) * tokens


def extra_blocks(a, dtype: torch.dtype, gb: float, block_tokens: int) -> int:
    """Pool blocks in policy.kv.cache_gb."""
    return int(gb * 1e9 // kv_cache_bytes(a, dtype, block_tokens))


def check_kv_cache(a, dtype: torch.dtype, slots: int, context: int, block_tokens: int, extra: int, budget: float,
                   device: torch.device) -> int:
    """The KV pool's bytes (every slot's blocks, the zero block and `extra` for cached prefixes); a ConfigError naming
    the knobs when the budget cannot hold it."""
    tokens = (1 + slots * -(-context // block_tokens) + extra) * block_tokens
    need = kv_cache_bytes(a, dtype, tokens)
    if need > budget:
        where = "GPU" if device.type == "cuda" else "host"
        per_token = kv_cache_bytes(a, dtype, 1)
        raise ConfigError(
            f"the KV cache for policy.kv.max_batch={slots} x policy.kv.max_context={context} (blocks of "
            f"{block_tokens}, policy.kv.cache_gb beside) needs {need / 1e9:.2f} GB ({per_token} bytes per token) but "
            f"the {where} budget left after the weights is {max(budget, 0) / 1e9:.2f} GB: lower "
            "policy.kv.max_context, policy.kv.max_batch or policy.kv.cache_gb"
            + (", or raise policy.gpu.memory_budget_gb" if device.type == "cuda" else ""))
    return need


def group_bytes(a, group: int) -> int:
    """The BF16 weight buffer of SLP's expert groups (none when experts go one at a time)."""
    return group * 3 * a.moe_intermediate_size * a.hidden_size * 2 if group > 1 else 0


def activation_bytes(a, tokens: int) -> float:
    """A generous estimate of one MoE layer's prefill activations: hidden states, routing, one expert's
    intermediate, attention scores per head chunk, and the layer's rows grouped by expert (in and out, BF16)."""
    grouped = 2 * a.num_experts_per_tok * a.hidden_size * 2
    return tokens * ((8 * a.hidden_size + 6 * a.moe_intermediate_size + 4 * a.num_experts_per_tok * 3) * 4 + grouped)


def auto_chunk(a, budget_bytes: float, slot: int) -> int:
    """The most tokens whose prefill activations fit the budget beside a ping-pong ring (0 = no chunking needed
    below a million tokens)."""
    room = budget_bytes - 2 * slot
    per_token = activation_bytes(a, 1)
    if room <= per_token * 1024:
        raise ConfigError(f"the GPU budget ({budget_bytes / 1e9:.2f} GB) leaves no room for stream-loading prefill "
                          "activations: raise policy.gpu.memory_budget_gb or set policy.prefill.slp_chunk_tokens")
    tokens = int(room // per_token)
    return 0 if tokens >= 1_000_000 else tokens // 256 * 256


def auto_ring_len(n_experts: int, slot_bytes: int, budget_bytes: float) -> int:
    """As deep as the budget allows, up to a layer's experts. A deep ring lets the loader stream ahead through all
    the work that needs no routed expert (attention, dense layers, router) — compute-bound long prompts gain the most
    (H200, 32K tokens: 16 slots 0.48 s, 256 slots 0.36 s). The caller's budget is what the prompt's activations
    leave, so longer prompts get shallower rings, down to ping-pong when memory is tight."""
    return max(1, min(n_experts, int(budget_bytes // slot_bytes)))


def ring_budget(a, free: float, kept_ring: float, group: int, tokens: int) -> float:
    """Bytes the ring may take for a prompt chunk of `tokens`: what is free now (the kept ring counts as free: the
    next prefill gets it back) less the chunk's activations and the group buffer."""
    return free + kept_ring - activation_bytes(a, tokens) - group_bytes(a, group)
