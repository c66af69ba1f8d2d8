"""INT4 checkpoints (compressed-tensors pack-quantized): our packing, scales and config reading against the
compressed-tensors package's own, the loader's zero-copy reading and its errors, the generated layout."""
from __future__ import annotations

import copy
import re
import shutil

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig
from compressed_tensors.quantization.lifecycle.forward import dequantize as ct_dequantize
from compressed_tensors.utils.match import match_name

from hybrid.errors import CheckpointError, UnsupportedArchitecture
from hybrid.model.layers import Int4Linear
from hybrid.quant import int4
from hybrid.weights.checkpoint import Checkpoint
from hybrid.weights.loader import load_model
from tests.weights.test_checkpoint_errors import _config, _set_tensor, _write_config

EXPERT = "model.layers.1.mlp.experts.5.down_proj"  # (192, 96): 3 groups of 32 per row
SHAPES = [(1, 1), (3, 7), (5, 8), (4, 31), (6, 32), (7, 33), (9, 72), (16, 100), (33, 257), (192, 96), (64, 7168)]


def _q(shape, seed=0) -> torch.Tensor:
    return torch.randint(-8, 8, shape, generator=torch.Generator().manual_seed(seed), dtype=torch.int8)


def _scales(shape, dtype=torch.bfloat16, seed=1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(int4.scale_shape(shape), generator=g) * 0.1 + 1e-3).to(dtype)


# ----------------------------------------------------------------------------------------------- packing

@pytest.mark.parametrize("shape", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_packing_is_compressed_tensors(shape):
    q = _q(shape, shape[0] * 1000 + shape[1])
    theirs = pack_to_int32(q, 4)
    assert torch.equal(int4.pack(q), theirs), f"{shape}: pack differs from pack_to_int32"
    assert theirs.shape == int4.packed_shape(shape)
    assert torch.equal(int4.unpack(theirs, shape[1]), q), f"{shape}: unpack of pack_to_int32's words"
    assert torch.equal(int4.unpack(theirs, shape[1]), unpack_from_int32(theirs, 4, torch.Size(shape)))


def test_nibble_order():
    """Element k at bit 4·(k % 8) of word k // 8, stored as q + 8: [-8, -7, ..., -1] is 0x76543210."""
    q = torch.arange(-8, 8, dtype=torch.int8)[None]
    assert int4.pack(q).tolist() == [[0x76543210, int(torch.tensor(0xFEDCBA98).to(torch.int32))]]


@pytest.mark.parametrize("shape", [(6, 32), (192, 96), (64, 7168), (7, 64)])
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32])
def test_dequantize_is_compressed_tensors(shape, scale_dtype):
    """Bit for bit compressed-tensors' own dequantisation (q·s in the scale's dtype) at that dtype; with BF16 scales
    at float64 the exact product."""
    q, s = _q(shape), _scales(shape, scale_dtype)
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32)
    theirs = ct_dequantize(unpack_from_int32(pack_to_int32(q, 4), 4, torch.Size(shape)), s, args=args)
    ours = int4.dequantize(int4.pack(q), s, shape, scale_dtype)
    assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)
    exact = q.double() * int4.expand_scale(s.double(), shape[1])
    assert scale_dtype != torch.bfloat16 or torch.equal(int4.dequantize(int4.pack(q), s, shape, torch.float64), exact)


def test_ragged_groups_take_the_last_scale():
    """K = 72: columns 64..71 use the third scale of their row (compressed-tensors itself takes whole groups only)."""
    q, s = _q((9, 72)), _scales((9, 72), torch.float32)
    w = int4.dequantize(int4.pack(q), s, (9, 72), torch.float32)
    assert torch.equal(w[:, 64:], q[:, 64:].float() * s[:, 2:3])
    assert torch.equal(w[:, :32], q[:, :32].float() * s[:, :1])


# ------------------------------------------------------------------------------------------------ config

def test_kimi_config_is_compressed_tensors_w4a16_group32():
    cfg = QuantizationConfig.model_validate(int4.KIMI_K2_THINKING)
    w = cfg.config_groups["group_0"].weights
    assert (w.num_bits, w.type, w.symmetric, w.strategy, w.group_size, w.dynamic) == tuple(int4.SCHEME.values())
    assert cfg.format == "pack-quantized" and cfg.quant_method == "compressed-tensors"


def test_ignore_list_matches_as_compressed_tensors_does():
    fmt = int4.read_config(int4.KIMI_K2_THINKING, "config.json")
    for name in int4.LINEARS + int4.ROUTED + ["model.layers.60.mlp.experts.383.up_proj", "model.layers.0.mlp.gate"]:
        theirs = not any(match_name(name, p) for p in int4.KIMI_K2_THINKING["ignore"])
        assert fmt.quantised(name) == theirs, name
    assert fmt.group == 32


def _variant(edit) -> dict:
    q = copy.deepcopy(int4.KIMI_K2_THINKING)
    edit(q, q["config_groups"]["group_0"])
    return q


VARIANTS = {
    "asymmetric": (lambda q, g: g["weights"].update(symmetric=False), "symmetric"),
    "8 bits": (lambda q, g: g["weights"].update(num_bits=8), "num_bits"),
    "group 128": (lambda q, g: g["weights"].update(group_size=128), "group_size"),
    "channel": (lambda q, g: g["weights"].update(strategy="channel"), "strategy"),
    "float": (lambda q, g: g["weights"].update(type="float"), "type"),
    "int-quantized": (lambda q, g: q.update(format="int-quantized"), "format"),
    "nvfp4": (lambda q, g: q.update(format="nvfp4-pack-quantized"), "format"),
    "w4a8": (lambda q, g: g.update(input_activations={"num_bits": 8, "type": "int"}), "activation"),
    "two groups": (lambda q, g: q["config_groups"].update(group_1=g), "config_groups"),
    "shared experts in int4": (lambda q, g: q["ignore"].remove("re:.*shared_experts.*"), "shared_experts"),
    "experts ignored": (lambda q, g: q["ignore"].append("re:.*experts.*"), "experts.0"),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variants_not_taken_are_named(name):
    edit, field = VARIANTS[name]
    with pytest.raises(UnsupportedArchitecture, match=field):
        int4.read_config(_variant(edit), "config.json")


# ----------------------------------------------------------------------------------------------- loading

def test_loads_zero_copy_with_bf16_elsewhere(kimi_int4_dir):
    ck = Checkpoint(kimi_int4_dir)
    a = ck.args
    assert a.expert_group == 32 and a.fp8_block is None
    assert a.expert_bytes == 3 * a.hidden_size * a.moe_intermediate_size // 2
    model = load_model(ck, torch.bfloat16, progress=False)
    lin = model.get_submodule(EXPERT)
    assert isinstance(lin, Int4Linear)
    for t in int4.TENSORS:
        assert getattr(lin, t).data_ptr() == ck.tensor(f"{EXPERT}.{t}").data_ptr(), f"{t} was copied"
    assert model.get_submodule("model.layers.1.mlp.shared_experts.up_proj").weight.dtype == torch.bfloat16
    assert model.get_submodule("model.layers.0.self_attn.o_proj").weight.dtype == torch.bfloat16


def test_generated_layout(kimi_int4_dir):
    ck = Checkpoint(kimi_int4_dir)
    assert _config(kimi_int4_dir)["quantization_config"] == int4.KIMI_K2_THINKING
    packed, scale, shape = (ck.tensor(f"{EXPERT}.{t}") for t in int4.TENSORS)
    assert (packed.dtype, tuple(packed.shape)) == (torch.int32, (192, 12))
    assert (scale.dtype, tuple(scale.shape)) == (torch.bfloat16, (192, 3))
    assert shape.tolist() == [192, 96]
    w = int4.dequantize(packed, scale, (192, 96), torch.float32)
    assert 0.5 < float(w.pow(2).mean().sqrt()) * 96 ** 0.5 < 2, "weights of RMS ~ 1/sqrt(fan_in)"


@pytest.fixture
def damaged(kimi_int4_dir, tmp_path):
    d = shutil.copytree(kimi_int4_dir, tmp_path / "ck")
    yield d
    shutil.rmtree(d)


@pytest.mark.parametrize("tensor,value,words", [
    ("weight_shape", torch.tensor([96, 192]), "records [96, 192]"),
    ("weight_packed", torch.zeros(192, 12, dtype=torch.int64), "dtype torch.int64"),
    ("weight_packed", torch.zeros(192, 24, dtype=torch.int32), "wrong shape"),
    ("weight_scale", torch.zeros(192, 2, dtype=torch.bfloat16), "scale shape mismatch"),
    ("weight_scale", torch.zeros(192, 3, dtype=torch.int32), "dtype torch.int32"),
])
def test_bad_int4_tensors_are_named(damaged, tensor, value, words):
    _set_tensor(damaged, f"{EXPERT}.{tensor}", value)
    with pytest.raises(CheckpointError, match=re.escape(words)) as err:
        load_model(Checkpoint(damaged), progress=False)
    assert f"{EXPERT}.{tensor}" in str(err.value)


def test_unsupported_config_fails_at_open(damaged):
    cfg = _config(damaged)
    cfg["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 128
    _write_config(damaged, cfg)
    with pytest.raises(UnsupportedArchitecture, match="group_size=128"):
        Checkpoint(damaged)
