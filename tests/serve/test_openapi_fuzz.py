"""Schemathesis over /openapi.json: requests generated from the documented schema (valid and invalid ones), a bounded
number per route, against the running server. No response may be a 5xx, and every response must match what the
schema documents (status code, content type, body, headers)."""
from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (content_type_conformance, response_headers_conformance,
                                               response_schema_conformance, status_code_conformance)

from tests.serve.conftest import MODEL

EXAMPLES = 30
MAX_TOKENS = 4  # generated requests that reach the engine stay short
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          response_headers_conformance]


def _served(case):
    """Most generated bodies name a random model (404 at once): name the served one, so generation runs too."""
    body = case.body
    if isinstance(body, dict):
        if isinstance(body.get("model"), str):
            body["model"] = MODEL
        for field in ("max_tokens", "max_completion_tokens"):
            if isinstance(body.get(field), int) and body[field] > MAX_TOKENS:
                body[field] = MAX_TOKENS
        if "max_tokens" not in body and "max_completion_tokens" not in body:
            body["max_tokens"] = MAX_TOKENS
    return case


@pytest.fixture(scope="module")
def schema(server):
    return schemathesis.openapi.from_url(f"{server.url}/openapi.json")


def _label(op) -> str:
    return f"{op.method.upper()} {op.path}"


@pytest.mark.parametrize("route", ["GET /health", "GET /metrics", "GET /v1/models", "GET /v1/models/{model}",
                                   "POST /v1/chat/completions", "POST /v1/completions", "POST /tokenize",
                                   "POST /detokenize"])
def test_generated_requests_get_no_5xx_and_conform_to_the_schema(schema, server, route):
    ops = {_label(r.ok()): r.ok() for r in schema.get_all_operations()}
    assert set(ops) >= {route}, sorted(ops)
    op = ops[route]
    modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if op.method.upper() == "POST" else [])
    for mode in modes:
        @given(case=op.as_strategy(generation_mode=mode).map(_served))
        @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        def check(case):
            case.call_and_validate(base_url=server.url, checks=CHECKS, timeout=60)
        check()
