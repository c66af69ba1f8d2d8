"""Anthropic's Messages API through the official `anthropic` client, on the tiny model with DeepSeek-V3's and
Kimi-K2's templates: messages.create and messages.stream, with and without tools, a forced tool_use that validates
against the tool's schema, a tool_use -> tool_result round trip, thinking blocks, stop_sequences, count_tokens, and
clear 400s for what is not served."""
from __future__ import annotations

import anthropic
import jsonschema
import pytest

from tests.serve.agents import WEATHER, agent_server, family_tokenizer

TOOLS = [{"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER}]
HELLO = [{"role": "user", "content": "Hello there"}]
GREEDY = {"temperature": 0}  # the client no longer sends sampling fields itself


@pytest.fixture(scope="module", params=["deepseek_v3", "kimi_k2"])
def client(request, tiny_model, tmp_path_factory):
    tok = family_tokenizer(tmp_path_factory.mktemp("tok"), request.param)
    with agent_server(tiny_model, tok) as srv:
        yield anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0, timeout=60)


def test_create_and_count_tokens(client):
    m = client.messages.create(model="tiny", max_tokens=8, messages=HELLO, system="Be brief.", extra_body=GREEDY)
    assert m.type == "message" and m.role == "assistant" and m.model == "tiny" and m.id.startswith("msg_")
    assert m.stop_reason in ("end_turn", "max_tokens") and 1 <= m.usage.output_tokens <= 8
    assert [b.type for b in m.content] == ["text"]
    count = client.messages.count_tokens(model="tiny", messages=HELLO, system="Be brief.")
    assert count.input_tokens == m.usage.input_tokens > 0


def test_stream_gives_the_same_text(client):
    whole = client.messages.create(model="tiny", max_tokens=12, messages=HELLO, extra_body=GREEDY)
    with client.messages.stream(model="tiny", max_tokens=12, messages=HELLO, extra_body=GREEDY) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    assert final.content[0].text == whole.content[0].text and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_use_validates_and_round_trips(client, stream):
    kw = dict(model="tiny", max_tokens=120, tools=TOOLS, extra_body=GREEDY,
              tool_choice={"type": "any", "disable_parallel_tool_use": True},
              messages=[{"role": "user", "content": "Weather in Paris?"}])
    if stream:
        with client.messages.stream(**kw) as s:
            m = s.get_final_message()
    else:
        m = client.messages.create(**kw)
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and len(uses) == 1, m
    assert uses[0].name == "get_weather"
    jsonschema.validate(uses[0].input, WEATHER)
    follow = client.messages.create(model="tiny", max_tokens=6, tools=TOOLS, extra_body=GREEDY, messages=[
        *kw["messages"], {"role": "assistant", "content": m.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "sunny, 21C"}]}])
    assert follow.usage.input_tokens > m.usage.input_tokens and follow.content


def test_named_tool_and_auto(client):
    m = client.messages.create(model="tiny", max_tokens=120, tools=TOOLS, extra_body=GREEDY,
                               tool_choice={"type": "tool", "name": "get_weather"},
                               messages=[{"role": "user", "content": "Oslo?"}])
    (use,) = [b for b in m.content if b.type == "tool_use"]
    jsonschema.validate(use.input, WEATHER)
    auto = client.messages.create(model="tiny", max_tokens=8, tools=TOOLS, messages=HELLO, extra_body=GREEDY)
    assert auto.stop_reason in ("end_turn", "max_tokens", "tool_use")


def test_stop_sequences(client):
    free = client.messages.create(model="tiny", max_tokens=24, messages=HELLO, extra_body=GREEDY)
    text = free.content[0].text
    if len(text) < 4:
        pytest.skip(f"the greedy answer is too short to cut: {text!r}")
    stop = text[2:4]
    m = client.messages.create(model="tiny", max_tokens=24, messages=HELLO, extra_body=GREEDY, stop_sequences=[stop])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop and m.content[0].text == text[:text.index(stop)]


def test_errors_are_specific(client):
    with pytest.raises(anthropic.BadRequestError, match="image"):
        client.messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}])
    with pytest.raises(anthropic.BadRequestError, match="not among the tools"):
        client.messages.create(model="tiny", max_tokens=4, messages=HELLO, tools=TOOLS,
                               tool_choice={"type": "tool", "name": "nope"})
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="other", max_tokens=4, messages=HELLO)


def test_the_api_key_from_x_api_key(tiny_model, tiny_tok):
    """Anthropic's clients send the key as x-api-key."""
    from hybrid.engine.engine import Engine
    from hybrid.serve import ServerConfig, ServerThread, create_app
    from tests.serve.agents import PLAN

    with ServerThread(create_app(Engine(tiny_model, PLAN, tiny_tok), ServerConfig(api_key="k3y"), "tiny")) as srv:
        good = anthropic.Anthropic(base_url=srv.url, api_key="k3y", max_retries=0, timeout=60)
        assert good.messages.count_tokens(model="tiny", messages=HELLO).input_tokens > 0
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=srv.url, api_key="wrong", max_retries=0).messages.count_tokens(
                model="tiny", messages=HELLO)
