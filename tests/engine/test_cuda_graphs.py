"""CUDA-graph decode: the bucket rule, the capture-mode hand-off and the native host functions run on the CPU; the
graphs themselves on a GPU (skipped without CUDA)."""
from __future__ import annotations

import ctypes

import pytest
import torch

from hybrid import _native
from hybrid.config.compose import compose, to_settings
from hybrid.engine.requests import SamplingParams
from hybrid.engine.build import build
from hybrid.engine.capture import CapturedExperts, stream_waits
from hybrid.engine.cuda_graphs import AHEAD_TOKENS, MIN_BUCKET, GraphedDecode, _Graph, buckets_ahead, kv_bucket
from hybrid.placement.passes import CpuExperts, cpu_experts, experts_to_cpu_kernels, swap_experts
from hybrid.placement.staging import Staging
from hybrid.model.moe import MoE
from hybrid.weights.checkpoint import Checkpoint
from hybrid.weights.loader import load_model

_call = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
SUBMIT, WAIT = _call(_native.host_submit_fn), _call(_native.host_wait_fn)


def test_buckets_ahead_cover_the_next_tokens_up_to_the_cache():
    assert buckets_ahead(256, 4096, 512) == [512, 768]
    assert buckets_ahead(256, 600, 1024) == [512, 600]  # capped at the cache's length
    assert buckets_ahead(600, 600) == []
    for bucket in (256, 1280, 8192, 20480):  # every KV length of the next AHEAD_TOKENS has its bucket among them
        ahead = set(buckets_ahead(bucket, 1 << 15))
        assert all(kv_bucket(n, 1 << 15) in ahead for n in range(bucket + 1, bucket + AHEAD_TOKENS + 1))
        assert len(ahead) <= 4


def test_kv_bucket_reads_little_more_than_needed():
    assert kv_bucket(1, 4096) == MIN_BUCKET
    assert kv_bucket(MIN_BUCKET + 1, 4096) == 2 * MIN_BUCKET
    assert kv_bucket(1024, 4096) == 1024 and kv_bucket(1025, 4096) == 1280
    assert kv_bucket(3000, 3000) == 3000  # capped at the cache
    buckets = {kv_bucket(n, 1 << 15) for n in range(1, (1 << 15) + 1)}
    assert len(buckets) <= 8 * 7  # graphs per batch size for a 32K cache (24 in fact)
    for n in range(1, 1 << 15, 97):
        assert n <= kv_bucket(n, 1 << 15) <= max(n + MIN_BUCKET, n * 5 / 4)
    for bad in (0, 4097):
        with pytest.raises(ValueError, match=r"policy\.kv\.max_context"):
            kv_bucket(bad, 4096)


class _RecordingCapture:
    """Stands in for a graph capture on the CPU: records the hand-off calls, runs the native host functions when
    the graph would (submit at the start, wait at the end)."""

    def __init__(self):
        self.calls, self.jobs = [], []

    def handoff_start(self, op, x_h, ids_h, w_h, out_h):
        job = op.host_job(x_h, ids_h, w_h, out_h)
        self.jobs.append(job)
        self.calls.append(("start", x_h.data_ptr(), out_h.data_ptr()))
        SUBMIT(job.address)
        return job

    def handoff_end(self, job):
        self.calls.append(("end", job.address))
        WAIT(job.address)


def test_capture_mode_hands_off_through_fixed_buffers_without_synchronising(tiny_dir):
    m = load_model(Checkpoint(tiny_dir), torch.float32, progress=False)
    staging = Staging(256, 4, stage_on_cpu=True)
    experts_to_cpu_kernels(m, staging=staging)
    moe = next(x for x in m.modules() if isinstance(x, MoE))
    x = torch.randn(3, 256)
    w, ids = moe.gate(x)
    want = moe.experts(x, w, ids)
    syncs = staging.syncs
    staging.reserve(4)
    captured = CapturedExperts(moe.experts, cap := _RecordingCapture())
    got = captured(x, w, ids)
    with pytest.raises(RuntimeError, match="reserve"):
        captured(torch.randn(5, 256), *moe.gate(torch.randn(5, 256)))
    assert torch.equal(got, want)
    assert staging.syncs == syncs, "a captured hand-off must not synchronise"
    assert [c[0] for c in cap.calls[:2]] == ["start", "end"]
    first = cap.calls[0]
    assert first[1] == staging.to_host(x, w, ids, sync=False)[0].data_ptr()  # the fixed buffers, every time
    assert cap.jobs[0].calls == 1 and cap.jobs[0].cpu_s > 0 and not cap.jobs[0].error


def test_capture_swaps_every_layer_for_the_capture_only(tiny_dir):
    m = load_model(Checkpoint(tiny_dir), torch.float32, progress=False)
    staging = Staging(256, 4, stage_on_cpu=True)
    experts_to_cpu_kernels(m, staging=staging)
    layers = cpu_experts(m)
    t, pos = torch.randint(2, 320, (1, 5), generator=torch.Generator().manual_seed(0)), torch.arange(5)[None]
    want = m(t, pos)
    staging.reserve(8)
    cap = _RecordingCapture()
    wrappers, restore = swap_experts(m, lambda layer: CapturedExperts(layer, cap))
    try:
        syncs = staging.syncs
        got = m(t, pos)
    finally:
        restore()
    assert [w.layer for w in wrappers] == layers and torch.equal(got, want)
    assert [c[0] for c in cap.calls] == ["start", "end"] * len(layers) and staging.syncs == syncs
    assert all(type(x.experts) is CpuExperts for x in m.modules() if isinstance(x, MoE))
    assert torch.equal(m(t, pos), want) and staging.syncs == syncs + len(layers), "eager again"


def test_deferred_experts_are_not_captured(tiny_dir):
    m = load_model(Checkpoint(tiny_dir), torch.float32, progress=False)
    experts_to_cpu_kernels(m, deferred_experts=1)
    with pytest.raises(ValueError, match="deferred_experts=0"):
        CapturedExperts(cpu_experts(m)[0], _RecordingCapture())


def test_host_job_reports_a_bad_call_instead_of_crashing(tiny_dir):
    m = load_model(Checkpoint(tiny_dir), torch.float32, progress=False)
    experts_to_cpu_kernels(m)
    op = next(x for x in m.modules() if isinstance(x, MoE)).experts.op
    x, w = torch.randn(2, 256).bfloat16(), torch.rand(2, 4)
    ids, out = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 999]]), torch.empty(2, 256)
    job = op.host_job(x, ids, w, out)
    SUBMIT(job.address)
    WAIT(job.address)
    assert "999 out of range" in job.error
    with pytest.raises(ValueError, match="x must be torch.bfloat16"):
        op.host_job(x.float(), ids, w, out)
    with pytest.raises(ValueError, match="out must be contiguous"):
        op.host_job(x, ids, w, torch.empty(256, 2).t())


def test_signalled_host_job_raises_its_word_when_complete(tiny_dir):
    """A job with a signal word (the stream waits for it instead of a host_wait node): the submit sets it to 0 and
    the call's last worker to 1 once the output is written; the next submit joins the call without a host_wait;
    a refused call raises the word too (a stream must never wait for a call that does not run)."""
    import time

    m = load_model(Checkpoint(tiny_dir), torch.float32, progress=False)
    experts_to_cpu_kernels(m)
    op = next(x for x in m.modules() if isinstance(x, MoE)).experts.op
    g = torch.Generator().manual_seed(3)
    signal = torch.full((1,), 7, dtype=torch.int32)
    x, w = torch.randn(3, 256, generator=g).bfloat16(), torch.rand(3, 4, generator=g)
    ids, out = torch.randint(0, 8, (3, 4), generator=g), torch.full((3, 256), float("nan"))
    want = op(x, ids, w)
    job = op.host_job(x, ids, w, out, signal=signal)
    for call in range(1, 4):
        out.fill_(float("nan"))
        SUBMIT(job.address)
        end = time.monotonic() + 60
        while signal.item() != 1 and time.monotonic() < end:
            time.sleep(1e-4)
        assert signal.item() == 1, "the signal word was not raised"
        assert torch.equal(out, want), f"call {call}: the output was not complete when the word was raised"
        assert job.calls == call and job.cpu_s > 0 and not job.error
    with pytest.raises(ValueError, match="not been waited for"):
        op(x, ids, w)  # signalled but not joined on the host: an eager call must wait for GraphedDecode._finish
    GraphedDecode._finish([_Graph([], out, [(job, op, signal)])])
    assert torch.equal(op(x, ids, w), want), "joined: the op serves an eager call again"
    ids[1, 2] = 999
    SUBMIT(job.address)
    assert signal.item() == 1 and "999 out of range" in job.error
    with pytest.raises(ValueError, match="signal must be one int32"):
        op.host_job(x, ids, w, out, signal=torch.zeros(2, dtype=torch.int32))


def test_cpu_join_is_checked_by_the_schema():
    """(Resolved with the machine's stream waits: tests/plan/test_resolve.py.)"""
    with pytest.raises(ValueError, match=r"policy\.decode\.cpu_join must be one of null, signal, host"):
        to_settings(compose(["policy.decode.cpu_join=spin"]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("invariant", [False, True])
@pytest.mark.parametrize("mode", ["hostfn", "hostfn:host", "segments"])
def test_graphed_decode_matches_eager(mode, invariant):
    """Graphs give eager's tokens; hostfn with either join of the CPU experts (auto: the signal word on a driver
    that takes stream memory operations; host: a host node)."""
    outputs = []
    mode, _, join = mode.partition(":")
    for graphs in ("off", mode):
        s = to_settings(compose(["+hw=h200_xeon16", "policy=default",
                                 "policy.adapt_to_hardware=true", "model.dtype=float32",
                                 f"policy.decode.cuda_graphs={graphs}", "policy.kv.max_batch=2",
                                 "policy.decode.batch_cap=2", f"policy.decode.batch_invariant={str(invariant).lower()}",
                                 f"policy.decode.cpu_join={join or 'null'}"]))
        engine = build(s, s.hw, progress=False)
        assert (engine.graphs is None) == (graphs == "off") and engine.plan.decode.cuda_graphs == graphs
        if graphs == "hostfn":
            assert engine.plan.decode.cpu_join == (join or ("signal" if stream_waits(engine.device) else "host"))
        assert bool(engine.plan.gpu.pad_rows) == invariant
        prompts = [list(range(2, 40)), list(range(50, 61))]  # two sequences, then one after the other ends
        out = [c.output_ids for c in engine.generate(prompts, SamplingParams(300))]  # KV buckets 256 -> 512
        outputs.append(out)
        if graphs != "off":
            last_kv = max(len(p) + len(o) for p, o in zip(prompts, out)) - 1  # the last token fed back
            dec = engine.graphs  # hostfn: the two sequences decode as two micro-batches on lanes 1-2
            buckets = {k[1] for lane in (dec.main, *dec.lanes) for k in lane.graphs}
            ctx = s.policy.kv.max_context  # and the buckets ahead of the last step's, captured with it
            last = kv_bucket(last_kv, ctx)
            assert min(buckets) == MIN_BUCKET and max(buckets) == max([last, *buckets_ahead(last, ctx)])
    assert outputs[0] == outputs[1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graphed_decode_serves_a_changing_set_of_slots_with_solo_tokens():
    """Requests arriving mid-decode and finishing at different steps, under graphs: each request's greedy tokens
    equal its tokens alone through the same engine configuration."""
    from tests.engine.test_serving import _drive, _greedy

    overrides = ["+hw=h200_xeon16", "policy=default", "policy.adapt_to_hardware=true", "model.dtype=float32",
                 "policy.decode.cuda_graphs=hostfn", "policy.kv.max_batch=3", "policy.decode.batch_cap=3",
                 "policy.kv.max_context=512"]
    s = to_settings(compose(overrides))
    engine = build(s, s.hw, progress=False)
    v = engine.model.args.vocab_size
    prompts = [torch.randint(2, v, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (9, 17, 5)]
    arrivals = {0: [(prompts[0], _greedy(40))], 4: [(prompts[1], _greedy(12))], 9: [(prompts[2], _greedy(30))]}
    got = _drive(engine, arrivals)
    for prompt, params, tokens, _ in got.values():
        alone = engine.generate([prompt], params)[0].output_ids
        assert tokens == alone
