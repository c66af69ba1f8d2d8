"""Stream-loading prefill on the CPU stand-in device: same logits as the plain forward, sound ring reuse, budget."""
from __future__ import annotations

import sys
from dataclasses import replace
import time
import warnings

import pytest
import torch

from hybrid.engine.engine import Engine
from hybrid.placement.memory import auto_ring_len
from hybrid.engine.probe import local_plan
from hybrid.engine.requests import SamplingParams
from hybrid.placement.passes import cpu_experts, experts_to_cpu_kernels, pin_experts
from hybrid.errors import ConfigError
from hybrid.model.moe import MoE
from hybrid.prefill.ring import overwritten_before_off
from hybrid.prefill import slp
from hybrid.prefill.pipeline import Pipeline
from hybrid.prefill.slp import StreamedExperts, StreamLoader
from hybrid.weights.checkpoint import Checkpoint
from hybrid.weights.loader import load_model
from hybrid.weights.synthetic import write_checkpoint
from tests.conftest import model_spec

CPU = torch.device("cpu")
BIG = 1e12  # budget, bytes


def _models(tiny_dir):
    plain = load_model(Checkpoint(tiny_dir), torch.float32, progress=False)  # torch experts
    hybrid = load_model(Checkpoint(tiny_dir), torch.float32, progress=False)
    experts_to_cpu_kernels(hybrid)
    return plain, hybrid


def streaming(model, device, ring_len, budget, group=1):
    """One prefill by a loader of its own (no ring kept from before)."""
    return StreamLoader().streaming(model, device, ring_len, budget, group)


@pytest.fixture(params=["tiny", "tiny_kimi_int4"])
def slp_dir(request):
    """FP8 experts, and Kimi-K2-Thinking's INT4 ones (more of those: tests/prefill/test_slp_int4.py)."""
    return request.getfixturevalue("tiny_dir" if request.param == "tiny" else "kimi_int4_dir")


@pytest.mark.parametrize("group", [1, 8])
@pytest.mark.parametrize("ring_len", [1, 2, 3, 16])
def test_slp_logits_equal_the_plain_forward(slp_dir, ring_len, group):
    plain, hybrid = _models(slp_dir)
    a = hybrid.args
    tokens = torch.randint(2, a.vocab_size - 4, (1, 40), generator=torch.Generator().manual_seed(ring_len))
    pos = torch.arange(40)[None]
    want = plain(tokens, pos)[0]
    with streaming(hybrid, CPU, ring_len, BIG, group) as pipe:
        got = hybrid(tokens, pos, experts=pipe.experts)[0]
    assert (got - want).abs().max() <= 1e-5, f"ring_len {ring_len}"
    n_moe, n_exp = a.n_moe_layers, a.n_routed_experts
    writes = [x for x in pipe.ring.log if x[0] == "write"]
    assert len(writes) == n_moe * n_exp and len(pipe.ring.log) == 2 * n_moe * n_exp
    assert overwritten_before_off(pipe.ring.log) == []
    assert {slot for _, slot, _ in writes} == set(range(min(ring_len, n_moe * n_exp)))


def test_a_ring_of_the_same_shape_is_reused_by_the_next_prefill(tiny_dir):
    plain, hybrid = _models(tiny_dir)
    tokens, pos = torch.randint(2, 320, (1, 24), generator=torch.Generator().manual_seed(5)), torch.arange(24)[None]
    want = plain(tokens, pos)[0]
    loader, other = StreamLoader(), StreamLoader()
    rings = []
    for ring_len in (3, 3, 5):
        with loader.streaming(hybrid, CPU, ring_len, BIG) as pipe:
            got = hybrid(tokens, pos, experts=pipe.experts)[0]
        assert (got - want).abs().max() <= 1e-5
        assert overwritten_before_off(pipe.ring.log) == [] and len(pipe.ring.log) == 2 * 2 * 16  # reset between
        rings.append(pipe.ring)
        assert loader.kept is pipe.ring and loader.kept_ring_bytes(CPU) == pipe.ring.memory.numel()
    assert rings[0] is rings[1] and rings[2] is not rings[1] and rings[2].ring_len == 5
    with other.streaming(hybrid, CPU, 5, BIG) as pipe:  # another loader keeps its own
        hybrid(tokens, pos, experts=pipe.experts)
    assert pipe.ring is not rings[2] and loader.kept is rings[2] and other.kept is pipe.ring
    with pytest.raises(ConfigError, match=r"policy\.prefill\.ring_len"):  # a kept ring never bypasses the budget
        loader.streaming(hybrid, CPU, 5, 4 * rings[2].slot_bytes).__enter__()
    assert loader.kept is None and loader.kept_ring_bytes(CPU) == 0, "let go before the new one was refused"


def test_a_kept_ring_counts_as_free_in_the_next_prefills_budget(tiny_dir, monkeypatch):
    from hybrid.engine import build, long_prefill

    _, hybrid = _models(tiny_dir)
    slot = build.slot_bytes(hybrid)
    loader = StreamLoader()
    # as on a GPU, memory held (the kept ring) is not free; 5.5 slots in all, the activations left out
    monkeypatch.setattr(long_prefill, "free_bytes",
                        lambda device, budget_gb: 5.5 * slot - loader.kept_ring_bytes(device))
    monkeypatch.setattr(long_prefill, "ring_budget", lambda a, free, kept, group, tokens: free + kept)
    context = long_prefill.LongPrefill(hybrid, CPU, loader, slot, group=1)  # ring_len auto: what the budget allows
    tokens, pos = torch.randint(2, 320, (1, 24)), torch.arange(24)[None]
    rings = []
    for _ in range(3):
        with context(24) as pipe:
            hybrid(tokens, pos, experts=pipe.experts)
        rings.append(pipe.ring)
    assert rings[0].ring_len == 5 and all(r is rings[0] for r in rings)


def test_the_ring_budget_takes_the_activations_and_the_group_buffer():
    from hybrid.placement.memory import activation_bytes, group_bytes, ring_budget
    from hybrid.model.args import ModelArgs
    from hybrid.weights.presets import DEEPSEEK_V3

    a = ModelArgs.from_hf_config(DEEPSEEK_V3)
    got = ring_budget(a, 50e9, 11e9, 16, 8192)
    assert got == 50e9 + 11e9 - activation_bytes(a, 8192) - group_bytes(a, 16)


@pytest.fixture(scope="module")
def block_aligned_dir(tmp_path_factory):
    """The tiny model with expert rows a whole number of 128-blocks (tiny's 96 are ragged): gate and up fuse."""
    return write_checkpoint(tmp_path_factory.mktemp("ck") / "aligned", {**model_spec("tiny"),
                            "moe_intermediate_size": 128}, seed=1, progress=False)


@pytest.mark.parametrize("aligned", [False, True])
def test_experts_in_a_slot_layout_arena_stream_in_one_copy_each(tiny_dir, block_aligned_dir, aligned,
                                                                 monkeypatch):
    plain, hybrid = _models(block_aligned_dir if aligned else tiny_dir)
    before = [p.clone() for layer in cpu_experts(hybrid) for p in layer.host_experts.parameters()]
    arena_bytes = pin_experts(hybrid, pin=False)
    layers = cpu_experts(hybrid)
    assert arena_bytes == sum(layer.arena.numel() for layer in layers) == 2 * 16 * layers[0].slot_bytes
    after = [p for layer in layers for p in layer.host_experts.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(before, after))  # same weights, now views of the arena
    assert after[0].data_ptr() == layers[0].arena.data_ptr()
    copies = []
    real = torch.Tensor.copy_

    def counting(self, src, non_blocking=False):
        copies.append(src.numel())
        return real(self, src, non_blocking)

    tokens = torch.randint(2, 320, (1, 24), generator=torch.Generator().manual_seed(5))
    want = plain(tokens, torch.arange(24)[None])[0]
    monkeypatch.setattr(torch.Tensor, "copy_", counting)
    with streaming(hybrid, CPU, 3, BIG) as pipe:
        got = hybrid(tokens, torch.arange(24)[None], experts=pipe.experts)[0]
    monkeypatch.undo()
    assert pipe.fused == aligned, "gate and up read by one GEMM when their blocks line up"
    assert (got - want).abs().max() <= 1e-5
    assert copies.count(layers[0].slot_bytes) == 2 * 16, "one copy per expert"


def _layer_inputs(model, seed: int, tokens: int = 40, experts=range(16)):
    """Inputs of one MoE layer routing only to `experts` (the others get no rows)."""
    a, experts = model.args, torch.tensor(list(experts))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, a.hidden_size, generator=g)
    ids = torch.stack([experts[torch.randperm(len(experts), generator=g)[:a.num_experts_per_tok]]
                       for _ in range(tokens)])
    return x, torch.rand(tokens, a.num_experts_per_tok, generator=g), ids


def _streamed_layer(hybrid, group: int, x, w, ids, device=CPU, loader=None):
    """Layer 0's routed experts through a pipeline whose ring holds the whole layer, once all of it is loaded."""
    with Pipeline(cpu_experts(hybrid), device, 16, BIG, group, loader) as pipe:
        deadline = time.monotonic() + 30
        while pipe.ready.qsize() < 16 and time.monotonic() < deadline:
            time.sleep(0.001)
        got = StreamedExperts(pipe, 0)(x, w, ids)
    assert overwritten_before_off(pipe.ring.log) == []
    return got, pipe


def test_a_streamed_layer_counts_its_routing_for_the_hot_experts(tiny_dir):
    from hybrid.placement.passes import hot_experts_to_device

    _, hybrid = _models(tiny_dir)
    hot = hot_experts_to_device(hybrid, 2, CPU)
    x, w, ids = _layer_inputs(hybrid, 6)
    _streamed_layer(hybrid, 1, x, w, ids)
    want = torch.bincount(ids.flatten(), minlength=16).float()
    assert torch.equal(hot[0].counts, want) and want.sum() == ids.numel()
    assert hot[1].counts.sum() == 0, "layer 1 did not stream"


@pytest.fixture
def grouped_calls(monkeypatch):
    """Counts torch._grouped_mm calls (the real one runs)."""
    calls, real = [], torch._grouped_mm

    def counting(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_grouped_mm", counting)
    return calls


@pytest.mark.parametrize("aligned", [False, True])
@pytest.mark.parametrize("group,sizes,experts", [(4, [4] * 4, range(16)), (16, [16], range(16)),
                                                 (5, [5, 5, 5, 1], range(16)), (16, [16], range(0, 16, 3)),
                                                 (4, [4] * 4, (0, 5, 6, 7, 12))])
def test_experts_already_on_the_device_go_in_groups(tiny_dir, block_aligned_dir, aligned, group, sizes, experts,
                                                    grouped_calls):
    plain, hybrid = _models(block_aligned_dir if aligned else tiny_dir)
    ref = next(m.experts for m in plain.modules() if isinstance(m, MoE))
    x, w, ids = _layer_inputs(hybrid, group + len(experts), experts=experts)  # the rest: experts with no rows
    got, pipe = _streamed_layer(hybrid, group, x, w, ids)
    assert pipe.group_sizes == sizes and pipe.fused == aligned
    assert (got - ref(x, w, ids)).abs().max() <= 1e-5
    # two grouped GEMMs for each group with rows for more than one expert (a lone expert goes the usual way)
    used = set(int(e) for e in ids.unique())
    at, multi = 0, 0
    for n in sizes:
        multi += len(used & set(range(at, at + n))) > 1
        at += n
    assert len(grouped_calls) == 2 * multi > 0
    assert 0 < pipe.expert_loop_cpu_s <= pipe.expert_loop_s + 0.02  # the model thread's own time in the loop


def test_copies_still_in_flight_are_not_grouped(tiny_dir, monkeypatch, grouped_calls):
    from hybrid.prefill.events import PairedEvent

    _, hybrid = _models(tiny_dir)
    x, w, ids = _layer_inputs(hybrid, 4)
    monkeypatch.setattr(PairedEvent, "done", lambda self: False)  # every copy posted, none landed yet
    _, pipe = _streamed_layer(hybrid, 8, x, w, ids)
    assert pipe.group_sizes == [1] * 16 and grouped_calls == []


def test_where_the_grouped_gemm_fails_the_experts_go_one_at_a_time(tiny_dir, monkeypatch, grouped_calls):
    plain, hybrid = _models(tiny_dir)
    ref = next(m.experts for m in plain.modules() if isinstance(m, MoE))
    x, w, ids = _layer_inputs(hybrid, 3)

    def unsupported(*args, **kwargs):
        raise RuntimeError("grouped gemm is not supported on this device")

    monkeypatch.setattr(torch, "_grouped_mm", unsupported)
    loader = StreamLoader()
    with pytest.warns(UserWarning, match=r"policy\.prefill\.slp_group_experts"):
        got, pipe = _streamed_layer(hybrid, 8, x, w, ids, loader=loader)
    assert (got - ref(x, w, ids)).abs().max() <= 1e-5
    assert loader.no_grouped_gemm == {("cpu", torch.float32)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # remembered: no second attempt, no second warning
        again, _ = _streamed_layer(hybrid, 8, x, w, ids, loader=loader)
    assert torch.equal(again, got)
    with pytest.warns(UserWarning, match="slp_group_experts"):  # another loader (engine) tries for itself
        _streamed_layer(hybrid, 8, x, w, ids, loader=StreamLoader())


def test_an_old_torch_without_a_grouped_gemm_is_told_apart_and_out_of_memory_is_not_swallowed(
        tiny_dir, monkeypatch, grouped_calls):
    _, hybrid = _models(tiny_dir)
    x, w, ids = _layer_inputs(hybrid, 5)
    monkeypatch.delattr(torch, "_grouped_mm")
    with pytest.warns(UserWarning, match=r"needs >= 2\.8"):
        assert not StreamLoader().grouped_gemm_applies(x)

    def out_of_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(torch, "_grouped_mm", out_of_memory, raising=False)
    loader = StreamLoader()
    with pytest.raises(torch.cuda.OutOfMemoryError):
        _streamed_layer(hybrid, 8, x, w, ids, loader=loader)
    assert loader.no_grouped_gemm == set()


def test_no_slot_is_overwritten_before_off_even_when_the_model_is_slow(tiny_dir, monkeypatch):
    _, hybrid = _models(tiny_dir)
    real_take = Pipeline.take

    def slow_take(self, layer, expert):
        time.sleep(0.002)  # the loader runs ahead as far as the ring lets it
        return real_take(self, layer, expert)

    monkeypatch.setattr(Pipeline, "take", slow_take)
    tokens = torch.randint(2, 320, (1, 12))
    with streaming(hybrid, CPU, 2, BIG) as pipe:
        hybrid(tokens, torch.arange(12)[None], experts=pipe.experts)
    assert overwritten_before_off(pipe.ring.log) == []
    # the checker itself catches a write into a slot still in use
    assert overwritten_before_off([("write", 0, "a"), ("write", 0, "b")]) == [(0, "a")]


def test_streaming_leaves_the_model_alone_and_restores_the_switch_interval(tiny_dir):
    """The streamed experts are handed to the model call, never put into the model: decode may run meanwhile."""
    _, hybrid = _models(tiny_dir)
    before = [m.experts for m in hybrid.modules() if isinstance(m, MoE)]
    switch = sys.getswitchinterval()
    with streaming(hybrid, CPU, 2, BIG) as pipe:
        assert before == [m.experts for m in hybrid.modules() if isinstance(m, MoE)]
        assert sorted(pipe.experts) == [i for i, b in enumerate(hybrid.model.layers) if isinstance(b.mlp, MoE)]
        assert all(isinstance(e, StreamedExperts) for e in pipe.experts.values())
        assert sys.getswitchinterval() == pytest.approx(slp.SWITCH_INTERVAL_S)
    assert sys.getswitchinterval() == switch


def test_the_streamed_experts_multiply_through_the_loaders_gemm_or_the_one_asked_for(tiny_dir):
    from hybrid.kernels.fp8_linear import Fp8Gemm

    _, hybrid = _models(tiny_dir)
    loader = StreamLoader(Fp8Gemm("dequant"), fused_combine=False)
    with loader.streaming(hybrid, CPU, 2, BIG) as pipe:
        assert pipe.gemm is loader.gemm and pipe.loader is loader
    auto = Fp8Gemm("auto", 64)
    with loader.streaming(hybrid, CPU, 2, BIG, gemm=auto) as pipe:
        assert pipe.gemm is auto
    assert loader.gemm == Fp8Gemm("dequant")


def test_budget_too_small_for_the_ring_names_the_knob(tiny_dir):
    _, hybrid = _models(tiny_dir)
    with pytest.raises(ConfigError, match=r"policy\.prefill\.ring_len=4 .*policy\.gpu\.memory_budget_gb"):
        with streaming(hybrid, CPU, 4, 1000):
            pass


def _recording(hybrid, calls: list):
    """long_prefill for the engine: streams through a 2-slot ring and records each chunk's length."""
    def long_prefill(tokens, **_):
        calls.append(tokens)
        return streaming(hybrid, CPU, 2, BIG)
    return long_prefill


def _engine(model, long_prefill=None, cutoff: int = 0, chunk: int = 0) -> Engine:
    plan = local_plan({"kv.max_batch": 1, "kv.max_context": 64, "decode.batch_cap": 1,
                       "prefill.slp_cutoff_tokens": cutoff})
    plan = replace(plan, prefill=replace(plan.prefill, slp_chunk_tokens=chunk))  # on the CPU nothing streams itself
    return Engine(model, plan, long_prefill=long_prefill)


def _first(engine: Engine, prompt, n: int = 1) -> list[int]:
    return engine.generate([prompt], SamplingParams(n, ignore_eos=True))[0].output_ids


def _same_cache(a: Engine, b: Engine, n: int) -> None:
    for mine, theirs in zip(a.cache.layers, b.cache.layers):  # what decode will read
        for x, y in zip(mine.rows(0, n), theirs.rows(0, n)):
            assert (x - y).abs().max() <= 1e-5


def test_engine_uses_slp_above_the_cutoff_and_writes_the_kv_cache(tiny_dir):
    plain, hybrid = _models(tiny_dir)
    used = []
    prompt = list(range(2, 30))
    ref = _engine(plain)
    want = _first(ref, prompt)
    slp = _engine(hybrid, _recording(hybrid, used), cutoff=16)
    assert _first(slp, prompt) == want and used == [len(prompt)]
    _same_cache(slp, ref, len(prompt))
    _first(_engine(hybrid, _recording(hybrid, used), cutoff=64), prompt, 2)
    assert used == [len(prompt)], "prompts at or under the cutoff take the CPU path"


def test_auto_ring_len_is_as_deep_as_the_budget_allows_up_to_a_layer():
    slot = 44 * 10**6
    assert auto_ring_len(256, slot, 100e9) == 256
    assert auto_ring_len(16, slot, 100e9) == 16  # never more than a layer's experts
    assert auto_ring_len(256, slot, 10.5 * slot) == 10  # capped by the budget
    assert auto_ring_len(256, slot, 2 * slot) == 2  # ping-pong when memory is tight
    assert auto_ring_len(256, slot, 0.5 * slot) == 1  # the ring then refuses it, naming the knobs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_slp_on_the_gpu_matches_the_plain_forward(tiny_dir):
    from hybrid.placement.passes import pin_experts, place

    plain, hybrid = _models(tiny_dir)
    gpu = torch.device("cuda", 0)
    pin_experts(hybrid)
    place(hybrid, gpu)
    tokens = torch.randint(2, 320, (1, 40))
    want = plain(tokens, torch.arange(40)[None])[0]
    for ring_len in (1, 2, 16):
        with streaming(hybrid, gpu, ring_len, BIG) as pipe:
            got = hybrid(tokens.to(gpu), torch.arange(40, device=gpu)[None], experts=pipe.experts)[0].cpu()
        assert (got - want).abs().max() <= 1e-4, f"ring_len {ring_len}"
        assert overwritten_before_off(pipe.ring.log) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_grouped_experts_on_the_gpu_match_one_at_a_time(block_aligned_dir, grouped_calls):
    from hybrid.placement.passes import pin_experts, place

    gpu = torch.device("cuda", 0)
    hybrid = load_model(Checkpoint(block_aligned_dir), torch.bfloat16, progress=False)
    experts_to_cpu_kernels(hybrid)
    pin_experts(hybrid)
    place(hybrid, gpu)
    x, w, ids = (t.to(gpu) for t in _layer_inputs(hybrid, 7))
    outs = {}
    for group in (1, 16):
        got, pipe = _streamed_layer(hybrid, group, x.bfloat16(), w, ids, device=gpu)
        outs[group] = got.float().cpu()
        assert pipe.group_sizes == ([16] if group == 16 else [1] * 16)
    assert len(grouped_calls) == 2, "gate+up and down as grouped GEMMs, no fallback"
    assert float((outs[16] - outs[1]).norm() / outs[1].norm()) < 1e-2


def test_chunked_slp_prefill_equals_one_pass(tiny_dir):
    plain, hybrid = _models(tiny_dir)
    chunks = []
    prompt = list(range(2, 45))
    ref = _engine(plain)
    want = _first(ref, prompt)
    slp = _engine(hybrid, _recording(hybrid, chunks), cutoff=16, chunk=16)
    assert _first(slp, prompt) == want
    assert chunks == [16, 16, 11], "the experts stream once per chunk"
    _same_cache(slp, ref, len(prompt))


def test_a_chunked_slp_prefill_keeps_no_pipeline_alive(tiny_dir):
    """Each chunk hands back its statistics, not its pipeline: the ring goes back to the loader and the group buffer
    is let go before the next chunk streams (kept alive, a long prompt held one buffer and ring per chunk)."""
    import gc
    import weakref

    _, hybrid = _models(tiny_dir)
    loader, pipes = StreamLoader(), []

    def long_prefill(tokens, **_):
        context = loader.streaming(hybrid, CPU, 2, BIG, group=8)
        pipe = context.__enter__()
        pipes.append(weakref.ref(pipe))
        return _Entered(context, pipe)

    stats = _engine(hybrid, long_prefill, cutoff=16, chunk=16).prefill(list(range(2, 45)))[1]
    gc.collect()
    assert [sorted(x) for x in stats] == [["expert_loop_cpu_s", "expert_loop_s", "group_sizes", "queue_wait_s",
                                        "rested_s", "throttled_s"]] * 3
    assert all(ref() is None for ref in pipes), "no pipeline outlives its chunk"


class _Entered:
    """A context already entered: exits it."""

    def __init__(self, context, value):
        self.context, self.value = context, value

    def __enter__(self):
        return self.value

    def __exit__(self, *exc):
        return self.context.__exit__(*exc)


def test_a_grouped_gemm_is_missing_without_torch_grouped_mm(monkeypatch):
    """What the machine probe reports (the plan then groups AUTO_GROUP experts, or one at a time:
    tests/plan/test_resolve.py)."""
    assert slp.grouped_gemm_missing(CPU, torch.float32) is None
    monkeypatch.delattr(torch, "_grouped_mm")
    assert "needs >= 2.8" in slp.grouped_gemm_missing(CPU, torch.float32)


def test_the_group_buffer_is_counted_in_the_budget():
    from hybrid.placement.memory import group_bytes
    from hybrid.model.args import ModelArgs
    from hybrid.weights.presets import DEEPSEEK_V3

    a = ModelArgs.from_hf_config(DEEPSEEK_V3)
    assert group_bytes(a, 1) == 0 and group_bytes(a, 32) == 32 * 3 * 2048 * 7168 * 2  # BF16 gate, up, down


def test_auto_chunk_fits_the_budget():
    from hybrid.placement.memory import activation_bytes, auto_chunk
    from hybrid.model.args import ModelArgs
    from hybrid.weights.presets import DEEPSEEK_V3

    a = ModelArgs.from_hf_config(DEEPSEEK_V3)
    slot = 44 * 10**6
    assert auto_chunk(a, 1e15, slot) == 0  # everything fits: one pass
    chunk = auto_chunk(a, 8e9, slot)
    assert 0 < chunk and activation_bytes(a, chunk) + 2 * slot <= 8e9 and chunk % 256 == 0
    with pytest.raises(ConfigError, match=r"policy\.gpu\.memory_budget_gb or set policy\.prefill\.slp_chunk_tokens"):
        auto_chunk(a, 2 * slot, slot)
