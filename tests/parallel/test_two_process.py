"""Prefill over two processes (gloo on the CPU; NCCL on two GPUs where there are) against the single-process prefill
of the tiny models: context-parallel attention with SmallEP or EP experts gives the same logits for every token and
the same latent KV cache on both ranks, for prompts that split evenly and not, in one call or two; greedy decode
after it (on either rank) equals decode after the single-process prefill. The streamed cases run the stream-loading
pipeline over each rank's half of the experts, read from one shared-memory copy made by the parent process."""
from __future__ import annotations

import pytest
import torch

from hybrid.parallel.group import run_ranks
from hybrid.parallel.shared import share_experts
from tests.parallel import ranks

ATOL = 1e-4  # float32; single-process streamed against plain differ by ~1e-5 (tests/prefill/test_slp.py)

CASES = [  # tiny: 16 experts in 2 MoE layers (8 per rank); tiny_kimi: 24 experts, 1 MoE layer
    dict(model="tiny", n=12, seed=1, mode="smallep"),
    dict(model="tiny", n=13, seed=2, mode="smallep"),
    dict(model="tiny", n=12, seed=3, mode="ep"),
    dict(model="tiny", n=13, seed=4, mode="ep"),
    dict(model="tiny", n=17, seed=5, mode="smallep", cut=6),  # two calls: positions 0..5, then 6..16
    dict(model="tiny_kimi", n=11, seed=6, mode="smallep"),
    dict(model="tiny_kimi", n=10, seed=7, mode="ep"),
    dict(model="tiny", n=13, seed=8, mode="smallep", streamed=True),
    dict(model="tiny", n=12, seed=9, mode="ep", streamed=True, cut=5),
]
CONTEXT = 32


BENCH_LENGTHS = [9, 16]


def _run(tiny_dir, kimi_dir, device_type: str):
    dirs = {"tiny": tiny_dir, "tiny_kimi": kimi_dir}
    cases = [{**{k: v for k, v in c.items() if k != "model"}, "ck": dirs[c["model"]], "context": CONTEXT}
             for c in CASES]
    owner = ranks.load(tiny_dir, streamed=True)
    arenas = share_experts(owner)  # the one copy of the experts both ranks stream from
    per_rank = run_ranks(ranks.run_cases, 2, (cases, arenas, {"ck": tiny_dir, "lengths": BENCH_LENGTHS}),
                         device_type=device_type)
    return cases, [r["cases"] for r in per_rank], [r["bench"] for r in per_rank]


@pytest.fixture(scope="module")
def gloo_results(tiny_dir, kimi_dir):
    return _run(tiny_dir, kimi_dir, "cpu")


def _check(case: dict, got: dict, want: dict, rank: int) -> None:
    what = f"rank {rank}, {case['mode']}, {case['n']} tokens" + (", streamed" if case.get("streamed") else "")
    err = (got["logits"] - want["logits"]).abs().max().item()
    assert got["logits"].shape == want["logits"].shape and err <= ATOL, f"{what}: logits differ by {err:.2e}"
    for layer, ((kv, pe), (kv_ref, pe_ref)) in enumerate(zip(got["cache"], want["cache"])):
        err = max((kv - kv_ref).abs().max().item(), (pe - pe_ref).abs().max().item())
        assert err <= ATOL, f"{what}: layer {layer}'s latent cache differs by {err:.2e}"
    assert got["decode"] == want["decode"], f"{what}: greedy decode after the prefill"


@pytest.mark.parametrize("index", range(len(CASES)), ids=[
    f"{c['model']}-{c['n']}-{c['mode']}{'-cut' if c.get('cut') else ''}{'-streamed' if c.get('streamed') else ''}"
    for c in CASES])
def test_two_process_prefill_equals_one_process(gloo_results, index):
    cases, per_rank, _ = gloo_results
    case = cases[index]
    want = ranks.reference(case["ck"], case["n"], case["seed"], CONTEXT)
    for rank, results in enumerate(per_rank):
        _check(case, results[index], want, rank)


def test_each_rank_streams_only_its_half_of_the_experts_from_the_shared_copy(gloo_results):
    cases, per_rank, _ = gloo_results
    streamed = [i for i, c in enumerate(cases) if c.get("streamed")]
    for i in streamed:
        for rank, results in enumerate(per_rank):
            ring = results[i]["ring"]
            assert ring["written"] == [(layer, e) for layer in range(2) for e in range(8)], f"rank {rank}"
            assert ring["overwritten"] == []
            assert results[i]["shared"] == [True, True]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (NCCL between them)")
def test_two_gpu_prefill_equals_one_process(tiny_dir, kimi_dir):
    cases, per_rank, _ = _run(tiny_dir, kimi_dir, "cuda")
    for case, *results in zip(cases, *per_rank):
        want = ranks.reference(case["ck"], case["n"], case["seed"], CONTEXT)
        for rank, got in enumerate(results):
            _check(case, got, want, rank)


def test_the_two_gpu_benchmark_reports_ttft_against_its_bound_and_the_split(gloo_results, tiny_model):
    from hybrid.bench import bounds
    from hybrid.bench.prefill_dual import PHASES, _records

    _, _, bench = gloo_results
    rates = [{"h2d": h, "matmul": 400.0, "runs": runs} for h, runs in zip((50.0, 40.0), bench)]
    records = _records(tiny_model.args, rates, BENCH_LENGTHS)
    ttft = [r for r in records if r.name == "dual_slp_ttft"]
    assert [(r.m, r.extra["ep"]) for r in ttft] == [(n, m) for n in BENCH_LENGTHS for m in ("smallep", "ep")]
    a = tiny_model.args
    for r in ttft:
        assert r.value > 0 and r.bound == bounds.parallel_prefill_bound_seconds(
            bounds.routed_bytes(a), bounds.prefill_flops(a, r.m), 40.0, 400.0), "the slower GPU's rates bound it"
        assert all(r.extra[f"{ph}_per_layer_s"] > 0 for ph in PHASES), r.extra
        assert r.extra["split_run_s"] >= r.extra["attention_and_rest_s"] > 0
        assert "projection" in r.extra["projection"] and r.extra["projected_full_model_s"] > r.value
