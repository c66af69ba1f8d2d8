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
rate)): the stream reads the same DRAM. `bench.stream_duties` repeats 1P+1D with the prompt beside decode at each
duty cycle (the trade-off curve: duty → TPOT ratio, TTFT; plotted beside the JSON), `bench.stream_caps` at each
cap; `bench.beside_cores` and
`bench.attention_chunks`, `bench.stream_queues`, `bench.mapped_outputs`, `bench.beside_sms`, `bench.cores_back`
likewise at each policy.prefill.beside_cores, attention_chunk_tokens, stream_queue_mb, policy.decode.mapped_outputs,
policy.prefill.beside_sms and cores_back_in_rests; given together, at every combination (one rebuild each, a curve
per setting of the others in the plot).
`bench.dual_batch` repeats the nD scenarios (n >= 2) with policy.decode.dual_batch flipped, side by side in one
run: with the overlap, a step is bounded by max(the CPU's expert bytes ÷ the roof, the GPU's time per step), the
GPU's time taken from the run without overlap as its step time less the CPU experts' time (the graphs' native jobs
clock them: GPU runs only).
"""
from __future__ import annotations

import itertools
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

from hybrid.bench import bounds
from hybrid.bench.records import Record, Records
from hybrid.config.schema import scenario_counts
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
    room = engine.plan.max_context
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
    p = engine.plan
    if not h2d or not p.prefill_beside_decode or prompt_tokens <= p.slp_cutoff_tokens:
        return 0.0
    return min(h2d, p.stream_cap_bytes_s / 1e9) if p.stream_cap_bytes_s else h2d


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
    from hybrid.bench.slo import bytes_per_decode_step, synthetic_prompts

    b = s.bench
    scenarios = [parse_scenario(n) for n in b.scenarios]
    streams = engine.device.type == "cuda" and engine.placed.loader is not None
    most = max((sc.decodes for sc in scenarios), default=0)
    check(b, scenarios, engine.plan.batch_cap, engine.plan.max_batch, engine.plan.max_context)
    streamed = streams and engine.plan.slp_cutoff_tokens < b.long_prompt_tokens
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
    how = ("chunked on the CPU path" if not streams or engine.plan.slp_cutoff_tokens >= b.long_prompt_tokens
           else "stream-loaded beside decode" if engine.plan.prefill_beside_decode else "stream-loaded, decode held")
    print(f"bench=concurrency: the {b.long_prompt_tokens}-token prompt is {how}", file=sys.stderr)
    for n in sorted({sc.decodes for sc in scenarios} - {0}) or [1]:  # warm-up: allocations, each batch's graphs
        _run_scenario(engine, Scenario(f"{n}D", 0, n), d_prompts, p_prompt, 4)
    if any(sc.prompts for sc in scenarios):  # and the long prompt's path (ring, kernels for its row counts)
        _run_scenario(engine, Scenario("1P", 1, 0), d_prompts, p_prompt, 0)
    plan = engine.plan.params()  # the scenarios' (the caps below rebuild the engine)
    results: dict[str, dict] = {}
    for sc in scenarios:
        results[sc.name] = _run_scenario(engine, sc, d_prompts, p_prompt, b.new_tokens)
        records += _records(engine, sc, results, roof, h2d, b.long_prompt_tokens, bytes_per_decode_step)
        _say(sc, results[sc.name])
    grid = _grid(b)
    if grid and not streamed:
        swept = ", bench.".join(key for _, _, key, _ in SWEEPS if getattr(b, key))
        print(f"bench=concurrency: the long prompt is not stream-loaded here (that needs a GPU and a prompt over "
              f"policy.prefill.slp_cutoff_tokens): bench.{swept} skipped", file=sys.stderr)
        grid = []
    for point in grid:
        engine, recs = _again(engine, s, point, d_prompts, p_prompt, results, roof, h2d)
        records += recs
    if b.dual_batch:
        records += _dual_batch(engine, s, [sc for sc in scenarios if not sc.prompts and sc.decodes >= 2], results,
                               d_prompts, roof, bytes_per_decode_step)
    return Records(records, {"plan": plan})


# the sweeps of 1P+1D beside decode: label, policy knob (policy.prefill's unless named group.knob), bench key, and the
# plot's axis for it
SWEEPS = (("duty", "stream_duty", "stream_duties", "prefill's share of the time while decoding"),
          ("cap", "stream_cap_gbps", "stream_caps", "stream cap while decoding (GB/s)"),
          ("cores", "beside_cores", "beside_cores", "CPU cores left to the prefill"),
          ("chunks", "attention_chunk_tokens", "attention_chunks", "prefill attention query chunk (tokens)"),
          ("queue", "stream_queue_mb", "stream_queues", "stream copies queued on the GPU (MB)"),
          ("mapped", "decode.mapped_outputs", "mapped_outputs", "CPU experts' outputs read in place"),
          ("sms", "beside_sms", "beside_sms", "SMs left to decode (the prefill in a green context)"),
          ("back", "cores_back_in_rests", "cores_back", "decode takes the prefill's cores in its rests"))


def _grid(b) -> list[dict]:
    """Every combination of the sweeps' values (a sweep left empty keeps the policy's value): [{knob: value}]."""
    swept = [(knob, list(getattr(b, key))) for _, knob, key, _ in SWEEPS if getattr(b, key)]
    if not swept:
        return []
    return [dict(zip([k for k, _ in swept], values)) for values in itertools.product(*[v for _, v in swept])]


def _policy_value(knob: str, v):
    """A sweep's value as the policy takes it: a stream cap of 0 and a duty of 1 are none."""
    if knob == "stream_cap_gbps":
        return v or None
    if knob == "stream_duty":
        return None if v == 1 else v
    return v


def _again(engine, s, point: dict, d_prompts, p_prompt, results: dict, roof: float, h2d: float):
    """1P+1D once more, the prompt beside decode with policy.prefill.<knob> = value for each of `point` (the rest
    of the policy as the run's; a stream cap of 0 is none): the rebuilt engine and the scenario's records, each
    tagged with the point's knobs."""
    from hybrid.bench.slo import bytes_per_decode_step
    from hybrid.engine.build import rebuild

    groups: dict = {"prefill": {"beside_decode": True}}
    for knob, v in point.items():
        group, _, name = knob.rpartition(".")
        groups.setdefault(group or "prefill", {})[name] = _policy_value(knob, v)
    p = replace(s.policy, **{g: replace(getattr(s.policy, g), **kv) for g, kv in groups.items()})
    engine = rebuild(engine, replace(s, policy=p), s.hw)
    label = " ".join(f"{name} {'none' if _policy_value(knob, point[knob]) is None else point[knob]}"
                     for name, knob, _, _ in SWEEPS if knob in point)
    sc = Scenario(f"1P+1D {label}", 1, 1)
    results[sc.name] = r = _run_scenario(engine, sc, d_prompts, p_prompt, s.bench.new_tokens)
    recs = _records(engine, sc, results, roof, h2d, s.bench.long_prompt_tokens, bytes_per_decode_step)
    for rec in recs:
        rec.extra.update(point)
    _say(sc, r)
    return engine, recs


def _dual_batch(engine, s, scenarios: list[Scenario], results: dict, d_prompts, roof: float, step_bytes) -> list:
    """The nD scenarios again without and with policy.decode.dual_batch (at each of bench.dual_staggers: half a
    step apart or in lockstep; none: the policy's), in turn, bench.dual_rounds times (the host's bandwidth drifts:
    rounds alternate the ways), at each of bench.cpu_joins (none: the policy's): decode tok/s of each way side by
    side (median over rounds; `vs_no_overlap` the median of each round's ratio), against the overlap's bound
    max(expert bytes ÷ roof, GPU time per step) and the serial bound; and how much of each step the CPU waited
    (`cpu_idle_s`: no CPU-expert call pending)."""
    from hybrid.engine.build import rebuild

    if not scenarios:
        print("bench=concurrency: bench.dual_batch needs an nD scenario with n >= 2", file=sys.stderr)
        return []
    b = s.bench
    joins = list(b.cpu_joins) or [s.policy.decode.cpu_join]
    ways = [(False, s.policy.decode.dual_stagger)] + [(True, st) for st in
                                                        (list(b.dual_staggers) or [s.policy.decode.dual_stagger])]
    runs: dict = {}  # (join, way, scenario) -> per round, the scenario's results
    labels: dict = {}  # join or way -> how it resolved, for the records and the log
    staggered: dict = {}  # way -> whether the plan ran it half a step apart (only under hostfn graphs)
    for _ in range(b.dual_rounds):
        for join in joins:
            for way in ways:
                dual, stagger = way
                p = replace(s.policy, decode=replace(s.policy.decode, dual_batch=dual, dual_stagger=stagger,
                                                     cpu_join=join))
                engine = rebuild(engine, replace(s, policy=p), s.hw)
                for n in sorted({sc.decodes for sc in scenarios}):  # warm-up: the micro-batches' graphs
                    _run_scenario(engine, Scenario(f"{n}D", 0, n), d_prompts, None, 4)
                labels[join] = join or engine.plan.cpu_join  # null: what it resolved to
                staggered[way] = dual and engine.plan.dual_stagger
                labels[way] = ("without overlap" if not dual else "two micro-batches in turn"
                               if engine.plan.cuda_graphs == "off" else "overlapped, half a step apart"
                               if engine.plan.dual_stagger else "overlapped in lockstep")
                for sc in scenarios:
                    r = _run_scenario(engine, sc, d_prompts, None, b.new_tokens)
                    runs.setdefault((join, way, sc.name), []).append(r)
                    idle = f", CPU idle {r['cpu_idle_s'] * 1e3:.2f} ms a step" if "cpu_idle_s" in r else ""
                    print(f"    {sc.name} {labels[way]} ({labels[join]} join): {r['before_tok_s']:.1f} tok/s{idle}",
                          file=sys.stderr)
    out = []
    for join in joins:
        for sc in scenarios:
            serial = runs[(join, ways[0], sc.name)]
            gpus = [r["gpu_s"] for r in serial if r.get("gpu_s") is not None]
            gpu_step = statistics.median(gpus) if gpus else None
            said = []
            for way in ways:
                rs = runs[(join, way, sc.name)]
                dual = way[0]
                ratios = [d["before_tok_s"] / o["before_tok_s"] for o, d in zip(serial, rs)]
                tok_s = [r["before_tok_s"] for r in rs]
                idle = [r["cpu_idle_s"] for r in rs if "cpu_idle_s" in r]
                tok = Record("decode_tok_s", statistics.median(tok_s), "tok/s", m=sc.decodes,
                             extra={"scenario": sc.name, "dual_batch": dual, "dual_stagger": staggered[way],
                                    "way": labels[way], "cpu_join": labels[join], "rounds": len(rs),
                                    "tok_s_by_round": tok_s, "vs_no_overlap": statistics.median(ratios)})
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
                said.append(f"{labels[way]} {tok.value:.1f} tok/s"
                            + (f" ({tok.extra['vs_no_overlap']:.3f}x)" if dual else "")
                            + (f", CPU idle {tok.extra['cpu_idle_s'] * 1e3:.2f} ms a step" if idle else ""))
            print(f"  {sc.name} (CPU experts joined by {labels[join]}; medians of {b.dual_rounds} rounds): "
                  + "; ".join(said), file=sys.stderr)
    return out


def _records(engine, sc: Scenario, results: dict, roof: float, h2d: float, prompt_tokens: int,
             step_bytes) -> list[Record]:
    r, n = results[sc.name], sc.decodes
    common = {"scenario": sc.name, "beside_decode": engine.plan.prefill_beside_decode}
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

    p = s.policy
    check(s.bench, [parse_scenario(name) for name in s.bench.scenarios], p.decode.batch_cap, p.kv.max_batch,
          p.kv.max_context)
    return measure(build(s, s.hw, progress=False), s)


def plot(records: list[Record], png: Path) -> Optional[Path]:
    """The trade-off curves of the 1P+1D sweeps: the first swept knob (in SWEEPS' order) that took two or more
    values -> the decode's TPOT ratio and the prompt's TTFT, a curve per setting of the other sweeps; each run a
    point, the curve through the medians of a setting's repeats. And bench.dual_batch's nD runs: tok/s by way of
    decoding (no overlap, lockstep, half a step apart) against each one's bound, every round a dot."""
    runs = [r for r in records if r.name in ("tpot_ratio", "tpot_mean_ratio", "ttft_s")
            and any(k in r.extra for _, k, _, _ in SWEEPS)]
    values = {k: {r.extra[k] for r in runs if k in r.extra} for _, k, _, _ in SWEEPS}
    axis = next((sw for sw in SWEEPS if len(values[sw[1]]) > 1), None) or next(
        (sw for sw in SWEEPS if values[sw[1]]), None)
    dual = [r for r in records if r.name == "decode_tok_s" and "way" in r.extra]
    if axis is None and not dual:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (2 if axis else 0) + (1 if dual else 0)
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 4), squeeze=False)
    if axis:
        _sweep_panels(axes[0][0], axes[0][1], runs, values, axis)
    if dual:
        _dual_panel(axes[0][-1], dual)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png


def _dual_panel(ax, recs: list[Record]) -> None:
    """Grouped bars: per nD scenario, each way's median tok/s, its rounds as dots, its bound as a dash."""
    scenarios = sorted({r.extra["scenario"] for r in recs}, key=lambda n: parse_scenario(n).decodes)
    ways = list(dict.fromkeys(r.extra["way"] for r in recs))
    width = 0.8 / len(ways)
    for j, way in enumerate(ways):
        for i, sc in enumerate(scenarios):
            r = next((r for r in recs if r.extra["scenario"] == sc and r.extra["way"] == way), None)
            if r is None:
                continue
            x = i + (j - (len(ways) - 1) / 2) * width
            ax.bar(x, r.value, width * 0.9, color=f"C{j}", label=way if i == 0 else None)
            rounds = r.extra.get("tok_s_by_round", [])
            ax.scatter([x] * len(rounds), rounds, color="black", s=8, zorder=3)
            if r.bound:
                ax.hlines(r.bound, x - width * 0.45, x + width * 0.45, color="gray", linestyle="--")
    ax.set_xticks(range(len(scenarios)), scenarios)
    ax.set(ylabel="decode tok/s (dash: bound, dots: rounds)", title="nD: dual-batch overlap")
    ax.legend(fontsize=8)


def _sweep_panels(ax, ax2, runs: list[Record], values: dict, axis) -> None:
    """The 1P+1D sweep's two panels: the decode's TPOT ratio and the prompt's TTFT by the swept knob."""
    _, knob, _, xlabel = axis
    points: dict = {}  # other settings -> x -> metric -> [values]
    for r in runs:
        if knob in r.extra:
            other = tuple((name, r.extra[k]) for name, k, _, _ in SWEEPS if k != knob and k in r.extra)
            points.setdefault(other, {}).setdefault(r.extra[knob], {}).setdefault(r.name, []).append(r.value)
    import matplotlib.ticker

    cap = knob == "stream_cap_gbps"  # 0 is none: drawn last
    order = lambda v: (float("inf") if cap and not v else float(v))  # noqa: E731
    xs = sorted(values[knob], key=order)
    at = {v: i for i, v in enumerate(xs)}
    for i, (other, pts) in enumerate(sorted(points.items(), key=lambda kv: str(kv[0]))):
        name = ", ".join(f"{n} {v}" for n, v in other) or "the policy's"
        for a, metric, marker, style in ((ax, "tpot_ratio", "o", "-"), (ax, "tpot_mean_ratio", "^", ":"),
                                         (ax2, "ttft_s", "s", "-")):
            line = [(at[v], statistics.median(m[metric])) for v, m in sorted(pts.items(), key=lambda kv: order(
                kv[0])) if metric in m]
            if line:
                a.plot(*zip(*line), marker=marker, linestyle=style, color=f"C{i}",
                       label=f"{name} (mean step)" if metric == "tpot_mean_ratio" else name)
            dots = [(at[v], y) for v, m in pts.items() for y in m.get(metric, [])]
            if len(dots) > len(line):  # repeats: every run shown
                a.scatter(*zip(*dots), color=f"C{i}", alpha=0.35, s=14)
    ax.axhline(1.15, linestyle="--", color="gray", alpha=0.6, label="1.15x")
    # log: an uncapped stream can hold decode 20x, a capped one 1.1-1.3x; both readable on one axis
    ax.set_yscale("log")
    lo, hi = ax.get_ylim()
    fmt = "%.3f" if hi / lo < 1.2 else "%.2f"  # a narrow range's ticks a hundredth apart would read alike
    for axis_ticks in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
        axis_ticks(matplotlib.ticker.FormatStrFormatter(fmt))
    for a in (ax, ax2):
        a.set_xticks(range(len(xs)), ["none" if cap and not v else f"{v:g}" if isinstance(v, float) else str(v)
                                      for v in xs])
        a.set_xlabel(xlabel)
        a.legend(fontsize=8)
    ax.set(ylabel="decode TPOT during ÷ before (log; median step, dotted: mean)",
           title="1P+1D: decode beside the prefill")
    ax2.set(ylabel="TTFT (s)", title="1P+1D: the long prompt's TTFT")
