"""`mode=bench bench=concurrency`: does a second request wreck the first one's latency? The source paper's
micro-benchmarks through the engine's scheduler, the policy deciding how a long prompt runs (held in a step of its
own, or beside decode at a share of the time or with its stream capped: policy.prefill.beside_decode,
stream_duty, stream_cap_gbps):

- nD: n requests of `bench.prompt_tokens` tokens decoding together, `bench.new_tokens` steps timed;
- 1P: a prompt of `bench.long_prompt_tokens` tokens alone: its TTFT is the solo TTFT;
- 1P+nD: the n requests decode `bench.new_tokens` steps, then the long prompt arrives; timed until its first
  token.

Records per scenario: each decode's TPOT (median step) before the prompt arrived, while it was prefilled (median
and the worst step: a held prefill is one long step) and their ratio, by median and by mean step (tpot_ratio,
tpot_mean_ratio: under a duty cycle only the mean counts the steps beside the working prefill as often as they
come); the prompt's TTFT against the solo TTFT;
decode tokens/s against the bound measured in the same run — the routed-expert bytes a step of n reads ÷ the read
roof, and while a prompt streams through the GPU, ÷ the roof less the stream's copy rate (min(cap, pinned H2D
rate)): the stream reads the same DRAM.
`bench.sweep` ({policy key: values}, e.g. {prefill.stream_duty: [1, 0.75, 0.5]}) repeats the scenarios on the engine
replanned at every combination, each record tagged with its point; the plot draws the trade-off of the 1P+nD scenario
(TPOT ratio, TTFT) along the first key that took two values, a curve per setting of the others.
`bench.dual_batch` repeats the nD scenarios (n >= 2) with policy.decode.dual_batch off and on, side by side in one
run: with the overlap, a step is bounded by max(the CPU's expert bytes ÷ the roof, the GPU's time per step), the
GPU's time taken from the run without overlap as its step time less the CPU experts' time (the graphs' native jobs
clock them: GPU runs only).

A scenario's run: hybrid/bench/scenario.py (the CPU-expert calls' spans: step_spans.py); its records:
scenario_records.py.
"""
from __future__ import annotations

import statistics
import sys

from hybrid.bench import sweep
from hybrid.bench.scenario_records import say, scenario_records
from hybrid.bench.records import Record, Records
from hybrid.bench.scenario import Scenario, parse_scenario, run_scenario
from hybrid.config.bench import label, points
from hybrid.errors import ConfigError


def check(b, scenarios: list[Scenario], batch_cap: int, max_batch: int, max_context: int) -> None:
    """The scenarios fit the engine's slots and context (checked before the model is built, and again on the
    engine's plan)."""
    need = max(sc.decodes + sc.prompts for sc in scenarios)
    if need > min(batch_cap, max_batch):
        raise ConfigError(f"bench.scenarios need {need} requests running at once: raise policy.decode.batch_cap "
                          f"(now {batch_cap}) and policy.kv.max_batch (now {max_batch})")
    if any(sc.prompts for sc in scenarios) and b.long_prompt_tokens + 1 > max_context:
        raise ConfigError(f"bench.long_prompt_tokens ({b.long_prompt_tokens}) needs policy.kv.max_context > it "
                          f"(now {max_context})")


def measure(engine, s) -> Records:
    """The scenarios on the engine as built, or at each point of bench.sweep on the engine replanned for it."""
    from hybrid.bench.slo import synthetic_prompts

    b = s.bench
    scenarios = [parse_scenario(n) for n in b.scenarios]
    streams = engine.device.type == "cuda" and engine.placed.loader is not None
    most = max((sc.decodes for sc in scenarios), default=0)
    a = engine.model.args
    d_prompts = synthetic_prompts(a, max(most, 1), b.prompt_tokens, s.seed)
    p_prompt = synthetic_prompts(a, 1, b.long_prompt_tokens, s.seed + 1)[0]
    roof = h2d = 0.0
    records = []
    if b.roof_gb > 0:
        from hybrid.kernels.membw import calibrate

        roof = max(calibrate(b.roof_gb)[1].values())
        records.append(Record("read_roof", roof, "GB/s", extra={"buffer_gb": b.roof_gb}))
    if streams:
        from hybrid.bench.prefill import h2d_rate

        h2d = h2d_rate()
        records.append(Record("h2d_pinned", h2d, "GB/s"))
    plan = engine.plan.params()  # the policy's (a sweep replans the engine)
    for point in points(b.sweep):
        if point:
            print(f"bench=concurrency at {label(point)}", file=sys.stderr)
            engine = sweep.replanned(engine, s, point)
        engine, recs = _at_point(engine, s, point, scenarios, streams, d_prompts, p_prompt, roof, h2d)
        records += recs
    return Records(records, {"plan": plan})


def _at_point(engine, s, point: dict, scenarios: list[Scenario], streams: bool, d_prompts, p_prompt, roof: float,
              h2d: float) -> tuple[object, list[Record]]:
    """The scenarios on the engine as it is, then bench.dual_batch's comparison (which replans it): the engine
    left and the records, each tagged with the sweep's point."""
    from hybrid.bench.slo import bytes_per_decode_step

    b = s.bench
    check(b, scenarios, engine.plan.decode.batch_cap, engine.plan.kv.max_batch, engine.plan.kv.max_context)
    how = ("chunked on the CPU path" if not streams or engine.plan.prefill.slp_cutoff_tokens >= b.long_prompt_tokens
           else "stream-loaded beside decode" if engine.plan.prefill.beside_decode else "stream-loaded, decode held")
    print(f"bench=concurrency: the {b.long_prompt_tokens}-token prompt is {how}", file=sys.stderr)
    for n in sorted({sc.decodes for sc in scenarios} - {0}) or [1]:  # warm-up: allocations, each batch's graphs
        run_scenario(engine, Scenario(f"{n}D", 0, n), d_prompts, p_prompt, 4)
    if any(sc.prompts for sc in scenarios):  # and the long prompt's path (ring, kernels for its row counts)
        run_scenario(engine, Scenario("1P", 1, 0), d_prompts, p_prompt, 0)
    results: dict[str, dict] = {}
    records = []
    for sc in scenarios:
        results[sc.name] = run_scenario(engine, sc, d_prompts, p_prompt, b.new_tokens)
        records += scenario_records(engine, sc, results, roof, h2d, b.long_prompt_tokens, bytes_per_decode_step)
        say(sc, results[sc.name])
    if b.dual_batch:
        engine, dual = _dual_batch(engine, s, point, [sc for sc in scenarios if not sc.prompts and sc.decodes >= 2],
                                   d_prompts, roof, bytes_per_decode_step)
        records += dual
    for r in records:
        r.extra.update(point)
    return engine, records


def _dual_batch(engine, s, point: dict, scenarios: list[Scenario], d_prompts, roof: float,
                step_bytes) -> tuple[object, list[Record]]:
    """The nD scenarios again without and with policy.decode.dual_batch (the rest of the policy at the sweep's
    point), in turn, bench.dual_rounds times (the host's bandwidth drifts: rounds alternate the ways): decode tok/s
    of each way side by side (median over rounds; `vs_no_overlap` the median of each round's ratio), against the
    overlap's bound max(expert bytes ÷ roof, GPU time per step) and the serial bound; and how much of each step the
    CPU waited (`cpu_idle_s`: no CPU-expert call pending). The engine left, and the records."""
    if not scenarios:
        print("bench=concurrency: bench.dual_batch needs an nD scenario with n >= 2", file=sys.stderr)
        return engine, []
    b = s.bench
    runs: dict = {}  # (dual, scenario) -> per round, the scenario's results
    way: dict = {}  # dual -> how it ran, for the records and the log
    staggered: dict = {}  # dual -> whether the plan ran it half a step apart (only under hostfn graphs)
    for _ in range(b.dual_rounds):
        for dual in (False, True):
            engine = sweep.replanned(engine, s, {**point, "decode.dual_batch": dual})
            for n in sorted({sc.decodes for sc in scenarios}):  # warm-up: the micro-batches' graphs
                run_scenario(engine, Scenario(f"{n}D", 0, n), d_prompts, None, 4)
            join = engine.plan.decode.cpu_join  # the hand-off as resolved
            staggered[dual] = dual and engine.plan.decode.dual_stagger
            way[dual] = ("without overlap" if not dual else "two micro-batches in turn"
                         if engine.plan.decode.cuda_graphs == "off" else "overlapped, half a step apart"
                         if engine.plan.decode.dual_stagger else "overlapped in lockstep")
            for sc in scenarios:
                r = run_scenario(engine, sc, d_prompts, None, b.new_tokens)
                runs.setdefault((dual, sc.name), []).append(r)
                idle = f", CPU idle {r['cpu_idle_s'] * 1e3:.2f} ms a step" if "cpu_idle_s" in r else ""
                print(f"    {sc.name} {way[dual]} ({join} join): {r['before_tok_s']:.1f} tok/s{idle}", file=sys.stderr)
    out = []
    for sc in scenarios:
        serial = runs[(False, sc.name)]
        gpus = [r["gpu_s"] for r in serial if r.get("gpu_s") is not None]
        gpu_step = statistics.median(gpus) if gpus else None
        said = []
        for dual in (False, True):
            rs = runs[(dual, sc.name)]
            ratios = [d["before_tok_s"] / o["before_tok_s"] for o, d in zip(serial, rs)]
            tok_s = [r["before_tok_s"] for r in rs]
            idle = [r["cpu_idle_s"] for r in rs if "cpu_idle_s" in r]
            tok = Record("decode_tok_s", statistics.median(tok_s), "tok/s", m=sc.decodes,
                         extra={"scenario": sc.name, "dual_batch": dual, "dual_stagger": staggered[dual],
                                "way": way[dual], "cpu_join": join, "rounds": len(rs), "tok_s_by_round": tok_s,
                                "vs_no_overlap": statistics.median(ratios)})
            if idle:
                tok.extra["cpu_idle_s"] = statistics.median(idle)
            if roof:
                cpu_step = step_bytes(engine, sc.decodes) / (roof * 1e9)
                tok.extra["cpu_experts_step_s"] = cpu_step
                if gpu_step is not None:
                    tok.extra["gpu_step_s"] = gpu_step
                # with the overlap, the slower side; without, both in turn
                step = max(cpu_step, gpu_step or 0) if dual else cpu_step + (gpu_step or 0)
                tok.bound = sc.decodes / step
            out.append(tok)
            said.append(f"{way[dual]} {tok.value:.1f} tok/s" + (f" ({tok.extra['vs_no_overlap']:.3f}x)" if dual else "")
                        + (f", CPU idle {tok.extra['cpu_idle_s'] * 1e3:.2f} ms a step" if idle else ""))
        print(f"  {sc.name} (CPU experts joined by {join}; medians of {b.dual_rounds} rounds): " + "; ".join(said),
              file=sys.stderr)
    return engine, out



def run(s) -> Records:
    from hybrid.engine.build import build

    scenarios = [parse_scenario(name) for name in s.bench.scenarios]
    sweep.check(s.bench.sweep)
    for point in points(s.bench.sweep):  # each point's slots and context, before the model is built
        p = sweep.at(s, point).policy
        check(s.bench, scenarios, p.decode.batch_cap, p.kv.max_batch, p.kv.max_context)
    return measure(build(s, s.hw, progress=False), s)
