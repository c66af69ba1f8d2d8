"""The benchmarks' bounds as pure arithmetic on numbers and ModelArgs: the weight bytes a decode step reads, the
transfer and the matmul FLOPs of a prefill, and the times and rates they bound.

Weights are counted as the published checkpoints store them (the model's layout, hybrid/model/): Linear weights in
FP8 E4M3 with one FP32 scale per block (BF16 and no scales when `fp8_block` is None); routed experts in INT4 where
`expert_group` is set (compressed-tensors' packing: int32 words of 8 values per row, a BF16 scale per group); norms,
the router, the embedding and lm_head in BF16; the router's score-correction bias in FP32. A FLOP is a multiply or an
add (a GEMM of M x N x K is 2MNK).
"""
from __future__ import annotations

from typing import Optional

from hybrid.model.args import ModelArgs

BF16, FP32 = 2, 4  # bytes per element


def gemm_flops(m: int, n: int, k: int) -> int:
    """FLOPs of an [M, K] x [K, N] matrix product."""
    return 2 * m * n * k


# ------------------------------------------------------------------------------------------------------- bytes

def scale_bytes(n: int, k: int, block: Optional[tuple[int, int]]) -> int:
    """The FP32 block scales of an [N, K] FP8 weight (blocks ragged at the edges); 0 without blocks."""
    if not block:
        return 0
    return FP32 * -(-n // block[0]) * -(-k // block[1])


def linear_bytes(n: int, k: int, block: Optional[tuple[int, int]]) -> int:
    """An [N, K] Linear weight as stored: FP8 plus its scales, or BF16."""
    return n * k * (1 if block else BF16) + scale_bytes(n, k, block)


def mlp_bytes(dim: int, inter: int, block: Optional[tuple[int, int]]) -> int:
    """A gated MLP (gate and up [inter, dim], down [dim, inter]) as stored."""
    return 2 * linear_bytes(inter, dim, block) + linear_bytes(dim, inter, block)


def int4_linear_bytes(n: int, k: int, group: int) -> int:
    """An [N, K] INT4 weight as packed: ceil(K/8) int32 words and ceil(K/group) BF16 scales per row."""
    return n * (FP32 * -(-k // 8) + BF16 * -(-k // group))


def expert_bytes(a: ModelArgs) -> int:
    """One routed expert's weights with their scales (INT4: the packed words and group scales)."""
    d, i, blk = a.hidden_size, a.moe_intermediate_size, a.fp8_block
    if a.expert_group:
        return 2 * int4_linear_bytes(i, d, a.expert_group) + int4_linear_bytes(d, i, a.expert_group)
    return a.expert_bytes + 2 * scale_bytes(i, d, blk) + scale_bytes(d, i, blk)


def routed_bytes(a: ModelArgs) -> int:
    """Every routed expert of every MoE layer."""
    return a.n_moe_layers * a.n_routed_experts * expert_bytes(a)


def attention_bytes(a: ModelArgs) -> int:
    """One layer's MLA weights, its norms (q_a_layernorm, kv_a_layernorm) included."""
    d, h, r, blk = a.hidden_size, a.num_attention_heads, a.q_lora_rank, a.fp8_block
    if r:
        q = linear_bytes(r, d, blk) + BF16 * r + linear_bytes(h * a.qk_head_dim, r, blk)
    else:
        q = linear_bytes(h * a.qk_head_dim, d, blk)
    return (q + linear_bytes(a.kv_lora_rank + a.qk_rope_head_dim, d, blk) + BF16 * a.kv_lora_rank
            + linear_bytes(h * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank, blk)
            + linear_bytes(d, h * a.v_head_dim, blk))


def layer_bytes(a: ModelArgs, layer: int) -> int:
    """One decoder layer without its routed experts: norms, attention, and the dense MLP or the router and the
    shared experts."""
    d, blk = a.hidden_size, a.fp8_block
    if a.is_moe_layer(layer):
        mlp = (BF16 * a.n_routed_experts * d + FP32 * a.n_routed_experts
               + mlp_bytes(d, a.moe_intermediate_size * a.n_shared_experts, blk))
    else:
        mlp = mlp_bytes(d, a.intermediate_size, blk)
    return 2 * BF16 * d + attention_bytes(a) + mlp


def embedding_bytes(a: ModelArgs) -> int:
    return BF16 * a.vocab_size * a.hidden_size


def non_expert_bytes(a: ModelArgs, embedding: bool = False) -> int:
    """Every weight but the routed experts (the GPU side's): the layers, the final norm and lm_head, and the
    embedding when asked."""
    layers = sum(layer_bytes(a, i) for i in range(a.num_hidden_layers))
    lm_head = BF16 * a.vocab_size * a.hidden_size
    return layers + BF16 * a.hidden_size + lm_head + (embedding_bytes(a) if embedding else 0)


# ------------------------------------------------------------------------------------------------------ decode

def active_experts(n_experts: int, top_k: int, tokens: int) -> float:
    """Distinct experts of a layer that `tokens` tokens activate on average, each choosing top_k of n_experts
    uniformly: E·(1-(1-k/E)^tokens)."""
    if n_experts <= 0:
        return 0.0
    return n_experts * (1.0 - (1.0 - top_k / n_experts) ** tokens)


def decode_step_bytes(a: ModelArgs, batch: int, whole_model: bool) -> float:
    """Weight bytes the CPU reads per decode step of `batch` sequences: the routed experts the batch activates, on
    average, in every MoE layer, plus, when the CPU runs the GPU side too (`whole_model`), every other weight but
    the embedding (one row per token)."""
    routed = a.n_moe_layers * active_experts(a.n_routed_experts, a.num_experts_per_tok, batch) * expert_bytes(a)
    return routed + (non_expert_bytes(a) if whole_model else 0)


def cpu_decode_bytes(a: ModelArgs, batch: int = 1, kv_b_dense: bool = True, lm_head_fp8: bool = False
                     ) -> dict[str, float]:
    """Weight bytes one decode step reads when the CPU runs the whole model, by part (attention, dense_mlp,
    router, shared_experts, routed_experts, lm_head; norms in attention): the routed experts the batch activates
    on average; kv_b as the two BF16 halves the CPU path keeps (`kv_b_dense`) instead of its FP8 form; lm_head in
    BF16, or in 128x128 block-scaled FP8 (`lm_head_fp8`). The embedding (a row per token) is left out."""
    d, h, blk = a.hidden_size, a.num_attention_heads, a.fp8_block
    kv_b_n = h * (a.qk_nope_head_dim + a.v_head_dim)
    kv_b_extra = BF16 * kv_b_n * a.kv_lora_rank - linear_bytes(kv_b_n, a.kv_lora_rank, blk) if kv_b_dense and blk else 0
    n_layers, n_moe = a.num_hidden_layers, a.n_moe_layers
    lm_block = (128, 128) if lm_head_fp8 else None
    return {
        "attention": n_layers * (attention_bytes(a) + 2 * BF16 * d + kv_b_extra),
        "dense_mlp": (n_layers - n_moe) * mlp_bytes(d, a.intermediate_size, blk),
        "router": n_moe * (BF16 * a.n_routed_experts * d + FP32 * a.n_routed_experts),
        "shared_experts": n_moe * mlp_bytes(d, a.moe_intermediate_size * a.n_shared_experts, blk),
        "routed_experts": n_moe * active_experts(a.n_routed_experts, a.num_experts_per_tok, batch) * expert_bytes(a),
        "lm_head": BF16 * d + linear_bytes(a.vocab_size, d, lm_block),
    }


def read_seconds(nbytes: float, gbs: float) -> float:
    """Seconds to move `nbytes` at `gbs` GB/s."""
    if gbs <= 0:
        raise ValueError(f"a rate of {gbs} GB/s bounds nothing: it must be > 0")
    return nbytes / (gbs * 1e9)


def decode_tok_s_bound(step_bytes: float, roof_gbs: float, batch: int) -> float:
    """Tokens per second of decoding `batch` sequences when each step reads `step_bytes` at the read roof."""
    if step_bytes <= 0:
        raise ValueError(f"the decode bound needs the bytes a step reads, got {step_bytes}: it bounds nothing")
    return batch * roof_gbs * 1e9 / step_bytes


# ----------------------------------------------------------------------------------------------------- prefill

def transfer_seconds(a: ModelArgs, h2d_gbs: float) -> float:
    """Stream-loading prefill's transfer: every routed expert of every MoE layer once, at `h2d_gbs` GB/s."""
    return read_seconds(routed_bytes(a), h2d_gbs)


def projection_flops(a: ModelArgs, n: int, layers: Optional[int] = None) -> float:
    """Attention's projections for n tokens (query, latent key-value, keys and values expanded as prefill does,
    output), all layers or `layers`."""
    d, h = a.hidden_size, a.num_attention_heads
    q = (gemm_flops(n, a.q_lora_rank, d) + gemm_flops(n, h * a.qk_head_dim, a.q_lora_rank) if a.q_lora_rank
         else gemm_flops(n, h * a.qk_head_dim, d))
    per_layer = (q + gemm_flops(n, a.kv_lora_rank + a.qk_rope_head_dim, d)
                 + gemm_flops(n, h * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank)
                 + gemm_flops(n, d, h * a.v_head_dim))
    return per_layer * (a.num_hidden_layers if layers is None else layers)


def attention_flops(a: ModelArgs, n: int, layers: Optional[int] = None) -> float:
    """Causal attention itself (scores and values over the causal triangle) for n tokens, all layers or `layers`."""
    per_layer = 2 * n * (n + 1) / 2 * a.num_attention_heads * (a.qk_head_dim + a.v_head_dim)
    return per_layer * (a.num_hidden_layers if layers is None else layers)


def mlp_flops(a: ModelArgs, n: int) -> float:
    """The dense layers' MLPs and the MoE layers' shared experts for n tokens."""
    dense = a.num_hidden_layers - a.n_moe_layers
    return (dense * 3 * gemm_flops(n, a.intermediate_size, a.hidden_size)
            + a.n_moe_layers * a.n_shared_experts * 3 * gemm_flops(n, a.moe_intermediate_size, a.hidden_size))


def routed_expert_flops(a: ModelArgs, n: int) -> float:
    """The routed experts for n tokens, top-k per token in every MoE layer."""
    return a.n_moe_layers * a.num_experts_per_tok * 3 * gemm_flops(n, a.moe_intermediate_size, a.hidden_size)


def logits_flops(a: ModelArgs, tokens: int = 1) -> float:
    """lm_head over `tokens` tokens (prefill: the last one)."""
    return gemm_flops(tokens, a.vocab_size, a.hidden_size)


def prefill_flops(a: ModelArgs, n: int) -> float:
    """Matmul FLOPs of prefilling n tokens: attention projections, causal attention, dense MLPs and shared experts,
    routed experts, the last token's logits (the router's few are left out)."""
    return (projection_flops(a, n) + attention_flops(a, n) + mlp_flops(a, n) + routed_expert_flops(a, n)
            + logits_flops(a))


def prefill_bound_seconds(transfer_s: float, flops: float, matmul_tflops: float, attention: float = 0.0,
                          attention_tflops: Optional[float] = None) -> float:
    """The slower of the transfer and the compute: `flops` at the matmul rate, or, given `attention_tflops`, the
    `attention` FLOPs among them at that rate and the rest at the matmul rate."""
    if matmul_tflops <= 0 or (attention_tflops is not None and attention_tflops <= 0):
        raise ValueError(f"FLOP rates must be > 0, got {matmul_tflops} and {attention_tflops} TFLOP/s")
    if attention_tflops is None:
        compute = flops / (matmul_tflops * 1e12)
    else:
        compute = (flops - attention) / (matmul_tflops * 1e12) + attention / (attention_tflops * 1e12)
    return max(transfer_s, compute)


# ------------------------------------------------------------------------------------------ prefill on two GPUs

def parallel_prefill_bound_seconds(routed: float, flops: float, h2d_gbs: float, matmul_tflops: float,
                                   gpus: int = 2) -> float:
    """Stream-loading prefill over `gpus` GPUs, each moving its share of the routed experts (`routed` bytes in all)
    and computing its share of the FLOPs: max(routed ÷ (gpus × H2D rate), flops ÷ (gpus × matmul rate)); the
    exchanges between the GPUs are left out."""
    if gpus < 1:
        raise ValueError(f"a prefill over {gpus} GPUs bounds nothing: it needs at least one")
    return prefill_bound_seconds(read_seconds(routed, gpus * h2d_gbs), flops, gpus * matmul_tflops)


def smallep_link_bytes(n: int, hidden: int, gpus: int = 2, element: int = BF16) -> float:
    """Bytes each GPU receives per MoE layer under SmallEP (n tokens in all, spread evenly): the other GPUs' tokens
    (all-gather), then their partial sums of its own tokens (the exchange)."""
    return 2 * n * hidden * element * (gpus - 1) / gpus


def ep_link_bytes(n: int, hidden: int, top_k: int, gpus: int = 2, element: int = BF16) -> float:
    """Bytes each GPU receives per MoE layer under standard expert parallelism, routing uniform: the (token, pick)
    rows for its experts from the other GPUs, then its own rows' results back from them."""
    return 2 * n * top_k * hidden * element * (gpus - 1) / gpus ** 2
