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
"""
from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass
from typing import Optional

from hybrid.bench import bounds, sweep
from hybrid.bench.records import Record, Records
from hybrid.config.bench import label, points, scenario_counts
from hybrid.errors import ConfigError


@dataclass(frozen=True)
class Scenario:
    name: str
    prompts: int  # long prompts (0 or 1)
    decodes: int  # requests decoding


def parse_scenario(name: str) -> Scenario:
    """'2D', '1P', '1P+2D' -> Scenario; anything else is a ConfigError naming the form (scenario_counts)."""
    return Scenario(name, *scenario_counts(name))


class _Driver:
    """Steps the engine and notes when each request's tokens arrive."""

    def __init__(self, engine):
        self.engine, self.times, self.errors = engine, {}, []

    def add(self, prompt: list[int], max_tokens: int) -> int:
        from hybrid.engine.requests import SamplingParams

        rid = self.engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        self.times[rid] = []
        return rid

    def step(self) -> None:
        for out in self.engine.step():
            now = time.perf_counter()
            self.times.setdefault(out.id, []).extend([now] * len(out.new_token_ids))
            if out.finish_reason is not None and out.error:
                self.errors.append(out.error)
        if self.errors:
            raise RuntimeError(f"bench=concurrency: a request failed: {self.errors[0]}")

    def until(self, done, what: str, limit_s: float = 3600.0) -> None:
        t0 = time.perf_counter()
        while not done():
            if not self.engine.has_work() or time.perf_counter() - t0 > limit_s:
                raise RuntimeError(f"bench=concurrency: gave up waiting for {what}")
            self.step()

    def steps(self, n: int) -> None:
        for _ in range(n):
            self.step()

    def drain(self, rids) -> None:
        for rid in rids:
            self.engine.abort(rid)
        while self.engine.has_work():
            self.engine.step()


def _intervals(times: list[float], start: float, end: float) -> list[float]:
    """Gaps between consecutive tokens that overlap [start, end] (a step spanning the window counts whole)."""
    return [b - a for a, b in zip(times, times[1:]) if b > start and a < end]


def _cpu_experts_s(engine) -> Optional[float]:
    """The CPU experts' time so far in graphed decode steps (their native jobs' own clocks); None when eager."""
    graphs = engine.graphs
    return None if graphs is None else sum(job.cpu_s for job in graphs.jobs())


def _cpu_spans(engine, tracing: bool) -> dict[int, list[tuple[int, int]]]:
    """The graphed decode steps' CPU-expert calls since the last take, by job (id), each (submit, complete) in
    time.monotonic_ns() (their native jobs' notes); from now on noted while `tracing`. Taken only while no call
    runs (the workers write the notes)."""
    graphs = engine.graphs
    spans = {}
    for job in graphs.jobs() if graphs is not None else []:
        spans[id(job)] = job.take_spans()
        job.tracing = tracing
    return spans


def _layer_spans(engine, spans: dict[int, list[tuple[int, int]]]) -> list[list[tuple[int, int]]]:
    """The single-batch steps' calls by MoE layer (lane 0's graphs), from _cpu_spans' notes."""
    graphs = engine.graphs
    layers = graphs.layer_jobs() if graphs is not None else []
    return [[span for job in jobs for span in spans.get(id(job), [])] for jobs in layers]


def step_parts(layers: list[list[tuple[int, int]]], start: int, end: int) -> Optional[dict[str, float]]:
    """Where the decode steps within [start, end) spent their time, from their CPU-expert calls by MoE layer (one
    request decoding: the steps one after the other): per step, in the spans' unit, `cpu_experts` (the calls,
    submit to complete), `between_layers` (from a call's end to the next layer's submit: the GPU's work in
    between, inside the step's graph) and `between_steps` (from a step's last call to the next step's first: the
    host's end and start of a step, and the GPU's work after the last call and before the first). Means over the
    whole steps in the window that another step follows there; None without one."""
    calls = sorted((s, e, layer) for layer, spans in enumerate(layers) for s, e in spans if start <= s and e <= end)
    steps, step = [], []
    for call in calls:
        if call[2] == 0 and step:  # the first MoE layer's call opens a step
            steps.append(step)
            step = []
        step.append(call)
    if step:
        steps.append(step)
    order = list(range(len(layers)))  # a whole step: every layer's call once, in order
    pairs = [(a, b) for a, b in zip(steps, steps[1:]) if [c[2] for c in a] == order]
    if not pairs:
        return None
    return {"cpu_experts": statistics.fmean(sum(e - s for s, e, _ in st) for st, _ in pairs),
            "between_layers": statistics.fmean(sum(b[0] - a[1] for a, b in zip(st, st[1:])) for st, _ in pairs),
            "between_steps": statistics.fmean(nxt[0][0] - st[-1][1] for st, nxt in pairs)}


def cpu_busy(spans: list[tuple[int, int]], start: int, end: int) -> float:
    """The time within [start, end) when at least one CPU-expert call was pending (submitted, not complete), in
    the spans' unit: what the CPU had to do; the rest of the window it waited for the GPU or the host."""
    busy, reach = 0, start
    for s, e in sorted(spans):
        s, e = max(s, reach), min(e, end)
        if e > s:
            busy += e - s
            reach = e
    return busy


def _run_scenario(engine, sc: Scenario, d_prompts, p_prompt, new_tokens: int) -> dict:
    drv = _Driver(engine)
    room = engine.plan.kv.max_context
    ds = [drv.add(p, room - len(p)) for p in d_prompts[:sc.decodes]]
    out: dict = {}
    if ds:
        drv.until(lambda: all(len(drv.times[r]) >= 2 for r in ds), "the decodes' first tokens")
        _cpu_spans(engine, True)
        cpu0, t0, ns0 = _cpu_experts_s(engine), time.perf_counter(), time.monotonic_ns()
        drv.steps(new_tokens)
        t1, cpu1, ns1 = time.perf_counter(), _cpu_experts_s(engine), time.monotonic_ns()
        ns_of = lambda t: ns1 + round((t - t1) * 1e9)  # noqa: E731 - a perf_counter time on the spans' clock
        out["before"] = [g for r in ds for g in _intervals(drv.times[r], t0, t1)]
        if cpu0 is not None:  # the CPU experts' share of a step, and the GPU's: what they leave of it
            out["cpu_s"] = (cpu1 - cpu0) / new_tokens
            if not sc.prompts:
                out["gpu_s"] = ((t1 - t0) - (cpu1 - cpu0)) / new_tokens
        out["before_tok_s"] = sum(t0 < t <= t1 for r in ds for t in drv.times[r]) / (t1 - t0)
    if sc.prompts:
        p = drv.add(p_prompt, 1)
        t_arrive, cpu0, steps0 = time.perf_counter(), _cpu_experts_s(engine), len(drv.times[ds[0]]) if ds else 0
        drv.until(lambda: bool(drv.times[p]), "the long prompt's first token")
        t_first, cpu1 = drv.times[p][0], _cpu_experts_s(engine)
        out["ttft"] = t_first - t_arrive
        if ds:
            out["during"] = [g for r in ds for g in _intervals(drv.times[r], t_arrive, t_first)]
            if cpu0 is not None and len(drv.times[ds[0]]) > steps0:  # decode's CPU experts per step meanwhile
                out["during_cpu_s"] = (cpu1 - cpu0) / (len(drv.times[ds[0]]) - steps0)
            out["during_tok_s"] = sum(t_arrive < t <= t_first for r in ds for t in drv.times[r]) / out["ttft"]
    drv.drain(ds)
    if ds:  # the spans taken once nothing runs (a step launched ahead notes its calls until collected)
        by_job = _cpu_spans(engine, False)
        spans = [span for job_spans in by_job.values() for span in job_spans]
        if spans:  # the CPU's share of the timed steps, and what it waited per step
            busy = cpu_busy(spans, ns0, ns1)
            out["cpu_busy"], out["cpu_idle_s"] = busy / (ns1 - ns0), (ns1 - ns0 - busy) * 1e-9 / new_tokens
        if sc.decodes == 1 and spans:  # one request: its steps one after the other, split by their calls
            layers = _layer_spans(engine, by_job)
            windows = {"before": (ns0, ns1)}
            if out.get("during"):
                windows["during"] = (ns_of(t_arrive), ns_of(t_first))
            for name, (a, b) in windows.items():
                parts = step_parts(layers, a, b)
                if parts:
                    out[f"{name}_parts"] = {k: v * 1e-9 for k, v in parts.items()}
    return out


def _stream_gbs(engine, h2d: float, prompt_tokens: int) -> float:
    """The copy rate a prompt's stream-loading prefill beside decode takes from the host's DRAM while requests
    decode: min(cap, H2D rate); 0 when it is not stream-loaded beside decode (held: decode waits; chunked: no
    stream)."""
    p = engine.plan.prefill
    if not h2d or not p.beside_decode or prompt_tokens <= p.slp_cutoff_tokens:
        return 0.0
    return min(h2d, p.stream_cap_gbps) if p.stream_cap_gbps else h2d


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
        _run_scenario(engine, Scenario(f"{n}D", 0, n), d_prompts, p_prompt, 4)
    if any(sc.prompts for sc in scenarios):  # and the long prompt's path (ring, kernels for its row counts)
        _run_scenario(engine, Scenario("1P", 1, 0), d_prompts, p_prompt, 0)
    results: dict[str, dict] = {}
    records = []
    for sc in scenarios:
        results[sc.name] = _run_scenario(engine, sc, d_prompts, p_prompt, b.new_tokens)
        records += _records(engine, sc, results, roof, h2d, b.long_prompt_tokens, bytes_per_decode_step)
        _say(sc, results[sc.name])
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
                _run_scenario(engine, Scenario(f"{n}D", 0, n), d_prompts, None, 4)
            join = engine.plan.decode.cpu_join  # the hand-off as resolved
            staggered[dual] = dual and engine.plan.decode.dual_stagger
            way[dual] = ("without overlap" if not dual else "two micro-batches in turn"
                         if engine.plan.decode.cuda_graphs == "off" else "overlapped, half a step apart"
                         if engine.plan.decode.dual_stagger else "overlapped in lockstep")
            for sc in scenarios:
                r = _run_scenario(engine, sc, d_prompts, None, b.new_tokens)
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


def _records(engine, sc: Scenario, results: dict, roof: float, h2d: float, prompt_tokens: int,
             step_bytes) -> list[Record]:
    r, n = results[sc.name], sc.decodes
    common = {"scenario": sc.name, "beside_decode": engine.plan.prefill.beside_decode}
    out = []
    if "before" in r and r["before"]:
        tpot = statistics.median(r["before"])
        extra = dict(common)
        if "cpu_s" in r:
            extra["cpu_experts_step_s"] = r["cpu_s"]
        if "before_parts" in r:
            extra["step_parts_s"] = r["before_parts"]
        solo = results.get("1D", {}).get("before")
        if solo and n > 1:
            extra["vs_1D"] = tpot / statistics.median(solo)
        out.append(Record("tpot_s", tpot, "s", m=n, extra=extra))
        tok = Record("decode_tok_s", r["before_tok_s"], "tok/s", m=n, extra=dict(common))
        if roof:
            tok.bound = bounds.decode_tok_s_bound(step_bytes(engine, n), roof, n)
        out.append(tok)
    if "ttft" in r:
        extra = dict(common)
        solo = results.get("1P", {}).get("ttft")
        if solo and n:
            extra["vs_1P"] = r["ttft"] / solo
        out.append(Record("ttft_s", r["ttft"], "s", m=n, extra=extra))
    if r.get("during"):
        during, before = statistics.median(r["during"]), statistics.median(r["before"])
        extra = {**common, "worst_step_s": max(r["during"]), "steps": len(r["during"])}
        if "during_cpu_s" in r:  # the CPU experts' time of a step meanwhile (mean; the tpot_s record's before)
            extra["cpu_experts_step_s"] = r["during_cpu_s"]
        if "during_parts" in r:
            extra["step_parts_s"] = r["during_parts"]
        out.append(Record("tpot_during_prefill_s", during, "s", m=n, extra=extra))
        ratio = Record("tpot_ratio", during / before, "x", m=n,
                       extra={**common, "worst_step_ratio": max(r["during"]) / before})
        # every step counted: under a duty cycle the steps while the prefill rests are decode's own, and a median
        # of the mixture would hide the others
        mean = Record("tpot_mean_ratio", statistics.fmean(r["during"]) / statistics.fmean(r["before"]), "x", m=n,
                      extra=dict(common))
        solo = results.get(f"{n}D", {}).get("before")  # the same decodes alone, in their own scenario
        if solo:
            ratio.extra["vs_solo"] = during / statistics.median(solo)
            mean.extra["vs_solo"] = statistics.fmean(r["during"]) / statistics.fmean(solo)
        out += [ratio, mean]
        tok = Record("decode_tok_s_during_prefill", r["during_tok_s"], "tok/s", m=n, extra=dict(common))
        stream = _stream_gbs(engine, h2d, prompt_tokens)
        if roof and roof > stream:
            tok.bound = bounds.decode_tok_s_bound(step_bytes(engine, n), roof - stream, n)
            tok.extra["roof_less_stream_gbs"] = roof - stream
        out.append(tok)
    return out


def _say(sc: Scenario, r: dict) -> None:
    parts = []
    if r.get("before"):
        parts.append(f"TPOT {statistics.median(r['before']) * 1e3:.1f} ms")
    if "ttft" in r:
        parts.append(f"TTFT {r['ttft']:.3f} s")
    if r.get("during"):
        parts.append(f"TPOT during the prefill {statistics.median(r['during']) * 1e3:.1f} ms "
                     f"(mean {statistics.fmean(r['during']) * 1e3:.1f} against "
                     f"{statistics.fmean(r['before']) * 1e3:.1f} before, worst step {max(r['during']) * 1e3:.0f} ms)")
    for when in ("before", "during"):  # a step's mean by part, from its CPU-expert calls
        if f"{when}_parts" in r:
            p = r[f"{when}_parts"]
            parts.append(f"{when}: CPU experts {p['cpu_experts'] * 1e3:.1f} ms + between layers "
                         f"{p['between_layers'] * 1e3:.1f} + between steps {p['between_steps'] * 1e3:.1f} a step")
    print(f"  {sc.name}: " + ", ".join(parts), file=sys.stderr)


def run(s) -> Records:
    from hybrid.engine.build import build

    scenarios = [parse_scenario(name) for name in s.bench.scenarios]
    sweep.check(s.bench.sweep)
    for point in points(s.bench.sweep):  # each point's slots and context, before the model is built
        p = sweep.at(s, point).policy
        check(s.bench, scenarios, p.decode.batch_cap, p.kv.max_batch, p.kv.max_context)
    return measure(build(s, s.hw, progress=False), s)
