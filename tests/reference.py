"""The reference: transformers' DeepseekV3ForCausalLM on our checkpoint's weights, dequantised by us (its own FP8
loader mis-handles weights whose row count is not a multiple of 128; INT4 experts it reads through compressed-tensors,
rounding q·s to BF16)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from hybrid.quant import fp8, int4
from hybrid.weights.checkpoint import Checkpoint


def dequantised_copy(src: Path, dst: Path, dtype=torch.float32) -> Path:
    """`src` as a plain (unquantised) Hugging Face checkpoint in `dtype`, read with the official safetensors."""
    ck = Checkpoint(src)
    block = ck.args.fp8_block
    tensors = {}
    for name in ck.names():
        if name.endswith(("weight_scale_inv", "weight_scale", "weight_shape")):
            continue
        t = ck.tensor(name)
        if t.dtype == fp8.FP8:
            t = fp8.dequantize(t, ck.tensor(name + "_scale_inv"), block, torch.float32)
        if name.endswith("weight_packed"):
            name = name.removesuffix("_packed")
            shape = tuple(ck.tensor(name + "_shape").tolist())
            t = int4.dequantize(t, ck.tensor(name + "_scale"), shape, torch.float32, ck.args.expert_group)
        tensors[name] = t.to(dtype).contiguous()
    dst.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dst / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("quantization_config", None)
    # Kimi-K2 is DeepseekV3ForCausalLM; transformers maps per-expert tensors onto its fused expert weights only
    # under the deepseek_v3 model type.
    cfg["model_type"] = "deepseek_v3"
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def reference_model(src: Path, dst: Path, dtype=torch.float32):
    from transformers import DeepseekV3ForCausalLM

    model = DeepseekV3ForCausalLM.from_pretrained(str(dequantised_copy(src, dst, dtype)), dtype=dtype)
    return model.eval()
