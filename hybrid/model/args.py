"""ModelArgs: the architecture of a DeepSeek-V3-family checkpoint, read from its Hugging Face config.json.

Both config forms are accepted: the releases' (`rope_theta` + a `rope_scaling` dict of type yarn) and the one
transformers 5 writes (`rope_parameters`). Routing fields are never defaulted silently.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from hybrid.errors import CheckpointError, UnsupportedArchitecture
from hybrid.quant import int4

SUPPORTED_MODEL_TYPES = ("deepseek_v3", "kimi_k2")
SUPPORTED_ARCHITECTURES = ("DeepseekV3ForCausalLM",)
# transformers' DeepseekV3 hard-codes this routing; a config it wrote may leave the fields out.
TRANSFORMERS_ROUTING = {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}
REQUIRED = (
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
    "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "n_group", "topk_group",
    "routed_scaling_factor", "norm_topk_prob", "first_k_dense_replace",
)


@dataclass(frozen=True)
class RopeArgs:
    theta: float
    factor: float = 1.0  # YaRN scaling factor; 1 = plain RoPE
    original_max_position: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0

    @property
    def is_yarn(self) -> bool:
        return self.factor > 1.0


@dataclass(frozen=True)
class ModelArgs:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    first_k_dense_replace: int
    num_attention_heads: int
    q_lora_rank: Optional[int]
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    rope: RopeArgs
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    fp8_block: Optional[tuple[int, int]] = (128, 128)  # None = BF16 checkpoint
    expert_group: Optional[int] = None  # routed experts in INT4 with this group size (hybrid/quant/int4.py)
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[int] = None

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim ** -0.5
        if self.rope.is_yarn and self.rope.mscale_all_dim:
            m = 0.1 * self.rope.mscale_all_dim * math.log(self.rope.factor) + 1.0
            scale *= m * m
        return scale

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    @property
    def n_moe_layers(self) -> int:
        return sum(map(self.is_moe_layer, range(self.num_hidden_layers)))

    @property
    def expert_bytes(self) -> int:
        """One routed expert's weights as stored (gate, up, down; INT4, FP8 or BF16; scales left out)."""
        n = 3 * self.hidden_size * self.moe_intermediate_size
        return n // 2 if self.expert_group else n * (1 if self.fp8_block else 2)

    @staticmethod
    def from_hf_config(cfg: dict[str, Any], source: str = "config.json") -> "ModelArgs":
        _check_architecture(cfg, source)
        missing = [k for k in REQUIRED if k not in cfg]
        if missing:
            raise CheckpointError(f"{source}: missing required field(s) {', '.join(missing)}")
        _check_routing(cfg, source)
        if cfg["n_routed_experts"] % cfg["n_group"]:
            raise CheckpointError(
                f"{source}: n_routed_experts={cfg['n_routed_experts']} is not divisible by n_group={cfg['n_group']}"
            )
        if not 1 <= cfg["topk_group"] <= cfg["n_group"]:
            raise CheckpointError(f"{source}: topk_group={cfg['topk_group']} must be in 1..n_group={cfg['n_group']}")
        return ModelArgs(
            model_type=cfg.get("model_type", "deepseek_v3"),
            q_lora_rank=cfg.get("q_lora_rank"),
            rope=_rope_args(cfg, source),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            fp8_block=_fp8_block(cfg, source),
            expert_group=int4.expert_group(cfg.get("quantization_config"), source),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=_first(cfg.get("eos_token_id")),
            **{k: cfg[k] for k in REQUIRED},
        )

    @staticmethod
    def from_file(path: Path) -> "ModelArgs":
        try:
            cfg = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise CheckpointError(f"{path}: not found (a Hugging Face checkpoint directory needs a config.json)")
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: not valid JSON ({e})")
        return ModelArgs.from_hf_config(cfg, str(path))


def _first(v: Any) -> Any:
    return v[0] if isinstance(v, list) and v else v


def _check_architecture(cfg: dict, source: str) -> None:
    archs = cfg.get("architectures") or []
    mtype = cfg.get("model_type")
    if mtype in SUPPORTED_MODEL_TYPES or any(a in SUPPORTED_ARCHITECTURES for a in archs):
        return
    raise UnsupportedArchitecture(
        f"{source}: unsupported architecture (model_type={mtype!r}, architectures={archs}); hybrid runs "
        f"model_type {' / '.join(SUPPORTED_MODEL_TYPES)} ({', '.join(SUPPORTED_ARCHITECTURES)})"
    )


def _check_routing(cfg: dict, source: str) -> None:
    written_by_transformers = "rope_parameters" in cfg
    for key, expected in TRANSFORMERS_ROUTING.items():
        value = cfg.get(key)
        if value is None and not written_by_transformers:
            raise CheckpointError(f"{source}: routing field {key!r} is missing (expected {expected!r})")
        if value is not None and value != expected:
            raise UnsupportedArchitecture(f"{source}: {key}={value!r} is not supported (only {expected!r})")


def _rope_args(cfg: dict, source: str) -> RopeArgs:
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or params
    theta = cfg.get("rope_theta", params.get("rope_theta"))
    if theta is None:
        raise CheckpointError(f"{source}: rope_theta is missing (neither rope_theta nor rope_parameters.rope_theta)")
    kind = scaling.get("type", scaling.get("rope_type", "default"))
    if kind in ("default", None):
        return RopeArgs(theta=float(theta))
    if kind != "yarn":
        raise UnsupportedArchitecture(f"{source}: rope scaling type {kind!r} is not supported (only yarn)")
    return RopeArgs(
        theta=float(theta),
        factor=float(scaling["factor"]),
        original_max_position=int(scaling.get("original_max_position_embeddings", 4096)),
        beta_fast=float(scaling.get("beta_fast", 32)),
        beta_slow=float(scaling.get("beta_slow", 1)),
        mscale=float(scaling.get("mscale", 1.0)),
        mscale_all_dim=float(scaling.get("mscale_all_dim", 0.0)),
    )


def _fp8_block(cfg: dict, source: str) -> Optional[tuple[int, int]]:
    q = cfg.get("quantization_config")
    if not q or q.get("quant_method") == "compressed-tensors":  # INT4 experts, the rest BF16
        return None
    if q.get("quant_method") != "fp8" or q.get("fmt", "e4m3") != "e4m3":
        raise UnsupportedArchitecture(
            f"{source}: quantization {q.get('quant_method')!r}/{q.get('fmt')!r} is not supported (only fp8 e4m3 "
            "or compressed-tensors INT4)"
        )
    block = tuple(q.get("weight_block_size") or (128, 128))
    if len(block) != 2:
        raise CheckpointError(f"{source}: weight_block_size must have two entries, got {list(block)}")
    return block
