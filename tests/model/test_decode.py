"""Cached decoding against full recomputation, and several sequences at once, each at its own position."""
from __future__ import annotations

import torch

from hybrid.engine.generate import Generator
from hybrid.engine.sampler import Sampler, Sampling

ATOL = 1e-4


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_cached_decode_equals_full_recomputation(tiny_model):
    m = tiny_model
    prompt = _prompt(9, 0, m.args.vocab_size)
    res = Generator(m, max_batch=2, max_context=64).generate([prompt], 16)
    seq = torch.tensor([prompt + res.output_ids[0]])
    full = m(seq, torch.arange(seq.shape[1])[None])[0]
    assert full[len(prompt) - 1:-1].argmax(-1).tolist() == res.output_ids[0]

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
    together = Generator(m, max_batch=4, max_context=64).generate(prompts, 12).output_ids
    alone = [Generator(m, max_batch=1, max_context=64).generate([p], 12).output_ids[0] for p in prompts]
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
    first = Generator(m, 1, 64).generate([prompt], 4).output_ids[0]
    stopped = Generator(m, 1, 64, eos_id=first[1]).generate([prompt], 4).output_ids[0]
    assert stopped == first[:2]
    gen = Generator(m, 1, 16)
    for bad, msg in (([prompt] * 2, "KV-cache slots"), ([[]], "empty"), ([[m.args.vocab_size]], "out of range")):
        try:
            gen.generate(bad, 4)
        except ValueError as e:
            assert msg in str(e)
        else:
            raise AssertionError(f"{bad} accepted")
    try:
        gen.generate([prompt], 12)
    except ValueError as e:
        assert "policy.max_context" in str(e)
    else:
        raise AssertionError("over-long request accepted")


def test_sampler_greedy_topk_topp():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    assert Sampler(Sampling())(logits).tolist() == [1]
    top1 = Sampler(Sampling(temperature=1.0, top_k=1, seed=3))
    assert {top1(logits).item() for _ in range(20)} == {1}
    nucleus = Sampler(Sampling(temperature=1.0, top_p=0.7, seed=3))
    assert {nucleus(logits).item() for _ in range(50)} == {1, 3}
    free = Sampler(Sampling(temperature=5.0, seed=3))
    assert len({free(logits).item() for _ in range(200)}) == 4
