"""The official `openai` client on the fields agents send: logprobs in OpenAI's shapes, penalties, logit_bias,
stop_token_ids, n choices, batched completion prompts; the developer and tool roles, content parts; fields the
server does not act on are accepted and named in X-Hybrid-Ignored-Fields."""
from __future__ import annotations

import math

import httpx

from tests.serve.conftest import MODEL

HELLO = [{"role": "user", "content": "Hello there"}]


def test_chat_logprobs_greedy_token_is_the_likeliest(client):
    r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=5, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 6 and "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        top = t.top_logprobs
        assert len(top) == 5 and top[0].token == t.token and top[0].logprob == t.logprob
        assert [x.logprob for x in top] == sorted((x.logprob for x in top), reverse=True)
        assert t.logprob < 0 and t.bytes == list(t.token.encode())
    assert sum(math.exp(x.logprob) for x in content[0].top_logprobs) <= 1 + 1e-6
    plain = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=6, temperature=0, logprobs=False)
    assert plain.choices[0].logprobs is None


def test_completion_logprobs_and_streamed_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="count", max_tokens=5, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text and len(lp.token_logprobs) == 5
    assert all(max(top.values()) == v for top, v in zip(lp.top_logprobs, lp.token_logprobs))
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    chunks = list(client.completions.create(model=MODEL, prompt="count", max_tokens=5, temperature=0, logprobs=3,
                                            stream=True, extra_body={"ignore_eos": True}))
    streamed = [v for c in chunks if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == lp.token_logprobs


def test_logit_bias_penalties_and_stop_token_ids(client, tiny_tok):
    forced = tiny_tok.encode("z")[-1]
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=4, temperature=0,
                                  logit_bias={str(forced): 100}, logprobs=0, extra_body={"ignore_eos": True})
    assert r.choices[0].text == tiny_tok.decode([forced] * 4)
    penalised = client.completions.create(model=MODEL, prompt="x", max_tokens=4, temperature=0, logprobs=0,
                                          logit_bias={str(forced): 5}, frequency_penalty=2, presence_penalty=2,
                                          extra_body={"ignore_eos": True, "repetition_penalty": 1.3, "min_p": 0.1})
    assert penalised.choices[0].text != r.choices[0].text  # the forced token is penalised after its first time
    stopped = client.completions.create(model=MODEL, prompt="x", max_tokens=8, temperature=0, logprobs=0,
                                        logit_bias={str(forced): 100}, extra_body={"stop_token_ids": [forced]})
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].text == ""
    assert stopped.choices[0].logprobs is None and stopped.usage.completion_tokens == 1


def test_n_choices_and_batched_prompts(client):
    greedy = client.completions.create(model=MODEL, prompt=["a b", "c d"], max_tokens=3, temperature=0, n=2)
    texts = [c.text for c in sorted(greedy.choices, key=lambda c: c.index)]
    assert len(texts) == 4 and texts[0] == texts[1] and texts[2] == texts[3]
    alone = client.completions.create(model=MODEL, prompt="c d", max_tokens=3, temperature=0)
    assert texts[2] == alone.choices[0].text
    assert greedy.usage.prompt_tokens == 2 * alone.usage.prompt_tokens
    seeded = [client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=5, temperature=1.0, seed=7, n=3)
              for _ in range(2)]
    again = [[c.message.content for c in sorted(r.choices, key=lambda c: c.index)] for r in seeded]
    assert again[0] == again[1] and len(set(again[0])) > 1  # reproducible, and each choice draws its own
    chunks = list(client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3, temperature=0, n=2,
                                                 stream=True))
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}
    assert sum(1 for c in chunks if c.choices and c.choices[0].finish_reason) == 2


def test_roles_parts_and_ignored_fields(client, server):
    messages = [{"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=3, temperature=0, store=False, metadata={"k": "v"},
        service_tier="auto", user="u1", stream_options={"include_usage": True}, presence_penalty=0,
        frequency_penalty=0, logprobs=False, parallel_tool_calls=True, response_format={"type": "text"})
    assert raw.headers["X-Hybrid-Ignored-Fields"].split(",") == [
        "metadata", "service_tier", "store", "stream_options", "user"]
    assert raw.parse().choices[0].finish_reason in ("stop", "length")
    plain = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
    assert plain.status_code == 200 and "X-Hybrid-Ignored-Fields" not in plain.headers
    r = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": [[5, 6], [7]], "max_tokens": 2,
                                                          "suffix": "!", "best_of": 1, "echo": True})
    assert r.status_code == 200 and r.headers["X-Hybrid-Ignored-Fields"] == "best_of,suffix"
    assert len(r.json()["choices"]) == 2


def test_tokenize_and_detokenize(server, tiny_tok):
    r = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "prompt": "Hello there"}).json()
    assert r["tokens"] == tiny_tok.encode("Hello there") and r["count"] == len(r["tokens"])
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": HELLO}).json()
    assert chat["tokens"] == tiny_tok.apply_chat_template(HELLO)
    back = httpx.post(f"{server.url}/detokenize", json={"tokens": r["tokens"]}).json()
    assert back["prompt"] == tiny_tok.decode(r["tokens"])
    for body in ({}, {"prompt": "x", "messages": HELLO}, {"tokens": [10**9]}):
        path = "/detokenize" if "tokens" in body else "/tokenize"
        bad = httpx.post(f"{server.url}{path}", json=body)
        assert bad.status_code == 400 and bad.json()["error"]["message"], body
