"""`bench=serve` with a multi-turn workload (workload.kind multi_turn, e.g. conf/workload/agent.yaml): the sessions
(hybrid/serve/sessions.py) against the real HTTP server twice, on an engine built with policy.kv.prefix_cache on,
then on one built with it off; each served in this process on a free port after one warm-up request.

Records:
- `ttft_cache_on_s`, `ttft_cache_off_s`: TTFT p50 of the turns whose context (prompt length) is in (m/2, m];
- `ttft_longest_s`: the turn of the longest context, cache on, against the time to prefill its new tokens alone after
  the rest of its prompt is cached (`hybrid.bench.prefix.suffix_prefill_s`, on the cache-on engine); beside it
  TTFT with the cache off, and `ttft_off_over_on` at that turn;
- `prefix_cache_hit_rate` of each run: cached prompt tokens / prompt tokens looked up, from the server's /metrics
  counters (null, and no record, where the server has none);
- the load driver's aggregates of each run (hybrid/bench/serve.py records_of), tagged `prefix_cache`;
- on a GPU with a host tier, `ttft_host_tier_hit_s`: a prompt of the longest turn's context served from the host tier
  against the same prompt cold (`hybrid.bench.prefix.host_tier_hit`, `of_cold` beside it).
"""
from __future__ import annotations

import gc
import sys
from dataclasses import replace
from pathlib import Path
from typing import Optional

from hybrid.bench.records import Record, Records, save_log_plot
from hybrid.config.bench import policy_keys, with_knobs
from hybrid.config.schema import HybridConfig
from hybrid.errors import ConfigError

PREFIX_CACHE = "kv.prefix_cache"  # the policy key run on and off
HIT_TOKENS = "hybrid_prefix_cache_hit_tokens_total"  # /metrics counters: prompt tokens found cached ...
QUERIED_TOKENS = "hybrid_prefix_cache_queried_tokens_total"  # ... of those looked up
WARM_UP_TOKENS = 4  # the warm-up request's answer


def sessions_workload(s: HybridConfig):
    """The configured multi-turn workload as the driver takes it."""
    from hybrid.serve.sessions import Sessions

    w = s.workload
    return Sessions(w.name, w.sessions, w.concurrency, w.system_tokens, tuple(w.message_tokens),
                    tuple(w.output_tokens), w.context_tokens, w.ttft_limit_s, w.tpot_limit_s, w.seed)


def check(s: HybridConfig) -> None:
    """Before anything is built: a session fits a KV slot, and the policy has the prefix cache's switch."""
    w = s.workload
    if w.context_tokens > s.policy.kv.max_context:
        raise ConfigError(f"workload {w.name}: sessions grow to workload.context_tokens {w.context_tokens}, which "
                          f"needs policy.kv.max_context >= {w.context_tokens} (it is {s.policy.kv.max_context})")
    if PREFIX_CACHE not in policy_keys():
        raise ConfigError(f"bench=serve with a multi-turn workload runs policy.{PREFIX_CACHE} on and off; this "
                          f"policy has no such key")


def with_prefix_cache(s: HybridConfig, on: bool) -> HybridConfig:
    return replace(s, policy=with_knobs(s.policy, {PREFIX_CACHE: on}))


def run(s: HybridConfig) -> Records:
    from hybrid.engine.build import build
    from hybrid.serve import ServerThread, create_app
    from hybrid.serve.sessions import run as drive

    check(s)
    w = sessions_workload(s)
    name = s.server.model_name or s.model.name
    cfg = replace(s.server, max_waiting=max(s.server.max_waiting, w.sessions))
    runs, hits, plan, bound, host = {}, {}, None, None, None
    for on in (True, False):
        engine = build(with_prefix_cache(s, on), s.hw, progress=False)
        plan = plan or engine.plan.params()
        vocab = engine.model.args.vocab_size
        app = create_app(engine, cfg, name)
        key = app.state.service.api_key  # server.api_key, its file or $HYBRID_API_KEY
        with ServerThread(app) as srv:
            print(f"bench=serve: {name} on {srv.url}, {w.name}: {w.sessions} sessions, {w.concurrency} at once, "
                  f"prefix cache {'on' if on else 'off'}", file=sys.stderr)
            warm_up(f"{srv.url}/v1", name, key or "EMPTY", w, vocab)
            before = counters(srv.url, key)
            runs[on] = drive(w, f"{srv.url}/v1", name, key or "EMPTY", vocab)
            hits[on] = hit_rate(before, counters(srv.url, key))
        if on:
            bound = suffix_bound(engine, runs[on].largest())
            host = host_tier(engine, runs[on].largest())
        del engine, app, srv
        _release()
    rep_on, rep_off = runs[True].report(), runs[False].report()
    print(turn_table(rep_on["turns"], rep_off["turns"], runs[True].largest(), bound), file=sys.stderr)
    records = records_of(runs[True], runs[False], hits, bound)
    if host is not None:
        print(f"host tier: {host['context_tokens']} tokens from the host tier {host['host_hit_s']:.3f} s to the first "
              f"token, cold {host['cold_s']:.3f} s ({host['host_hit_s'] / host['cold_s']:.1%})", file=sys.stderr)
        records.append(Record("ttft_host_tier_hit_s", host["host_hit_s"], "s", None, host["context_tokens"],
                              extra={**host, "of_cold": host["host_hit_s"] / host["cold_s"]}))
    return Records(records, {"plan": plan})


def warm_up(base_url: str, model: str, api_key: str, w, vocab_size: int, prompts=None) -> None:
    """One request of a first turn's length, of random ids apart from the sessions' (no prefix shared): thread pools,
    allocations and compiled kernels ready before the measured turns. `prompts` (hybrid/serve/prompts.py) None:
    random ids below vocab_size."""
    import random

    from openai import OpenAI

    from hybrid.serve.prompts import Prompts

    prompts = prompts or Prompts.ids(vocab_size)
    rng = random.Random(f"warm-up {w.seed}")
    prompt = prompts.draw(rng, w.system_tokens + w.message_tokens[1])
    with OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=600.0) as client:
        client.completions.create(model=model, prompt=prompts.payload(prompt), max_tokens=WARM_UP_TOKENS,
                                  temperature=0.0, extra_body={"ignore_eos": True})


def counters(url: str, api_key: Optional[str] = None) -> dict[str, float]:
    """The prefix cache's counters (those it has) on a server's /metrics (`url`: the server, or its /metrics URL),
    each summed over its samples (a gateway's aggregate of several servers adds up)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    text = httpx.get(url if url.endswith("/metrics") else f"{url}/metrics", headers=headers, timeout=30).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in (HIT_TOKENS, QUERIED_TOKENS):
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def hit_rate(before: dict[str, float], after: dict[str, float]) -> dict:
    """Prompt tokens found cached / looked up between two scrapes; rate None without the counters or lookups."""
    if not all(k in before and k in after for k in (HIT_TOKENS, QUERIED_TOKENS)):
        return {"rate": None, "hit_tokens": None, "queried_tokens": None}
    hit, queried = (after[k] - before[k] for k in (HIT_TOKENS, QUERIED_TOKENS))
    return {"rate": hit / queried if queried > 0 else None, "hit_tokens": int(hit), "queried_tokens": int(queried)}


def suffix_bound(engine, turn) -> Optional[float]:
    """The time to prefill the turn's new tokens alone after the rest of its prompt (its context) is cached; None
without a turn that has both."""
    if turn is None or not 0 < turn.new_tokens < len(turn.prompt):
        return None
    try:
        from hybrid.bench.prefix import suffix_prefill_s
    except ImportError as e:
        print(f"note: no bound for the longest turn ({e})", file=sys.stderr)
        return None
    cut = len(turn.prompt) - turn.new_tokens
    return suffix_prefill_s(engine, turn.prompt[:cut], turn.prompt[cut:])


def host_tier(engine, turn) -> Optional[dict]:
    """On a GPU with a host tier: a prompt of the longest turn's context served from the host tier against the same
    cold (hybrid.bench.prefix.host_tier_hit); None elsewhere (on the CPU the pool is host memory already)."""
    if turn is None or engine.device.type != "cuda" or engine.kv.host is None:
        return None
    from hybrid.bench.prefix import host_tier_hit

    return host_tier_hit(engine, len(turn.prompt) - 256, 256)


def _release() -> None:
    """The last engine's memory back before the next is built."""
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def bucket(context: int) -> int:
    """The power of two m with context in (m/2, m]."""
    return 1 << max(0, context - 1).bit_length()


def records_of(on, off, hits: dict[bool, dict], bound: Optional[float]) -> list[Record]:
    """The records of the two runs (`on`, `off`: hybrid.serve.sessions.Run)."""
    from hybrid.bench.serve import records_of as aggregates

    out = []
    for label, r in (("on", on), ("off", off)):
        out += ttft_by_context(f"ttft_cache_{label}_s", r.turns)
    top = on.largest()
    if top is not None:
        twin = next((t for t in off.turns if t.ok and (t.session, t.turn) == (top.session, top.turn)), None)
        ratio = twin.ttft_s / top.ttft_s if twin is not None and top.ttft_s > 0 else None
        out.append(Record("ttft_longest_s", top.ttft_s, "s", bound, top.prompt_tokens, extra={
            "session": top.session, "turn": top.turn, "new_tokens": top.new_tokens,
            "ttft_cache_off_s": twin.ttft_s if twin is not None else None, "off_over_on": ratio}))
        if ratio is not None:
            out.append(Record("ttft_off_over_on", ratio, "x", None, top.prompt_tokens))
    for flag, r in ((True, on), (False, off)):
        tag = {"prefix_cache": flag}
        h = hits[flag]
        if h["rate"] is not None:
            out.append(Record("prefix_cache_hit_rate", h["rate"], "fraction", extra={
                **tag, "hit_tokens": h["hit_tokens"], "queried_tokens": h["queried_tokens"]}))
        recs = aggregates(r.report(), r.workload.concurrency)
        for rec in recs:
            rec.extra.update(tag)
        recs[0].extra["prefix_cache_hit_rate"] = h["rate"]
        out += recs
    return out


def ttft_by_context(name: str, turns) -> list[Record]:
    """TTFT p50 of the completed turns by context bucket (m: the bucket's upper edge)."""
    from hybrid.serve.load import _percentiles

    by: dict[int, list] = {}
    for t in turns:
        if t.ok:
            by.setdefault(bucket(t.prompt_tokens), []).append(t)
    out = []
    for m in sorted(by):
        ts = by[m]
        p = _percentiles([t.ttft_s for t in ts])
        out.append(Record(name, p["p50"], "s", None, m, extra={
            "p90": p["p90"], "mean": p["mean"], "turns": len(ts),
            "context_mean": sum(t.prompt_tokens for t in ts) / len(ts),
            "new_tokens_mean": sum(t.new_tokens for t in ts) / len(ts)}))
    return out


def turn_table(on_rows: list[dict], off_rows: Optional[list[dict]], top, bound: Optional[float]) -> str:
    """Each turn with the cache on and off (off_rows None: one run, as configured), and the longest one against its
    bound."""
    off = {(r["session"], r["turn"]): r for r in off_rows} if off_rows is not None else None
    t = lambda r: f"{r['ttft_s']:.3f}" if r and r["ok"] else "-"  # noqa: E731
    lines = [f"{'session':>7} {'turn':>4} {'context':>8} {'new':>6} " +
             (f"{'TTFT on s':>10} {'TTFT off s':>10}" if off is not None else f"{'TTFT s':>10}")]
    for r in on_rows:
        lines.append(f"{r['session']:>7} {r['turn']:>4} {r['context_tokens']:>8} {r['new_tokens']:>6} {t(r):>10}" +
                     (f" {t(off.get((r['session'], r['turn']))):>10}" if off is not None else ""))
    if top is not None:
        line = f"longest: context {top.prompt_tokens}, {top.new_tokens} new tokens, TTFT {top.ttft_s:.3f} s with " \
               f"the cache on"
        if bound:
            line += f"; prefilling the new tokens alone {bound:.3f} s (TTFT / bound {top.ttft_s / bound:.2f})"
        lines.append(line)
    return "\n".join(lines)


def plot(records: list[Record], png: Path) -> Optional[Path]:
    """TTFT p50 against context (each bucket at its turns' mean context), the cache on and off (or, against an
    endpoint, as configured), and the longest turn with its bound; None for a run without multi-turn records."""
    names = {"prefix cache on": "ttft_cache_on_s", "prefix cache off": "ttft_cache_off_s",
             "as configured": "ttft_context_s"}
    series = {label: sorted((r.extra["context_mean"], r.value) for r in records if r.name == name)
              for label, name in names.items()}
    if not any(series.values()):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, points in series.items():
        if points:
            ax.plot(*zip(*points), marker="o", label=f"{label} (p50)")
    for r in records:
        if r.name == "ttft_longest_s" and r.bound:
            ax.plot([r.m], [r.bound], "k_", ms=14, label="longest turn: its new tokens' prefill")
    return save_log_plot(fig, ax, png, "context tokens", "TTFT (s)", "Multi-turn TTFT")
