"""`mode=bench bench=slo`: the SLO report card of the configured model on this machine, through the same engine
`python -m hybrid` generates with (hybrid/engine/build.py): a synthetic prompt of `bench.prompt_tokens` tokens per
sequence, `bench.batch` sequences prefilled and then decoded together for `bench.new_tokens` tokens each
(end-of-sequence does not stop them). One warm-up pass, then `bench.repeats` passes; the median of each figure counts.

Records: ttft_s (start to the first token of every sequence), tpot_s (per decode step; p50/p90/max of the steps
beside it), prefill_tok_s (prompt tokens of all sequences / TTFT), decode_tok_s (generated tokens of all sequences
per second of decoding). decode_tok_s is bounded by the memory read roof measured in the same run
(`bench.roof_gb`): the bytes the CPU reads per decode step (routed experts the batch activates, on average, plus
everything else when the CPU does the GPU side's work too) at the roof's GB/s. This is the tuner's objective
(`python -m tuner`): it runs `python -m hybrid mode=bench bench=slo output=json policy.x=...` once per trial.
"""
from __future__ import annotations

import os
import statistics
import sys
import time

from hybrid.bench.records import Record
from hybrid.config.schema import HybridConfig
from hybrid.errors import ConfigError

# Test-only fault injection for the tuner's tests: "<trial>:<crash|hang>[,...]" makes the bench of that tuner trial
# (HYBRID_TUNER_TRIAL, set by the tuner) fail or hang. Never set it outside tests.
TEST_FAULT_ENV = "HYBRID_TEST_INJECT_FAULT"
TRIAL_ENV = "HYBRID_TUNER_TRIAL"


def run(s: HybridConfig) -> list[Record]:
    from hybrid.engine.build import build
    from hybrid.engine.sampler import Sampling
    from hybrid.model.moe import RoutedExperts

    _inject_test_fault()
    b, p = s.bench, s.policy
    if b.batch > p.max_batch:
        raise ConfigError(f"bench.batch ({b.batch}) exceeds policy.max_batch ({p.max_batch}), the KV-cache slots")
    if b.prompt_tokens + b.new_tokens > p.max_context:
        raise ConfigError(f"bench.prompt_tokens + bench.new_tokens ({b.prompt_tokens + b.new_tokens}) exceeds "
                          f"policy.max_context ({p.max_context})")
    engine = build(s, s.hw, progress=False)
    gen, args = engine.generator, engine.model.args
    gen.eos_id = None  # a fixed number of tokens per sequence
    prompts = _prompts(args, b.batch, b.prompt_tokens, s.seed)

    def once(new_tokens: int) -> tuple[float, float, list[float]]:
        stamps: list[float] = []
        res = gen.generate(prompts, new_tokens, Sampling(),
                           on_token=lambda seq, _tok: stamps.append(time.perf_counter()) if seq == 0 else None)
        steps = [b - a for a, b in zip(stamps, stamps[1:])]
        return res.timings.ttft_s, res.timings.decode_s, steps

    once(min(b.new_tokens, 2))  # warm-up: thread pools, allocations, caches
    passes = [once(b.new_tokens) for _ in range(b.repeats)]
    ttft = statistics.median(t for t, _, _ in passes)
    decode_s = statistics.median(d for _, d, _ in passes)
    steps = sorted(statistics.median(step) for step in zip(*(st for _, _, st in passes))) or [decode_s]
    decoded = b.batch * max(b.new_tokens - 1, 1)
    tpot = decode_s / max(b.new_tokens - 1, 1)
    shape = {"prompt_tokens": b.prompt_tokens, "new_tokens": b.new_tokens, "batch": b.batch, "repeats": b.repeats}

    records = [
        Record("ttft_s", ttft, "s", extra=shape),
        Record("tpot_s", tpot, "s", extra={"p50_ms": 1e3 * steps[len(steps) // 2],
                                           "p90_ms": 1e3 * steps[min(len(steps) - 1, int(0.9 * len(steps)))],
                                           "max_ms": 1e3 * steps[-1]}),
        Record("prefill_tok_s", b.batch * b.prompt_tokens / ttft if ttft else 0.0, "tok/s"),
        Record("decode_tok_s", decoded / decode_s if decode_s else 0.0, "tok/s"),
    ]
    if b.roof_gb > 0:
        from hybrid.kernels.membw import calibrate

        _, readings = calibrate(b.roof_gb)
        roof = max(readings.values())
        step_bytes = _bytes_per_decode_step(engine, RoutedExperts, b.batch)
        records[-1].bound = roof * 1e9 / step_bytes * b.batch
        records[-1].extra = {"bytes_per_step": step_bytes}
        records.append(Record("read_roof", roof, "GB/s", extra={"buffer_gb": b.roof_gb}))
    return records


def _prompts(args, batch: int, length: int, seed: int) -> list[list[int]]:
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


def _bytes_per_decode_step(engine, routed_type, batch: int) -> float:
    """Weight bytes the CPU reads per decode step: the routed experts a batch of `batch` tokens activates on
    average (E·(1-(1-k/E)^batch) of E per layer), plus, when the CPU runs the GPU side too, every other weight but
    the embedding (one row per token)."""
    model, args = engine.model, engine.model.args
    seen: set[int] = set()

    def size(tensors) -> int:
        total = 0
        for t in tensors:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total

    def tensors(m):
        yield from m.parameters()
        yield from m.buffers()

    routed = sum(size(tensors(m)) for m in model.modules() if isinstance(m, routed_type))
    k, e = args.num_experts_per_tok, args.n_routed_experts
    active = 1.0 - (1.0 - k / e) ** batch if e else 0.0
    size(tensors(model.model.embed_tokens))  # marked as seen: not read whole
    rest = size(tensors(model)) if engine.device.type == "cpu" else 0
    return routed * active + rest


def _inject_test_fault() -> None:
    spec, trial = os.environ.get(TEST_FAULT_ENV), os.environ.get(TRIAL_ENV)
    if not spec or trial is None:
        return
    for item in spec.split(","):
        number, _, kind = item.partition(":")
        if number.strip() == trial:
            print(f"{TEST_FAULT_ENV}: injected {kind} in trial {trial}", file=sys.stderr, flush=True)
            if kind == "hang":
                while True:
                    time.sleep(60)
            raise RuntimeError(f"{TEST_FAULT_ENV}: injected crash in trial {trial}")
