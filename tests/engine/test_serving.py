"""The serving engine: requests in flight, continuous batching, chunked prefill. Every request's greedy tokens must
equal its tokens when run alone (same engine plan, one request), whatever its batch mates and arrival time."""
from __future__ import annotations

import threading

import pytest
import torch

from hybrid.engine.engine import Engine
from hybrid.engine.probe import local_plan
from hybrid.plan.plan import Plan
from hybrid.engine.requests import FinishReason, RequestError, SamplingParams
from hybrid.engine.scheduler import Scheduler
from hybrid.engine.requests import Request, State
from hybrid.tokenizer import Tokenizer

PLAN = local_plan({"kv.max_batch": 3, "kv.max_context": 96, "decode.batch_cap": 3, "prefill.chunk_tokens": 8})


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _engine(model, plan: Plan = PLAN, tokenizer=None) -> Engine:
    return Engine(model, plan, tokenizer)


def _solo(model, prompt, params, plan: Plan = PLAN) -> list[int]:
    return _engine(model, plan).generate([prompt], params)[0].output_ids


def _drive(engine: Engine, arrivals: dict[int, list[tuple[list[int], SamplingParams]]], steps: int = 200,
           got: dict | None = None, aborts: dict[int, list[int]] | None = None, one_per_step: bool = False):
    """Steps the engine, adding requests at the given step numbers (and aborting `aborts`' ids at theirs); returns
    id -> (prompt, params, tokens, reason) (`got`: requests added before, updated). `one_per_step`: fails if a
    request gets more than one token in a step."""
    got = {} if got is None else got
    for step in range(steps):
        for prompt, params in arrivals.get(step, []):
            rid = engine.add_request(prompt, params)
            got[rid] = [prompt, params, [], None]
        for rid in (aborts or {}).get(step, []):
            engine.abort(rid)
        for out in engine.step():
            assert not one_per_step or len(out.new_token_ids) <= 1, \
                f"request {out.id} got {len(out.new_token_ids)} tokens in a step"
            got[out.id][2] += out.new_token_ids
            if out.finished:
                got[out.id][3] = out.finish_reason
        if step >= max(arrivals) and not engine.has_work():
            break
    assert not engine.has_work(), "requests left unfinished"
    return got


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def _check_solo(model, got, plan: Plan = PLAN):
    for rid, (prompt, params, tokens, reason) in got.items():
        assert tokens == _solo(model, prompt, params, plan), f"request {rid} changed by its batch mates"
        assert reason in (FinishReason.length, FinishReason.stop)


def test_requests_arriving_mid_decode_and_finishing_early_keep_their_solo_tokens(tiny_model):
    v = tiny_model.args.vocab_size
    arrivals = {0: [(_prompt(5, 1, v), _greedy(12))],
                3: [(_prompt(11, 2, v), _greedy(4))],  # arrives mid-decode, finishes first
                5: [(_prompt(7, 3, v), _greedy(9))]}
    _check_solo(tiny_model, _drive(_engine(tiny_model), arrivals))


def test_more_requests_than_slots_wait_and_none_is_lost(tiny_model):
    v = tiny_model.args.vocab_size
    engine = _engine(tiny_model)
    requests = [(_prompt(4 + i, 10 + i, v), _greedy(3 + i % 4)) for i in range(7)]
    got = {engine.add_request(*r): [*r, [], None] for r in requests}
    for out in engine.step():
        got[out.id][2] += out.new_token_ids
    assert engine.running == 3 and engine.waiting == 4
    _drive(engine, {0: []}, got=got)
    assert len(got) == 7 and all(reason is not None for *_, reason in got.values())
    _check_solo(tiny_model, got)


def test_chunked_prefill_while_two_others_decode(tiny_model):
    v = tiny_model.args.vocab_size
    engine = _engine(tiny_model)
    arrivals = {0: [(_prompt(6, 4, v), _greedy(20)), (_prompt(9, 5, v), _greedy(20))],
                4: [(_prompt(30, 6, v), _greedy(6))]}  # 30 tokens in chunks of 8: 4 steps of prefill
    decoded_during_prefill = []
    orig_step = engine.step

    def step():
        outs = orig_step()
        long = [r for r in engine.scheduler.running if len(r.prompt) == 30 and r.state is State.prefilling]
        if long:
            decoded_during_prefill.append(sum(len(o.new_token_ids) for o in outs))
        return outs
    engine.step = step
    got = _drive(engine, arrivals)
    assert len(decoded_during_prefill) >= 3 and all(n == 2 for n in decoded_during_prefill), \
        "the two running requests decode a token in every step while the long prompt prefills"
    _check_solo(tiny_model, got)


def test_batch_cap_bounds_the_running_requests(tiny_model):
    v = tiny_model.args.vocab_size
    engine = _engine(tiny_model, local_plan({"kv.max_batch": 3, "kv.max_context": 96, "decode.batch_cap": 2,
                                             "prefill.chunk_tokens": 64}))
    for i in range(3):
        engine.add_request(_prompt(5, i, v), _greedy(4))
    seen = 0
    while engine.has_work():
        engine.step()
        seen = max(seen, engine.running)
    assert seen == 2


def test_abort_frees_the_slot_for_the_next_request(tiny_model):
    v = tiny_model.args.vocab_size
    plan = local_plan({"kv.max_batch": 1, "kv.max_context": 96, "decode.batch_cap": 1, "prefill.chunk_tokens": 64})
    engine = _engine(tiny_model, plan)
    first = engine.add_request(_prompt(5, 1, v), _greedy(50))
    second = engine.add_request(_prompt(6, 2, v), _greedy(5))
    engine.step()
    engine.step()
    assert engine.running == 1 and engine.waiting == 1
    engine.abort(first)
    outs = {o.id: o for o in engine.step()}
    assert outs[first].finished and outs[first].finish_reason is FinishReason.abort
    tokens = list(outs.get(second).new_token_ids) if second in outs else []
    while engine.has_work():
        for o in engine.step():
            tokens += o.new_token_ids
    assert tokens == _solo(tiny_model, _prompt(6, 2, v), _greedy(5), plan)
    engine.abort(12345)  # unknown ids are ignored
    assert engine.step() == []


def test_stop_tokens_stop_strings_and_max_tokens(tiny_model, tiny_dir):
    tok = Tokenizer(tiny_dir)
    v = tiny_model.args.vocab_size
    prompt = _prompt(7, 8, v)
    free = _engine(tiny_model, tokenizer=tok).generate([prompt], _greedy(12))[0]
    assert len(free.output_ids) == 12 and free.finish_reason is FinishReason.length
    stop_id = free.output_ids[3]
    at = free.output_ids.index(stop_id)
    by_id = _engine(tiny_model, tokenizer=tok).generate([prompt], SamplingParams(12, stop_token_ids=(stop_id,)))[0]
    assert by_id.output_ids == free.output_ids[:at + 1] and by_id.finish_reason is FinishReason.stop
    assert by_id.text == tok.decode(free.output_ids[:at])
    text = free.text
    assert len(text) >= 4, text
    stop = text[2:4]
    cut = text.index(stop)
    streamed = []
    by_text = _engine(tiny_model, tokenizer=tok).generate(
        [prompt], SamplingParams(12, stop=(stop,), ignore_eos=True), on_output=lambda i, o: streamed.append(o))[0]
    assert by_text.text == text[:cut] and by_text.finish_reason is FinishReason.stop
    assert "".join(o.text_delta for o in streamed) == text[:cut], "streamed text never shows the stop string"


def test_seeded_sampling_is_reproducible_whatever_the_batch_mates(tiny_model):
    v = tiny_model.args.vocab_size
    params = SamplingParams(max_tokens=10, temperature=1.5, top_k=20, top_p=0.95, seed=7, ignore_eos=True)
    prompt = _prompt(6, 9, v)
    alone = _solo(tiny_model, prompt, params)
    got = _drive(_engine(tiny_model), {0: [(_prompt(8, 1, v), _greedy(15))], 2: [(prompt, params)],
                                       3: [(_prompt(5, 2, v), SamplingParams(8, temperature=1.0, seed=3))]})
    mine = next(tokens for p, _, tokens, _ in got.values() if p == prompt)
    assert mine == alone
    other = _solo(tiny_model, prompt, SamplingParams(max_tokens=10, temperature=1.5, top_k=20, top_p=0.95, seed=8,
                                                     ignore_eos=True))
    assert other != alone, "another seed draws other tokens"


def test_bad_requests_fail_alone_with_a_clear_reason(tiny_model):
    v = tiny_model.args.vocab_size
    engine = _engine(tiny_model)
    good = engine.add_request(_prompt(5, 1, v), _greedy(6))
    tokens = [t for o in engine.step() for t in o.new_token_ids]
    with pytest.raises(RequestError,
                       match=r"90 tokens \+ max_tokens 10 = 100 exceeds the 96 .*policy\.kv\.max_context"):
        engine.add_request(_prompt(90, 2, v), _greedy(10))
    with pytest.raises(RequestError, match=f"token id {v} out of range 0..{v - 1}"):
        engine.add_request([3, v, 4], _greedy(2))
    with pytest.raises(RequestError, match="empty prompt"):
        engine.add_request([], _greedy(2))
    with pytest.raises(RequestError, match="stop strings need"):
        engine.add_request([3], SamplingParams(2, stop=("x",)))
    with pytest.raises(RequestError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(RequestError, match="at most 16 stop strings of at most 256"):
        SamplingParams(stop=("x" * 257,))
    while engine.has_work():
        tokens += [t for o in engine.step() if o.id == good for t in o.new_token_ids]
    assert tokens == _solo(tiny_model, _prompt(5, 1, v), _greedy(6))


def test_an_engine_error_fails_its_requests_and_the_engine_goes_on(tiny_model):
    v = tiny_model.args.vocab_size
    calls = {"n": 0}

    def flaky(tokens, pos, slots, kv_len, capture=True):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected")
        return tiny_model(tokens, pos, engine.cache, slots, kv_len=kv_len)[:, -1]
    engine = Engine(tiny_model, PLAN, decode=flaky)
    first = engine.add_request(_prompt(5, 1, v), _greedy(6))
    outs = {}
    while engine.has_work():
        outs.update({o.id: o for o in engine.step() if o.finished})
    assert outs[first].finish_reason is FinishReason.error and "injected" in outs[first].error
    later = engine.generate([_prompt(5, 1, v)], _greedy(6))[0]
    assert later.output_ids == _solo(tiny_model, _prompt(5, 1, v), _greedy(6))


def test_requests_from_other_threads(tiny_model):
    v = tiny_model.args.vocab_size
    engine = _engine(tiny_model)
    ids = []
    adders = [threading.Thread(target=lambda i=i: ids.append(engine.add_request(_prompt(4, i, v), _greedy(3))))
              for i in range(5)]
    for t in adders:
        t.start()
    for t in adders:
        t.join()
    finished = set()
    while engine.has_work():
        finished |= {o.id for o in engine.step() if o.finished}
    assert finished == set(ids) and len(ids) == 5


def test_scheduler_admits_in_order_and_spends_the_chunk_budget():
    s = Scheduler(slots=3, batch_cap=2, chunk_tokens=10, long_cutoff=20)
    reqs = [Request(i, list(range(n)), SamplingParams()) for i, n in enumerate((6, 30, 7, 3))]
    for r in reqs:
        s.add(r)
    plan = s.plan()
    assert [r.id for r in s.running] == [0, 1] and [r.slot for r in s.running] == [0, 1]
    # the short prompt takes 6 of the 10 tokens; the long one (> cutoff) waits for a step of its own
    assert [(c.request.id, c.start, c.end, c.streamed) for c in plan.prefill] == [(0, 0, 6, False)]
    reqs[0].prefilled, reqs[0].state = 6, State.decoding
    plan = s.plan()
    assert [(c.request.id, c.streamed) for c in plan.prefill] == [(1, True)] and plan.decode == [reqs[0]]
    s.finish(reqs[0])
    s.plan()
    assert [r.id for r in s.running] == [1, 2] and reqs[2].slot == 0
    with pytest.raises(ValueError, match="batch_cap"):
        Scheduler(slots=2, batch_cap=3, chunk_tokens=4)


def test_chunk_boundaries_do_not_depend_on_batch_mates_in_bf16(tiny_dir):
    """In BF16 how a prompt is cut changes its logits in the last bits: a prompt's chunks end at multiples of the
    chunk size whatever its batch mates leave of a step, so its greedy tokens are its solo ones."""
    from hybrid.weights.checkpoint import Checkpoint
    from hybrid.weights.loader import load_model

    model = load_model(Checkpoint(tiny_dir), torch.bfloat16, progress=False)
    v = model.args.vocab_size
    plan = local_plan({"kv.max_batch": 4, "kv.max_context": 256, "decode.batch_cap": 4, "prefill.chunk_tokens": 16})
    mates = [(_prompt(64, 1, v), _greedy(4)), (_prompt(23, 2, v), _greedy(4))]
    for seed in range(4):
        mine = (_prompt(17, 10 + seed, v), _greedy(10))
        got = _drive(Engine(model, plan), {0: [*mates, mine]})
        tokens = next(t for p, _, t, _ in got.values() if p == mine[0])
        assert tokens == _solo(model, *mine, plan), f"seed {seed}"


def test_a_failing_after_prefill_hook_warns_and_the_requests_go_on(tiny_model):
    v = tiny_model.args.vocab_size
    calls = []

    def hook():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("refresh failed")
    engine = Engine(tiny_model, PLAN, after_prefill=hook)
    with pytest.warns(UserWarning, match="refresh failed"):
        done = engine.generate([_prompt(4, 1, v), _prompt(20, 2, v)], _greedy(5))
    assert [c.finish_reason for c in done] == [FinishReason.length] * 2 and len(calls) == 2
    assert [c.output_ids for c in done] == [_solo(tiny_model, _prompt(n, s, v), _greedy(5))
                                            for n, s in ((4, 1), (20, 2))]


def test_a_finished_request_leaves_nothing_in_its_kv_slot(tiny_model):
    """Decode reads a slot past its own length (masked, but 0 x NaN is NaN): the blocks a request wrote are zeroed
    before they are handed out again, so a non-finite value it left cannot reach the slot's next occupant."""
    v = tiny_model.args.vocab_size
    plan = local_plan({"kv.max_batch": 2, "kv.max_context": 96, "decode.batch_cap": 2, "prefill.chunk_tokens": 64})
    engine = _engine(tiny_model, plan)
    first = engine.add_request(_prompt(50, 1, v), _greedy(40))
    for _ in range(4):
        engine.step()
    held = engine.kv.blocks(0)
    for layer in engine.cache.layers:  # as if its activations had overflowed: non-finite latents in slot 0
        layer.kv[held] = float("nan")
    engine.abort(first)
    engine.step()
    assert engine.kv.blocks(0) == []
    # a short request takes slot 0 beside a long one: its decode reads slot 0 up to the long one's length
    got = _drive(engine, {0: [(_prompt(6, 2, v), _greedy(6)), (_prompt(50, 3, v), _greedy(6))]})
    _check_solo(tiny_model, got, plan)


def test_generation_config_end_of_turn_ids_stop_a_request(tiny_model, tiny_dir, tmp_path):
    """Kimi-K2's chat turns end with <|im_end|>, generation_config.json's eos, not config.json's: every id listed
    there ends a request."""
    import json
    import shutil

    v = tiny_model.args.vocab_size
    prompt = _prompt(7, 8, v)
    free = _engine(tiny_model, tokenizer=Tokenizer(tiny_dir)).generate([prompt], _greedy(12))[0].output_ids
    ck = tmp_path / "ck"
    shutil.copytree(tiny_dir, ck)
    (ck / "generation_config.json").write_text(json.dumps({"eos_token_id": [free[5], 123456]}))
    tok = Tokenizer(ck)
    assert free[5] in tok.eos_ids and 123456 in tok.eos_ids
    done = _engine(tiny_model, tokenizer=tok).generate([prompt], SamplingParams(12))[0]
    assert done.output_ids == free[:free.index(free[5]) + 1] and done.finish_reason is FinishReason.stop
