"""Cached decoding against full recomputation, and several sequences at once, each at its own position."""
from __future__ import annotations

import pytest
import torch

from hybrid.engine.engine import Engine
from hybrid.engine.probe import local_plan
from hybrid.engine.requests import RequestError, SamplingParams
from hybrid.engine.sampler import Sampler, choose

ATOL = 1e-4


def _generate(m, prompts, n: int, slots: int = 1, context: int = 64, ignore_eos: bool = True) -> list[list[int]]:
    engine = Engine(m, local_plan({"kv.max_batch": slots, "kv.max_context": context, "decode.batch_cap": slots}))
    return [c.output_ids for c in engine.generate(prompts, SamplingParams(n, ignore_eos=ignore_eos))]


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_cached_decode_equals_full_recomputation(tiny_model):
    m = tiny_model
    prompt = _prompt(9, 0, m.args.vocab_size)
    out = _generate(m, [prompt], 16, slots=2)[0]
    seq = torch.tensor([prompt + out])
    full = m(seq, torch.arange(seq.shape[1])[None])[0]
    assert full[len(prompt) - 1:-1].argmax(-1).tolist() == out

    cache = m.new_cache(1, 64)
    slot = torch.tensor([0])
    step_logits = [m(seq[:, :len(prompt)], torch.arange(len(prompt))[None], cache, slot)[0, -1]]
    for p in range(len(prompt), seq.shape[1] - 1):
        step_logits.append(m(seq[:, p:p + 1], torch.tensor([[p]]), cache, slot)[0, -1])
    err = (torch.stack(step_logits) - full[len(prompt) - 1:-1]).abs().max()
    assert err <= ATOL, f"cached vs recomputed logits differ by {err:.2e}"


def test_batched_sequences_at_their_own_positions(tiny_model):
    m = tiny_model
    prompts = [_prompt(n, n, m.args.vocab_size) for n in (3, 11, 7)]
    together = _generate(m, prompts, 12, slots=4)
    alone = [_generate(m, [p], 12)[0] for p in prompts]
    assert together == alone


def test_prefill_in_chunks_equals_one_pass(tiny_model):
    m = tiny_model
    seq = torch.tensor([_prompt(20, 5, m.args.vocab_size)])
    cache, slot = m.new_cache(1, 32), torch.tensor([0])
    m(seq[:, :8], torch.arange(8)[None], cache, slot)
    chunked = m(seq[:, 8:], torch.arange(8, 20)[None], cache, slot)[0]
    whole = m(seq, torch.arange(20)[None])[0, 8:]
    assert (chunked - whole).abs().max() <= ATOL


def test_generation_stops_at_eos_and_respects_limits(tiny_model):
    m = tiny_model
    prompt = _prompt(5, 1, m.args.vocab_size)
    first = _generate(m, [prompt], 4)[0]
    engine = Engine(m, local_plan({"kv.max_batch": 1, "kv.max_context": 16, "decode.batch_cap": 1}))
    engine.eos_ids = frozenset({first[1]})
    stopped = engine.generate([prompt], SamplingParams(4))[0]
    assert stopped.output_ids == first[:2] and stopped.finish_reason.value == "stop"
    for bad, msg in (([], "empty"), ([m.args.vocab_size], "out of range")):
        with pytest.raises(RequestError, match=msg):
            engine.add_request(bad, SamplingParams(4))
    with pytest.raises(RequestError, match=r"policy\.kv\.max_context"):
        engine.add_request(prompt, SamplingParams(12))


def test_sampler_greedy_topk_topp():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    assert choose(logits, [Sampler(SamplingParams())]) == [1]
    top1 = Sampler(SamplingParams(temperature=1.0, top_k=1, seed=3))
    assert {top1.sample(logits[0]) for _ in range(20)} == {1}
    nucleus = Sampler(SamplingParams(temperature=1.0, top_p=0.7, seed=3))
    assert {nucleus.sample(logits[0]) for _ in range(50)} == {1, 3}
    free = Sampler(SamplingParams(temperature=5.0, seed=3))
    assert len({free.sample(logits[0]) for _ in range(200)}) == 4
    same = [Sampler(SamplingParams(temperature=5.0, seed=11)) for _ in range(2)]
    assert [same[0].sample(logits[0]) for _ in range(30)] == [same[1].sample(logits[0]) for _ in range(30)]
