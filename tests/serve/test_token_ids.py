"""vLLM's `return_token_ids` on /v1/completions through the official `openai` client (extra_body): each choice's
prompt ids and generated ids, whole and streamed, equal to what the engine generates for the prompt on its own."""
from __future__ import annotations

import pytest

from hybrid.engine.engine import Engine
from hybrid.engine.requests import SamplingParams
from tests.serve.conftest import MODEL, PLAN, wait_idle

IDS = {"return_token_ids": True, "ignore_eos": True}


@pytest.fixture(scope="module")
def solo(tiny_model, tiny_tok) -> Engine:
    """An engine of its own on the tiny model: the reference generation."""
    return Engine(tiny_model, PLAN, tiny_tok)


def _greedy(engine: Engine, prompt: list[int], n: int) -> list[int]:
    return engine.generate([prompt], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))[0].output_ids


def test_whole_answer_carries_prompt_and_generated_ids(server, client, solo, tiny_tok):
    prompt = tiny_tok.encode("Once upon a time")
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=7, temperature=0, n=2, extra_body=IDS)
    want = _greedy(solo, prompt, 7)
    assert len(want) == 7
    for c in out.choices:
        assert c.prompt_token_ids == prompt and c.token_ids == want, c
    by_text = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=7, temperature=0,
                                        extra_body=IDS).choices[0]
    assert by_text.prompt_token_ids == prompt and by_text.token_ids == want
    wait_idle(server)


def test_streamed_chunks_carry_their_new_ids(server, client, solo):
    prompt = [5, 17, 200, 31, 9, 64, 128, 7, 300, 42]
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=9, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body=IDS))
    choices = [c.choices[0] for c in chunks if c.choices]
    assert choices[0].prompt_token_ids == prompt
    assert all(getattr(c, "prompt_token_ids", None) is None for c in choices[1:]), "the prompt once, first"
    got = [t for c in choices for t in c.token_ids]
    assert got == _greedy(solo, prompt, 9) and chunks[-1].usage.completion_tokens == 9
    assert choices[-1].finish_reason == "length" and choices[-1].token_ids == []
    assert "".join(c.text for c in choices) == client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=9, temperature=0, extra_body={"ignore_eos": True}).choices[0].text
    wait_idle(server)


def test_without_the_flag_no_ids(server, client):
    whole = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=3, temperature=0)
    streamed = list(client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=3, temperature=0,
                                              stream=True))
    for c in [whole.choices[0]] + [c.choices[0] for c in streamed]:
        assert not {"token_ids", "prompt_token_ids"} & set(c.model_extra or {}), c
    wait_idle(server)


def test_a_stop_token_that_ended_the_text_is_in_the_ids(server, client):
    prompt = [11, 12, 13, 14]
    free = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, extra_body=IDS)
    ids = free.choices[0].token_ids
    stop = ids[2]
    first = ids.index(stop)
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
                                    extra_body={**IDS, "stop_token_ids": [stop]}).choices[0]
    assert out.finish_reason == "stop" and out.token_ids == ids[:first + 1]
    wait_idle(server)
