"""`bench=serve` against an endpoint (`bench.endpoint`, a base URL …/v1): one replica, the gateway of
`mode=replicas`, another server. Nothing is built here; the workload (conf/workload/) is driven at the endpoint as
against a server of our own (hybrid/bench/serve.py), as random token ids or, with `bench.prompt=text`, their text
(hybrid/serve/prompts.py: for sglang-router, which takes text prompts only). The key is this config's
(server.api_key, its file or $HYBRID_API_KEY).

- single-turn workloads: the same records as against our own server, at each of bench.concurrency;
- multi-turn: one run as the endpoint is configured (turning the prefix cache on and off needs engines of our own),
  after one warm-up request: the load driver's aggregates, `ttft_turn_s` per turn (m: its context), `ttft_context_s`
  (TTFT p50 by context bucket), and `prefix_cache_hit_rate` from the prefix-cache counters summed over
  `bench.metrics` (each replica's /metrics: `[replicas]` names those of mode=replicas' replicas.*; empty: the
  endpoint's own), a table of the turns on stderr.
"""
from __future__ import annotations

import sys
from typing import Optional

from hybrid.bench.records import Record, Records
from hybrid.config.schema import HybridConfig


def root(endpoint: str) -> str:
    """The server's URL of a base URL (…/v1)."""
    url = endpoint.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def metrics_urls(s: HybridConfig) -> list[str]:
    """bench.metrics with `replicas` expanded; empty: the endpoint's own /metrics."""
    from hybrid.serve.replicas import replica_urls

    out: list[str] = []
    for m in s.bench.metrics:
        out += [f"{u}/metrics" for u in replica_urls(s)] if m == "replicas" else [m]
    return out or [f"{root(s.bench.endpoint)}/metrics"]


def prompts_of(s: HybridConfig):
    """Random ids of the model's vocabulary, or their text (the model's tokenizer)."""
    from hybrid.models import args_of, open_source
    from hybrid.serve.prompts import Prompts
    from hybrid.tokenizer import Tokenizer

    if s.bench.prompt == "ids":
        return Prompts.ids(args_of(s.model).vocab_size)
    prompts = Prompts.text(Tokenizer(open_source(s.model)[1]))
    if not prompts.exact:
        print("note: this tokenizer does not split the prompts' text back into their ids: lengths are approximate",
              file=sys.stderr)
    return prompts


def model_at(base_url: str, key: str, model: Optional[str]) -> str:
    """bench.model, else the first model the endpoint lists."""
    if model:
        return model
    from openai import OpenAI

    with OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=60) as client:
        return client.models.list().data[0].id


def run(s: HybridConfig) -> Records:
    from hybrid.serve.service import api_key

    url, key = s.bench.endpoint.rstrip("/"), api_key(s.server) or "EMPTY"
    prompts = prompts_of(s)
    model = model_at(url, key, s.bench.model)
    context = {"endpoint": url, "model": model, "prompt": s.bench.prompt}
    print(f"bench=serve: {model} at {url} ({s.bench.prompt} prompts)", file=sys.stderr)
    if s.workload.kind == "multi_turn":
        return Records(sessions(s, url, model, key, prompts), context)
    return Records(single(s, url, model, key, prompts), context)


def single(s: HybridConfig, url: str, model: str, key: str, prompts) -> list[Record]:
    from hybrid.bench.serve import records_of, workloads
    from hybrid.serve.load import run as drive

    records = []
    for load in workloads(s):
        rep = drive(load, url, model, key, prompts=prompts)
        records += records_of(rep, load.concurrency)
        print(f"  concurrency {load.concurrency or f'rate {load.rate}/s'}: {rep['completed']}/{rep['requests']} done, "
              f"TTFT p50 {rep['ttft_s']['p50']:.3f} s, TPOT p50 {rep['tpot_s']['p50'] * 1e3:.1f} ms", file=sys.stderr)
    return records


def sessions(s: HybridConfig, url: str, model: str, key: str, prompts) -> list[Record]:
    from hybrid.bench.serve import records_of
    from hybrid.bench.sessions import counters, hit_rate, sessions_workload, ttft_by_context, turn_table, warm_up
    from hybrid.serve.sessions import run as drive

    w = sessions_workload(s)
    scraped = metrics_urls(s)
    auth = key if key != "EMPTY" else None
    total = lambda: _sum(counters(m, auth) for m in scraped)  # noqa: E731
    print(f"  {w.name}: {w.sessions} sessions, {w.concurrency} at once; prefix-cache counters from "
          f"{', '.join(scraped)}", file=sys.stderr)
    warm_up(url, model, key, w, 0, prompts)
    before = total()
    r = drive(w, url, model, key, prompts=prompts)
    hits = hit_rate(before, total())
    rep = r.report()
    print(turn_table(rep["turns"], None, None, None), file=sys.stderr)
    print(f"  prefix-cache hit rate {hits['rate'] if hits['rate'] is None else round(hits['rate'], 4)} "
          f"({hits['hit_tokens']} of {hits['queried_tokens']} prompt tokens)", file=sys.stderr)
    out = [Record("ttft_turn_s", t.ttft_s, "s", None, t.prompt_tokens, extra={
        "session": t.session, "turn": t.turn, "new_tokens": t.new_tokens}) for t in r.turns if t.ok]
    out += ttft_by_context("ttft_context_s", r.turns)
    if hits["rate"] is not None:
        out.append(Record("prefix_cache_hit_rate", hits["rate"], "fraction", extra={
            "hit_tokens": hits["hit_tokens"], "queried_tokens": hits["queried_tokens"], "metrics": scraped}))
    aggregates = records_of(rep, w.concurrency)
    aggregates[0].extra["prefix_cache_hit_rate"] = hits["rate"]
    return out + aggregates


def _sum(scrapes) -> dict[str, float]:
    out: dict[str, float] = {}
    for c in scrapes:
        for k, v in c.items():
            out[k] = out.get(k, 0.0) + v
    return out
