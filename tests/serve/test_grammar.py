"""The grammar masks (hybrid/serve/grammar.py) on random logits: whatever the logits, the text is valid JSON of the
schema or a tool-call section the family's parser reads back; a mask prefetched on the worker thread equals the one
computed in place; a schema llguidance cannot enforce is the client's error."""
from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from hybrid.engine.requests import RequestError
from hybrid.serve import agent
from tests.serve.agents import WEATHER, family_tokenizer

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": -5, "maximum": 5},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
                                           "name": {"type": "string", "maxLength": 6}},
          "required": ["n", "tags"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "ping"}}]


def _run(tok, turn, seed: int, steps: int = 3000) -> list[int]:
    (c,) = turn.processors()
    gen, out = torch.Generator().manual_seed(seed), []
    for _ in range(steps):
        row = c(out, torch.randn(320, generator=gen) * 4)
        out.append(int(torch.multinomial(row.softmax(-1), 1, generator=gen)))
        if out[-1] in tok.eos_ids:
            break
    return out


@pytest.mark.parametrize("family", ["deepseek_v3", "kimi_k2"])
def test_json_schema_holds_under_random_logits(tmp_path, family):
    tok = family_tokenizer(tmp_path, family)
    turn = agent.prepare(tok, 320, [{"role": "user", "content": "hi"}],
                         response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA}})
    for seed in range(5):
        out = _run(tok, turn, seed)
        assert out[-1] in tok.eos_ids, f"seed {seed}: no end in {len(out)} tokens"
        jsonschema.validate(json.loads(tok.decode(out)), SCHEMA)


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_r1", "deepseek_v31", "kimi_k2", "kimi_k2_thinking"])
def test_required_calls_parse_back(tmp_path, family):
    tok = family_tokenizer(tmp_path, family)
    turn = agent.prepare(tok, 320, [{"role": "user", "content": "hi"}], tools=TOOLS, tool_choice="required",
                         template_kwargs={"thinking": False})
    for seed in range(3):
        out = _run(tok, turn, seed)
        stream = turn.stream()
        stream.feed(tok.decode(out))
        parsed = stream.finish()[1]
        assert parsed.calls and out[-1] in tok.eos_ids, (seed, tok.decode(out))
        for call in parsed.calls:
            schema = WEATHER if call.name == "get_weather" else {"type": "object", "maxProperties": 0}
            jsonschema.validate(json.loads(call.arguments), schema)


def test_prefetched_mask_equals_the_computed_one(tmp_path):
    tok = family_tokenizer(tmp_path, "deepseek_v3")
    turn = agent.prepare(tok, 320, [{"role": "user", "content": "hi"}],
                         response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA}})
    ids = _run(tok, turn, 0, steps=12)
    a, b = turn.processors()[0], turn.processors()[0]
    b.prefetch(ids)
    b._prefetch(ids)  # done (the worker's job may still be queued: advance is idempotent)
    assert b.consumed == len(ids) and torch.equal(a.advance(ids), b.advance(ids))


def test_unenforceable_schema_is_a_request_error(tmp_path):
    tok = family_tokenizer(tmp_path, "deepseek_v3")
    with pytest.raises(RequestError, match="cannot be enforced"):
        agent.prepare(tok, 320, [{"role": "user", "content": "hi"}], response_format={
            "type": "json_schema", "json_schema": {"schema": {"type": "object", "required": 3}}})
