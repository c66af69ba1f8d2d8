"""The benchmarks' bounds (hybrid/bench/bounds.py) against hand arithmetic on DeepSeek-V3's dimensions, against the
model's own tensors (the real layout on the meta device, the tiny checkpoint loaded), and against torch's FLOP
counter."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from hybrid.bench import bounds
from hybrid.model.args import ModelArgs
from hybrid.model.moe import RoutedExperts
from hybrid.model.transformer import Transformer
from hybrid.weights.presets import DEEPSEEK_V3, KIMI_K2_THINKING

V3 = ModelArgs.from_hf_config(DEEPSEEK_V3)
# DeepSeek-V3 by hand: hidden 7168, expert intermediate 2048, 256 experts top-8, 61 layers of which the first 3 are
# dense (intermediate 18432), 128 heads, q rank 1536, kv rank 512, head dims 128 (no rope) + 64 (rope), values 128,
# vocabulary 129280, FP8 weights with one FP32 scale per 128x128 block.
EXPERT = 3 * 2048 * 7168 + 3 * (16 * 56) * 4  # gate, up [2048, 7168], down [7168, 2048]: 16 x 56 blocks each
MOE_LAYERS = 61 - 3


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_deepseek_v3_expert_bytes_with_scales():
    assert EXPERT == 44_050_944
    assert V3.expert_bytes == 44_040_192, "ModelArgs leaves the scales out"
    assert bounds.expert_bytes(V3) == EXPERT
    assert bounds.mlp_bytes(7168, 2048, (128, 128)) == EXPERT
    assert bounds.routed_bytes(V3) == MOE_LAYERS * 256 * EXPERT == 654_068_416_512
    assert bounds.scale_bytes(576, 7168, (128, 128)) == 5 * 56 * 4, "ragged blocks count whole"
    assert bounds.linear_bytes(576, 7168, None) == 576 * 7168 * 2 and bounds.scale_bytes(576, 7168, None) == 0


def test_deepseek_v3_weights_but_the_routed_experts():
    attention = (1536 * 7168 + 12 * 56 * 4            # q_a_proj
                 + 1536 * 2                             # q_a_layernorm
                 + 128 * 192 * 1536 + 192 * 12 * 4      # q_b_proj
                 + 576 * 7168 + 5 * 56 * 4              # kv_a_proj_with_mqa
                 + 512 * 2                              # kv_a_layernorm
                 + 128 * 256 * 512 + 256 * 4 * 4        # kv_b_proj
                 + 7168 * 128 * 128 + 56 * 128 * 4)     # o_proj
    assert bounds.attention_bytes(V3) == attention
    norms = 2 * 7168 * 2
    dense_mlp = 3 * 18432 * 7168 + 3 * (144 * 56) * 4
    moe = 256 * 7168 * 2 + 256 * 4 + EXPERT  # router (BF16) and its FP32 bias, one shared expert
    lm_head = 129280 * 7168 * 2
    want = 61 * (attention + norms) + 3 * dense_mlp + MOE_LAYERS * moe + 7168 * 2 + lm_head
    assert bounds.non_expert_bytes(V3) == want == 17_228_837_216
    assert bounds.non_expert_bytes(V3, embedding=True) == want + 129280 * 7168 * 2


def test_deepseek_v3_bytes_match_the_models_own_layout():
    with torch.device("meta"):
        state = Transformer(V3).state_dict()
    routed = {k: v for k, v in state.items() if ".mlp.experts." in k}
    assert _nbytes(v for k, v in routed.items() if ".mlp.experts.0." in k and "layers.3." in k) == \
        bounds.expert_bytes(V3)
    assert _nbytes(routed.values()) == bounds.routed_bytes(V3)
    rest = {k: v for k, v in state.items() if k not in routed}
    assert _nbytes(rest.values()) == bounds.non_expert_bytes(V3, embedding=True)
    assert _nbytes(v for k, v in rest.items() if k != "model.embed_tokens.weight") == bounds.non_expert_bytes(V3)


def test_kimi_k2_thinking_int4_expert_bytes_match_the_models_own_layout():
    """INT4 experts: half a byte per weight and a BF16 scale per 32 inputs (the recorded shapes, 16 bytes a Linear,
    are left out: they never stream); the rest BF16."""
    a = ModelArgs.from_hf_config(KIMI_K2_THINKING)
    assert bounds.expert_bytes(a) == 3 * 2048 * 7168 // 2 + 3 * 2048 * 7168 // 32 * 2 == 24_772_608
    assert bounds.int4_linear_bytes(100, 200, 32) == 100 * (25 * 4 + 7 * 2), "ragged words and groups count whole"
    args = dataclasses.replace(a, num_hidden_layers=3, first_k_dense_replace=1, vocab_size=1024)
    with torch.device("meta"):
        state = Transformer(args).state_dict()
    routed = {k: v for k, v in state.items() if ".mlp.experts." in k}
    assert _nbytes(v for k, v in routed.items() if not k.endswith("weight_shape")) == bounds.routed_bytes(args)
    rest = {k: v for k, v in state.items() if k not in routed}
    assert _nbytes(rest.values()) == bounds.non_expert_bytes(args, embedding=True)


def test_tiny_bytes_match_the_loaded_checkpoint(tiny_model):
    """Dimensions that are not multiples of 128 (ragged scale blocks), as loaded from a checkpoint."""
    a, m = tiny_model.args, tiny_model
    layers = [x for x in m.modules() if isinstance(x, RoutedExperts)]
    assert len(layers) == a.n_moe_layers == 2
    assert all(_nbytes(e.state_dict().values()) == bounds.expert_bytes(a) for layer in layers for e in layer)
    rest = [t for k, t in m.state_dict().items() if ".mlp.experts." not in k and k != "model.embed_tokens.weight"]
    assert _nbytes(rest) == bounds.non_expert_bytes(a)


def test_active_experts():
    assert bounds.active_experts(256, 8, 1) == 8.0
    assert bounds.active_experts(256, 8, 2) == pytest.approx(256 * 63 / 1024)  # 256·(1-(31/32)²) = 15.75
    assert bounds.active_experts(256, 8, 4) == pytest.approx(125055 / 4096)  # 256 - 256·31⁴/32⁴
    assert bounds.active_experts(256, 8, 10_000) == pytest.approx(256)
    assert bounds.active_experts(0, 8, 4) == 0.0
    g = torch.Generator().manual_seed(0)
    seen = [len({int(e) for _ in range(4) for e in torch.randperm(256, generator=g)[:8]}) for _ in range(3000)]
    assert sum(seen) / len(seen) == pytest.approx(125055 / 4096, abs=0.15), "distinct experts of 4 tokens, sampled"


def test_decode_step_bytes_and_bound():
    hybrid = MOE_LAYERS * 8 * EXPERT  # one token: 8 experts in each MoE layer
    assert bounds.decode_step_bytes(V3, 1, whole_model=False) == pytest.approx(hybrid) == 20_439_638_016
    assert bounds.decode_step_bytes(V3, 1, whole_model=True) == pytest.approx(hybrid + 17_228_837_216)
    assert bounds.decode_step_bytes(V3, 4, whole_model=False) == pytest.approx(MOE_LAYERS * 125055 / 4096 * EXPERT)
    assert bounds.decode_tok_s_bound(hybrid, 84.0, 1) == pytest.approx(84e9 / hybrid)  # ~4.1 tok/s
    assert bounds.decode_tok_s_bound(1e9, 10.0, 4) == pytest.approx(40.0)
    with pytest.raises(ValueError, match="bytes a step reads, got 0"):
        bounds.decode_tok_s_bound(0, 84.0, 1)
    assert bounds.read_seconds(2e9, 50.0) == pytest.approx(0.04)
    with pytest.raises(ValueError, match="GB/s"):
        bounds.read_seconds(1e9, 0.0)


def test_deepseek_v3_prefill_flops_by_hand():
    n = 4096
    projections = 7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 * 128 * 256 + 128 * 128 * 7168  # per token
    attention = n * (n + 1) / 2 * 128 * (192 + 128) * 2  # scores and values over the causal pairs, per layer
    dense = 3 * 7168 * 18432  # per token
    expert = 3 * 7168 * 2048
    assert bounds.projection_flops(V3, n) == 61 * 2 * n * projections
    assert bounds.attention_flops(V3, n) == 61 * attention
    assert bounds.mlp_flops(V3, n) == 2 * n * (3 * dense + MOE_LAYERS * expert)
    assert bounds.routed_expert_flops(V3, n) == 2 * n * MOE_LAYERS * 8 * expert
    assert bounds.logits_flops(V3) == 2 * 7168 * 129280
    total = 2 * n * (61 * projections + 3 * dense + MOE_LAYERS * 9 * expert) + 61 * attention + 2 * 7168 * 129280
    assert bounds.prefill_flops(V3, n) == pytest.approx(total, rel=1e-12)
    assert total == pytest.approx(3.335e14, rel=1e-3)  # a third of a PFLOP
    assert bounds.gemm_flops(8192, 2048, 7168) == 2 * 8192 * 2048 * 7168


def test_prefill_bounds():
    assert bounds.transfer_seconds(V3, 55.0) == pytest.approx(654_068_416_512 / 55e9)  # ~11.9 s
    assert bounds.prefill_bound_seconds(2.0, 1e15, 500.0) == 2.0, "the transfer dominates"
    assert bounds.prefill_bound_seconds(1.0, 1e15, 500.0) == pytest.approx(2.0), "the compute dominates"
    # 4e14 of the 1e15 FLOPs are attention's, at 200 TFLOP/s: 6e14 / 5e14 + 4e14 / 2e14
    assert bounds.prefill_bound_seconds(1.0, 1e15, 500.0, 4e14, 200.0) == pytest.approx(1.2 + 2.0)
    with pytest.raises(ValueError, match="TFLOP/s"):
        bounds.prefill_bound_seconds(1.0, 1e15, 0.0)


@pytest.mark.parametrize("n", [16, 64])
def test_prefill_flops_agree_with_torchs_flop_counter(tiny_model, n):
    tokens = torch.randint(2, 300, (1, n), generator=torch.Generator().manual_seed(n))
    with FlopCounterMode(display=False) as counter:
        tiny_model(tokens, torch.arange(n)[None], last_only=True)
    # the counter also sees the router and the masked half of the attention square, which the bound leaves out
    assert 1.0 <= counter.get_total_flops() / bounds.prefill_flops(tiny_model.args, n) < 1.05


def test_attention_flops_are_the_quadratic_part_of_the_prefill_count(tiny_model):
    a = tiny_model.args
    one_token = 2 * a.num_attention_heads * (a.qk_head_dim + a.v_head_dim)  # scores + values, attending itself
    assert bounds.attention_flops(a, 1, layers=1) == one_token
    assert bounds.attention_flops(a, 100) == a.num_hidden_layers * one_token * 100 * 101 / 2
    rest = [bounds.prefill_flops(a, n) - bounds.attention_flops(a, n) for n in (10, 20, 30)]
    assert rest[2] - rest[1] == pytest.approx(rest[1] - rest[0])  # what is left grows linearly with the prompt


def test_two_gpu_prefill_bound_and_the_traffic_of_smallep_against_ep():
    routed, flops = bounds.routed_bytes(V3), bounds.prefill_flops(V3, 32768)
    transfer_bound = routed / (2 * 55e9)  # both GPUs' links: 654 GB over 2 x 55 GB/s
    assert bounds.parallel_prefill_bound_seconds(routed, flops, 55.0, 1e9) == pytest.approx(transfer_bound)
    assert bounds.parallel_prefill_bound_seconds(routed, flops, 1e9, 400.0) == pytest.approx(flops / 800e12)
    assert bounds.parallel_prefill_bound_seconds(routed, flops, 55.0, 400.0, gpus=1) == \
        bounds.prefill_bound_seconds(bounds.transfer_seconds(V3, 55.0), flops, 400.0)
    with pytest.raises(ValueError, match="at least one"):
        bounds.parallel_prefill_bound_seconds(routed, flops, 55.0, 400.0, gpus=0)
    n, d = 32768, 7168
    assert bounds.smallep_link_bytes(n, d) == n * d * 2, "half the tokens gathered + half the partials, BF16"
    assert bounds.ep_link_bytes(n, d, 8) == 4 * n * d * 2, "N·A·D/S with A = 8, S = 2"
    assert bounds.ep_link_bytes(n, d, 2) == bounds.smallep_link_bytes(n, d), "equal where top-k = GPUs"


def test_cpu_decode_bytes_count_every_weight_as_the_cpu_path_reads_it():
    parts = bounds.cpu_decode_bytes(V3, 1)
    stored = bounds.decode_step_bytes(V3, 1, whole_model=True)
    kv_b = 128 * 256 * 512  # [H (N + V), C] elements
    kv_b_extra = 61 * (2 * kv_b - (kv_b + 4 * 256 * 4))  # BF16 halves in place of FP8 with its 256 x 4 scales
    assert sum(parts.values()) == pytest.approx(stored + kv_b_extra)
    fp8_head = bounds.cpu_decode_bytes(V3, 1, lm_head_fp8=True)["lm_head"]
    assert parts["lm_head"] - fp8_head == 129280 * 7168 - 4 * 1010 * 56
