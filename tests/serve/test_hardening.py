"""What a hostile or careless client cannot do to the server: freeze it with a large body, get 429 while KV slots
are free; and the settings around it: the API key from a file or the environment, /docs without the network,
CORS."""
from __future__ import annotations

import concurrent.futures
import json
import threading
import time

import httpx
import pytest

from hybrid.engine.engine import Engine
from hybrid.engine.probe import local_plan
from hybrid.serve import ServerConfig
from tests.serve.conftest import MODEL, PLAN, client_for, running

HELLO = [{"role": "user", "content": "Hello there"}]


def _stream(url: str, times: list, started: threading.Event) -> None:
    """Streams a completion (a chunk per token: logprobs), recording when each chunk came."""
    body = {"model": MODEL, "prompt": "flow", "max_tokens": 100, "temperature": 0, "stream": True,
            "ignore_eos": True, "logprobs": 0}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                times.append(time.monotonic())
                started.set()


def test_a_large_body_freezes_nothing(tiny_model, tiny_tok):
    """20 MB bodies (413 before they are read) and 6 MB prompts (400 before they are tokenised), one after
    another for 2 s: meanwhile /health answers within 0.5 s and another client's stream goes on."""
    engine = Engine(tiny_model, PLAN, tiny_tok)
    step = engine.step

    def paced():  # a stream of >= 5 s, so that the large bodies arrive while it flows
        time.sleep(0.05)
        return step()
    engine.step = paced
    big = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * (20 << 20)}]})
    under = json.dumps({"model": MODEL, "prompt": "y " * (3 << 20)})  # 6 MB: far beyond 128 tokens
    with running(engine, ServerConfig(max_body_mb=8)) as srv:
        times, started = [], threading.Event()
        streamer = threading.Thread(target=_stream, args=(srv.url, times, started))
        streamer.start()
        assert started.wait(30)
        health, answers = [], []
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            t0 = time.monotonic()
            while time.monotonic() < t0 + 2:
                posts = [pool.submit(httpx.post, f"{srv.url}{path}", content=body, timeout=60,
                                     headers={"content-type": "application/json"})
                         for path, body in (("/v1/chat/completions", big), ("/v1/completions", under))]
                while not all(p.done() for p in posts):
                    t = time.monotonic()
                    assert httpx.get(f"{srv.url}/health", timeout=5).status_code == 200
                    health.append(time.monotonic() - t)
                answers += [p.result() for p in posts]
            t1 = time.monotonic()
        streamer.join(60)
        for too_big, too_long in zip(answers[::2], answers[1::2]):
            assert too_big.status_code == 413 and too_big.json()["error"]["code"] == "body_too_large", too_big.text
            assert "server.max_body_mb (8 MiB)" in too_big.json()["error"]["message"]
            assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"
        assert health and max(health) < 0.5, health
        during = [t for t in times if t0 <= t <= t1]
        gaps = [b - a for a, b in zip(times, times[1:]) if t0 <= b and a <= t1]
        assert len(during) >= 3 and max(gaps) < 1.5, (len(during), gaps)


def test_a_burst_with_free_slots_is_all_admitted(tiny_model, tiny_tok):
    eight = local_plan({"kv.max_batch": 8, "kv.max_context": 128, "decode.batch_cap": 8, "prefill.chunk_tokens": 64})
    engine = Engine(tiny_model, eight, tiny_tok)
    step = engine.step

    def slow():  # the burst lands between two steps: all of it waits in the engine's inbox at once
        time.sleep(0.3)
        return step()
    engine.step = slow
    with running(engine, ServerConfig(max_waiting=1)) as srv:
        c = client_for(srv)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            done = list(pool.map(lambda i: c.completions.create(model=MODEL, prompt=f"burst {i}", max_tokens=2),
                                 range(8)))
        assert all(r.usage.completion_tokens >= 1 for r in done)
        with concurrent.futures.ThreadPoolExecutor(10) as pool:  # 8 slots + 1 waiting: the 10th is refused
            codes = list(pool.map(lambda i: httpx.post(f"{srv.url}/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": "more", "max_tokens": 2}).status_code, range(10)))
        assert sorted(codes) == [200] * 9 + [429], codes


@pytest.mark.parametrize("how", ["file", "env"])
def test_the_api_key_from_a_file_or_the_environment(tiny_model, tiny_tok, tmp_path, monkeypatch, how):
    key = f"sk-from-{how}"
    if how == "file":
        (tmp_path / "key").write_text(key + "\n")
        cfg = ServerConfig(api_key_file=str(tmp_path / "key"))
    else:
        monkeypatch.setenv("HYBRID_API_KEY", key)
        cfg = ServerConfig()
    with running(Engine(tiny_model, PLAN, tiny_tok), cfg) as srv:
        assert httpx.get(f"{srv.url}/v1/models").status_code == 401
        assert client_for(srv, key).models.list().data[0].id == MODEL


def test_docs_need_no_network_and_cors_is_configurable(tiny_model, tiny_tok):
    origin = "http://ui.example"
    with running(Engine(tiny_model, PLAN, tiny_tok), ServerConfig(cors_origins=[origin], api_key="k")) as srv:
        page = httpx.get(f"{srv.url}/docs")
        assert page.status_code == 200 and "/docs/assets/swagger-ui-bundle.js" in page.text
        assert "cdn" not in page.text and "https://" not in page.text.replace("https://fastapi.tiangolo.com", "")
        for asset in ("swagger-ui-bundle.js", "swagger-ui.css"):
            r = httpx.get(f"{srv.url}/docs/assets/{asset}")
            assert r.status_code == 200 and len(r.content) > 10_000, asset
        pre = httpx.options(f"{srv.url}/v1/chat/completions", headers={
            "Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == origin
        r = httpx.get(f"{srv.url}/v1/models", headers={"Origin": origin, "Authorization": "Bearer k"})
        assert r.headers["access-control-allow-origin"] == origin
        other = httpx.get(f"{srv.url}/v1/models", headers={"Origin": "http://evil.example",
                                                           "Authorization": "Bearer k"})
        assert "access-control-allow-origin" not in other.headers
