"""The Kimi-K2-Thinking layout (tiny_kimi_int4: INT4 routed experts, the rest BF16) against transformers, also at
sizes with ragged groups and with a multi-token-prediction layer present (and skipped).

- transformers reading the packed checkpoint itself (through compressed-tensors) holds exactly our BF16
  dequantisation of every routed expert;
- our model against transformers' DeepseekV3ForCausalLM on the same weights dequantised in float32 (q·s exact): the
  FP8 parity tests themselves (tests/model/test_parity.py), with their tolerances, on the torch reference path and
  on the native CPU kernels (policy.cpu.moe_backend=torch / native);
- in BF16 the reference path computes what the checkpoint dequantised to BF16 does, bit for bit.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybrid.engine.engine import Engine
from hybrid.engine.probe import local_plan
from hybrid.engine.requests import SamplingParams
from hybrid.errors import ConfigError
from hybrid.placement.passes import experts_to_cpu_kernels, hot_experts_to_device, pin_experts
from hybrid.weights.checkpoint import Checkpoint
from hybrid.weights.loader import load_model
from hybrid.weights.synthetic import write_checkpoint
from tests.conftest import model_spec
from tests.model.test_parity import pair, reference, test_greedy_generation_matches_reference  # noqa: F401
from tests.model.test_parity import test_prefill_logits_match_reference  # noqa: F401
from tests.reference import dequantised_copy


@pytest.fixture(scope="module")
def ragged_mtp_dir(tmp_path_factory):
    """Kimi-K2-Thinking's layout at sizes that are not whole groups of 32 (hidden 200, expert intermediate 100: each
    row's last group ragged, as our reader takes and compressed-tensors' own does not), with a multi-token-prediction
    layer after the last one (DeepSeek-V3's layout: its own norms, projection and head, and a whole decoder layer,
    INT4 experts included), which inference skips."""
    spec = {**model_spec("tiny_kimi_int4"), "hidden_size": 200, "moe_intermediate_size": 100}
    ck = write_checkpoint(tmp_path_factory.mktemp("ck") / "ragged_mtp", spec, seed=0, progress=False)
    (shard,) = ck.glob("*.safetensors")
    tensors = load_file(str(shard))
    cfg = json.loads((ck / "config.json").read_text())
    last, mtp = cfg["num_hidden_layers"] - 1, cfg["num_hidden_layers"]
    g = torch.Generator().manual_seed(5)
    for name, t in list(tensors.items()):  # the decoder layer: the last one's tensors, perturbed where float
        if name.startswith(f"model.layers.{last}."):
            new = name.replace(f"model.layers.{last}.", f"model.layers.{mtp}.")
            tensors[new] = t + 0.01 * torch.randn(t.shape, generator=g).to(t.dtype) if t.is_floating_point() else t.clone()
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    for name, shape in (("enorm.weight", (h,)), ("hnorm.weight", (h,)), ("eh_proj.weight", (h, 2 * h)),
                        ("embed_tokens.weight", (v, h)), ("shared_head.norm.weight", (h,)),
                        ("shared_head.head.weight", (v, h))):
        tensors[f"model.layers.{mtp}.{name}"] = torch.randn(shape, generator=g).to(torch.bfloat16)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    (ck / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 1}))
    return ck


@pytest.fixture(scope="module", params=["whole_groups", "ragged_mtp"])
def any_dir(request, kimi_int4_dir, ragged_mtp_dir):
    """test_parity's fixtures and tests, on the INT4 checkpoints."""
    return kimi_int4_dir if request.param == "whole_groups" else ragged_mtp_dir


def test_the_ragged_checkpoint_has_ragged_groups_and_its_mtp_layer_is_skipped(ragged_mtp_dir):
    ck = Checkpoint(ragged_mtp_dir)
    names = ck.names()
    assert any(n.startswith("model.layers.2.mlp.experts.") and n.endswith("weight_packed") for n in names)
    assert ck.args.hidden_size % ck.args.expert_group and ck.args.moe_intermediate_size % ck.args.expert_group
    model = load_model(ck, torch.float32, progress=False)
    assert len(model.model.layers) == ck.args.num_hidden_layers == 2


def test_transformers_reads_the_packed_experts_as_we_do(kimi_int4_dir, tmp_path):
    """transformers + compressed-tensors on the checkpoint as written (only model_type renamed: transformers maps
    per-expert tensors onto its fused expert weights under deepseek_v3) equals our BF16 dequantisation bit for bit."""
    from transformers import DeepseekV3ForCausalLM

    for f in kimi_int4_dir.iterdir():
        (tmp_path / f.name).symlink_to(f)
    cfg = json.loads((kimi_int4_dir / "config.json").read_text())
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "model_type": "deepseek_v3"}))
    theirs = DeepseekV3ForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    ours = load_model(Checkpoint(kimi_int4_dir), torch.float32, progress=False)
    for i in range(ours.args.first_k_dense_replace, ours.args.num_hidden_layers):
        fused = theirs.model.layers[i].mlp.experts
        for e, expert in enumerate(ours.model.layers[i].mlp.experts):
            gate_up = torch.cat([expert.gate_proj.dense_weight(torch.bfloat16),
                                 expert.up_proj.dense_weight(torch.bfloat16)])
            assert torch.equal(gate_up.to(fused.gate_up_proj.dtype), fused.gate_up_proj[e]), f"layer {i} expert {e}"
            down = expert.down_proj.dense_weight(torch.bfloat16).to(fused.down_proj.dtype)
            assert torch.equal(down, fused.down_proj[e]), f"layer {i} expert {e} down"


def test_bf16_reference_path_is_the_dequantised_bf16_checkpoint(kimi_int4_dir, tmp_path):
    """The INT4 experts dequantised per call (policy.cpu.moe_backend=torch) give the logits and greedy tokens of the
    same checkpoint dequantised to BF16 on disk, bit for bit."""
    int4_model = load_model(Checkpoint(kimi_int4_dir), torch.bfloat16, progress=False)
    bf16_model = load_model(Checkpoint(dequantised_copy(kimi_int4_dir, tmp_path, torch.bfloat16)), torch.bfloat16,
                            progress=False)
    assert int4_model.args.expert_group == 32 and bf16_model.args.expert_group is None
    prompt = torch.randint(2, 380, (12,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = [m(prompt[None], torch.arange(12)[None])[0] for m in (int4_model, bf16_model)]
    assert torch.equal(*logits)
    tokens = [Engine(m, local_plan({"kv.max_batch": 1, "kv.max_context": 64, "decode.batch_cap": 1})).generate(
        [prompt.tolist()], SamplingParams(16, ignore_eos=True))[0].output_ids for m in (int4_model, bf16_model)]
    assert tokens[0] == tokens[1]


def test_gpu_paths_refuse_int4_experts(kimi_int4_dir):
    """Pinned experts (a GPU host's stream-loading prefill) and hot experts on the GPU do not take INT4 yet."""
    model = load_model(Checkpoint(kimi_int4_dir), torch.bfloat16, progress=False)
    experts_to_cpu_kernels(model)
    with pytest.raises(ConfigError, match="INT4 routed experts"):
        pin_experts(model, pin=False)
    with pytest.raises(ConfigError, match="experts_per_layer"):
        hot_experts_to_device(model, 1, torch.device("cpu"))
