"""bench=concurrency's records of a scenario's run: TPOT before and during the long prompt's prefill and their
ratios, its TTFT against the solo one, decode tokens/s against the bound (the roof less the prefill's stream); and
the line each scenario prints.
"""
from __future__ import annotations

import statistics
import sys

from hybrid.bench import bounds
from hybrid.bench.records import Record
from hybrid.bench.scenario import Scenario


def _stream_gbs(engine, h2d: float, prompt_tokens: int) -> float:
    """The copy rate a prompt's stream-loading prefill beside decode takes from the host's DRAM while requests
    decode: min(cap, H2D rate); 0 when it is not stream-loaded beside decode (held: decode waits; chunked: no
    stream)."""
    p = engine.plan.prefill
    if not h2d or not p.beside_decode or prompt_tokens <= p.slp_cutoff_tokens:
        return 0.0
    return min(h2d, p.stream_cap_gbps) if p.stream_cap_gbps else h2d


def scenario_records(engine, sc: Scenario, results: dict, roof: float, h2d: float, prompt_tokens: int,
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


def say(sc: Scenario, r: dict) -> None:
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
