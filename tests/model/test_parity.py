"""Our model against transformers' DeepseekV3ForCausalLM on the same FP8 weights, dequantised by us.

Tolerances (atol + rtol·|ref| on logits; a greedy step counts when the reference's top-2 gap is >= the tie gap):
- routed experts in torch, float32: both compute the same function in a different order (absorbed vs expanded
  MLA): 1e-4 + 1e-4·|ref|, tie gap 1e-3;
- routed experts on the native CPU kernels: they take BF16 activations (as DeepSeek's own inference does), which
  moves logits by up to ~0.02 here: 0.03 + 0.02·|ref|, tie gap 0.05;
- our whole bfloat16 path: on random weights bf16 rounding flips near-tied expert choices, moving those tokens
  (and, through attention, later ones) by O(1), so bf16 numerics are checked on an all-dense variant of the tiny
  model: ||Δ|| <= 0.03·||ref||.
"""
from __future__ import annotations

import pytest
import torch

from hybrid.engine.engine import Engine
from hybrid.engine.probe import local_plan
from hybrid.engine.requests import SamplingParams
from hybrid.placement.passes import experts_to_cpu_kernels
from hybrid.weights.checkpoint import Checkpoint
from hybrid.weights.loader import load_model
from hybrid.weights.synthetic import write_checkpoint
from tests.conftest import model_spec
from tests.reference import reference_model

STEPS = 32


TOLERANCE = {"torch": (1e-4, 1e-4, 1e-3), "native": (0.03, 0.02, 0.05)}  # atol, rtol, greedy near-tie gap


@pytest.fixture(scope="module")
def reference(any_dir, tmp_path_factory):
    return reference_model(any_dir, tmp_path_factory.mktemp("ref"))


@pytest.fixture(scope="module", params=["torch", "native"])
def pair(request, any_dir, reference):
    ours = load_model(Checkpoint(any_dir), torch.float32, progress=False)
    if request.param == "native":
        assert experts_to_cpu_kernels(ours) == ours.args.num_hidden_layers - ours.args.first_k_dense_replace
    return ours, reference, TOLERANCE[request.param]


def _prompts(vocab: int, lengths=(17, 40)) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(2, vocab, (n,), generator=g) for n in lengths]


def test_prefill_logits_match_reference(pair):
    ours, ref, (atol, rtol, _) = pair
    for tokens in _prompts(ours.args.vocab_size):
        with torch.no_grad():
            want = ref(tokens[None]).logits[0].float()
        got = ours(tokens[None], torch.arange(len(tokens))[None])[0]
        err = (got - want).abs() - (atol + rtol * want.abs())
        assert err.max() <= 0, f"len {len(tokens)}: max |Δ| {(got - want).abs().max():.2e}"


def test_bf16_prefill_close_to_reference(tmp_path):
    spec = {**model_spec("tiny"), "first_k_dense_replace": 3, "max_shard_mb": 100}
    ck = write_checkpoint(tmp_path / "dense", spec, progress=False)
    ref = reference_model(ck, tmp_path / "ref")
    ours = load_model(Checkpoint(ck), torch.bfloat16, progress=False)
    tokens = _prompts(ours.args.vocab_size, (48,))[0]
    with torch.no_grad():
        want = ref(tokens[None]).logits[0].float()
    got = ours(tokens[None], torch.arange(len(tokens))[None])[0]
    rel = (got - want).norm() / want.norm()
    assert rel <= 0.03, f"relative error {rel:.4f}"


def _reference_greedy(ref, prompt: torch.Tensor, steps: int) -> tuple[list[int], list[float]]:
    with torch.no_grad():
        out = ref.generate(prompt[None], max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                           output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    tokens = out.sequences[0, len(prompt):].tolist()
    margins = [float(s[0].topk(2)[0].diff().abs()) for s in out.scores]
    return tokens, margins


def test_greedy_generation_matches_reference(pair):
    """Free-running greedy decoding agrees until the reference's first near-tie; then, teacher-forced along the
    reference's 32 tokens through our KV cache, our arg-max is the reference's token at every decisive step."""
    ours, ref, (_, _, tie) = pair
    prompt = _prompts(ours.args.vocab_size, (12,))[0]
    want, margins = _reference_greedy(ref, prompt, STEPS)
    got = Engine(ours, local_plan({"kv.max_batch": 1, "kv.max_context": 64, "decode.batch_cap": 1})).generate(
        [prompt.tolist()], SamplingParams(STEPS, ignore_eos=True))[0].output_ids
    first_tie = next((i for i, m in enumerate(margins) if m < tie), STEPS)
    assert got[: first_tie + 1] == want[: first_tie + 1], f"diverged before the first near-tie (step {first_tie})"

    seq = prompt.tolist() + want
    cache, slot = ours.new_cache(1, 64), torch.tensor([0])
    logits = [ours(prompt[None], torch.arange(len(prompt))[None], cache, slot, last_only=True)[0, -1]]
    for p in range(len(prompt), len(seq) - 1):
        logits.append(ours(torch.tensor([[seq[p]]]), torch.tensor([[p]]), cache, slot)[0, -1])
    decisive = [i for i, m in enumerate(margins) if m >= tie]
    assert len(decisive) >= STEPS // 2, f"only {len(decisive)} decisive steps of {STEPS}"
    wrong = [i for i in decisive if int(logits[i].argmax()) != want[i]]
    assert not wrong, f"teacher-forced arg-max differs at decisive steps {wrong}"
