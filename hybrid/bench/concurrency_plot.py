"""bench=concurrency's plot (a PNG beside the JSON): the trade-off a sweep (bench.sweep) traces for the prompt
beside decode, and bench.dual_batch's ways of decoding side by side."""
from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, Optional

from hybrid.bench.scenario import parse_scenario
from hybrid.bench.records import Record
from hybrid.config.bench import label, policy_keys

BESIDE = ("tpot_ratio", "tpot_mean_ratio", "ttft_s")  # the prompt beside decode: the records a sweep's curve draws


def plot(records: list[Record], png: Path) -> Optional[Path]:
    """The sweep's trade-off in the 1P+nD scenario of fewest decodes: along the first policy key that took two or
    more values, the decode's TPOT ratio and the prompt's TTFT, a curve per setting of the other keys; each run a
    point, the curve through the medians of a setting's repeats. And bench.dual_batch's nD runs: tok/s by way of
    decoding (no overlap, lockstep, half a step apart) against each one's bound, every round a dot. None when the
    run has neither."""
    beside = [r for r in records if r.name in BESIDE and _point(r) and _beside_decode(r.extra.get("scenario"))]
    scenario = min({r.extra["scenario"] for r in beside}, key=lambda n: parse_scenario(n).decodes, default=None)
    runs = [r for r in beside if r.extra["scenario"] == scenario]
    keys = list(dict.fromkeys(k for r in runs for k in _point(r)))
    values = {k: {r.extra[k] for r in runs if k in r.extra} for k in keys}
    axis = next((k for k in keys if len(values[k]) > 1), keys[0] if keys else None)
    dual = [r for r in records if r.name == "decode_tok_s" and "way" in r.extra]
    if axis is None and not dual:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (2 if axis else 0) + (1 if dual else 0)
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 4), squeeze=False)
    if axis:
        _sweep_panels(axes[0][0], axes[0][1], runs, sorted(values[axis], key=_order), axis, scenario)
    if dual:
        _dual_panel(axes[0][-1], dual)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png


def _point(r: Record) -> dict[str, Any]:
    """The sweep's point a record was measured at (its policy keys)."""
    keys = set(policy_keys())
    return {k: v for k, v in r.extra.items() if k in keys}


def _beside_decode(scenario: Optional[str]) -> bool:
    """A scenario with the long prompt arriving while requests decode (1P+nD)."""
    sc = parse_scenario(scenario) if scenario else None
    return bool(sc and sc.prompts and sc.decodes)


def _order(v) -> tuple:
    """Numbers in order, other values by name, null (none) last."""
    number = isinstance(v, (int, float))
    return v is None, not number, v if number else str(v)


def _tick(v) -> str:
    return "none" if v is None else f"{v:g}" if isinstance(v, float) else str(v)


def _dual_panel(ax, recs: list[Record]) -> None:
    """Grouped bars: per nD scenario, each way's median tok/s (at each point of a sweep), its rounds as dots, its
    bound as a dash."""
    def way(r: Record) -> str:
        return r.extra["way"] + (f" ({label(_point(r))})" if _point(r) else "")

    scenarios = sorted({r.extra["scenario"] for r in recs}, key=lambda n: parse_scenario(n).decodes)
    ways = list(dict.fromkeys(way(r) for r in recs))
    width = 0.8 / len(ways)
    for j, name in enumerate(ways):
        for i, sc in enumerate(scenarios):
            r = next((r for r in recs if r.extra["scenario"] == sc and way(r) == name), None)
            if r is None:
                continue
            x = i + (j - (len(ways) - 1) / 2) * width
            ax.bar(x, r.value, width * 0.9, color=f"C{j}", label=name if i == 0 else None)
            rounds = r.extra.get("tok_s_by_round", [])
            ax.scatter([x] * len(rounds), rounds, color="black", s=8, zorder=3)
            if r.bound:
                ax.hlines(r.bound, x - width * 0.45, x + width * 0.45, color="gray", linestyle="--")
    ax.set_xticks(range(len(scenarios)), scenarios)
    ax.set(ylabel="decode tok/s (dash: bound, dots: rounds)", title="nD: dual-batch overlap")
    ax.legend(fontsize=8)


def _sweep_panels(ax, ax2, runs: list[Record], xs: list, axis: str, scenario: str) -> None:
    """The sweep's two panels: the decode's TPOT ratio and the prompt's TTFT along the `axis` key."""
    points: dict = {}  # the other keys' settings -> x -> metric -> [values]
    for r in runs:
        if axis in r.extra:
            other = tuple((k, v) for k, v in _point(r).items() if k != axis)
            points.setdefault(other, {}).setdefault(r.extra[axis], {}).setdefault(r.name, []).append(r.value)
    import matplotlib.ticker

    at = {v: i for i, v in enumerate(xs)}
    for i, (other, pts) in enumerate(sorted(points.items(), key=lambda kv: str(kv[0]))):
        name = label(dict(other)) or "the policy's"
        for a, metric, marker, style in ((ax, "tpot_ratio", "o", "-"), (ax, "tpot_mean_ratio", "^", ":"),
                                         (ax2, "ttft_s", "s", "-")):
            line = [(at[v], statistics.median(m[metric])) for v, m in sorted(pts.items(), key=lambda kv: _order(
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
        a.set_xticks(range(len(xs)), [_tick(v) for v in xs])
        a.set_xlabel(f"policy.{axis}")
        a.legend(fontsize=8)
    ax.set(ylabel="decode TPOT during ÷ before (log; median step, dotted: mean)",
           title=f"{scenario}: decode beside the prefill")
    ax2.set(ylabel="TTFT (s)", title=f"{scenario}: the long prompt's TTFT")
