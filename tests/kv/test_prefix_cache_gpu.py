"""Prefix reuse on the GPU profile (skipped without CUDA): the graphed hybrid decode reading the paged cache through
its block table, suffixes prefilled in chunks or stream-loaded, the host tier's pinned copies; a request from a
cached prefix gives the greedy tokens of the same request served cold."""
from __future__ import annotations

import pytest
import torch

from hybrid.config.compose import compose, to_settings
from hybrid.engine.build import build
from hybrid.engine.requests import SamplingParams
from tests.kv.test_prefix_cache import abort_one

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
P = 256


def _engine(invariant: bool, prefix: bool = True, slots: int = 2, host_gb: float = 0.05):
    s = to_settings(compose(["+hw=h200_xeon16", "policy=default", "policy.adapt_to_hardware=true",
                             "model.dtype=float32", "policy.decode.cuda_graphs=hostfn", f"policy.kv.max_batch={slots}",
                             f"policy.decode.batch_cap={slots}", "policy.kv.max_context=1024",
                             f"policy.decode.batch_invariant={str(invariant).lower()}",
                             f"policy.kv.prefix_cache={str(prefix).lower()}", f"policy.kv.host_cache_gb={host_gb}",
                             "policy.prefill.slp_cutoff_tokens=300"]))
    return build(s, s.hw, progress=False)


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(engine, prompt, n: int = 8) -> list[int]:
    return engine.generate([prompt], SamplingParams(max_tokens=n, ignore_eos=True))[0].output_ids


@pytest.mark.parametrize("invariant", [False, True])
def test_turns_from_the_cache_and_the_host_tier_give_the_cold_tokens(invariant):
    hot, cold = _engine(invariant), _engine(invariant, prefix=False)
    v = hot.model.args.vocab_size
    turn1 = _prompt(2 * P + 20, 1, v)  # stream-loaded (above the cutoff)
    answer = _run(hot, turn1, 40)
    assert answer == _run(cold, turn1, 40)
    turn2 = turn1 + answer + _prompt(100, 2, v)  # the suffix goes in chunks
    before = hot.kv.stats().hit_tokens
    assert _run(hot, turn2) == _run(cold, turn2)
    assert hot.kv.stats().hit_tokens - before == 2 * P
    long_suffix = turn1[:P + 10] + _prompt(400, 3, v)  # one block hit, a stream-loaded suffix
    assert _run(hot, long_suffix) == _run(cold, long_suffix)
    # every slot's room taken by other prompts: the conversation's blocks go to the host tier and come back
    for seed in (4, 5, 6):
        _run(hot, _prompt(3 * P + 40, seed, v), 2)
    s = hot.kv.stats()
    assert s.evictions > 0 and s.host_blocks_cached > 0
    turn3 = turn2 + _prompt(30, 7, v)
    assert _run(hot, turn3) == _run(cold, turn3)
    assert hot.kv.stats().host_hit_tokens > s.host_hit_tokens


def test_an_abort_leaves_the_shared_blocks_to_the_other_request():
    engine, cold = _engine(True), _engine(True, prefix=False)
    v = engine.model.args.vocab_size
    system = _prompt(2 * P, 8, v)
    _run(engine, system + [5], 1)
    x, y = system + _prompt(30, 9, v), system + _prompt(60, 10, v)
    assert abort_one(engine, x, y, 16, at_step=5) == _run(cold, y, 16)
