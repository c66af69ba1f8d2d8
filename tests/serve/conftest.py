"""Servers for the HTTP tests: the real app under uvicorn on a free 127.0.0.1 port, on a thread of the test process,
over an engine on the tiny model (which has a chat template: hybrid/weights/tokenizer_files.py)."""
from __future__ import annotations

import contextlib
import time
from typing import Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hybrid.engine.engine import Engine
from hybrid.engine.probe import local_plan
from hybrid.serve import ServerConfig, ServerThread, create_app
from hybrid.tokenizer import Tokenizer

MODEL = "tiny"
PLAN = local_plan({"kv.max_batch": 4, "kv.max_context": 128, "decode.batch_cap": 4, "prefill.chunk_tokens": 64})


@pytest.fixture(scope="session")
def tiny_tok(tiny_dir) -> Tokenizer:
    return Tokenizer(tiny_dir)


@contextlib.contextmanager
def running(source, cfg: ServerConfig = ServerConfig(), name: str = MODEL) -> Iterator[ServerThread]:
    with ServerThread(create_app(source, cfg, name)) as srv:
        yield srv


@pytest.fixture(scope="module")
def server(tiny_model, tiny_tok) -> Iterator[ServerThread]:
    with running(Engine(tiny_model, PLAN, tiny_tok)) as srv:
        yield srv


def client_for(srv: ServerThread, key: str = "unused", **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key=key, max_retries=0, timeout=60, **kw)


@pytest.fixture
def client(server) -> openai.OpenAI:
    return client_for(server)


def metrics(srv: ServerThread, **headers) -> dict[str, float]:
    """/metrics as {'name{label="v"}': value}."""
    text = httpx.get(f"{srv.url}/metrics", headers=headers, timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def wait_idle(srv: ServerThread, timeout_s: float = 10.0) -> dict[str, float]:
    """Polls /metrics until no request runs, waits or holds a KV slot; returns the last scrape."""
    end = time.monotonic() + timeout_s
    while True:
        m = metrics(srv)
        idle = m["hybrid_requests_running"] == 0 and m["hybrid_requests_waiting"] == 0 and \
            m["hybrid_kv_slots_in_use"] == 0
        if idle or time.monotonic() > end:
            return m
        time.sleep(0.02)
