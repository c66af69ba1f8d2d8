"""The Kimi-K2-Thinking layout (tiny_kimi_int4: INT4 routed experts, the rest BF16) against transformers, also at
sizes with ragged groups and with a multi-token-prediction layer present (and skipped).

- transformers reading the packed checkpoint itself (through compressed-tensors) holds exactly our BF16
  dequantisation of every routed expert;
- our model against transformers' DeepseekV3ForCausalLM on the same weights dequantised in float32 (q·s exact): the
  FP8 parity tests themselves (tests/model/test_parity.py), with their tolerances, on the torch reference path and
  on the native CPU kernels (policy.cpu.moe_backend=torch / native);
- in BF16 the reference path computes what the checkpoint dequantised to BF16 does, bit for bit;
- the GPU paths (CUDA only): stream-loading prefill through the W4A16 GEMM at the torch path's tolerance, grouped
  experts against one at a time, the engine on the GPU profile (stream-loaded prompt, hot experts) greedy against
  transformers; on the CPU stand-in, pinned and hot INT4 experts.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybrid.engine.engine import Engine
from hybrid.engine.probe import local_plan
from hybrid.engine.requests import SamplingParams
from hybrid.model.moe import MoE
from hybrid.placement.passes import experts_to_cpu_kernels, hot_experts_to_device, pin_experts
from hybrid.placement.staging import Staging
from hybrid.weights.checkpoint import Checkpoint
from hybrid.weights.loader import load_model
from hybrid.weights.synthetic import write_checkpoint
from tests.conftest import model_spec
from tests.model.test_parity import pair, reference, test_greedy_generation_matches_reference  # noqa: F401
from tests.model.test_parity import STEPS, TOLERANCE, _prompts, _reference_greedy
from tests.model.test_parity import test_prefill_logits_match_reference  # noqa: F401
from tests.reference import dequantised_copy, reference_model

CPU, GPU = torch.device("cpu"), torch.device("cuda", 0)


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


def test_gpu_paths_take_int4_experts(kimi_int4_dir):
    """Pinned experts (a GPU host's stream-loading prefill: tests/prefill/test_slp_int4.py) and hot experts take INT4:
    the resident slots hold the packed words and group scales, and on the CPU stand-in the layer's sum with experts
    resident equals the all-CPU one at the resident-expert tests' tolerance (tests/engine/test_hot_experts.py)."""
    model = load_model(Checkpoint(kimi_int4_dir), torch.float32, progress=False)
    a = model.args
    experts_to_cpu_kernels(model, staging=Staging(a.hidden_size, a.num_experts_per_tok, stage_on_cpu=True))
    assert pin_experts(model, pin=False) > 0
    (hot,) = hot_experts_to_device(model, 4, CPU)
    d, i = a.hidden_size, a.moe_intermediate_size
    assert hot.gate_proj_w.shape == (4, i, d // 8) and hot.gate_proj_w.dtype == torch.int32
    assert hot.down_proj_s.shape == (4, d, i // 32) and hot.down_proj_s.dtype == torch.bfloat16
    assert hot.nbytes < 4 * 3 * d * i * 0.6, "half a byte per weight and a BF16 scale per 32"
    moe = next(m for m in model.modules() if isinstance(m, MoE))
    x = torch.randn(6, d, generator=torch.Generator().manual_seed(2))
    w, ids = moe.gate(x)
    want = moe.experts(x, w, ids)  # nothing resident yet: all on the CPU
    hot.observe(ids)
    resident = hot.refresh()
    assert -1 not in resident and all(torch.equal(hot.up_proj_w[j], hot.host_experts[e].up_proj.weight_packed)
                                      for j, e in enumerate(resident))
    assert int(torch.isin(ids, torch.tensor(resident)).sum()) > 0
    torch.testing.assert_close(moe.experts(x, w, ids), want, atol=0.03, rtol=0.02)
    plain = next(m for m in load_model(Checkpoint(kimi_int4_dir), torch.float32, progress=False).modules()
                 if isinstance(m, MoE)).experts
    w_TN, _ = hot.route(w, ids)
    only = torch.where(torch.isin(ids, torch.tensor(resident)), w, 0.0)  # the resident picks alone, in torch
    torch.testing.assert_close(hot(x, w_TN), plain(x, only, ids).float(), atol=1e-5, rtol=1e-5)


def _gpu_int4_model(ck, dtype):
    from hybrid.placement.passes import place

    model = load_model(Checkpoint(ck), dtype, progress=False)
    experts_to_cpu_kernels(model)
    pin_experts(model)
    place(model, GPU)
    return model


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("ring_len", [3, 24])
def test_gpu_stream_loaded_prefill_matches_transformers(any_dir, reference, ring_len):
    """float32 on the GPU: the streamed INT4 experts through the W4A16 GEMM (its IEEE FP32 tile), the rest of the
    model on the GPU; the logits against transformers at the torch path's parity tolerance."""
    from hybrid.prefill.slp import StreamLoader

    model = _gpu_int4_model(any_dir, torch.float32)
    atol, rtol, _ = TOLERANCE["torch"]
    for tokens in _prompts(model.args.vocab_size):
        with torch.no_grad():
            want = reference(tokens[None]).logits[0].float()
        pos = torch.arange(len(tokens), device=GPU)[None]
        with StreamLoader().streaming(model, GPU, ring_len, 1e12) as pipe:
            got = model(tokens[None].to(GPU), pos, experts=pipe.experts)[0].float().cpu()
        err = (got - want).abs() - (atol + rtol * want.abs())
        assert err.max() <= 0, f"len {len(tokens)}: max |Δ| {(got - want).abs().max():.2e}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_grouped_int4_experts_match_one_at_a_time(kimi_int4_dir):
    """BF16 on the GPU: a layer's experts in groups (the dequantise pass into the group buffer, grouped GEMMs where
    torch has them) and one at a time (the W4A16 GEMM) against the layer in float32 torch."""
    from tests.prefill.test_slp import _layer_inputs, _streamed_layer

    model = _gpu_int4_model(kimi_int4_dir, torch.bfloat16)
    x, w, ids = (t.to(GPU) for t in _layer_inputs(model, 7, experts=range(24)))
    x = x.bfloat16()
    ref = next(m for m in load_model(Checkpoint(kimi_int4_dir), torch.float32, progress=False).modules()
               if isinstance(m, MoE)).experts(x.float().cpu(), w.float().cpu(), ids.cpu())
    for group in (1, 16):  # the ring holds 16 experts
        got, pipe = _streamed_layer(model, group, x, w, ids, device=GPU)
        assert max(pipe.group_sizes) == group
        assert float((got.float().cpu() - ref).norm() / ref.norm()) < 1e-2, group


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_engine_matches_transformers_greedy(kimi_int4_dir, tmp_path):
    """The engine on the GPU profile (+hw=h200_xeon16) serving the INT4 checkpoint as published: the prompt
    stream-loaded (above its cutoff), hot experts on the GPU, the rest of the routed experts on the CPU kernels
    (BF16 activations: the native tolerance). Greedy tokens equal transformers' before its first near-tie, and the
    prompt's last logits match."""
    from hybrid.config.compose import compose, to_settings
    from hybrid.engine.build import build

    s = to_settings(compose(["+hw=h200_xeon16", "policy=default", "policy.adapt_to_hardware=true",
                             "model=tiny_kimi_int4", f"model.path={kimi_int4_dir}", "model.dtype=float32",
                             "policy.prefill.slp_cutoff_tokens=16", "policy.gpu.experts_per_layer=4",
                             "policy.kv.max_batch=1", "policy.decode.batch_cap=1", "policy.kv.max_context=128",
                             "policy.decode.cuda_graphs=off"]))
    engine = build(s, s.hw, progress=False)
    assert engine.device.type == "cuda" and engine.runner.long_prefill is not None and engine.hot
    ref = reference_model(kimi_int4_dir, tmp_path / "ref")
    prompt = _prompts(engine.model.args.vocab_size, (40,))[0]
    want, margins = _reference_greedy(ref, prompt, STEPS)
    got = engine.generate([prompt.tolist()], SamplingParams(STEPS, ignore_eos=True))[0].output_ids
    atol, rtol, tie = TOLERANCE["native"]
    first_tie = next((i for i, m in enumerate(margins) if m < tie), STEPS)
    assert got[: first_tie + 1] == want[: first_tie + 1], f"diverged before the first near-tie (step {first_tie})"
    assert all(-1 not in h.resident for h in engine.hot), "the hot experts filled after the prefill"
    logits, pipes = engine.prefill(prompt.tolist(), streamed=True)
    with torch.no_grad():
        last = ref(prompt[None]).logits[0, -1].float()
    assert pipes and ((logits.float().cpu().view(-1) - last).abs() - (atol + rtol * last.abs())).max() <= 0
