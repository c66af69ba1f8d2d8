"""The OpenAI-compatible server through the official `openai` client: chat and text completions, streamed and not,
usage, stop strings, seeds; concurrent streams keep their solo greedy output; a client that leaves frees its KV slot;
every bad request gets OpenAI's error body with the right status."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from tests.serve.conftest import MODEL, PLAN, metrics, wait_idle

HELLO = [{"role": "user", "content": "Hello there"}]


def _chat(client, messages=HELLO, **kw):
    return client.chat.completions.create(model=MODEL, messages=messages, **{"temperature": 0, **kw})


def _chat_stream(client, messages=HELLO, **kw) -> tuple[str, str, list]:
    chunks = list(_chat(client, messages, stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(reasons) == 1, chunks
    return text, reasons[0], chunks


def _counter(m: dict, outcome: str) -> float:
    return m[f'hybrid_requests_total{{outcome="{outcome}"}}']


def test_chat_completion_with_usage(client, tiny_tok):
    r = _chat(client, max_tokens=6)
    assert r.object == "chat.completion" and r.model == MODEL and r.id.startswith("chatcmpl-")
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    prompt = tiny_tok.apply_chat_template(HELLO)
    assert r.usage.prompt_tokens == len(prompt)
    assert 1 <= r.usage.completion_tokens <= 6
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # content as a list of text parts, a system message, max_completion_tokens winning over max_tokens
    parts = [{"role": "system", "content": "Be brief."},
             {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}]
    r2 = _chat(client, parts, max_tokens=50, max_completion_tokens=3, extra_body={"ignore_eos": True})
    assert r2.usage.completion_tokens == 3 and r2.choices[0].finish_reason == "length"
    assert r2.usage.prompt_tokens == len(tiny_tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello\nthere"}]))


def test_streamed_text_equals_the_non_streamed_text(client):
    full = _chat(client, max_tokens=10, extra_body={"ignore_eos": True})
    text, reason, chunks = _chat_stream(client, max_tokens=10, extra_body={"ignore_eos": True})
    assert text == full.choices[0].message.content and reason == full.choices[0].finish_reason == "length"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)

    done = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=8, temperature=0)
    streamed = list(client.completions.create(model=MODEL, prompt="Once upon", max_tokens=8, temperature=0,
                                              stream=True))
    assert "".join(c.choices[0].text for c in streamed) == done.choices[0].text
    assert streamed[-1].choices[0].finish_reason == done.choices[0].finish_reason
    assert all(c.usage is None for c in streamed), "no usage chunk unless stream_options.include_usage"


def test_completion_from_token_ids(client, tiny_tok):
    ids = tiny_tok.encode("Once upon")
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0)
    by_text = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=5, temperature=0)
    assert by_ids.object == "text_completion" and by_ids.usage.prompt_tokens == len(ids)
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_stop_strings_end_the_text_before_them(client):
    free = client.completions.create(model=MODEL, prompt="abc", max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    clean = [i for i in range(2, len(free) - 2) if "\ufffd" not in free[i:i + 2] and "<" not in free[i:i + 2]]
    assert clean, free
    stop = free[clean[0]:clean[0] + 2]
    want = free[:free.index(stop)]
    for stream in (False, True):
        kw = dict(model=MODEL, prompt="abc", max_tokens=12, temperature=0, stop=[stop, "never-seen"],
                  extra_body={"ignore_eos": True})
        if stream:
            chunks = list(client.completions.create(stream=True, **kw))
            text, reason = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
        else:
            r = client.completions.create(**kw)
            text, reason = r.choices[0].text, r.choices[0].finish_reason
        assert text == want and reason == "stop", (stream, free, stop)


def test_a_seed_makes_sampling_reproducible(client):
    kw = dict(max_tokens=10, temperature=1.0, top_p=0.95, extra_body={"top_k": 50, "ignore_eos": True})
    a = _chat(client, seed=7, **kw).choices[0].message.content
    b = _chat(client, seed=7, **kw).choices[0].message.content
    c = _chat(client, seed=8, **kw).choices[0].message.content
    assert a == b and a != c


def test_eight_concurrent_streams_each_get_their_solo_greedy_output(server, client):
    prompts = [[{"role": "user", "content": f"client {i} says {'hi ' * i}"}] for i in range(8)]
    kw = dict(max_tokens=8, temperature=0)
    solo = [_chat(client, p, **kw).choices[0].message.content for p in prompts]

    async def stream(ac, p):
        s = await ac.chat.completions.create(model=MODEL, messages=p, stream=True, **kw)
        text, reason = "", None
        async for c in s:
            text += c.choices[0].delta.content or ""
            reason = c.choices[0].finish_reason or reason
        return text, reason

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0, timeout=60) as ac:
            return await asyncio.gather(*(stream(ac, p) for p in prompts))
    got = asyncio.run(main())
    assert [t for t, _ in got] == solo  # 8 clients on 4 KV slots: half of them wait their turn
    assert all(r in ("stop", "length") for _, r in got)


def test_a_client_leaving_mid_stream_frees_its_slot(server, client):
    before = _counter(metrics(server), "abort")
    s = client.completions.create(model=MODEL, prompt="to be cut", max_tokens=100, temperature=0, stream=True,
                                  extra_body={"ignore_eos": True})
    it = iter(s)
    for _ in range(3):
        next(it)
    assert metrics(server)["hybrid_kv_slots_in_use"] == 1
    t0 = time.monotonic()
    s.close()
    m = wait_idle(server)
    assert m["hybrid_kv_slots_in_use"] == 0 and m["hybrid_requests_running"] == 0, m
    assert time.monotonic() - t0 < 3, "freed well before the 100 tokens would have been generated"
    assert _counter(m, "abort") == before + 1


def test_a_client_leaving_a_non_streamed_request_frees_its_slot(server):
    before = _counter(metrics(server), "abort")
    body = {"model": MODEL, "prompt": "to be cut", "max_tokens": 100, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=httpx.Timeout(10, read=0.3))
    m = wait_idle(server)
    assert m["hybrid_kv_slots_in_use"] == 0 and m["hybrid_requests_running"] == 0, m
    assert _counter(m, "abort") == before + 1


def _post(server, path: str, body, status: int) -> dict:
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(f"{server.url}{path}", content=content, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    return err


def test_bad_requests_get_openai_errors_never_422_or_5xx(server):
    chat, comp = "/v1/chat/completions", "/v1/completions"
    assert "not valid JSON" in _post(server, chat, '{"model": "tiny", "messages": [', 400)["message"]
    assert _post(server, comp, {"model": MODEL}, 400)["param"] == "prompt"
    assert _post(server, chat, {"model": MODEL, "messages": []}, 400)["param"] == "messages"
    assert _post(server, chat, {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, 400)["param"] \
        .startswith("messages.0.role")
    assert _post(server, comp, {"model": MODEL, "prompt": "x", "temperature": "hot"}, 400)["param"] == "temperature"
    assert _post(server, comp, {"model": MODEL, "prompt": "x", "logprobs": 21}, 400)["param"] == "logprobs"
    assert _post(server, chat, {"model": MODEL, "messages": HELLO, "frobnicate": 1}, 400)["param"] == "frobnicate"
    err = _post(server, chat, {"model": "gpt-4", "messages": HELLO}, 404)
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert _post(server, comp, {"model": MODEL, "prompt": "x", "n": 17}, 400)["param"] == "n"
    assert _post(server, chat, {"model": MODEL, "messages": HELLO, "top_logprobs": 2}, 400)["param"] == "top_logprobs"
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
    assert "image_url" in _post(server, chat, {"model": MODEL, "messages": image}, 400)["message"]
    assert "must be token ids" in _post(server, comp, {"model": MODEL, "prompt": "x", "logit_bias": {"a": 1}},
                                        400)["message"]
    err = _post(server, comp, {"model": MODEL, "prompt": [5] * 100, "max_tokens": 40}, 400)
    assert f"prompt of 100 tokens + max_tokens 40 = 140 exceeds the {PLAN.kv.max_context}" in err["message"]
    assert "out of range" in _post(server, comp, {"model": MODEL, "prompt": [5, 10**6]}, 400)["message"]
    assert "empty" in _post(server, comp, {"model": MODEL, "prompt": "x", "stop": ""}, 400)["message"]
    err = _post(server, "/v1/nothing", {}, 404)
    assert err["code"] == "unknown_url" and "/v1/nothing" in err["message"]
    r = httpx.get(f"{server.url}/v1/chat/completions")
    assert r.status_code == 405 and r.json()["error"]["message"]
    m = metrics(server)
    assert _counter(m, "rejected") >= 10 and _counter(m, "error") == 0


def test_models_health_metrics_and_openapi(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    for other in ("other", "org/other"):
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve(other)
    h = httpx.get(f"{server.url}/health")
    assert h.status_code == 200 and h.json()["status"] == "ok"
    client.completions.create(model=MODEL, prompt="count me", max_tokens=3, temperature=0,
                              extra_body={"ignore_eos": True})
    m = metrics(server)
    for name in ("hybrid_time_to_first_token_seconds_count", "hybrid_time_per_output_token_seconds_count",
                 "hybrid_e2e_request_latency_seconds_count", "hybrid_engine_step_seconds_count",
                 "hybrid_prompt_tokens_total", "hybrid_generation_tokens_total"):
        assert m[name] > 0, name
    assert m["hybrid_kv_slots_total"] == PLAN.kv.max_batch
    spec = httpx.get(f"{server.url}/openapi.json").json()
    chat = spec["paths"]["/v1/chat/completions"]["post"]
    assert "422" not in chat["responses"] and {"400", "404", "429", "500", "503"} <= set(chat["responses"])
    assert "ChatCompletionRequest" in spec["components"]["schemas"]
