"""Servers for the agent API tests: the tiny model behind a generated tokenizer of one family (its chat template and
tool-call tokens), with a context long enough for tool schemas in the prompt (a byte-level tokenizer: a token per
byte)."""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

from hybrid.engine.engine import Engine
from hybrid.engine.probe import local_plan
from hybrid.serve import ServerConfig, ServerThread, create_app
from hybrid.tokenizer import Tokenizer
from hybrid.weights.tokenizer_files import write_byte_tokenizer

PLAN = local_plan({"kv.max_batch": 4, "kv.max_context": 2048, "decode.batch_cap": 4, "prefill.chunk_tokens": 512})
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}


def family_tokenizer(root: Path, family: str, vocab: int = 320) -> Tokenizer:
    d = root / family
    if not (d / "tokenizer.json").exists():
        d.mkdir(parents=True, exist_ok=True)
        write_byte_tokenizer(d, vocab, 0, 1, family)
    return Tokenizer(d)


@contextlib.contextmanager
def agent_server(model, tok: Tokenizer) -> Iterator[ServerThread]:
    app = create_app(Engine(model, PLAN, tok), ServerConfig(), "tiny")
    with ServerThread(app) as srv:
        yield srv
