"""The paged KV cache's prefix reuse: a request served from a cached prefix gives exactly the greedy tokens of the same
request served cold, whether the prefix comes from the device pool or the host tier, under eviction, and while
another request sharing its blocks is aborted."""
from __future__ import annotations

import pytest
import torch

from hybrid.engine.engine import Engine
from hybrid.engine.probe import local_plan
from hybrid.engine.requests import FinishReason, SamplingParams

P = 256  # block_tokens


def _plan(**knobs):
    base = {"kv.max_batch": 2, "kv.max_context": 4 * P, "decode.batch_cap": 2, "prefill.chunk_tokens": P,
            "kv.host_cache_gb": 0.0}
    return local_plan({**base, **{k.replace("__", "."): v for k, v in knobs.items()}})


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def _run(engine: Engine, prompt: list[int], n: int = 6) -> list[int]:
    return engine.generate([prompt], _greedy(n))[0].output_ids


def _cold(model, prompt: list[int], n: int = 6) -> list[int]:
    return _run(Engine(model, _plan(kv__prefix_cache=False)), prompt, n)


def abort_one(engine: Engine, x: list[int], y: list[int], n: int, at_step: int = 4) -> list[int]:
    """x and y (sharing a cached prefix of two blocks) decode side by side; x is aborted at step `at_step`: y's
    tokens (n of them)."""
    rx = engine.add_request(x, _greedy(n + 30))
    ry = engine.add_request(y, _greedy(n))
    out: dict[int, list[int]] = {rx: [], ry: []}
    reasons, steps = {}, 0
    while engine.has_work():
        for o in engine.step():
            out[o.id] += o.new_token_ids
            if o.finished:
                reasons[o.id] = o.finish_reason
        steps += 1
        if steps == at_step:
            shared = set(engine.kv.blocks(engine.request(rx).slot)) & set(engine.kv.blocks(engine.request(ry).slot))
            assert len(shared) == 2  # both hold the prefix's two blocks
            engine.abort(rx)
    assert reasons == {rx: FinishReason.abort, ry: FinishReason.length}
    return out[ry]


@pytest.fixture(scope="module")
def vocab(tiny_model) -> int:
    return tiny_model.args.vocab_size


def test_a_hit_ending_mid_block_gives_the_cold_tokens(tiny_model, vocab):
    engine = Engine(tiny_model, _plan())
    shared = _prompt(P + 100, 1, vocab)  # one whole block and part of the next
    first = shared + _prompt(300, 2, vocab)
    second = shared + _prompt(200, 3, vocab)
    _run(engine, first)
    before = engine.kv.stats()
    got = _run(engine, second)
    after = engine.kv.stats()
    assert after.hit_tokens - before.hit_tokens == P  # the whole block; the part after it is prefilled
    assert got == _cold(tiny_model, second)


def test_the_next_turn_reuses_the_conversation(tiny_model, vocab):
    engine = Engine(tiny_model, _plan())
    turn1 = _prompt(2 * P + 30, 4, vocab)
    answer = _run(engine, turn1, 40)
    turn2 = turn1 + answer + _prompt(150, 5, vocab)
    before = engine.kv.stats().hit_tokens
    got = _run(engine, turn2)
    written = len(turn1) + len(answer) - 1  # the last answer token's KV is never written
    assert engine.kv.stats().hit_tokens - before == written // P * P
    assert got == _cold(tiny_model, turn2)


def test_a_prompt_cached_whole_still_prefills_its_last_token(tiny_model, vocab):
    engine = Engine(tiny_model, _plan())
    prompt = _prompt(2 * P, 6, vocab)
    want = _run(engine, prompt)
    before = engine.kv.stats().hit_tokens
    assert _run(engine, prompt) == want
    assert engine.kv.stats().hit_tokens - before == P  # the second block holds the last token: prefilled again


def test_a_hit_from_the_host_tier_after_eviction(tiny_model, vocab):
    """One slot of 4 blocks and nothing beside: a second prompt takes the first one's room, its blocks go to the
    host tier, and the first prompt's next turn copies them back."""
    engine = Engine(tiny_model, _plan(kv__max_batch=1, decode__batch_cap=1, kv__host_cache_gb=0.01))
    a, b = _prompt(3 * P + 10, 7, vocab), _prompt(3 * P + 50, 8, vocab)
    _run(engine, a, 2)
    _run(engine, b, 2)
    s = engine.kv.stats()
    assert s.evictions >= 3 and s.host_blocks_cached >= 3
    again = a + _prompt(60, 9, vocab)
    got = _run(engine, again)
    s2 = engine.kv.stats()
    assert s2.host_hit_tokens - s.host_hit_tokens == 3 * P
    assert got == _cold(tiny_model, again)


def test_eviction_without_a_host_tier_recomputes(tiny_model, vocab):
    engine = Engine(tiny_model, _plan(kv__max_batch=1, decode__batch_cap=1))
    a, b = _prompt(3 * P + 10, 10, vocab), _prompt(3 * P + 50, 11, vocab)
    _run(engine, a, 2)
    _run(engine, b, 2)
    before = engine.kv.stats()
    assert before.evictions >= 3 and before.host_blocks == 0
    again = a + _prompt(20, 12, vocab)
    assert _run(engine, again) == _cold(tiny_model, again)
    assert engine.kv.stats().hit_tokens == before.hit_tokens  # nothing of `a` left to hit


def test_two_requests_share_blocks_and_one_is_aborted(tiny_model, vocab):
    engine = Engine(tiny_model, _plan())
    system = _prompt(2 * P, 13, vocab)
    _run(engine, system + _prompt(5, 14, vocab), 1)  # the shared prefix, cached
    x, y = system + _prompt(40, 15, vocab), system + _prompt(70, 16, vocab)
    out = abort_one(engine, x, y, 12)
    assert out == _cold(tiny_model, y, 12)
    z = system + _prompt(33, 17, vocab)
    before = engine.kv.stats().hit_tokens
    assert _run(engine, z) == _cold(tiny_model, z)
    assert engine.kv.stats().hit_tokens - before == 2 * P  # still cached after the abort


def test_with_the_prefix_cache_off_nothing_is_shared(tiny_model, vocab):
    engine = Engine(tiny_model, _plan(kv__prefix_cache=False))
    prompt = _prompt(2 * P + 5, 18, vocab)
    _run(engine, prompt)
    _run(engine, prompt)
    s = engine.kv.stats()
    assert s.hit_tokens == 0 and s.queried_tokens == 2 * len(prompt) and s.device_blocks_cached == 0


def test_the_suffix_bound_prefills_the_suffix_over_its_context_and_frees_the_slot(tiny_model, vocab):
    from hybrid.bench.prefix import suffix_prefill_s

    engine = Engine(tiny_model, _plan())
    context, suffix = _prompt(P + 40, 19, vocab), _prompt(300, 20, vocab)
    assert suffix_prefill_s(engine, context, suffix) > 0
    assert all(not engine.kv.blocks(s) for s in range(2))
    with pytest.raises(ValueError, match="non-empty"):
        suffix_prefill_s(engine, [], suffix)
    assert _run(engine, context + suffix) == _cold(tiny_model, context + suffix)


def test_a_host_tier_too_small_for_both_keeps_the_hit_it_copies_back(tiny_model, vocab):
    """Three host blocks: the second prompt's evicted blocks find no room beside the first prompt's, which are being
    copied back; those win."""
    a = tiny_model.args
    per_block = a.num_hidden_layers * P * (a.kv_lora_rank + a.qk_rope_head_dim) * 4  # float32
    engine = Engine(tiny_model, _plan(kv__max_batch=1, decode__batch_cap=1, kv__host_cache_gb=3.5 * per_block / 1e9))
    assert engine.kv.stats().host_blocks == 3
    first, second = _prompt(3 * P + 10, 21, vocab), _prompt(3 * P + 20, 22, vocab)
    _run(engine, first, 2)
    _run(engine, second, 2)
    again = first + _prompt(40, 23, vocab)
    got = _run(engine, again)
    assert engine.kv.stats().host_hit_tokens == 3 * P
    assert got == _cold(tiny_model, again)


def test_the_host_tier_bench_evicts_then_hits_from_the_host(tiny_model):
    from hybrid.bench.prefix import host_tier_hit

    engine = Engine(tiny_model, _plan(kv__max_batch=1, decode__batch_cap=1, kv__host_cache_gb=0.05))
    got = host_tier_hit(engine, 3 * P + 10, 30)
    assert got["host_hit_tokens"] == 3 * P and got["cold_s"] > 0 and got["host_hit_s"] > 0
    assert host_tier_hit(Engine(tiny_model, _plan()), 3 * P, 30) is None  # no host tier
