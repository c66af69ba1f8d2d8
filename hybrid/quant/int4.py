"""INT4 weights in compressed-tensors' `pack-quantized` format, as Kimi-K2-Thinking publishes its routed experts.

W = q · s: q a symmetric 4-bit integer in [-8, 7], s one scale per group of 32 input values (ragged at the end of a
row). Stored per Linear as
- `weight_packed` int32 [N, ceil(K/8)]: q + 8 as unsigned nibbles, element k at bit 4·(k % 8) of word k // 8 (so,
  little-endian, byte j of a row holds elements 2j (low nibble) and 2j + 1 (high)); a row's last word is padded with
  zero nibbles;
- `weight_scale` [N, ceil(K/32)]: BF16 as published (F32 and F16 are read too);
- `weight_shape` int [2]: (N, K).
Layers in the config's `ignore` list are kept unquantised (BF16).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

import torch

from hybrid.errors import UnsupportedArchitecture

GROUP = 32
PER_WORD = 8  # 4-bit values per int32 word
OFFSET = 8  # stored nibble = q + 8
TENSORS = ("weight_packed", "weight_scale", "weight_shape")
SHAPE_DTYPES = (torch.int32, torch.int64)

# The one scheme taken: the weights' fields that must have these values (missing: compressed-tensors' default).
SCHEME = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP, "dynamic": False}
DEFAULTS = {"type": "int", "symmetric": True, "dynamic": False}

# One name of each Linear of the DeepSeek-V3 family (hybrid/model/), dense layer 0 and MoE layer 1, as
# compressed-tensors matches them; only the routed experts may be quantised.
_ATTENTION = ("q_a_proj", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
LINEARS = (["lm_head"] + [f"model.layers.{i}.self_attn.{p}" for i in (0, 1) for p in _ATTENTION]
           + [f"model.layers.0.mlp.{p}" for p in _MLP] + [f"model.layers.1.mlp.shared_experts.{p}" for p in _MLP])
ROUTED = [f"model.layers.1.mlp.experts.0.{p}" for p in _MLP]

# Kimi-K2-Thinking's quantization_config (config.json), which generated INT4 checkpoints write.
KIMI_K2_THINKING = {
    "config_groups": {"group_0": {
        "input_activations": None, "output_activations": None, "targets": ["Linear"],
        "weights": {"actorder": None, "block_structure": None, "dynamic": False, "group_size": GROUP,
                    "num_bits": 4, "observer": "minmax", "observer_kwargs": {}, "strategy": "group",
                    "symmetric": True, "type": "int"},
    }},
    "format": "pack-quantized",
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"],
    "kv_cache_scheme": None,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
}


def packed_shape(shape: tuple[int, int]) -> tuple[int, int]:
    return (shape[0], -(-shape[1] // PER_WORD))


def scale_shape(shape: tuple[int, int], group: int = GROUP) -> tuple[int, int]:
    return (shape[0], -(-shape[1] // group))


def unpack(packed: torch.Tensor, k: int) -> torch.Tensor:
    """q (int8 [N, k]) from the packed words."""
    nibbles = packed.contiguous().view(torch.uint8)
    q = torch.stack((nibbles & 0xF, nibbles >> 4), dim=-1).view(packed.shape[0], -1)[:, :k]
    return q.to(torch.int8) - OFFSET


def pack(q: torch.Tensor) -> torch.Tensor:
    """int8 q in [-8, 7] [N, K] -> the packed words [N, ceil(K/8)] (the row's last word padded with zero nibbles)."""
    n, k = q.shape
    u = torch.zeros(n, packed_shape((n, k))[1] * PER_WORD, dtype=torch.uint8)
    u[:, :k] = (q.to(torch.int16) + OFFSET).to(torch.uint8)
    return (u[:, 0::2] | (u[:, 1::2] << 4)).contiguous().view(torch.int32)


def expand_scale(scale: torch.Tensor, k: int, group: int = GROUP) -> torch.Tensor:
    """The group scales broadcast to one value per weight element."""
    return scale.repeat_interleave(group, 1)[:, :k]


def dequantize(packed: torch.Tensor, scale: torch.Tensor, shape: tuple[int, int], dtype=torch.bfloat16,
               group: int = GROUP) -> torch.Tensor:
    """q·s with the product formed in FP32 (exact for BF16 scales), then one rounding to `dtype`: compressed-tensors'
    own (q·s in the scale's dtype) when `dtype` is the scale's."""
    n, k = shape
    q = unpack(packed, k).to(torch.float32)
    s = scale.to(torch.float32)
    if k % group == 0:
        return (q.view(n, -1, group) * s[:, :, None]).view(n, k).to(dtype)
    return (q * expand_scale(s, k, group)).to(dtype)


@dataclass(frozen=True)
class Int4Format:
    group: int
    ignore: tuple[str, ...]

    def quantised(self, name: str) -> bool:
        """Whether the Linear `name` is stored in INT4 (compressed-tensors' matching: `re:` + a regex matched from
        the name's start, else the exact name)."""
        return not any(_matches(name, p) for p in self.ignore)


def _matches(name: str, pattern: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern.removeprefix("re:"), name) is not None
    return pattern == name


def read_config(q: dict, source: str) -> Int4Format:
    """The INT4 format of a `compressed-tensors` quantization_config; the variants not taken (another format, bit
    width, group size, asymmetric, activations quantised, several groups, layers other than the routed experts
    quantised) raise UnsupportedArchitecture naming the field."""
    def refuse(what: str) -> UnsupportedArchitecture:
        return UnsupportedArchitecture(f"{source}: quantization_config: {what} is not supported (only "
                                       f"pack-quantized INT4 weights, symmetric, group {GROUP}, on the routed experts)")
    if q.get("format") != "pack-quantized":
        raise refuse(f"format {q.get('format')!r}")
    groups = q.get("config_groups") or {}
    if len(groups) != 1:
        raise refuse(f"{len(groups)} config_groups")
    (name, scheme), = groups.items()
    if scheme.get("input_activations") or scheme.get("output_activations"):
        raise refuse(f"config_groups.{name}: activation quantisation")
    if list(scheme.get("targets") or []) != ["Linear"]:
        raise refuse(f"config_groups.{name}.targets {scheme.get('targets')!r}")
    weights = scheme.get("weights") or {}
    for key, want in SCHEME.items():
        if weights.get(key, DEFAULTS.get(key)) != want:
            raise refuse(f"config_groups.{name}.weights.{key}={weights.get(key)!r} (need {want!r})")
    fmt = Int4Format(GROUP, tuple(q.get("ignore") or ()))
    wrong = [n for n in LINEARS if fmt.quantised(n)] + [n for n in ROUTED if not fmt.quantised(n)]
    if wrong:
        raise refuse(f"the ignore list {list(fmt.ignore)} (it makes {wrong[0]} "
                     f"{'INT4' if fmt.quantised(wrong[0]) else 'BF16'})")
    return fmt


def expert_group(q: Optional[dict], source: str) -> Optional[int]:
    """The routed experts' INT4 group size when `q` is a compressed-tensors config, else None."""
    if not q or q.get("quant_method") != "compressed-tensors":
        return None
    return read_config(q, source).group
