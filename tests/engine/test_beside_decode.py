"""A long prompt's stream-loading prefill beside decode (policy.prefill.beside_decode), on the CPU stand-in device:
the running requests keep decoding while it streams, every request's greedy tokens equal its solo tokens, an abort
or a failure of the streamed prompt touches nothing else, and the stream is paced while requests decode."""
from __future__ import annotations

import collections
from dataclasses import replace

import threading
import time

import pytest
import torch

from hybrid.engine.build import slot_bytes
from hybrid.engine.decoder import Decoder
from hybrid.engine.engine import Engine
from hybrid.placement.passes import cpu_experts, experts_to_cpu_kernels, pin_experts
from hybrid.engine.probe import local_plan
from hybrid.engine.requests import FinishReason, SamplingParams
from hybrid.errors import ConfigError
from hybrid.kernels import thread_pool
from hybrid.prefill import pipeline
from hybrid.prefill.pipeline import Pipeline
from hybrid.prefill.slp import StreamLoader
from hybrid.prefill.throttle import Throttle
from hybrid.weights.checkpoint import Checkpoint
from hybrid.weights.loader import load_model
from tests.plans import GPU, gpu_plan

CPU = torch.device("cpu")
BIG = 1e12
CUTOFF = 16  # prompts longer than this are stream-loaded


@pytest.fixture(scope="module")
def hybrid(tiny_dir):
    model = load_model(Checkpoint(tiny_dir), torch.float32, progress=False)
    experts_to_cpu_kernels(model)
    return model


def _engine(model, beside: bool = True, cap: float | None = None, budget: float = BIG, context: int = 96,
            decode: Decoder | None = None, queue_bytes: int | None = None, **knobs) -> Engine:
    """cap: the stream's bytes/s while requests decode, queue_bytes: its copies queued at a time (None: none, finer
    than the policy's MB); knobs: policy paths."""
    loader = StreamLoader()

    def long_prefill(tokens, throttle=None, cancel=None, **_):
        return loader.streaming(model, CPU, 2, budget, throttle=throttle, cancel=cancel)

    plan = local_plan({"kv.max_batch": 3, "kv.max_context": context, "decode.batch_cap": 3, "prefill.chunk_tokens": 8,
                       "prefill.slp_cutoff_tokens": CUTOFF, "prefill.beside_decode": beside, **knobs})
    plan = replace(plan, prefill=replace(plan.prefill, stream_cap_gbps=(cap or 0) / 1e9,
                                         stream_queue_mb=(queue_bytes or 0) / 2 ** 20))
    return Engine(model, plan, decode=decode, long_prefill=long_prefill)


class _Noting(Decoder):
    """Eager decode that notes, at each step, (a prompt streaming beside?, the pool's threads, the rest held?)."""

    def __init__(self):
        self.engine: Engine | None = None
        self.seen: list[tuple[bool, int, bool]] = []

    def __call__(self, *part, capture=True):
        beside = self.engine.beside
        self.seen.append((beside.running, thread_pool.threads(), beside.throttle._held))
        return self.engine.runner.eager(*part)


def _noted(model, **knobs) -> tuple[Engine, list[tuple[bool, int, bool]]]:
    note = _Noting()
    note.engine = _engine(model, decode=note, **knobs)
    return note.engine, note.seen


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(2, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def _run(engine: Engine, arrivals: dict[int, list], steps: int = 2000):
    """Steps the engine, adding (prompt, params) at the given steps; returns id -> [tokens, reason, error,
    steps at which it got tokens]."""
    got = {}
    for step in range(steps):
        for prompt, params in arrivals.get(step, []):
            got[engine.add_request(prompt, params)] = [[], None, "", []]
        for out in engine.step():
            got[out.id][0] += out.new_token_ids
            if out.new_token_ids:
                got[out.id][3].append(step)
            if out.finished:
                got[out.id][1], got[out.id][2] = out.finish_reason, out.error
        if step >= max(arrivals) and not engine.has_work():
            return got
    raise AssertionError("requests left unfinished")


@pytest.fixture
def slow_stream(monkeypatch):
    """Each streamed expert waits 15 ms before the model computes it: a prefill that outlasts several steps."""
    real = Pipeline.take

    def take(self, layer, expert):
        time.sleep(0.015)
        return real(self, layer, expert)

    monkeypatch.setattr(Pipeline, "take", take)


def test_decode_goes_on_while_a_long_prompt_streams_and_tokens_equal_solo(hybrid, slow_stream):
    short, long_, late = (_prompt(10, 1), _greedy(40)), (_prompt(40, 2), _greedy(6)), (_prompt(12, 3), _greedy(8))
    got = _run(_engine(hybrid), {0: [short], 3: [long_], 4: [late]})
    ids = sorted(got)
    for rid, (prompt, params) in zip(ids, (short, long_, late)):
        solo = _engine(hybrid).generate([prompt], params)[0].output_ids
        held = _engine(hybrid, beside=False).generate([prompt], params)[0].output_ids
        assert got[rid][0] == solo == held, f"request {rid} changed by its batch mates or by the path"
        assert got[rid][1] is FinishReason.length
    first_long = got[ids[1]][3][0]
    during = [s for s in got[ids[0]][3] if 3 <= s < first_long]
    # 2 MoE layers x 16 experts x 15 ms ~ 0.5 s of streaming: the short request decodes right through it, and the
    # late short prompt (behind the long one in arrival order) gets its chunks and tokens meanwhile
    assert len(during) >= 5, f"the running request made {len(during)} steps of progress during the prefill"
    assert got[ids[2]][3][0] < first_long, "the prompt behind the streamed one waited for it"


def test_decode_leaves_cores_to_a_prompt_streaming_beside_it(hybrid, slow_stream):
    """policy.prefill.beside_cores: while the prompt streams, decode's CPU experts run on that many fewer threads
    (the pool resized between steps, never below one); before and after it, on all of them; tokens unchanged."""
    before = thread_pool.threads()
    short, long_ = (_prompt(10, 1), _greedy(30)), (_prompt(40, 2), _greedy(4))
    try:
        engine, noted = _noted(hybrid, **{"cpu.threads": 2, "prefill.beside_cores": 1})
        got = _run(engine, {0: [short], 3: [long_]})
        after = thread_pool.threads()
    finally:
        thread_pool.set_threads(before)
    seen = [(b, threads) for b, threads, _ in noted]  # (prompt streaming beside?, the pool's threads) at each step
    assert {(True, 1), (False, 2)} <= set(seen) and set(seen) <= {(True, 1), (False, 2)}, seen
    assert seen[0] == (False, 2) and after == 2
    solo = _engine(hybrid).generate([short[0]], short[1])[0].output_ids
    assert got[min(got)][0] == solo
    p = local_plan({"cpu.threads": 16, "prefill.beside_cores": 2})
    assert (p.decode_threads(True), p.decode_threads(False)) == (14, 16)
    assert local_plan({"cpu.threads": 2, "prefill.beside_cores": 4}).decode_threads(True) == 1


def test_held_decode_makes_no_progress_while_a_long_prompt_streams(hybrid, slow_stream):
    """The same arrivals with beside_decode off: the prefill takes one step and decode waits for it (the contrast
    the test above relies on)."""
    got = _run(_engine(hybrid, beside=False), {0: [(_prompt(10, 1), _greedy(20))], 3: [(_prompt(40, 2), _greedy(4))]})
    ids = sorted(got)
    first_long = got[ids[1]][3][0]
    assert [s for s in got[ids[0]][3] if 3 <= s < first_long] == []


def test_aborting_the_streamed_prompt_frees_its_slot_for_the_next_request(hybrid, slow_stream):
    engine = _engine(hybrid)
    a = engine.add_request(_prompt(10, 1), _greedy(30))
    engine.step()
    b = engine.add_request(_prompt(40, 2), _greedy(5))
    engine.step()  # b streams now
    engine.abort(b)
    outs, t0, b_done = {}, time.monotonic(), None
    while engine.has_work() and time.monotonic() - t0 < 60:
        for o in engine.step():
            outs.setdefault(o.id, []).append(o)
            if o.id == b and o.finished:
                b_done = time.monotonic() - t0
    assert outs[b][-1].finish_reason is FinishReason.abort and not outs[b][-1].new_token_ids
    # the stream stopped at its next expert, not after all 32 (~0.5 s at 15 ms each)
    assert b_done is not None and b_done < 0.25, f"the aborted stream ran on for {b_done} s"
    assert outs[a][-1].finish_reason is FinishReason.length
    assert sum(len(o.new_token_ids) for o in outs[a]) + 1 >= 30  # the first token came in the first step
    engine.add_request(_prompt(40, 4), _greedy(3))  # into the freed slot, streamed in turn
    tokens = []
    while engine.has_work():
        for o in engine.step():
            tokens += o.new_token_ids
    assert tokens == _engine(hybrid).generate([_prompt(40, 4)], _greedy(3))[0].output_ids


def test_close_stops_a_prefill_running_beside(hybrid, slow_stream):
    """What the server does on shutdown: the stream stops at its next expert; a step then ends the request."""
    engine = _engine(hybrid)
    rid = engine.add_request(_prompt(40, 2), _greedy(5))
    engine.step()
    t0 = time.monotonic()
    engine.close()
    assert time.monotonic() - t0 < 0.25
    outs = [o for o in engine.step() if o.id == rid]
    assert outs and outs[-1].finish_reason is FinishReason.abort and not engine.has_work()


def test_a_failing_streamed_prefill_fails_its_request_alone(hybrid):
    engine = _engine(hybrid, budget=1000)  # too small for a 2-slot ring: the stream refuses to start
    short, long_ = (_prompt(10, 1), _greedy(12)), (_prompt(40, 2), _greedy(4))
    got = _run(engine, {0: [short], 2: [long_]})
    ids = sorted(got)
    assert got[ids[1]][1] is FinishReason.error and "policy.prefill.ring_len" in got[ids[1]][2]
    assert got[ids[0]][1] is FinishReason.length
    assert got[ids[0]][0] == _engine(hybrid).generate([short[0]], short[1])[0].output_ids
    with pytest.raises(ConfigError):  # the same refusal, on the engine's own thread
        _engine(hybrid, budget=1000).prefill(long_[0])


def test_the_stream_is_paced_while_requests_decode_and_not_when_none_does(hybrid):
    cap = slot_bytes(hybrid) / 0.02  # one expert per 20 ms: 32 experts ~ 0.6 s
    prompt = _prompt(40, 2)

    def ttft(with_decode: bool) -> float:
        engine = _engine(hybrid, cap=cap, context=2000)
        if with_decode:  # decoding all through the stream (1,900 steps)
            engine.add_request(_prompt(10, 1), _greedy(1900))
            engine.step()
        rid, t0 = engine.add_request(prompt, _greedy(1)), time.perf_counter()
        while True:
            for o in engine.step():
                if o.id == rid and o.new_token_ids:
                    return time.perf_counter() - t0

    paced, free = ttft(True), ttft(False)
    assert paced >= 0.5, f"the paced stream took {paced:.2f} s for 32 experts at one per 20 ms"
    assert free < paced / 2, f"nothing decoding, yet the stream was paced ({free:.2f} s vs {paced:.2f} s)"


@pytest.fixture(scope="module")
def pinned(tiny_dir):
    """The tiny model with its routed experts in one arena per layer (pin_experts, unpinned on the CPU): the one-copy
    path of the loader, as on a GPU."""
    model = load_model(Checkpoint(tiny_dir), torch.float32, progress=False)
    experts_to_cpu_kernels(model)
    pin_experts(model, pin=False)
    return model


@pytest.mark.parametrize("cap, queued", [(BIG, None), (None, 2), (BIG, 1)])
def test_a_limited_stream_copies_each_expert_in_pieces_and_keeps_tokens(pinned, monkeypatch, cap, queued):
    """Beside decode with a cap or a queue bound (`queued` pieces), an expert's one copy goes in pieces of
    PACED_COPY_BYTES, each announced to the throttle and queued only when the queue has room for it (decode's small
    copies wait behind little); at full speed, one copy per expert."""
    slot = slot_bytes(pinned)
    piece = slot // 3 + 64
    monkeypatch.setattr(pipeline, "PACED_COPY_BYTES", piece)
    waits, real_wait, most, real_queue = [], Throttle.wait, [0], Pipeline._queue

    def wait(self, nbytes, stop=None):
        waits.append((nbytes, self.limited))
        return real_wait(self, nbytes, stop)

    def queue(self, nbytes):
        real_queue(self, nbytes)
        most[0] = max(most[0], self._queued_bytes)

    monkeypatch.setattr(Throttle, "wait", wait)
    monkeypatch.setattr(Pipeline, "_queue", queue)
    bound = None if queued is None else queued * piece
    short, long_ = (_prompt(10, 1), _greedy(60)), (_prompt(40, 2), _greedy(4))
    got = _run(_engine(pinned, cap=cap, queue_bytes=bound), {0: [short], 2: [long_]})
    limited = [n for n, on in waits if on]
    experts = sum(len(layer.host_experts) for layer in cpu_experts(pinned))  # each streamed once
    assert sorted(set(limited)) == sorted({piece, slot - 2 * piece}) and len(limited) == 3 * experts, waits[:8]
    if bound is not None:  # the queue kept (on the CPU stand-in a copy is done once made: the logic, not the wait)
        assert 0 < most[0] <= bound
    else:
        assert most[0] == 0
    for rid, (prompt, params) in zip(sorted(got), (short, long_)):
        assert got[rid][0] == _engine(pinned).generate([prompt], params)[0].output_ids
    waits.clear()
    _engine(pinned, cap=cap, queue_bytes=bound).generate([long_[0]], long_[1])  # none decodes: whole copies
    assert [n for n, _ in waits] == [slot] * experts and not any(on for _, on in waits)


def test_the_queue_bound_waits_for_the_oldest_copies():
    """_room: the oldest queued copies are waited for until the next fits (one goes whatever its size when none
    is queued); with no bound the queue is forgotten."""
    class Done:
        def __init__(self):
            self.waited = False

        def synchronize(self):
            self.waited = True

    pipe = Pipeline.__new__(Pipeline)
    pipe.throttle, pipe.queue_wait_s = Throttle(None, 10), 0.0
    first, second = Done(), Done()
    pipe._queued, pipe._queued_bytes = collections.deque([(6, first), (4, second)]), 10
    pipe._room(3)
    assert first.waited and not second.waited and pipe._queued_bytes == 4
    pipe._room(20)  # larger than the bound: it waits for all, then goes
    assert second.waited and not pipe._queued and pipe._queued_bytes == 0
    pipe._queued, pipe._queued_bytes = collections.deque([(6, Done())]), 6
    pipe.throttle.set_limits(None, None)
    pipe._room(100)
    assert not pipe._queued and pipe._queued_bytes == 0


def test_throttle_paces_announced_copies():
    now = [0.0]
    t = Throttle(1e9, clock=lambda: now[0])
    assert [t.delay(100_000_000) for _ in range(3)] == pytest.approx([0.0, 0.1, 0.2])
    now[0] = 1.0  # idle a while: no credit is banked beyond the pace
    assert t.delay(100_000_000) == 0.0 and t.delay(100_000_000) == pytest.approx(0.1)
    t.set_limits(None)
    assert t.delay(10**12) == 0.0 and t.rate is None
    with pytest.raises(ValueError, match="> 0"):
        t.set_limits(0)
    stop = threading.Event()
    stop.set()
    t.set_limits(1.0)
    t0 = time.monotonic()
    assert t.wait(10, stop) == 0.0 and t.wait(10, stop) == pytest.approx(10.0)  # the second would wait 10 s...
    assert time.monotonic() - t0 < 1  # ...but the stop ends it


def test_throttle_duty_cycle_rests_its_share_of_the_time():
    """Under a duty d the prefill rests (1 - d) / d times each spell of work once a spell reaches d of the period
    (an overrun paid in full), and no copy starts during a rest."""
    now = [0.0]
    t = Throttle(duty=0.25, clock=lambda: now[0], period_s=0.04)
    t.begin()
    now[0] = 0.005
    assert t.rest_for() == 0.0  # 5 ms of the 10 it may work
    now[0] = 0.030  # 30 ms worked: three times its share, rests three times as long
    assert t.rest_for() == pytest.approx(0.090)
    assert t.delay(10) == pytest.approx(0.090)  # the loader waits out the rest too
    now[0] = 0.120  # rested; the next spell starts at the next call
    assert t.delay(10) == 0.0 and t.rest_for() == 0.0
    now[0] = 0.131
    assert t.rest_for() == pytest.approx(0.011 * 3)
    t.set_limits(None, None, None)  # nothing decodes: no rest left, none taken
    assert t.delay(10) == 0.0 and t.rest_for() == 0.0 and t.duty is None
    t.set_limits(None, None, 1.0)  # always at work is none
    assert t.duty is None
    for bad in (0, -0.5, 1.5):
        with pytest.raises(ValueError, match=r"\(0, 1\]"):
            t.set_limits(None, None, bad)


def test_a_rest_ends_when_the_duty_cycle_is_lifted():
    t = Throttle(duty=0.1, period_s=0.01)
    t.begin()
    time.sleep(0.05)  # 50 ms of work: a 450 ms rest
    lifted = threading.Timer(0.05, t.set_limits, (None, None, None))
    lifted.start()
    t0 = time.monotonic()
    assert t.breathe() >= 0.449  # at least 50 ms worked (a loaded machine sleeps longer): 9x that to rest
    assert time.monotonic() - t0 < 0.3, "the rest went on after the duty cycle was lifted"
    lifted.join()


def test_a_held_rest_lasts_until_released():
    """hold(): outside a rest (or without a duty cycle) nothing is held; in a rest the prefill and the loader wait
    past its end until release() (decode took their cores for a step)."""
    now = [0.0]
    t = Throttle(duty=0.5, clock=lambda: now[0], period_s=0.02)
    t.begin()
    assert not t.hold(), "at work: nothing to hold"
    now[0] = 0.010
    assert t.rest_for() == pytest.approx(0.010)  # resting until 0.020
    now[0] = 0.015
    assert t.hold() and t.hold(), "in a rest: held (twice is once)"
    now[0] = 0.050  # the rest's time is up, but it is held
    done = []
    waiters = [threading.Thread(target=lambda: done.append(("model", t._rest(None)))),
               threading.Thread(target=lambda: done.append(("loader", t.wait(10))))]
    for w in waiters:
        w.start()
    time.sleep(0.1)
    assert done == [], "a held rest went on past its time"
    t.release()
    for w in waiters:
        w.join(timeout=5)
    assert sorted(d[0] for d in done) == ["loader", "model"]
    assert not t.hold(), "past the rest: nothing to hold"
    t.set_limits(None, None, None)
    assert not t.hold()


@pytest.mark.parametrize("back", [True, False])
def test_decode_takes_the_prefills_cores_in_its_rests(hybrid, slow_stream, back):
    """policy.prefill.cores_back_in_rests: under a duty cycle, a step begun while the prefill rests runs on every
    thread (the rest held until it is done); steps while it works leave it its cores; tokens equal solo."""
    before = thread_pool.threads()
    short, long_ = (_prompt(10, 1), _greedy(60)), (_prompt(40, 2), _greedy(4))
    try:
        engine, seen = _noted(hybrid, **{"cpu.threads": 2, "prefill.beside_cores": 1, "prefill.stream_duty": 0.3,
                                             "prefill.cores_back_in_rests": back})
        got = _run(engine, {0: [short], 3: [long_]})
    finally:
        thread_pool.set_threads(before)
    beside = {(threads, held) for b, threads, held in seen if b}
    want = {(1, False), (2, True)} if back else {(1, False)}
    assert beside == want, seen
    solo = _engine(hybrid).generate([short[0]], short[1])[0].output_ids
    assert got[min(got)][0] == solo


def test_a_prefill_at_a_share_of_the_time_beside_decode_keeps_tokens_and_rests_only_while_requests_decode(
        hybrid, slow_stream):
    """policy.prefill.stream_duty: while requests decode the streamed prompt works a quarter of the time (its TTFT
    about 4x), at full speed when none does; every request's tokens equal its solo tokens."""
    short, long_ = (_prompt(10, 1), _greedy(400)), (_prompt(40, 2), _greedy(3))

    def ttft(with_decode: bool):
        engine = _engine(hybrid, context=600, **{"prefill.stream_duty": 0.25})
        got = {}
        if with_decode:
            got[engine.add_request(*short)] = []
            engine.step()
        rid, t0 = engine.add_request(*long_), time.perf_counter()
        got[rid], first = [], None
        while engine.has_work():
            for o in engine.step():
                got[o.id] += o.new_token_ids
                if o.id == rid and o.new_token_ids and first is None:
                    first = time.perf_counter() - t0
        return first, got

    (paced, got), (free, alone) = ttft(True), ttft(False)
    assert paced > 2 * free, f"decoding, the prefill at a quarter of the time took {paced:.2f} s vs {free:.2f} s"
    for rid, (prompt, params) in zip(sorted(got), (short, long_)):
        assert got[rid] == _engine(hybrid, context=600).generate([prompt], params)[0].output_ids
    assert list(alone.values())[0] == got[max(got)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cap, sms, duty", [(None, 0, None), (2.0, 0, None), (None, 16, None), (None, None, None),
                                           (None, None, 0.3)])
def test_gpu_prefill_beside_graphed_decode_keeps_solo_tokens(cap, sms, duty):
    """On a GPU, under CUDA graphs: a long prompt streamed on its own thread and stream while two requests decode
    (one of them arriving during the stream), its attention in query chunks; every request's greedy tokens equal
    its tokens alone. (On the H200, 2026-12-01, run D, request 0 left its solo tokens at its 34th token with the
    einsum attention and unpadded GEMMs; policy.decode.batch_invariant, on here, fixed it: passed in G1 and K7.)"""
    from hybrid.config.compose import compose, to_settings
    from hybrid.engine.build import build

    overrides = ["+hw=h200_xeon16", "policy=default", "policy.adapt_to_hardware=true", "model.dtype=float32",
                 "policy.decode.cuda_graphs=hostfn", "policy.kv.max_batch=3", "policy.decode.batch_cap=3",
                 "policy.kv.max_context=512", "policy.prefill.slp_cutoff_tokens=32",
                 "policy.prefill.beside_decode=true", "policy.decode.batch_invariant=true",
                 "policy.prefill.attention_chunk_tokens=64"]  # 200: 4 chunks
    if cap is not None:
        overrides.append(f"policy.prefill.stream_cap_gbps={cap}")
    if sms is not None:  # 16: the prefill's kernels in a green context, 16 SMs left to decode; None: auto
        overrides.append(f"policy.prefill.beside_sms={sms}")
    if duty is not None:  # the prefill resting between its groups of experts while requests decode
        overrides.append(f"policy.prefill.stream_duty={duty}")
    s = to_settings(compose(overrides))
    engine = build(s, s.hw, progress=False)
    from hybrid.engine.streams import green_contexts

    assert (engine.plan.prefill_sms is None) == (sms == 0 or (sms is None and not green_contexts()))
    v = engine.model.args.vocab_size
    p = [torch.randint(2, v, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (9, 200, 12)]
    got = _run(engine, {0: [(p[0], _greedy(60))], 2: [(p[1], _greedy(10))], 3: [(p[2], _greedy(20))]})
    for rid, (prompt, n) in zip(sorted(got), ((p[0], 60), (p[1], 10), (p[2], 20))):
        assert got[rid][1] is FinishReason.length, got[rid][2]
        assert got[rid][0] == engine.generate([prompt], _greedy(n))[0].output_ids, f"request {rid}"


def test_the_engine_steps_on_no_stream_off_cuda():
    from hybrid.engine.streams import PrefillSide, decode_stream, on

    assert decode_stream(CPU) is None
    with on(None):  # a no-op: the CPU has no streams
        pass
    assert PrefillSide(CPU, None).stream() is None


def test_a_plan_with_sms_left_to_decode_says_so():
    """policy.prefill.beside_sms (null: 32 left to decode where green contexts exist; resolved in
    tests/plan/test_resolve.py)."""
    assert "its kernels on 100 SMs (a green context)" in gpu_plan({"prefill.beside_decode": True}).describe()
    no_green = gpu_plan({"prefill.beside_decode": True}, replace(GPU, green_contexts=False))
    assert "green context" not in no_green.describe()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_steps_run_on_the_highest_priority_stream_ordered_with_the_caller():
    """Decode's GPU work on a stream of the device's highest priority (ahead of a prefill streaming beside it), the
    caller's stream ordered before and after the step."""
    from hybrid.config.compose import compose, to_settings
    from hybrid.engine.build import build

    s = to_settings(compose(["+hw=h200_xeon16", "policy=default", "policy.adapt_to_hardware=true",
                             "policy.decode.cuda_graphs=off"]))
    built = build(s, s.hw, progress=False)
    seen = []
    decode = built.decoder("off")

    def spy(*args, **kwargs):
        seen.append(torch.cuda.current_stream())
        return decode(*args, **kwargs)

    engine = Engine(built.model, built.plan, built.tokenizer, built.cache, decode=spy)
    caller = torch.cuda.current_stream()
    out = engine.generate([[5, 6, 7, 8]], _greedy(3))[0]
    assert not out.error and len(out.output_ids) == 3
    assert seen and all(st == engine.stream for st in seen)
    assert engine.stream.priority < caller.priority == 0  # lower numbers run first
    assert torch.cuda.current_stream() == caller  # the step left the caller's stream current
