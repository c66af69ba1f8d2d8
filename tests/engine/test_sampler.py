"""The sampler's knobs against hand-computed rows, and per-request independence: a request's tokens (greedy, or
seeded) and log-probabilities do not depend on its batch mates, penalties and processors included."""
from __future__ import annotations

import pytest
import torch

from hybrid.engine.engine import Engine
from hybrid.engine.probe import local_plan
from hybrid.engine.requests import RequestError, SamplingParams
from hybrid.engine.sampler import Sampler, choose

ROW = torch.tensor([0.0, 3.0, 1.0, 2.0])


def _greedy(**kw) -> int:
    return Sampler(SamplingParams(**kw)).sample(ROW)


def test_logit_bias_and_processors_move_the_greedy_choice():
    assert _greedy() == 1
    assert _greedy(logit_bias={2: 5.0}) == 2
    assert _greedy(logit_bias={1: -100}) == 3
    seen = []

    def only_even(output, row):
        seen.append(list(output))
        return row.masked_fill(torch.arange(row.shape[-1]) % 2 == 1, float("-inf"))
    s = Sampler(SamplingParams(logits_processors=[only_even]))
    assert [s.sample(ROW) for _ in range(2)] == [2, 2] and seen == [[], [2]]
    assert choose(ROW[None], [Sampler(SamplingParams(logits_processors=[only_even]))]) == [2]


def test_penalties_as_defined():
    s = Sampler(SamplingParams(repetition_penalty=2.0), prompt=[1, 0])
    assert torch.equal(s.adjust(torch.tensor([-1.0, 3.0, 1.0, 2.0])), torch.tensor([-2.0, 1.5, 1.0, 2.0]))
    s = Sampler(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25))
    s.output = [1, 1, 3]
    assert torch.allclose(s.adjust(ROW), torch.tensor([0.0, 3.0 - 1.0 - 0.25, 1.0, 2.0 - 0.5 - 0.25]))
    rep = Sampler(SamplingParams(frequency_penalty=2.0))  # the greedy token repeated is penalised away
    assert [rep.sample(ROW) for _ in range(3)] == [1, 3, 1]


def test_min_p_drops_the_unlikely():
    s = Sampler(SamplingParams(temperature=1.0, min_p=0.3, seed=0))
    assert {s.sample(ROW) for _ in range(100)} == {1, 3}  # p(3)/p(1) = e^-1 = 0.37 stays; e^-2 = 0.14 goes


def test_logprobs_are_the_models_distribution():
    s = Sampler(SamplingParams(logprobs=3, repetition_penalty=3.0), prompt=[1])
    token = s.sample(ROW)
    logp = ROW.log_softmax(-1)
    assert token == 3 and s.last.token == 3 and s.last.logprob == pytest.approx(float(logp[3]))
    assert [t for t, _ in s.last.top] == [1, 3, 2]
    assert [v for _, v in s.last.top] == pytest.approx(logp[[1, 3, 2]].tolist())
    none = Sampler(SamplingParams(logprobs=0))
    none.sample(ROW)
    assert none.last.top == () and none.last.logprob == pytest.approx(float(logp[1]))


def test_rows_do_not_depend_on_batch_mates():
    torch.manual_seed(0)
    logits_BV = torch.randn(4, 50)
    kinds = [dict(), dict(temperature=0.9, seed=5, min_p=0.05, presence_penalty=1.0, logprobs=2),
             dict(repetition_penalty=1.5, logit_bias={7: 3.0}, logprobs=5), dict(temperature=1.3, seed=9, top_k=10)]

    def run(rows: list[int], steps: int = 6) -> dict[int, list]:
        samplers = {i: Sampler(SamplingParams(**kinds[i]), prompt=[3, 4]) for i in rows}
        got = {i: [] for i in rows}
        for step in range(steps):
            tokens = choose(logits_BV[rows] + step * 0.1, [samplers[i] for i in rows])
            for i, t in zip(rows, tokens):
                got[i].append((t, samplers[i].last))
        return got
    together = run([0, 1, 2, 3])
    for i in range(4):
        assert run([i])[i] == together[i], kinds[i]


def test_bad_knobs_are_refused():
    for bad in (dict(min_p=1.5), dict(presence_penalty=3), dict(frequency_penalty=-2.5), dict(repetition_penalty=0),
                dict(repetition_penalty=5e-324), dict(logprobs=21), dict(logit_bias={1: 101})):
        with pytest.raises(RequestError):
            SamplingParams(**bad)


def test_engine_hands_back_logprobs_and_refuses_unknown_ids(tiny_model):
    engine = Engine(tiny_model, local_plan({"kv.max_batch": 2, "kv.max_context": 32, "decode.batch_cap": 2}))
    prompt = [5, 9, 2, 7]
    done = engine.generate([prompt, prompt], [SamplingParams(6, logprobs=3), SamplingParams(6)])
    outs = []
    rid = engine.add_request(prompt, SamplingParams(6, logprobs=3))
    while engine.has_work():
        outs += [o for o in engine.step() if o.id == rid]
    lps = [lp for o in outs for lp in o.logprobs]
    assert [lp.token for lp in lps] == done[0].output_ids == done[1].output_ids
    assert all(lp.top[0] == (lp.token, lp.logprob) for lp in lps)  # greedy: the likeliest token
    vocab = tiny_model.args.vocab_size
    for bad in (SamplingParams(4, logit_bias={vocab: 1.0}), SamplingParams(4, stop_token_ids=(-1,))):
        with pytest.raises(RequestError, match="out of range"):
            engine.add_request(prompt, bad)
