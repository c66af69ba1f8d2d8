"""Two replicas of the tiny model behind each standard gateway (`python -m hybrid mode=replicas`, cache_aware):
chat (streamed and not), text completions, a tool call and a json_schema answer give through the gateway what one
replica gives directly (greedy); the key and the request id pass through. Skipped where the gateway is not
installed (sglang-router, vllm-router: the `test` extra)."""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.serve.deploy import deployment
from tests.serve.test_gateway_fields import HI

KEY = "sk-gw"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
           "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": WEATHER}}]
ANSWER = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}


@pytest.fixture(scope="module", params=["sglang", "vllm"])
def deployed(request, tiny_dir, tmp_path_factory):
    pytest.importorskip({"sglang": "sglang_router", "vllm": "vllm_router"}[request.param])
    with deployment(tiny_dir, tmp_path_factory.mktemp("runs"), request.param,
                    overrides=("policy.kv.max_context=2048", "policy.prefill.chunk_tokens=512"), key=KEY) as d:
        yield d


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)


def _chat_stream(client, **kw) -> tuple[str, str]:
    content, finish = "", None
    for c in client.chat.completions.create(stream=True, **kw):
        if c.choices:
            content += c.choices[0].delta.content or ""
            finish = c.choices[0].finish_reason or finish
    return content, finish


def test_text_through_the_gateway_is_the_replicas(deployed):
    via, direct = _client(deployed.url), _client(deployed.replicas[0])
    models = [m.id for m in via.models.list().data]
    assert "tiny" in models, models
    chat = dict(model="tiny", messages=HI, max_tokens=12, temperature=0)
    want = direct.chat.completions.create(**chat).choices[0].message.content
    assert via.chat.completions.create(**chat).choices[0].message.content == want
    assert _chat_stream(via, **chat)[0] == want
    text = dict(model="tiny", prompt="The three laws of", max_tokens=12, temperature=0)
    want = direct.completions.create(**text).choices[0].text
    assert via.completions.create(**text).choices[0].text == want
    assert "".join(c.choices[0].text for c in via.completions.create(**text, stream=True) if c.choices) == want


def test_tool_call_and_json_schema_through_the_gateway(deployed):
    via, direct = _client(deployed.url), _client(deployed.replicas[1])
    ask = dict(model="tiny", messages=[{"role": "user", "content": "Weather in Paris?"}], max_tokens=60,
               temperature=0, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    calls = [c.choices[0].message.tool_calls for c in (via.chat.completions.create(**ask),
                                                         direct.chat.completions.create(**ask))]
    assert len(calls[0]) == 1 and calls[0][0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0][0].function.arguments), WEATHER)
    assert calls[0][0].function.arguments == calls[1][0].function.arguments
    fmt = dict(model="tiny", messages=HI, max_tokens=40, temperature=0,
               response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}})
    got = via.chat.completions.create(**fmt).choices[0].message.content
    jsonschema.validate(json.loads(got), ANSWER)
    assert got == direct.chat.completions.create(**fmt).choices[0].message.content


def test_key_and_request_id_pass_through(deployed):
    body = {"model": "tiny", "messages": HI, "max_tokens": 2}
    assert httpx.post(f"{deployed.url}/v1/chat/completions", json=body, timeout=60).status_code == 401
    r = httpx.post(f"{deployed.url}/v1/chat/completions", json=body, timeout=60,
                   headers={"Authorization": f"Bearer {KEY}", "X-Request-Id": "trace-7"})
    assert r.status_code == 200 and r.headers.get("x-request-id") == "trace-7", (r.status_code, r.headers)


def test_bench_drives_the_agent_workload_through_the_gateway(deployed, tiny_dir):
    from hybrid.bench import endpoint
    from hybrid.config.compose import compose, to_settings

    scraped = ",".join(f"{u}/metrics" for u in deployed.replicas)
    s = to_settings(compose(["mode=bench", "bench=serve", f"bench.endpoint={deployed.url}/v1", "bench.prompt=text",
                             f"bench.metrics=[{scraped}]", f"model.path={tiny_dir}", f"server.api_key={KEY}",
                             "workload=agent", "workload.sessions=2", "workload.system_tokens=300",
                             "workload.message_tokens=[8,16]", "workload.output_tokens=[2,4]",
                             "workload.context_tokens=360"]))
    recs = endpoint.run(s)
    assert next(r for r in recs if r.name == "errors").value == 0
    assert len([r for r in recs if r.name == "ttft_turn_s"]) >= 4
    rate = next(r for r in recs if r.name == "prefix_cache_hit_rate")
    assert 0 < rate.value <= 1 and rate.extra["queried_tokens"] > 0
