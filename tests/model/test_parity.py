"""Our model against transformers' DeepseekV3ForCausalLM on the same FP8 weights, dequantised by us.

Tolerances: in float32 both compute the same function in a different order (absorbed vs expanded MLA), so logits
agree to |Δ| <= 1e-4 + 1e-4·|ref|. Our bfloat16 path against the float32 reference: on random weights bf16
rounding flips near-tied expert choices, moving those tokens (and, through attention, later ones) by O(1), so the
bf16 numerics are checked on an all-dense variant of the tiny model: ||Δ|| <= 0.03·||ref||. Greedy decoding must pick the reference's token at every step
until the reference's top-2 logits come within 1e-3 of each other (a tie that rounding may break either way).
"""
from __future__ import annotations

import pytest
import torch

from hybrid.engine.generate import Generator
from hybrid.weights.checkpoint import Checkpoint
from hybrid.weights.loader import load_model
from hybrid.weights.synthetic import write_checkpoint
from tests.conftest import model_spec
from tests.reference import reference_model

TIE = 1e-3
STEPS = 32


@pytest.fixture(scope="module")
def pair(any_dir, tmp_path_factory):
    ours = load_model(Checkpoint(any_dir), torch.float32, progress=False)
    ref = reference_model(any_dir, tmp_path_factory.mktemp("ref"))
    return ours, ref


def _prompts(vocab: int, lengths=(17, 40)) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(2, vocab, (n,), generator=g) for n in lengths]


def test_prefill_logits_match_reference(pair):
    ours, ref = pair
    for tokens in _prompts(ours.args.vocab_size):
        with torch.no_grad():
            want = ref(tokens[None]).logits[0].float()
        got = ours(tokens[None], torch.arange(len(tokens))[None])[0]
        err = (got - want).abs() - (1e-4 + 1e-4 * want.abs())
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
    ours, ref = pair
    prompt = _prompts(ours.args.vocab_size, (12,))[0]
    want, margins = _reference_greedy(ref, prompt, STEPS)
    gen = Generator(ours, max_batch=1, max_context=64, eos_id=None)
    got = gen.generate([prompt.tolist()], STEPS).output_ids[0]
    decisive = next((i for i, m in enumerate(margins) if m < TIE), STEPS)
    assert decisive >= STEPS // 2, f"reference near-ties at step {decisive}: prompt too ambiguous to compare"
    assert got[: decisive + 1] == want[: decisive + 1], f"diverged before the first near-tie (step {decisive})"
