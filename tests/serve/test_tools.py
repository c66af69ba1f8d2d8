"""Tool calling, reasoning and structured output through the official `openai` client on the tiny model (random
weights: only the grammar makes its calls and JSON valid): tool_choice required and named, streamed and not, whose
arguments validate against the tool's schema; a follow-up turn with a `tool` message; json_schema output that
validates on 20 seeded requests; reasoning_content split from content; clear 400s for bad tools and schemas."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from tests.serve.agents import WEATHER, agent_server, family_tokenizer

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time now"}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
ANSWER = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "confidence": {"type": "integer",
                                                                                               "minimum": 0,
                                                                                               "maximum": 100},
                                           "why": {"type": "string", "maxLength": 16}},
          "required": ["answer", "confidence", "why"], "additionalProperties": False}


@pytest.fixture(scope="module", params=["deepseek_v3", "deepseek_v31", "kimi_k2"])
def client(request, tiny_model, tmp_path_factory):
    tok = family_tokenizer(tmp_path_factory.mktemp("tok"), request.param)
    with agent_server(tiny_model, tok) as srv:
        yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)


def _validate(call) -> dict:
    schema = next(t["function"].get("parameters", {"type": "object", "properties": {},
                                                   "additionalProperties": False})
                  for t in TOOLS if t["function"]["name"] == call.function.name)
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, schema)
    return args


def _streamed(client, **kw):
    """The streamed answer put together from its deltas: (content, reasoning, [(id, name, arguments)], finish)."""
    content, reasoning, calls, finish = "", "", {}, None
    for c in client.chat.completions.create(stream=True, **kw):
        d = c.choices[0].delta
        content += d.content or ""
        reasoning += getattr(d, "reasoning_content", None) or ""
        for t in d.tool_calls or ():
            entry = calls.setdefault(t.index, ["", "", ""])
            entry[0] = t.id or entry[0]
            entry[1] += (t.function.name or "") if t.function else ""
            entry[2] += (t.function.arguments or "") if t.function else ""
        finish = c.choices[0].finish_reason or finish
    return content, reasoning, [tuple(calls[i]) for i in sorted(calls)], finish


def test_required_tool_call_validates_streamed_and_not(client):
    kw = dict(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
              max_tokens=200, temperature=0)
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and len(msg.tool_calls) == 1, msg
    assert msg.tool_calls[0].type == "function" and msg.tool_calls[0].id
    _validate(msg.tool_calls[0])
    content, _, calls, finish = _streamed(client, **kw)
    assert finish == "tool_calls"
    assert [(n, a) for _, n, a in calls] == [(c.function.name, c.function.arguments) for c in msg.tool_calls]
    assert (content or None) == msg.content


def test_named_function_and_a_tool_message_follow_up(client):
    r = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=200, temperature=0,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    _validate(call)
    history = ASK + [r.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21C"}]
    follow = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=8,
                                            temperature=0)
    assert follow.usage.prompt_tokens > r.usage.prompt_tokens and follow.choices[0].finish_reason
    none = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="none",
                                          max_tokens=4, temperature=0)
    assert none.choices[0].message.tool_calls is None
    assert none.usage.prompt_tokens < r.usage.prompt_tokens  # tools are not shown with tool_choice none


def test_json_schema_validates_on_20_seeded_requests(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}

    def one(seed: int) -> dict:
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Is it?"}],
                                           response_format=fmt, max_tokens=120, temperature=1.0, seed=seed)
        return json.loads(r.choices[0].message.content)
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(one, range(20)))
    for out in outs:
        jsonschema.validate(out, ANSWER)
    assert len({json.dumps(o) for o in outs}) > 1  # seeds draw different answers
    obj = client.chat.completions.create(model="tiny", messages=ASK, response_format={"type": "json_object"},
                                         max_tokens=60, temperature=0)
    assert obj.choices[0].finish_reason in ("stop", "length")


def test_bad_tools_and_schemas_are_400(client):
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError, match="no tools"):
        client.chat.completions.create(model="tiny", messages=ASK, tool_choice="required")
    with pytest.raises(openai.BadRequestError, match="function tools"):
        client.chat.completions.create(model="tiny", messages=ASK, tools=[{"type": "custom", "custom": {}}])
    with pytest.raises(openai.BadRequestError, match="schema"):
        client.chat.completions.create(model="tiny", messages=ASK, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "required": 3}}})


def test_reasoning_content_with_the_thinking_switch(tiny_model, tmp_path_factory):
    """V3.1's `thinking` opens the reasoning; with json_schema the JSON follows the reasoning's end."""
    tok = family_tokenizer(tmp_path_factory.mktemp("tok"), "deepseek_v31")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    with agent_server(tiny_model, tok) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)
        plain = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=6, temperature=0)
        assert getattr(plain.choices[0].message, "reasoning_content", None) is None
        r = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=6, temperature=0,
                                           extra_body={"chat_template_kwargs": {"thinking": True}})
        msg = r.choices[0].message
        assert msg.reasoning_content  # the tiny model may close it (</think>) and answer within 6 tokens
        assert r.usage.prompt_tokens == plain.usage.prompt_tokens  # <think> in place of </think>
        content, reasoning, _, _ = _streamed(client, model="tiny", messages=ASK, max_tokens=6, temperature=0,
                                             extra_body={"chat_template_kwargs": {"thinking": True}})
        assert (content, reasoning) == (msg.content or "", msg.reasoning_content)
        # a reasoning cut short by a forced </think> (logit_bias) leaves the JSON to the grammar
        end = tok.markers["</think>"]
        j = client.chat.completions.create(
            model="tiny", messages=ASK, max_tokens=60, temperature=0, logit_bias={str(end): 100},
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
            extra_body={"chat_template_kwargs": {"thinking": True}})
        jsonschema.validate(json.loads(j.choices[0].message.content), schema)
