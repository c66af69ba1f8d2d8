"""The CPU path with the native kernels (`place(..., cpu_kernel=...)`, what build() does without a GPU): every FP8
Linear on the native GEMM, kv_b dequantised once, the routed experts in turn with the rest.

Tokens: float32 models keep torch's forms, so placing changes nothing (bit for bit). BF16 numerics move: the
native GEMM multiplies by the exact FP8 weights where torch's path first rounds them to BF16. On the tiny MoE model
BF16 rounding flips near-tied expert choices either way, moving logits by O(1) (see tests/model/test_parity.py), so
tokens are compared on its all-dense variant: free-running greedy decoding agrees before the torch path's first
near-tie (top-2 gap < TIE), and, teacher-forced along the torch path's tokens, the arg-max agrees at every decisive
step. Over 16 prompts the two paths' logits differed by up to 0.2 and arg-maxes flipped only at gaps <= 0.062.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

import numpy as np
import pytest
import torch

from hybrid.config.compose import compose, to_settings
from hybrid.engine.build import build
from hybrid.engine.engine import Engine
from hybrid.placement.passes import cpu_experts, experts_to_cpu_kernels, place
from hybrid.engine.probe import local_plan
from hybrid.engine.requests import SamplingParams
from hybrid.kernels.dispatch import available
from hybrid.kernels.fp8_linear import DEFAULT_GEMM, CpuFp8Gemm, Fp8Gemm
from hybrid.kernels.gemm import (AMX_MIN_TOKENS, OUTER_MIN_TOKENS, TILE_MIN_TOKENS, gemm, set_amx_min_tokens,
                                 set_batch_invariant, set_tile_min_tokens)
from hybrid.model.attention import MLA
from hybrid.model.layers import Linear
from hybrid.quant import fp8
from hybrid.weights.checkpoint import Checkpoint
from hybrid.weights.loader import load_model
from hybrid.weights.synthetic import fp8_codes, write_checkpoint
from tests.conftest import model_spec

STEPS = 32
TIE = 0.1


def _model(ck, dtype, cpu_kernel=None, placed=True):
    m = load_model(Checkpoint(ck), dtype, progress=False)
    experts_to_cpu_kernels(m)
    if placed:
        place(m, torch.device("cpu"), cpu_kernel=cpu_kernel)
    return m


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    spec = {**model_spec("tiny"), "first_k_dense_replace": 3}
    return write_checkpoint(tmp_path_factory.mktemp("ck") / "tiny_dense", spec, progress=False)


def test_build_without_a_gpu_puts_every_fp8_linear_on_the_native_gemm(monkeypatch):
    s = to_settings(compose(["+hw=cpu_only"]))
    engine = build(s, s.hw, progress=False)
    m = engine.model
    assert m.dtype == torch.bfloat16
    linears = [x for x in m.modules() if isinstance(x, Linear)]
    assert linears and all(isinstance(x.gemm, CpuFp8Gemm) for x in linears)
    x = torch.zeros(1, 8, dtype=torch.bfloat16)
    assert all(x_.gemm.path(x, x_.block, 1) == "native" for x_ in linears if x_.block)
    mlas = [x for x in m.modules() if isinstance(x, MLA)]
    assert mlas and all(a.w_uk_HNC.dtype == torch.bfloat16 and a.w_uk_HNC.is_contiguous()
                        and a.w_uv_HVC.is_contiguous() for a in mlas)
    assert all(not layer.overlap for layer in cpu_experts(m)), "the routed experts take every core in turn"

    def refuse(*args, **kwargs):
        raise AssertionError("a weight was dequantised while serving")
    monkeypatch.setattr(fp8, "dequantize", refuse)
    out = engine.generate([[5, 6, 7, 8, 9]], SamplingParams(4, ignore_eos=True))[0]
    assert not out.error and len(out.output_ids) == 4


def test_the_torch_moe_backend_keeps_torch_forms():
    s = to_settings(compose(["+hw=cpu_only", "policy.cpu.moe_backend=torch"]))
    m = build(s, s.hw, progress=False).model
    assert {type(x.gemm) for x in m.modules() if isinstance(x, Linear)} == {Fp8Gemm}


def test_float32_models_are_unchanged_by_the_native_placement(tiny_dir):
    plain, placed = _model(tiny_dir, torch.float32, placed=False), _model(tiny_dir, torch.float32, "auto")
    assert all(isinstance(x.gemm, CpuFp8Gemm) for x in placed.modules() if isinstance(x, Linear))
    t, pos = torch.randint(2, 320, (1, 20), generator=torch.Generator().manual_seed(0)), torch.arange(20)[None]
    assert torch.equal(placed(t, pos), plain(t, pos))
    prompt = t[0, :12].tolist()
    assert _greedy(placed, prompt) == _greedy(plain, prompt)


def _greedy(model, prompt) -> list[int]:
    engine = Engine(model, local_plan({"kv.max_batch": 1, "kv.max_context": 64, "decode.batch_cap": 1}))
    return engine.generate([prompt], SamplingParams(STEPS, ignore_eos=True))[0].output_ids


def _decode(model, prompt: list[int], tokens: Optional[list[int]] = None) -> tuple[list[int], list[torch.Tensor]]:
    """Step by step through the KV cache: the arg-max tokens and the logits of each step, along `tokens` when given
    (teacher-forced), else along the arg-max (greedy)."""
    cache, slot = model.new_cache(1, 64), torch.tensor([0])
    logits = [model(torch.tensor([prompt]), torch.arange(len(prompt))[None], cache, slot, last_only=True)[0, -1]]
    for i in range(STEPS - 1):
        token = tokens[i] if tokens else int(logits[-1].argmax())
        logits.append(model(torch.tensor([[token]]), torch.tensor([[len(prompt) + i]]), cache, slot)[0, -1])
    return [int(x.argmax()) for x in logits], logits


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bf16_tokens_through_the_native_path_match_the_torch_path(dense_dir, seed):
    torch_path, native = _model(dense_dir, torch.bfloat16, placed=False), _model(dense_dir, torch.bfloat16, "auto")
    assert {type(x.gemm) for x in torch_path.modules() if isinstance(x, Linear)} == {type(DEFAULT_GEMM)}
    prompt = torch.randint(2, 320, (12,), generator=torch.Generator().manual_seed(seed)).tolist()
    _assert_same_decisive_tokens(_decode(torch_path, prompt), _greedy(native, prompt),  # through the engine
                                 lambda tokens: _decode(native, prompt, tokens)[1])


def _assert_same_decisive_tokens(reference, got: list[int], forced) -> None:
    """`reference` = (greedy tokens, logits per step); `got`: the other path's greedy tokens; forced(tokens): the
    other path's logits per step teacher-forced along `tokens`. The greedy tokens agree before the reference's first
    near-tie (top-2 gap < TIE), and teacher-forced the arg-max agrees at every decisive step."""
    want, want_logits = reference
    margins = [float(x.topk(2)[0].diff().abs()) for x in want_logits]
    first_tie = next((i for i, m in enumerate(margins) if m < TIE), STEPS)
    assert got[:first_tie] == want[:first_tie], f"diverged before the first near-tie (step {first_tie})"
    decisive = [i for i, m in enumerate(margins) if m >= TIE]
    assert len(decisive) >= STEPS // 2, f"only {len(decisive)} decisive steps of {STEPS}"
    logits = forced(want)
    wrong = [i for i in decisive if int(logits[i].argmax()) != want[i]]
    assert not wrong, f"teacher-forced arg-max differs at decisive steps {wrong}"


def test_the_fp8_lm_head_knob_quantises_lm_head_once_and_keeps_the_logits_close(dense_dir):
    bf16 = _model(dense_dir, torch.bfloat16, cpu_kernel="auto")
    q8 = load_model(Checkpoint(dense_dir), torch.bfloat16, progress=False)
    experts_to_cpu_kernels(q8)
    place(q8, torch.device("cpu"), cpu_kernel="auto", cpu_lm_head="fp8")
    assert q8.lm_head.weight.dtype == fp8.FP8 and q8.lm_head.block == (128, 128)
    assert bf16.lm_head.weight.dtype == torch.bfloat16  # the default keeps the published weights
    tokens = torch.randint(2, bf16.args.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(24)[None]
    a, b = bf16(tokens, pos), q8(tokens, pos)
    cos = torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0)
    assert cos > 0.999, f"cosine {cos:.5f} between the BF16 and FP8 lm_head's logits"


def test_the_lm_head_knob_is_in_the_plan():
    s = to_settings(compose(["+hw=cpu_only", "policy.cpu.lm_head=fp8"]))
    engine = build(s, s.hw, progress=False)
    assert engine.plan.cpu.lm_head == "fp8" and "lm_head fp8" in engine.plan.describe()
    assert engine.model.lm_head.weight.dtype == fp8.FP8


@pytest.mark.parametrize("invariant", [False, True])
def test_batch_invariance_sets_the_cpu_kernels_one_form(invariant):
    """Under policy.decode.batch_invariant the kernels keep one form of sums at every token count: amx_min_tokens
    null resolves to 1 (every expert call on AMX tiles, which round differently from the AVX-512 kernel below the
    threshold: tests/kernels/test_amx.py), else to AMX_MIN_TOKENS; and avx512_bf16's converted tiles keep the
    streaming form's sums (tests/kernels/test_gemm.py), from TILE_MIN_TOKENS (gemm_tile_tokens null), where the
    outer-product form starts at OUTER_MIN_TOKENS. The plan, its banner and the native settings say so."""
    s = to_settings(compose(["+hw=cpu_only", f"policy.decode.batch_invariant={str(invariant).lower()}"]))
    try:
        engine = build(s, s.hw, progress=False)
        want = 1 if invariant else AMX_MIN_TOKENS
        assert engine.plan.cpu.amx_min_tokens == want and engine.plan.cpu.batch_invariant == invariant
        outer = engine.plan.cpu.kernel == "avx512_bf16" and not invariant  # the outer-product form's threshold
        assert engine.plan.cpu.gemm_tile_tokens == (OUTER_MIN_TOKENS if outer else TILE_MIN_TOKENS)
        assert f"AMX from {want}" in replace(engine.plan, cpu=replace(engine.plan.cpu, kernel="amx")).describe()
        assert ("one form of sums at every token count" in engine.plan.describe()) == invariant
        # a 2-token GEMM: on the emulated tiles only under a threshold of 1 or 2, else the generic kernel's bits
        x = torch.randn(2, 256, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
        w, sc = fp8_codes(np.random.default_rng(0), (256, 256)), torch.full((2, 2), 1e-2)
        assert torch.equal(gemm(x, w, sc, kernel="amx_emulated"), gemm(x, w, sc, kernel="generic")) != invariant
        if "avx512_bf16" in available():  # a token alone and in a batch of 64: on the converted tiles either way
            x = torch.randn(64, 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
            alone, batch = gemm(x[:1], w, sc, kernel="avx512_bf16"), gemm(x, w, sc, kernel="avx512_bf16")[:1]
            assert torch.equal(alone, batch) == invariant
    finally:
        set_amx_min_tokens(AMX_MIN_TOKENS)
        set_batch_invariant(False)
        set_tile_min_tokens(TILE_MIN_TOKENS)


def _engine_decode(engine, prompt: list[int], tokens: Optional[list[int]] = None):
    """_decode through a built engine's placed model (inputs on its device), in KV slot 0."""
    model, dev = engine.model, engine.device
    slot = torch.tensor([0], device=dev)
    logits = [model(torch.tensor([prompt], device=dev), torch.arange(len(prompt), device=dev)[None], engine.cache,
                    slot, last_only=True, kv_len=len(prompt))[0, -1].float().cpu()]
    for i in range(STEPS - 1):
        token = tokens[i] if tokens else int(logits[-1].argmax())
        pos = len(prompt) + i
        logits.append(model(torch.tensor([[token]], device=dev), torch.tensor([[pos]], device=dev), engine.cache,
                            slot, kv_len=pos + 1)[0, -1].float().cpu())
    return [int(x.argmax()) for x in logits], logits


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gpu_and_cpu_deployments_agree_on_greedy_tokens(seed):
    """The CPU-only deployment (+hw=cpu_only: every FP8 linear on the native kernels) against the GPU deployment
    (attention and dense layers on the GPU's FP8 GEMM), both BF16 as served, on the all-dense tiny model: the CPU's
    greedy tokens (through its engine) equal the GPU's before the GPU's first near-tie, and teacher-forced along the
    GPU's tokens the CPU's arg-max agrees at every decisive step."""
    dense = ["model.synthetic.first_k_dense_replace=3", "model.dtype=bfloat16"]
    cpu_s = to_settings(compose(["+hw=cpu_only", *dense]))
    gpu_s = to_settings(compose(["+hw=h200_xeon16", "policy=default", "policy.adapt_to_hardware=true",
                                 "policy.decode.cuda_graphs=off", *dense]))
    cpu, gpu = build(cpu_s, cpu_s.hw, progress=False), build(gpu_s, gpu_s.hw, progress=False)
    assert cpu.device.type == "cpu" and gpu.device.type == "cuda"
    prompt = torch.randint(2, 320, (12,), generator=torch.Generator().manual_seed(seed)).tolist()
    got = cpu.generate([prompt], SamplingParams(STEPS, ignore_eos=True))[0].output_ids
    _assert_same_decisive_tokens(_engine_decode(gpu, prompt), got,
                                 lambda tokens: _engine_decode(cpu, prompt, tokens)[1])
