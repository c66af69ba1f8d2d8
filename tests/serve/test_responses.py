"""OpenAI's Responses API (stateless) through the official `openai` client on the tiny model: text, streamed and
not, a forced function call that validates against its schema and a function_call_output follow-up, a json_schema
text format, and 400s for what is not served."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.serve.agents import WEATHER, agent_server, family_tokenizer

TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": WEATHER}]


@pytest.fixture(scope="module", params=["deepseek_v31", "kimi_k2"])
def client(request, tiny_model, tmp_path_factory):
    tok = family_tokenizer(tmp_path_factory.mktemp("tok"), request.param)
    with agent_server(tiny_model, tok) as srv:
        yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_text_streamed_and_not(client):
    r = client.responses.create(model="tiny", input="Hello there", instructions="Be brief.", max_output_tokens=10,
                                temperature=0)
    assert r.object == "response" and r.status in ("completed", "incomplete") and r.id.startswith("resp_")
    assert r.output[0].type == "message" and r.usage.output_tokens <= 10
    events = list(client.responses.create(model="tiny", input="Hello there", instructions="Be brief.",
                                          max_output_tokens=10, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert events[-1].response.output_text == r.output_text


@pytest.mark.parametrize("stream", [False, True])
def test_required_function_call_and_its_output(client, stream):
    kw = dict(model="tiny", input=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS,
              tool_choice="required", parallel_tool_calls=False, max_output_tokens=150, temperature=0)
    if stream:
        events = list(client.responses.create(stream=True, **kw))
        r = events[-1].response
        args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    else:
        r = client.responses.create(**kw)
        args = None
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_weather" and (args is None or args == call.arguments)
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    follow = client.responses.create(model="tiny", tools=TOOLS, max_output_tokens=5, temperature=0, input=[
        *kw["input"], {"type": "function_call", "call_id": call.call_id, "name": call.name,
                       "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert follow.usage.input_tokens > r.usage.input_tokens and follow.output


def test_json_schema_format(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
              "required": ["ok", "n"], "additionalProperties": False}
    r = client.responses.create(model="tiny", input="Answer in JSON", max_output_tokens=60, temperature=0,
                                text={"format": {"type": "json_schema", "name": "a", "schema": schema,
                                                 "strict": True}})
    jsonschema.validate(json.loads(r.output_text), schema)


def test_not_served(client):
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.create(model="tiny", input="hi", previous_response_id="resp_1")
    with pytest.raises(openai.BadRequestError, match="function tools"):
        client.responses.create(model="tiny", input="hi", tools=[{"type": "web_search"}])
