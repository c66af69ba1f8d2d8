"""Dual-batch decode (policy.decode.dual_batch): a step's decoding requests as two micro-batches whose graph
segments interleave at the CPU hand-offs. The overlap itself needs a GPU (the GPU test below); on the CPU these
tests hold the logic: the interleaving order, the split, the micro-batches' logits going back to the right
requests, the staging lanes, and every request's greedy tokens equal to its solo tokens."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from hybrid.config import compose, to_settings
from hybrid.engine.build import build
from hybrid.engine.capture import CpuStep, interleave
from hybrid.engine.decoder import Decoder, Eager
from hybrid.engine.engine import Engine
from hybrid.engine.runner import ModelRunner
from hybrid.engine.staggered import micro_batches
from hybrid.placement.passes import CpuExperts, experts_to_cpu_kernels
from hybrid.engine.probe import local_plan
from hybrid.plan.plan import Plan
from hybrid.engine.requests import FinishReason, Request, SamplingParams
from hybrid.placement.staging import Staging
from hybrid.model.moe import MoE
from hybrid.models import Checkpoint, load_model
from tests.engine.test_serving import PLAN, _check_solo, _drive, _greedy, _prompt, _solo
from tests.plans import gpu_plan

DUAL = local_plan({"kv.max_batch": 3, "kv.max_context": 96, "decode.batch_cap": 3, "prefill.chunk_tokens": 8,
                   "decode.dual_batch": True})


def _lane(log: list, name: str, cpu_steps: int) -> list:
    """GPU step, then (CPU step, GPU step) x cpu_steps: as a graph-segment step list."""
    gpu = lambda k: lambda: log.append(f"{name}.gpu{k}")  # noqa: E731
    cpu = lambda k: CpuStep(lambda: log.append(f"{name}.cpu{k}"))  # noqa: E731
    steps = [gpu(0)]
    for k in range(cpu_steps):
        steps += [cpu(k), gpu(k + 1)]
    return steps


def test_interleave_switches_micro_batches_at_each_cpu_step():
    log, entered = [], []

    class Stream:
        def __init__(self, name):
            self.name = name

        def __enter__(self):
            entered.append(self.name)

        def __exit__(self, *exc):
            entered.append("/" + self.name)

    interleave([(lambda: Stream("A"), _lane(log, "A", 2)), (lambda: Stream("B"), _lane(log, "B", 2))])
    assert log == ["A.gpu0", "B.gpu0", "A.cpu0", "A.gpu1", "B.cpu0", "B.gpu1", "A.cpu1", "A.gpu2", "B.cpu1",
                   "B.gpu2"], "each lane's GPU work is enqueued before the other lane's CPU step runs"
    # GPU steps run within their lane's context (its stream); CPU steps outside any
    assert entered == ["A", "/A", "B", "/B", "A", "/A", "B", "/B", "A", "/A", "B", "/B"]


def test_interleave_runs_lanes_of_different_lengths_to_the_end():
    log = []
    nothing = lambda: __import__("contextlib").nullcontext()  # noqa: E731
    interleave([(nothing, _lane(log, "A", 1)), (nothing, _lane(log, "B", 3))])
    assert [x for x in log if x.startswith("A")] == ["A.gpu0", "A.cpu0", "A.gpu1"]
    assert [x for x in log if x.startswith("B")] == ["B.gpu0", "B.cpu0", "B.gpu1", "B.cpu1", "B.gpu2", "B.cpu2",
                                                     "B.gpu3"]


def test_micro_batches_split_in_admission_order():
    reqs = [Request(i, [1], SamplingParams()) for i in range(5)]
    assert micro_batches(reqs[:1]) == [reqs[:1]]
    assert micro_batches(reqs[:2]) == [reqs[:1], reqs[1:2]]
    assert micro_batches(reqs) == [reqs[:3], reqs[3:]]
    assert sum(micro_batches(reqs), []) == reqs


def test_dual_batch_keeps_every_request_on_its_solo_tokens(tiny_model):
    """On the CPU the micro-batches run in turn (eager): requests arriving and finishing at different steps, so the
    split changes from step to step (1, 1+1, 2+1, ...)."""
    v = tiny_model.args.vocab_size
    engine = Engine(tiny_model, DUAL)
    arrivals = {0: [(_prompt(9, 1, v), _greedy(20))], 2: [(_prompt(14, 2, v), _greedy(9))],
                5: [(_prompt(5, 3, v), _greedy(14))]}
    _check_solo(tiny_model, _drive(engine, arrivals), PLAN)


class _DualDecoder(Decoder):
    """A decoder with its own `dual` (as graphed decode has): each micro-batch's logits from the eager step, the
    calls noted."""

    def __init__(self, eager: Decoder):
        self.eager, self.calls = eager, []

    def __call__(self, *part, capture=True):
        self.calls.append(("single", part[0].shape[0]))
        return self.eager(*part)

    def dual(self, parts, capture=True):
        self.calls.append(("dual", [p[0].shape[0] for p in parts]))
        return [self.eager(*p) for p in parts]


def _with(model, plan: Plan, make, **kw) -> tuple[Engine, Decoder]:
    """An engine whose decoder is make(its eager decoder), given to it as `decode`."""
    cache = model.new_cache(plan.kv.max_batch, plan.kv.max_context, plan.device)
    dec = make(Eager(model, cache))
    return Engine(model, plan, cache=cache, decode=dec, **kw), dec


def test_a_decoder_with_dual_gets_both_micro_batches_and_their_logits_go_to_their_requests(tiny_model):
    v = tiny_model.args.vocab_size
    engine, dec = _with(tiny_model, DUAL, _DualDecoder)
    arrivals = {0: [(_prompt(7, 4, v), _greedy(12)), (_prompt(11, 5, v), _greedy(12)),
                    (_prompt(6, 6, v), _greedy(12))]}
    _check_solo(tiny_model, _drive(engine, arrivals), PLAN)
    assert ("dual", [2, 1]) in dec.calls, dec.calls
    assert all(n == 1 for kind, n in dec.calls if kind == "single"), "a step of two or more goes to dual"


def test_without_dual_batch_one_batch_per_step(tiny_model):
    v = tiny_model.args.vocab_size
    engine, dec = _with(tiny_model, PLAN, _DualDecoder)
    _drive(engine, {0: [(_prompt(7, 4, v), _greedy(4)), (_prompt(9, 5, v), _greedy(4))]})
    assert ("single", 2) in dec.calls and not any(kind == "dual" for kind, _ in dec.calls)


def test_staging_lanes_give_each_lane_its_own_fixed_buffers(tiny_dir):
    m = load_model(Checkpoint(tiny_dir), torch.float32, progress=False)
    staging = Staging(256, 4, stage_on_cpu=True)
    experts_to_cpu_kernels(m, staging=staging)
    layer = next(x for x in m.modules() if isinstance(x, MoE)).experts
    assert isinstance(layer, CpuExperts)
    x = torch.randn(2, 256)
    w, ids = next(x for x in m.modules() if isinstance(x, MoE)).gate(x)
    with pytest.raises(RuntimeError, match="lane 1 is not reserved"):
        with staging.lane(1):
            pass
    staging.reserve(4)
    staging.reserve(4, lane=1)
    main = staging.to_host(x, w, ids, sync=False)[0].data_ptr()
    with staging.lane(1):
        other = staging.to_host(x, w, ids, sync=False)[0].data_ptr()
        assert staging.out(2, fixed=True).data_ptr() != staging.out(2, fixed=False).data_ptr()
    assert main != other and staging.to_host(x, w, ids, sync=False)[0].data_ptr() == main, "lane 0 again after"


def test_dual_batch_is_a_policy_knob_in_the_plan():
    s = to_settings(compose(["policy.decode.dual_batch=true", "model=tiny"]))
    assert s.policy.decode.dual_batch is True
    assert "two micro-batches in turn" in local_plan({"decode.dual_batch": True}).describe()
    assert "micro-batches" not in local_plan().describe()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("graphs", ["hostfn", "hostfn:host", "hostfn:null:lockstep", "segments"])
def test_graphed_dual_batch_keeps_solo_tokens(graphs):
    """Under graphs the two micro-batches replay on two streams at once (lanes 1 and 2): requests arriving and
    finishing at different steps keep their solo tokens (each alone through the same engine); hostfn with either
    join of the CPU experts (auto and host), half a step apart (the default) and in lockstep."""
    graphs, _, rest = graphs.partition(":")
    join, _, lockstep = rest.partition(":")
    s = to_settings(compose(["+hw=h200_xeon16", "policy=default", f"policy.decode.dual_stagger={not lockstep}",
                             "policy.adapt_to_hardware=true", "model.dtype=float32",
                             f"policy.decode.cpu_join={join or 'null'}", f"policy.decode.cuda_graphs={graphs}",
                             "policy.decode.dual_batch=true", "policy.decode.batch_invariant=true",
                             "policy.kv.max_batch=3", "policy.decode.batch_cap=3", "policy.kv.max_context=512"]))
    engine = build(s, s.hw, progress=False)
    dec, launched = engine.graphs, []
    launch = dec.launch
    dec.launch = lambda *a: launched.append(a[0]) or launch(*a)  # noqa: E731 - counted
    v = engine.model.args.vocab_size
    prompts = [torch.randint(2, v, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (9, 17, 5)]
    got = _drive(engine, {0: [(prompts[0], _greedy(40))], 3: [(prompts[1], _greedy(12))],
                          8: [(prompts[2], _greedy(30))]})
    assert dec.lanes and any(lane.graphs for lane in dec.lanes)
    assert engine.plan.decode.dual_stagger == (graphs == "hostfn" and not lockstep)
    assert (len(launched) > 20) == engine.plan.decode.dual_stagger, f"{len(launched)} micro-batch steps launched ahead"
    for prompt, params, tokens, _ in got.values():
        assert tokens == engine.generate([prompt], params)[0].output_ids


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_dual_without_its_graphs_gives_each_micro_batch_its_logits():
    """Where the lanes' graphs cannot be replayed (no capture while a prefill beside decode uses the GPU), dual()
    runs both micro-batches on lane 0 one after the other: same batch size, same graph, one static logits tensor,
    so the first one's logits must be copied before the second replay (on the H200, 2026-12-04, they were not:
    the first micro-batch got the second's tokens)."""
    s = to_settings(compose(["+hw=h200_xeon16", "policy=default", "policy.adapt_to_hardware=true",
                             "model.dtype=float32", "policy.decode.cuda_graphs=hostfn", "policy.decode.dual_batch=true",
                             "policy.kv.max_batch=2", "policy.decode.batch_cap=2", "policy.kv.max_context=512"]))
    engine = build(s, s.hw, progress=False)
    dec, dev = engine.graphs, engine.device
    parts = [(torch.tensor([[t]], device=dev), torch.tensor([[3]], device=dev), torch.tensor([slot], device=dev), 4)
             for t, slot in ((5, 0), (7, 1))]
    with torch.cuda.stream(engine.stream):
        alone = [dec(*part).clone() for part in parts]  # lane 0's graph of batch 1 captured, then replayed
        both = dec.dual(parts, capture=False)
    assert not any(lane.graphs for lane in dec.lanes)
    assert not torch.equal(alone[0], alone[1])
    for got, want in zip(both, alone):
        assert torch.equal(got, want)


# staggering resolves to hostfn graphs only (a GPU): on the CPU the test's staggering decoder stands in for them
STAGGER = replace(DUAL, decode=replace(DUAL.decode, dual_stagger=True))


class _StaggeredDecoder(_DualDecoder):
    """A decoder that staggers (as graphed hostfn decode does): a launch computes the step eagerly into its lane's
    one logits buffer (as a graph's static output) and is pending until collected. It fails the test if a lane is
    launched again before it was collected, or (`guard`) if anything else runs the model meanwhile (a prefill: the
    layers' ops would be called while a launched step holds them)."""
    staggers = True

    def __init__(self, eager: Decoder, ready_after: int = 0):
        super().__init__(eager)
        self.pending: dict[int, torch.Tensor] = {}
        self.buffers: dict[int, torch.Tensor] = {}
        self.ready_after = ready_after  # prepare says "not captured" this many times first

    def guard(self, runner: ModelRunner) -> None:
        forward = runner.forward

        def guarded(*a, **k):
            assert not self.pending, "a prefill ran while a micro-batch step was launched"
            return forward(*a, **k)
        runner.forward = guarded

    def __call__(self, *part, capture=True):
        assert not self.pending, "a single step ran while a micro-batch step was launched"
        return super().__call__(*part, capture=capture)

    def dual(self, parts, capture=True):
        assert not self.pending, "a dual step ran while a micro-batch step was launched"
        return super().dual(parts, capture)

    def prepare(self, i, part, capture):
        self.calls.append(("prepare", i))
        if self.ready_after:
            self.ready_after -= 1
            return False
        return True

    def launch(self, i, part):
        assert i not in self.pending, f"lane {i} launched again before it was collected"
        self.calls.append(("launch", i, part[0].shape[0]))
        self.buffers[i] = logits = self.eager(*part)
        self.pending[i] = logits
        return i

    def collect(self, i):
        self.calls.append(("collect", i))
        return self.pending.pop(i)


def _staggered(model, ready_after: int = 0, **kw) -> tuple[Engine, _StaggeredDecoder]:
    engine, dec = _with(model, STAGGER, lambda eager: _StaggeredDecoder(eager, ready_after), **kw)
    dec.guard(engine.runner)
    return engine, dec


def _stepwise(engine: Engine, arrivals: dict, aborts: dict | None = None) -> dict:
    """As _drive, and each request gets at most one token per step; `aborts`: step -> request ids to abort."""
    return _drive(engine, arrivals, aborts=aborts, one_per_step=True)


def test_staggered_micro_batches_keep_solo_tokens_and_run_half_a_step_apart(tiny_model):
    """Requests arriving and finishing at different steps: the micro-batch launched ahead is collected whenever
    the set changes; in between, each step launches the other micro-batch, collects the one ahead, launches its
    next step and only then collects the other."""
    v = tiny_model.args.vocab_size
    engine, dec = _staggered(tiny_model)
    arrivals = {0: [(_prompt(9, 1, v), _greedy(24)), (_prompt(6, 7, v), _greedy(30))],
                4: [(_prompt(14, 2, v), _greedy(9))], 9: [(_prompt(5, 3, v), _greedy(14))]}
    _check_solo(tiny_model, _stepwise(engine, arrivals), PLAN)
    assert not dec.pending
    kinds = [c[0] + (str(c[1]) if c[0] != "single" else "") for c in dec.calls]
    steady = ["launch1", "collect0", "launch0", "collect1"]
    runs = sum(kinds[i:i + 4] == steady or kinds[i:i + 4] == ["launch0", "collect1", "launch1", "collect0"]
               for i in range(len(kinds)))
    assert runs >= 10, f"the micro-batches did not run half a step apart: {kinds}"


def test_staggered_abort_of_a_request_launched_ahead(tiny_model):
    v = tiny_model.args.vocab_size
    engine, _ = _staggered(tiny_model)
    arrivals = {0: [(_prompt(9, 1, v), _greedy(30)), (_prompt(6, 7, v), _greedy(30))]}
    got = _stepwise(engine, arrivals, aborts={8: [0]})
    (p0, s0, t0, r0), (p1, s1, t1, r1) = got[0], got[1]
    assert r0 == FinishReason.abort and 0 < len(t0) < 30
    assert t0 == _solo(tiny_model, p0, s0, PLAN)[:len(t0)], "tokens before the abort are its solo tokens"
    assert t1 == _solo(tiny_model, p1, s1, PLAN) and r1 == FinishReason.length


def test_staggered_waits_for_graphs_not_captured_yet(tiny_model):
    """prepare saying "not captured" (no capture allowed) makes the step run the usual way (dual), tokens the same."""
    v = tiny_model.args.vocab_size
    engine, dec = _staggered(tiny_model, ready_after=3)
    arrivals = {0: [(_prompt(9, 1, v), _greedy(12)), (_prompt(6, 7, v), _greedy(12))]}
    _check_solo(tiny_model, _stepwise(engine, arrivals), PLAN)
    assert any(c[0] == "dual" for c in dec.calls) and any(c[0] == "launch" for c in dec.calls)


def test_dual_batch_auto_is_on_under_hostfn_graphs_only():
    assert to_settings(compose(["model=tiny"])).policy.decode.dual_batch is None
    assert gpu_plan().decode.dual_batch is True
    assert gpu_plan({"decode.cuda_graphs": "segments"}).decode.dual_batch is False
    assert local_plan().decode.dual_batch is False  # on the CPU the halves would run in turn
    assert gpu_plan({"decode.dual_batch": False}).decode.dual_batch is False
    assert local_plan({"decode.dual_batch": True}).decode.dual_batch is True
    from hybrid.config.schema import DecodePolicy

    with pytest.raises(ValueError, match="dual_batch"):
        DecodePolicy(dual_batch="yes")


def test_dual_stagger_is_a_plan_knob_resolved_to_hostfn_graphs():
    s = to_settings(compose(["model=tiny"]))
    assert s.policy.decode.dual_stagger is True
    assert "half a step apart" in gpu_plan().describe()
    assert "half a step apart" not in gpu_plan({"decode.dual_stagger": False}).describe()
    assert not gpu_plan({"decode.cuda_graphs": "segments"}).decode.dual_stagger


def test_collected_between_steps_the_tokens_go_out_with_the_next_step(tiny_model):
    """engine.prefill (a probe) and close() between steps collect the step running ahead first (the layers' ops are
    then free); those requests' tokens are reported by the next step, still one per request per step."""
    v = tiny_model.args.vocab_size
    engine, dec = _staggered(tiny_model)
    prompts = [(_prompt(9, 1, v), _greedy(12)), (_prompt(6, 7, v), _greedy(5))]
    got = {engine.add_request(p, s): [p, s, [], None] for p, s in prompts}
    step, between = 0, []
    while engine.has_work():
        for out in engine.step():
            assert len(out.new_token_ids) <= 1
            got[out.id][2] += out.new_token_ids
            if out.finished:
                got[out.id][3] = out.finish_reason
        step += 1
        if engine.runner.ahead is not None and step >= 3 and len(between) < 2:  # something else needs the model
            engine.close() if between else engine.prefill(_prompt(5, 9, v), slot=2)
            assert not dec.pending and engine.runner.ahead is None
            between.append(step)
    assert len(between) == 2, "no step ran ahead to collect"
    for p, s, tokens, reason in got.values():
        assert tokens == _solo(tiny_model, p, s, PLAN) and reason == FinishReason.length


def test_after_prefill_waits_until_no_step_runs_ahead(tiny_model):
    """Moving hot experts in (after_prefill) while a micro-batch's step runs ahead would change the weights under
    it: put off to the start of the next step, after that step is collected."""
    v = tiny_model.args.vocab_size
    seen = []
    engine, dec = _staggered(tiny_model, after_prefill=lambda: seen.append(bool(dec.pending)))
    for p, s in [(_prompt(9, 1, v), _greedy(20)), (_prompt(6, 7, v), _greedy(20))]:
        engine.add_request(p, s)
    while engine.runner.ahead is None:
        engine.step()
    seen.clear()
    engine.runner.refresh()  # as a prefill beside decode that ends after the step launched ahead
    assert seen == [] and engine.runner.refresh_due
    engine.step()
    assert seen == [False] and not engine.runner.refresh_due
    assert all(not pending for pending in seen)
