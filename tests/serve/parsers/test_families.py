"""Each family's tool calls and reasoning, parsed out of the family's own template output: an assistant turn with
reasoning, text and two calls is rendered by the template (as it goes back into the next prompt), and the parser
recovers it whole, streamed in pieces of any size or at once."""
from __future__ import annotations

import json

import pytest

from hybrid.serve.parsers import CallArgs, CallStart, OutputParser, Text, deepseek, family_of, kimi
from hybrid.tokenizer import Tokenizer
from hybrid.weights.chat_templates import FAMILIES
from hybrid.weights.tokenizer_files import write_byte_tokenizer

CALLS = [("get_weather", {"city": "Paris", "units": "celsius"}),
         ("search", {"query": "a ``` fence, <b>tags</b> and \"quotes\"", "n": [1, {"k": None}]})]
FAMILY_OF = {"deepseek_v3": "deepseek_v3", "deepseek_r1": "deepseek_v3", "deepseek_v31": "deepseek_v31",
             "kimi_k2": "kimi_k2", "kimi_k2_thinking": "kimi_k2"}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def tok(request, tmp_path_factory) -> Tokenizer:
    d = tmp_path_factory.mktemp(request.param)
    write_byte_tokenizer(d, 384, 380, 381, request.param)
    return Tokenizer(d)


def _assistant_output(tok: Tokenizer, message: dict) -> str:
    """What the model wrote in `message`, as the template renders it back: the text after the prompt's shared
    part, up to the end of the turn."""
    user = [{"role": "user", "content": "What now?"}]
    before = tok.render_chat(user)
    after = tok.render_chat(user + [message])
    shared = next(i for i, (a, b) in enumerate(zip(before + "\0", after)) if a != b)
    end = min(i for i in (after.find(e, shared) for e in ("<｜end▁of▁sentence｜>", "<|im_end|>")) if i >= 0)
    return after[shared:end]


def _parse(tok: Tokenizer, text: str, chunk: int, reasoning: bool = False):
    p = OutputParser(family_of(tok).calls, reasoning)
    events = []
    for i in range(0, len(text), chunk):
        events += p.feed(text[i:i + chunk])
    tail, parsed = p.finish()
    return events + tail, parsed


@pytest.mark.parametrize("chunk", [1, 2, 5, 13, 10**6])
def test_tool_calls_round_trip_the_template(tok, chunk):
    fam = family_of(tok)
    assert fam is not None and fam.name == FAMILY_OF[next(n for n in FAMILIES if tok.chat_template ==
                                                          FAMILIES[n][0])]
    calls = [{"id": f"functions.{n}:{i}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
             for i, (n, a) in enumerate(CALLS)]
    text = _assistant_output(tok, {"role": "assistant", "content": "Let me look.", "tool_calls": calls})
    events, parsed = _parse(tok, text, chunk)
    assert parsed.content == "Let me look.", (text, parsed)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == CALLS, text
    if fam.name == "kimi_k2":
        assert [c.id for c in parsed.calls] == ["functions.get_weather:0", "functions.search:1"]
    else:
        assert all(c.id.startswith("call_") for c in parsed.calls) and len({c.id for c in parsed.calls}) == 2
    # the streamed events add up to the same: each call announced once, then its arguments in pieces
    starts = [e for e in events if isinstance(e, CallStart)]
    assert [(e.index, e.name) for e in starts] == [(0, "get_weather"), (1, "search")]
    for i, (_, args) in enumerate(CALLS):
        assert json.loads("".join(e.text for e in events if isinstance(e, CallArgs) and e.index == i)) == args
    assert "".join(e.text for e in events if isinstance(e, Text) and e.kind == "content") == "Let me look."


@pytest.mark.parametrize("chunk", [1, 3, 10**6])
def test_reasoning_is_split_from_the_answer(tok, chunk):
    thinking_template = "<think>" in tok.chat_template
    prompt = tok.render_chat([{"role": "user", "content": "Hi"}], thinking=True)
    opened = prompt.rstrip().endswith("<think>")
    text = ("" if opened else "<think>") + "Weigh it <b>up</b>.</think>The answer."
    events, parsed = _parse(tok, text, chunk, reasoning=opened)
    assert (parsed.reasoning, parsed.content) == ("Weigh it <b>up</b>.", "The answer."), (thinking_template, text)
    assert "".join(e.text for e in events if isinstance(e, Text) and e.kind == "reasoning") == parsed.reasoning


def test_reasoning_then_calls(tok):
    """Kimi-K2-Thinking may open its calls before closing the reasoning; DeepSeek closes it first."""
    fam = family_of(tok)
    section = fam.section([("get_weather", '{"city": "Oslo"}')])
    for text in ("<think>First, the weather.</think>" + section,
                 *(["<think>First, the weather." + section] if fam.name == "kimi_k2" else [])):
        _, parsed = _parse(tok, text, 4)
        assert parsed.reasoning == "First, the weather." and parsed.content == ""
        assert [(c.name, c.arguments) for c in parsed.calls] == [("get_weather", '{"city": "Oslo"}')]


def test_without_tools_the_markers_stay_text(tok):
    section = family_of(tok).section([("f", "{}")])
    p = OutputParser(None, False)
    events = p.feed("a" + section)
    tail, parsed = p.finish()
    assert parsed.content == "a" + section and not parsed.calls and events + tail


def test_a_call_cut_by_max_tokens_keeps_what_was_written(tok):
    fam = family_of(tok)
    text = fam.section([("get_weather", '{"city": "Oslo"}')])
    cut = text[:text.index("Oslo") + 2]
    _, parsed = _parse(tok, cut, 3)
    assert [(c.name, c.arguments) for c in parsed.calls] == [("get_weather", '{"city": "Os')]


@pytest.mark.parametrize("syntax, text", [
    (deepseek.V3, "plain <｜tool▁calls▁be"),  # a marker's start at the end is held back, then given back
    (kimi.K2, "plain <|tool_calls_sec"),
])
def test_partial_marker_at_the_end_is_content(syntax, text):
    p = OutputParser(syntax, False)
    assert "".join(e.text for e in p.feed(text)) == "plain "
    tail, parsed = p.finish()
    assert parsed.content == text and [e.text for e in tail] == [text[len("plain "):]]


def test_family_of_published_templates():
    """The published templates' own spellings: V3.1 writes the name before <｜tool▁sep｜>, V3/R1 after it."""
    class Tok:
        def __init__(self, template):
            self.chat_template, self.markers = template, {}
    v3 = "{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name']}}"
    v31 = "{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>'+ tool['function']['name'] + '<｜tool▁sep｜>'}}{% if thinking %}"
    k2 = "<|tool_calls_section_begin|>{%- for tool_call in message['tool_calls'] -%}"
    assert family_of(Tok(v3)).name == "deepseek_v3" and not family_of(Tok(v3)).renders_tools
    assert family_of(Tok(v31)).name == "deepseek_v31" and family_of(Tok(v31)).thinking_switch
    assert family_of(Tok(k2)).name == "kimi_k2"
    assert family_of(Tok("{{ messages }}")) is None
