"""config.json of the published checkpoints, as their releases write them; synthetic models start from these."""
from __future__ import annotations

import copy

from hybrid.quant import int4

_FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}

DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "ep_size": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "quantization_config": _FP8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096, "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 129280,
}

KIMI_K2 = {
    **DEEPSEEK_V3,
    "model_type": "kimi_k2",
    "bos_token_id": 163584,
    "eos_token_id": 163585,
    "first_k_dense_replace": 1,
    "max_position_embeddings": 131072,
    "n_group": 1,
    "n_routed_experts": 384,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "num_nextn_predict_layers": 0,
    "rope_scaling": {
        "beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096, "type": "yarn",
    },
    "rope_theta": 50000.0,
    "routed_scaling_factor": 2.827,
    "topk_group": 1,
    "vocab_size": 163840,
}

# Kimi-K2 with its routed experts in INT4 (compressed-tensors, group 32), the rest BF16
KIMI_K2_THINKING = {**KIMI_K2, "quantization_config": int4.KIMI_K2_THINKING}

PRESETS = {"deepseek_v3": DEEPSEEK_V3, "kimi_k2": KIMI_K2, "kimi_k2_thinking": KIMI_K2_THINKING}
# a base's default family of chat template
CHAT_TEMPLATES = {"deepseek_v3": "deepseek_v3", "kimi_k2": "kimi_k2", "kimi_k2_thinking": "kimi_k2_thinking"}


def chat_family(spec: dict) -> str:
    """The chat template family of a generated checkpoint (`spec['chat_template']`, else its base's):
    hybrid/weights/chat_templates.py."""
    return spec.get("chat_template") or CHAT_TEMPLATES[spec.get("base", "deepseek_v3")]


def hf_config(spec: dict) -> dict:
    """A preset (`spec['base']`) with the spec's config.json fields overriding it."""
    spec = dict(spec)
    base = spec.pop("base", "deepseek_v3")
    if base not in PRESETS:
        raise ValueError(f"model.synthetic.base must be one of {sorted(PRESETS)}, got {base!r}")
    spec.pop("max_shard_mb", None)
    spec.pop("chat_template", None)  # the tokenizer's, not config.json's
    cfg = copy.deepcopy(PRESETS[base])
    for key, value in spec.items():
        if key not in cfg and key not in ("quantization_config",):
            raise ValueError(f"model.synthetic.{key}: not a config.json field of {base}")
        cfg[key] = value
    return cfg
