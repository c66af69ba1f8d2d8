"""The server's guards: the API key, the bound on waiting requests, an engine failure that takes one request down
and not the server, and /health while the engine is still loading (or failed to)."""
from __future__ import annotations

import threading

import httpx
import openai
import pytest

from hybrid.engine.engine import Engine
from hybrid.engine.probe import local_plan
from hybrid.errors import CheckpointError
from hybrid.serve import ServerConfig
from hybrid.serve.load import Workload
from tests.serve.conftest import MODEL, PLAN, client_for, metrics, running, wait_idle

KEY = "sk-test-123"


def test_api_key_guards_every_route_but_health(tiny_model, tiny_tok):
    with running(Engine(tiny_model, PLAN, tiny_tok), ServerConfig(api_key=KEY)) as srv:
        with pytest.raises(openai.AuthenticationError) as e:
            client_for(srv, "sk-wrong").completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
        for headers in ({}, {"Authorization": f"Basic {KEY}"}):
            r = httpx.post(f"{srv.url}/v1/completions", json={"model": MODEL, "prompt": "x"}, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "missing_api_key"
        r = client_for(srv, KEY).completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert r.usage.completion_tokens >= 1
        assert httpx.get(f"{srv.url}/health").status_code == 200
        for path in ("/metrics", "/v1/models", "/openapi.json", "/v1/unknown"):
            assert httpx.get(f"{srv.url}{path}").status_code == 401, path
            ok = httpx.get(f"{srv.url}{path}", headers={"Authorization": f"Bearer {KEY}"})
            assert ok.status_code == (404 if "unknown" in path else 200), path
        spec = httpx.get(f"{srv.url}/openapi.json", headers={"Authorization": f"Bearer {KEY}"}).json()
        assert spec["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"


def test_a_full_queue_answers_429_with_retry_after(tiny_model, tiny_tok):
    one_slot = local_plan({"kv.max_batch": 1, "kv.max_context": 128, "decode.batch_cap": 1, "prefill.chunk_tokens": 64})
    with running(Engine(tiny_model, one_slot, tiny_tok), ServerConfig(max_waiting=2)) as srv:
        c = client_for(srv)
        streams, refused = [], None
        for _ in range(6):  # 1 runs, 2 wait, then the queue is full
            try:
                streams.append(c.completions.create(model=MODEL, prompt="busy", max_tokens=100, temperature=0,
                                                    stream=True, extra_body={"ignore_eos": True}))
            except openai.RateLimitError as e:
                refused = e
                break
        assert refused is not None and len(streams) in (2, 3), len(streams)
        assert refused.response.headers["Retry-After"].isdigit() and refused.body["code"] == "queue_full"
        assert metrics(srv)['hybrid_requests_total{outcome="queue_full"}'] == 1
        for s in streams:
            s.close()
        m = wait_idle(srv)
        assert m["hybrid_kv_slots_in_use"] == 0
        assert c.completions.create(model=MODEL, prompt="now", max_tokens=2).usage.completion_tokens >= 1


def test_an_engine_error_fails_that_request_alone(tiny_model, tiny_tok):
    fail = {"on": False}

    def flaky(tokens, pos, slots, kv_len, capture=True):
        if fail["on"]:
            raise RuntimeError("injected decode failure")
        return tiny_model(tokens, pos, engine.cache, slots, kv_len=kv_len)[:, -1]
    engine = Engine(tiny_model, PLAN, tiny_tok, decode=flaky)
    with running(engine) as srv:
        c = client_for(srv)
        before = c.completions.create(model=MODEL, prompt="ok", max_tokens=4, temperature=0).choices[0].text
        fail["on"] = True
        with pytest.raises(openai.InternalServerError) as e:
            c.completions.create(model=MODEL, prompt="ok", max_tokens=4, temperature=0)
        assert e.value.status_code == 500 and "injected decode failure" in e.value.body["message"]
        with pytest.raises(openai.APIError, match="injected decode failure"):
            list(c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                           stream=True))
        fail["on"] = False
        after = c.completions.create(model=MODEL, prompt="ok", max_tokens=4, temperature=0).choices[0].text
        assert after == before
        assert metrics(srv)['hybrid_requests_total{outcome="error"}'] == 2


def test_health_is_503_while_the_engine_loads(tiny_model, tiny_tok):
    go = threading.Event()

    def loader() -> Engine:
        go.wait(30)
        return Engine(tiny_model, PLAN, tiny_tok)
    with running(loader) as srv:
        h = httpx.get(f"{srv.url}/health")
        assert h.status_code == 503 and h.json()["status"] == "loading"
        r = httpx.post(f"{srv.url}/v1/completions", json={"model": MODEL, "prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_loading"
        go.set()
        for _ in range(500):
            if httpx.get(f"{srv.url}/health").status_code == 200:
                break
            threading.Event().wait(0.01)
        assert client_for(srv).completions.create(model=MODEL, prompt="x", max_tokens=2).usage.completion_tokens


def test_a_failed_load_shows_in_health():
    def loader() -> Engine:
        raise CheckpointError("no such checkpoint")
    with running(loader) as srv:
        for _ in range(500):
            h = httpx.get(f"{srv.url}/health")
            if h.json()["status"] != "loading":
                break
            threading.Event().wait(0.01)
        assert h.status_code == 503 and h.json() == {"status": "failed", "message": "CheckpointError: no such "
                                                                                      "checkpoint"}


def test_settings_are_checked():
    from hybrid.errors import ConfigError

    for bad in (dict(port=70000), dict(max_waiting=0), dict(shutdown_grace_s=-1), dict(api_key="")):
        with pytest.raises(ConfigError):
            ServerConfig(**bad)
    with pytest.raises(ValueError, match="exactly one"):
        Workload("w", (1, 2), (1, 2), 1.0, 1.0, requests=1)
    with pytest.raises(ValueError, match="lo <= hi"):
        Workload("w", (5, 2), (1, 2), 1.0, 1.0, requests=1, concurrency=1)
