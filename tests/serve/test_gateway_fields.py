"""The fields the SGLang and vLLM gateways add to every request (hybrid/serve/gateway.py), through the official
`openai` client (extra_body) straight at the server: their defaults change nothing, other values are honoured or
refused with a 400 naming the field; the request id is echoed."""
from __future__ import annotations

import openai
import pytest

from tests.serve.agents import agent_server, family_tokenizer
from tests.serve.conftest import MODEL, wait_idle

# what sglang-router 0.3.2 and vllm-router 0.1.17 send with every request, at their defaults
SGLANG_CHAT = {"logprobs": False, "no_stop_trim": False, "ignore_eos": False, "continue_final_message": False,
               "skip_special_tokens": True, "separate_reasoning": True, "stream_reasoning": True,
               "return_hidden_states": False}
VLLM_CHAT = {**SGLANG_CHAT, "include_reasoning": True}
COMPLETION = {"echo": False, "no_stop_trim": False, "ignore_eos": False, "skip_special_tokens": True,
              "return_hidden_states": False}
HI = [{"role": "user", "content": "Hi there"}]


def _stream_text(chunks) -> str:
    return "".join((c.choices[0].delta.content or "") if hasattr(c.choices[0], "delta") else c.choices[0].text
                   for c in chunks if c.choices)


def test_the_gateways_defaults_change_nothing(server, client):
    base = dict(model=MODEL, messages=HI, max_tokens=8, temperature=0)
    want = client.chat.completions.create(**base).choices[0].message.content
    for extra in (SGLANG_CHAT, VLLM_CHAT):
        r = client.chat.completions.with_raw_response.create(**base, extra_body=extra)
        assert r.parse().choices[0].message.content == want
        assert "x-hybrid-ignored-fields" not in r.headers
        assert _stream_text(client.chat.completions.create(**base, stream=True, extra_body=extra)) == want
    text = client.completions.create(model=MODEL, prompt="Once", max_tokens=8, temperature=0).choices[0].text
    got = client.completions.create(model=MODEL, prompt="Once", max_tokens=8, temperature=0, extra_body=COMPLETION)
    assert got.choices[0].text == text
    wait_idle(server)


def test_return_hidden_states_true_is_refused_by_name(client):
    for call in (lambda: client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2,
                                                        extra_body={"return_hidden_states": True}),
                 lambda: client.completions.create(model=MODEL, prompt="a", max_tokens=2,
                                                   extra_body={"return_hidden_states": True})):
        with pytest.raises(openai.BadRequestError) as e:
            call()
        assert "return_hidden_states" in str(e.value) and e.value.body["param"] == "return_hidden_states"


def test_skip_special_tokens_false_shows_them(server, client, tiny_tok):
    eos = tiny_tok.token_id(tiny_tok.eos_token)
    kw = dict(model=MODEL, prompt="Once", max_tokens=3, temperature=0, logit_bias={str(eos): 100})
    assert client.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0].text == ""
    shown = {"ignore_eos": True, "skip_special_tokens": False}
    assert client.completions.create(**kw, extra_body=shown).choices[0].text == tiny_tok.eos_token * 3
    assert _stream_text(client.completions.create(**kw, stream=True, extra_body=shown)) == tiny_tok.eos_token * 3
    chat = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2, temperature=0,
                                          logit_bias={str(eos): 100}, extra_body=shown)
    assert chat.choices[0].message.content == tiny_tok.eos_token * 2
    wait_idle(server)


def test_no_stop_trim_keeps_the_stop_string_and_token(server, client, tiny_tok):
    a, b = (tiny_tok.encode(c, add_bos=False)[0] for c in "ab")
    kw = dict(model=MODEL, prompt="Once", max_tokens=5, temperature=0, logit_bias={str(a): 100}, stop=["a"])
    cut = client.completions.create(**kw)
    assert (cut.choices[0].text, cut.choices[0].finish_reason) == ("", "stop")
    kept = client.completions.create(**kw, extra_body={"no_stop_trim": True})
    assert (kept.choices[0].text, kept.choices[0].finish_reason) == ("a", "stop")
    assert _stream_text(client.completions.create(**kw, stream=True, extra_body={"no_stop_trim": True})) == "a"
    by_id = dict(model=MODEL, prompt="Once", max_tokens=5, temperature=0, logit_bias={str(b): 100})
    assert client.completions.create(**by_id, extra_body={"stop_token_ids": [b]}).choices[0].text == ""
    assert client.completions.create(**by_id, extra_body={"stop_token_ids": [b], "no_stop_trim": True}
                                     ).choices[0].text == "b"
    eos = tiny_tok.token_id(tiny_tok.eos_token)
    at_eos = dict(model=MODEL, prompt="Once", max_tokens=5, temperature=0, logit_bias={str(eos): 100})
    assert client.completions.create(**at_eos, extra_body={"no_stop_trim": True}).choices[0].text == ""
    assert client.completions.create(**at_eos, extra_body={"no_stop_trim": True, "skip_special_tokens": False}
                                     ).choices[0].text == tiny_tok.eos_token
    wait_idle(server)


def test_continue_final_message_goes_on_with_the_assistant(server, client, tiny_tok):
    import httpx

    messages = HI + [{"role": "assistant", "content": "Once upon"}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 6, "temperature": 0,
            "continue_final_message": True}
    ids = httpx.post(f"{server.url}/v1/chat/completions/render", json=body, timeout=30).json()["token_ids"]
    assert tiny_tok.decode(ids).endswith("Once upon")
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                          extra_body={"continue_final_message": True})
    text = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0).choices[0].text
    assert chat.choices[0].message.content == text and chat.usage.prompt_tokens == len(ids)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2,
                                       extra_body={"continue_final_message": True})
    assert e.value.body["param"] == "continue_final_message"
    wait_idle(server)


def test_reasoning_fields(tiny_model, tmp_path_factory):
    """V3.1 with `thinking`: the output starts inside the reasoning."""
    tok = family_tokenizer(tmp_path_factory.mktemp("tok"), "deepseek_v31")
    think = {"chat_template_kwargs": {"thinking": True}}
    with agent_server(tiny_model, tok) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)
        kw = dict(model="tiny", messages=HI, max_tokens=8, temperature=0)
        split = client.chat.completions.create(**kw, extra_body=think).choices[0].message
        assert split.reasoning_content
        joined = client.chat.completions.create(**kw, extra_body={**think, "separate_reasoning": False})
        whole = joined.choices[0].message
        assert getattr(whole, "reasoning_content", None) is None and whole.content.startswith(split.reasoning_content)
        hidden = client.chat.completions.create(**kw, extra_body={**think, "include_reasoning": False}).choices[0]
        assert getattr(hidden.message, "reasoning_content", None) is None
        assert (hidden.message.content or "") == (split.content or "")
        deltas = [getattr(c.choices[0].delta, "reasoning_content", None) for c in client.chat.completions.create(
            **kw, stream=True, extra_body={**think, "stream_reasoning": False}) if c.choices]
        assert [d for d in deltas if d] == [split.reasoning_content]
        streamed = [getattr(c.choices[0].delta, "reasoning_content", None) for c in client.chat.completions.create(
            **kw, stream=True, extra_body=think) if c.choices]
        assert "".join(d for d in streamed if d) == split.reasoning_content and len([d for d in streamed if d]) > 1


def test_request_id_is_echoed(server, client):
    r = client.chat.completions.with_raw_response.create(model=MODEL, messages=HI, max_tokens=1,
                                                         extra_headers={"X-Request-Id": "req-42"})
    assert r.headers["x-request-id"] == "req-42"
    import httpx

    new = httpx.get(f"{server.url}/v1/models", timeout=10).headers.get("x-request-id")
    assert new and new != "req-42"
    assert httpx.get(f"{server.url}/health", headers={"X-Request-Id": "h1"}).headers["x-request-id"] == "h1"
