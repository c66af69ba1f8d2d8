"""The two-GPU pieces that need no second process: how a prompt and the experts are split, the scheduler's rule for
two-GPU prefill, policy.prefill.gpus and policy.prefill.ep, and the module swap of sharded_moe."""
from __future__ import annotations

import pytest
import torch

from hybrid.config.schema import PrefillPolicy
from hybrid.engine.requests import Request, SamplingParams, State
from hybrid.engine.scheduler import Scheduler, prefill_gpus
from hybrid.errors import ConfigError
from hybrid.model.moe import MoE
from hybrid.parallel.cp import ContextParallelCache, split
from hybrid.parallel.group import Dist
from hybrid.parallel.smallep import ShardedMoE, shard, sharded_moe

TWO = Dist(0, 2, torch.device("cpu"))  # no collective is called in these tests


@pytest.mark.parametrize("start,end", [(0, 12), (0, 13), (5, 6 + 5), (3, 20)])
def test_a_prompt_splits_into_contiguous_ranges_the_first_one_longer(start, end):
    ranges = split(start, end, 2)
    assert ranges[0].start == start and ranges[0].stop == ranges[1].start and ranges[1].stop == end
    assert 0 <= len(ranges[0]) - len(ranges[1]) <= 1
    with pytest.raises(ValueError, match="1 tokens cannot be split over 2"):
        split(4, 5, 2)


@pytest.mark.parametrize("experts,world", [(16, 2), (24, 2), (256, 2), (7, 2), (384, 3)])
def test_every_expert_is_owned_by_exactly_one_rank(experts, world):
    shares = [shard(experts, r, world) for r in range(world)]
    assert [e for s in shares for e in s] == list(range(experts))
    assert max(map(len, shares)) - min(map(len, shares)) <= 1


def test_sharded_moe_swaps_every_moe_layer_and_puts_them_back(tiny_model):
    moes = [m for m in tiny_model.modules() if isinstance(m, MoE)]
    with sharded_moe(tiny_model, TWO, "smallep", [6, 6]) as wrappers:
        assert [w.moe for w in wrappers] == moes and [w.owned for w in wrappers] == [range(0, 8)] * 2
        assert [m for m in tiny_model.modules() if isinstance(m, MoE)] == moes, "still found inside the wrappers"
        assert all(isinstance(b.mlp, ShardedMoE) for b in tiny_model.model.layers[1:])
    assert [b.mlp for b in tiny_model.model.layers[1:]] == moes
    with pytest.raises(ValueError, match="smallep, ep"):
        ShardedMoE(moes[0], TWO, "alltoall", [6, 6])


def test_the_context_parallel_cache_checks_its_counts(tiny_model):
    cache = tiny_model.new_cache(1, 16)
    with pytest.raises(ValueError, match="12 positions"):
        ContextParallelCache(cache, TWO, [6, 7], torch.arange(12))
    cp = ContextParallelCache(cache, TWO, [6, 6], torch.arange(12))
    assert len(cp.layers) == len(cache.layers) and cp.max_context == 16


def test_two_gpus_prefill_a_long_prompt_only_when_nothing_decodes():
    assert prefill_gpus(5000, decoding=0, gpus=2, long_cutoff=4096) == 2
    assert prefill_gpus(5000, decoding=1, gpus=2, long_cutoff=4096) == 1, "the other GPU serves decode"
    assert prefill_gpus(4096, decoding=0, gpus=2, long_cutoff=4096) == 1, "a short prompt goes in chunks"
    assert prefill_gpus(5000, decoding=0, gpus=2, long_cutoff=None) == 1, "no stream-loading: no GPU prefill"
    assert prefill_gpus(5000, decoding=0, gpus=1, long_cutoff=4096) == 1


def _req(rid: int, n: int) -> Request:
    return Request(rid, list(range(2, 2 + n)), SamplingParams(4))


def test_the_scheduler_marks_a_long_prompts_gpus_by_what_decodes():
    s = Scheduler(slots=4, batch_cap=4, chunk_tokens=8, long_cutoff=16, gpus=2)
    s.add(_req(0, 40))
    (chunk,) = s.plan().prefill
    assert chunk.streamed and chunk.gpus == 2
    chunk.request.prefilled, chunk.request.state = 40, State.decoding
    s.add(_req(1, 40))
    plan = s.plan()
    assert [r.id for r in plan.decode] == [0] and plan.prefill[0].gpus == 1
    one = Scheduler(slots=4, batch_cap=4, chunk_tokens=8, long_cutoff=16)
    one.add(_req(2, 40))
    assert one.plan().prefill[0].gpus == 1, "one GPU unless asked"


def test_policy_prefill_gpus_and_ep():
    assert PrefillPolicy().gpus is None and PrefillPolicy().ep == "smallep"
    with pytest.raises(ValueError, match=r"policy\.prefill\.gpus must be 1, 2 or null, got 3"):
        PrefillPolicy(gpus=3)
    with pytest.raises(ValueError, match=r"policy\.prefill\.ep must be one of smallep, ep"):
        PrefillPolicy(ep="alltoall")
    # resolved with the machine: tests/plan/test_resolve.py


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="checks the message given without two GPUs")
def test_the_two_gpu_benchmark_says_what_it_needs():
    from hybrid.bench.prefill import run
    from hybrid.config.compose import compose, to_settings

    settings = to_settings(compose(["mode=bench", "bench=prefill", "policy.prefill.gpus=2"]))
    with pytest.raises(ConfigError, match=r"needs 2 GPUs, torch sees \d"):
        run(settings)
