"""`bench=serve` against an endpoint (hybrid/bench/endpoint.py) — here the test server, as a replica would be — and
the text prompts a gateway that takes text only needs (hybrid/serve/prompts.py)."""
from __future__ import annotations

import random

import pytest

from hybrid.bench import endpoint
from hybrid.config.compose import compose, to_settings
from hybrid.serve.prompts import Prompts
from hybrid.engine.engine import Engine
from hybrid.engine.probe import local_plan
from tests.serve.conftest import MODEL, running, wait_idle

# contexts past one KV block (256 tokens): a next turn finds its first block cached
LONG = local_plan({"kv.max_batch": 4, "kv.max_context": 1024, "decode.batch_cap": 4, "prefill.chunk_tokens": 256})


def _settings(srv, tiny_dir, *overrides):
    return to_settings(compose(["mode=bench", "bench=serve", f"bench.endpoint={srv.url}/v1", f"model.path={tiny_dir}",
                                *overrides]))


def test_text_prompts_tokenize_back_into_their_ids(tiny_tok):
    p = Prompts.text(tiny_tok)
    assert p.exact and len(p.pool) >= 26
    ids = p.draw(random.Random(0), 300)
    assert tiny_tok.encode(p.payload(ids), add_bos=False) == ids
    assert len(p.stand_in([7, 300, 5])) == 3 and set(p.stand_in(range(1000))) <= set(p.pool)
    assert Prompts.ids(320).payload([5, 6]) == [5, 6] and Prompts.ids(320).stand_in([9]) == [9]
    assert random.Random(1).randrange(3, 320) == Prompts.ids(320).draw(random.Random(1), 1)[0], "same draws as before"


@pytest.mark.parametrize("prompt", ["ids", "text"])
def test_single_turn_workload_at_an_endpoint(server, tiny_dir, prompt):
    s = _settings(server, tiny_dir, "bench.concurrency=[2]", "workload.requests=4", "workload.prompt_tokens=[8,24]",
                  "workload.output_tokens=[2,4]", f"bench.prompt={prompt}")
    recs = endpoint.run(s)
    by = {r.name: r for r in recs}
    assert by["errors"].value == 0 and by["ttft_s"].extra["completed"] == 4
    assert recs.context == {"endpoint": f"{server.url}/v1", "model": MODEL, "prompt": prompt}
    wait_idle(server)


def test_multi_turn_at_an_endpoint_reports_each_turn_and_the_hit_rate(tiny_model, tiny_tok, tiny_dir, capsys):
    with running(Engine(tiny_model, LONG, tiny_tok)) as server:
        s = _settings(server, tiny_dir, "workload=agent", "workload.sessions=2", "workload.system_tokens=300",
                      "workload.message_tokens=[8,16]", "workload.output_tokens=[2,4]",
                      "workload.context_tokens=360", "bench.prompt=text", f"bench.metrics=[{server.url}/metrics]")
        recs = endpoint.run(s)
        wait_idle(server)
    turns = [r for r in recs if r.name == "ttft_turn_s"]
    assert len(turns) >= 4 and {r.extra["session"] for r in turns} == {0, 1}
    assert all(r.value > 0 for r in turns)
    rate = next(r for r in recs if r.name == "prefix_cache_hit_rate")
    assert 0 < rate.value <= 1 and rate.extra["metrics"] == [f"{server.url}/metrics"]
    assert next(r for r in recs if r.name == "errors").value == 0
    assert any(r.name == "ttft_context_s" for r in recs)
    assert "TTFT s" in capsys.readouterr().err


def test_metrics_urls():
    s = to_settings(compose(["mode=bench", "bench=serve", "bench.endpoint=http://h:8100/v1", "replicas.count=3",
                             "replicas.base_port=9001", "bench.metrics=[replicas,http://x:1/metrics]"]))
    assert endpoint.metrics_urls(s) == [f"http://127.0.0.1:{p}/metrics" for p in (9001, 9002, 9003)] + \
        ["http://x:1/metrics"]
    own = to_settings(compose(["mode=bench", "bench=serve", "bench.endpoint=http://h:8100/v1/"]))
    assert endpoint.metrics_urls(own) == ["http://h:8100/metrics"]
