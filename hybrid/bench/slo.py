"""`mode=bench bench=slo`: the SLO report card of the configured model on this machine, through the same engine
`python -m hybrid` generates with (hybrid/engine/build.py): `bench.batch` requests of a synthetic prompt of
`bench.prompt_tokens` tokens each, queued at once and served by the scheduler (admitted, prefilled, then decoded
together) for `bench.new_tokens` tokens each (end-of-sequence does not stop them). One warm-up pass, then
`bench.repeats` passes; the median of each figure counts.

Records: ttft_s (start to the first token of every request), tpot_s (the median step while the whole batch
decodes; p50/p90/max beside it), prefill_tok_s (prompt tokens of all requests / TTFT), decode_tok_s (tokens per
second while the whole batch decodes together: from the last request's first token to the first request's last —
requests are admitted and prefilled one after another, so they start and stop decoding at different steps).
decode_tok_s is bounded by the memory read roof measured in the same run (`bench.roof_gb`): the bytes the CPU
reads per decode step (routed experts the batch activates, on average, plus everything else when the CPU does the
GPU side's work too) at the roof's GB/s. The tuner's `decode_tok_s` objective measures this
(`measure`) on the engine its trial worker keeps.
"""
from __future__ import annotations

import statistics
import time

from hybrid.bench import bounds
from hybrid.bench.records import Record, Records
from hybrid.config.schema import HybridConfig
from hybrid.errors import ConfigError


def run(s: HybridConfig) -> list[Record]:
    from hybrid.engine.build import build

    b, p = s.bench, s.policy
    batches = list(b.batches) or [b.batch]
    if max(batches) > p.decode.batch_cap:
        raise ConfigError(f"bench.batch ({max(batches)}) exceeds policy.decode.batch_cap ({p.decode.batch_cap}), "
                          "the requests that run at once")
    if b.prompt_tokens + b.new_tokens > p.kv.max_context:
        raise ConfigError(f"bench.prompt_tokens + bench.new_tokens ({b.prompt_tokens + b.new_tokens}) exceeds "
                          f"policy.kv.max_context ({p.kv.max_context})")
    return measure(build(s, s.hw, progress=False), s)


def measure(engine, s: HybridConfig) -> Records:
    """The report card on a built engine (the tuner's trial worker keeps one across trials)."""
    b = s.bench
    roof = 0.0
    if b.roof_gb > 0:
        from hybrid.kernels.membw import calibrate

        _, readings = calibrate(b.roof_gb)
        roof = max(readings.values())
    records = []
    for batch in list(b.batches) or [b.batch]:  # one engine: the batch sizes side by side
        records += _batch(engine, s, batch, roof, m=batch if b.batches else None)
    if roof:
        records.append(Record("read_roof", roof, "GB/s", extra={"buffer_gb": b.roof_gb}))
    return Records(records, {"plan": engine.plan.params()})


def _batch(engine, s: HybridConfig, batch: int, roof: float, m) -> list[Record]:
    """TTFT, TPOT and tokens/s of `batch` requests queued at once (their decode against the read roof, if any)."""
    from hybrid.engine.requests import SamplingParams

    b = s.bench
    prompts = synthetic_prompts(engine.model.args, batch, b.prompt_tokens, s.seed)

    def once(new_tokens: int) -> tuple[float, float, int, list[float]]:
        """All prompts as requests at once, through the scheduler. The batch decodes together from the last first
        token to the first last token (prompts are admitted and prefilled one after another, so requests start and
        end decoding at different steps): TTFT of the last first token, that window's length and tokens, and the
        first request's step times inside it."""
        t0 = time.perf_counter()
        done = engine.generate(prompts, SamplingParams(new_tokens, ignore_eos=True))
        failed = [c.error for c in done if c.error]
        if failed:
            raise RuntimeError(f"bench=slo: a request failed: {failed[0]}")
        start = max(c.token_times[0] for c in done)
        end = min(c.token_times[-1] for c in done)
        if end <= start:
            raise ConfigError(f"bench=slo: the {batch} requests never decoded together: raise bench.new_tokens "
                              f"(now {new_tokens})")
        tokens = sum(start < t <= end for c in done for t in c.token_times)
        mine = [t for t in done[0].token_times if start <= t <= end]
        return start - t0, end - start, tokens, [y - x for x, y in zip(mine, mine[1:])]

    once(min(b.new_tokens, 2 + batch))  # warm-up: thread pools, allocations, caches, graphs of this batch size
    passes = [once(b.new_tokens) for _ in range(b.repeats)]
    ttft = statistics.median(p[0] for p in passes)
    tok_s = statistics.median(p[2] / p[1] for p in passes)
    steps = sorted(x for p in passes for x in p[3]) or [statistics.median(p[1] for p in passes)]
    tpot = statistics.median(steps)
    shape = {"prompt_tokens": b.prompt_tokens, "new_tokens": b.new_tokens, "batch": batch, "repeats": b.repeats}
    records = [
        Record("ttft_s", ttft, "s", None, m, extra=shape),
        Record("tpot_s", tpot, "s", None, m, extra={"p50_ms": 1e3 * steps[len(steps) // 2],
                                                    "p90_ms": 1e3 * steps[min(len(steps) - 1, int(0.9 * len(steps)))],
                                                    "max_ms": 1e3 * steps[-1], "batch": batch}),
        Record("prefill_tok_s", batch * b.prompt_tokens / ttft if ttft else 0.0, "tok/s", None, m),
        Record("decode_tok_s", tok_s, "tok/s", None, m, extra={"batch": batch}),
    ]
    if roof:
        step_bytes = bytes_per_decode_step(engine, batch)
        records[-1].bound = bounds.decode_tok_s_bound(step_bytes, roof, batch)
        records[-1].extra["bytes_per_step"] = step_bytes
    return records


def synthetic_prompts(args, batch: int, length: int, seed: int) -> list[list[int]]:
    """`batch` prompts of `length` random token ids (no special ids; the first one BOS where the model has one)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    special = {args.bos_token_id, args.eos_token_id} - {None}
    ids = [i for i in range(args.vocab_size) if i not in special]
    out = []
    for _ in range(batch):
        pick = torch.randint(len(ids), (length,), generator=g).tolist()
        body = [ids[i] for i in pick]
        out.append(([args.bos_token_id] + body[1:]) if args.bos_token_id is not None else body)
    return out


def bytes_per_decode_step(engine, batch: int) -> float:
    """Weight bytes the CPU reads per decode step of `batch` sequences (bounds.decode_step_bytes): from the model's
    arguments, whatever placement did to the module tree; the rest of the model counts when the CPU runs it."""
    return bounds.decode_step_bytes(engine.model.args, batch, whole_model=engine.device.type == "cpu")
