"""`bench=concurrency`: scenario names, and the whole run on the CPU (the long prompt takes the chunked path there:
the decodes go on between its chunks, so TPOT while it prefills is measured; the stream caps need a GPU), a sweep's
points replanned, the plot."""
from __future__ import annotations

import json
import statistics
import os
import subprocess
import sys

import pytest

from hybrid.bench.scenario import Scenario, _intervals, parse_scenario
from hybrid.bench.step_spans import cpu_busy, cpu_spans, layer_spans, step_parts
from hybrid.config.compose import compose, to_settings
from hybrid.errors import ConfigError


def test_scenario_names():
    assert parse_scenario("2D") == Scenario("2D", 0, 2)
    assert parse_scenario("1P") == Scenario("1P", 1, 0)
    assert parse_scenario("1P+2D") == Scenario("1P+2D", 1, 2)
    for bad in ("", "P", "2P", "1P+", "+2D", "D2", "1P2D", "0D"):
        with pytest.raises(ConfigError, match="nD, 1P or 1P"):
            parse_scenario(bad)
    with pytest.raises(ValueError, match="3X"):  # checked when the config is composed
        to_settings(compose(["mode=bench", "bench=concurrency", "bench.scenarios=[1D,3X]"]))


def test_intervals_count_a_step_spanning_the_window_whole():
    times = [0.0, 1.0, 2.0, 10.0, 11.0]
    assert _intervals(times, 2.5, 9.0) == [8.0]  # the held step: one long gap
    assert _intervals(times, 0.5, 10.5) == [1.0, 1.0, 8.0, 1.0]


def test_cpu_busy_is_the_union_of_pending_calls_within_the_window():
    # two lanes' calls overlapping (queued), a gap, one running past the window's end
    spans = [(10, 30), (20, 40), (50, 60), (55, 58), (90, 130)]
    assert cpu_busy(spans, 0, 100) == 30 + 10 + 10
    assert cpu_busy(spans, 25, 95) == 15 + 10 + 5
    assert cpu_busy([], 0, 10) == 0 and cpu_busy([(0, 5)], 5, 10) == 0


def test_step_parts_split_one_request_steps_by_their_calls():
    """Two MoE layers; step k's calls at 100k + [0, 30) and 100k + [40, 60): 50 of CPU experts, 10 between the
    layers, 40 from a step's last call to the next step's first."""
    layers = [[(100 * k, 100 * k + 30) for k in range(4)], [(100 * k + 40, 100 * k + 60) for k in range(4)]]
    assert step_parts(layers, 0, 400) == {"cpu_experts": 50, "between_layers": 10, "between_steps": 40}
    # the window cuts the third step (its second call ends at 260): two whole steps followed by another
    assert step_parts(layers, 0, 250) == step_parts(layers, 0, 400)
    # a step without its second layer's call (e.g. all its experts on the GPU) is left out, not half counted
    gappy = [layers[0], [span for k, span in enumerate(layers[1]) if k != 1]]
    assert step_parts(gappy, 0, 400) == {"cpu_experts": 50, "between_layers": 10, "between_steps": 40}
    assert step_parts([[(0, 30)], [(40, 60)]], 0, 400) is None  # one step, none after it
    assert step_parts([], 0, 400) is None  # no graphs: no calls noted
    # a step's time is the sum of its parts: here 100 = 50 + 10 + 40
    parts = step_parts(layers, 0, 400)
    assert sum(parts.values()) == 100


class _Job:
    def __init__(self, spans):
        self.spans, self.tracing = spans, False

    def take_spans(self):
        spans, self.spans = self.spans, []
        return spans


def test_layer_spans_gather_each_layer_across_the_graphs():
    """Lane 0's graphs (one per KV bucket here) each hold a job per MoE layer; a layer's calls are those of its job
    in every graph; jobs of the other lanes are taken (cleared) but belong to no layer."""
    g1, g2, lane = [_Job([(0, 5)]), _Job([(6, 9)])], [_Job([(20, 25)]), _Job([(26, 29)])], _Job([(1, 2)])

    class Graphs:
        def jobs(self):
            return [*g1, *g2, lane]

        def layer_jobs(self):
            return [[g1[0], g2[0]], [g1[1], g2[1]]]

    class Engine:
        graphs = Graphs()

    taken = cpu_spans(Engine, True)
    assert all(job.tracing and job.spans == [] for job in (*g1, *g2, lane))
    assert layer_spans(Engine, taken) == [[(0, 5), (20, 25)], [(6, 9), (26, 29)]]
    assert step_parts(layer_spans(Engine, taken), 0, 30) == {"cpu_experts": 8, "between_layers": 1,
                                                               "between_steps": 11}


def test_concurrency_bench_on_the_cpu(tmp_path, tiny_dir):  # +hw=cpu_only: on the CPU on a GPU machine too
    env = {**os.environ, "HYBRID_RUNS_DIR": str(tmp_path)}
    args = ["mode=bench", "bench=concurrency", "+hw=cpu_only",
            "output=json", "bench.long_prompt_tokens=160", "bench.prompt_tokens=8",
            "bench.new_tokens=6", "bench.roof_gb=0.05", "policy.prefill.chunk_tokens=16", "policy.kv.max_context=256",
            "policy.kv.max_batch=3", "policy.decode.batch_cap=3", "bench.scenarios=[1D,2D,1P,1P+1D,1P+2D]",
            "bench.sweep={prefill.attention_chunk_tokens:[0],decode.mapped_outputs:[false]}",
            "bench.dual_batch=true", "bench.dual_rounds=2"]
    p = subprocess.run([sys.executable, "-m", "hybrid", *args], capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    dual = {r["dual_batch"]: r for r in out["records"] if "dual_batch" in r}  # the 2D pair: without and with
    recs = {(r["name"], r.get("scenario")): r for r in out["records"] if "dual_batch" not in r}  # extras flattened
    # the sweep's one point: the engine replanned with it, every record tagged with it
    assert "bench=concurrency at prefill.attention_chunk_tokens 0, decode.mapped_outputs False" in p.stderr
    assert all(r["prefill.attention_chunk_tokens"] == 0 and r["decode.mapped_outputs"] is False
               for r in out["records"] if r["name"] not in ("read_roof", "h2d_pinned"))
    for sc, n in (("1D", 1), ("2D", 2), ("1P+1D", 1), ("1P+2D", 2)):
        tpot, tok = recs[("tpot_s", sc)], recs[("decode_tok_s", sc)]
        assert tpot["m"] == n and 0 < tpot["value"] < 5
        assert tok["bound"] and 0 < tok["value"] <= 1.2 * tok["bound"]  # never past the roof's bound (noise aside)
    assert 0 < recs[("ttft_s", "1P")]["value"] and "vs_1P" in recs[("ttft_s", "1P+1D")]
    for sc in ("1P+1D", "1P+2D"):
        ratio = recs[("tpot_ratio", sc)]
        during = recs[("tpot_during_prefill_s", sc)]
        assert ratio["value"] > 0 and during["steps"] >= 2  # chunks: the decodes stepped during the prompt
        assert during["worst_step_s"] >= during["value"]
        solo = recs[("tpot_s", f"{sc[-2]}D")]["value"]  # the same decodes alone (1D / 2D)
        assert ratio["vs_solo"] == pytest.approx(during["value"] / solo)
        mean = recs[("tpot_mean_ratio", sc)]  # the mean steps' ratio, beside the medians'
        assert mean["value"] > 0 and "vs_solo" in mean
    assert "vs_1D" in recs[("tpot_s", "2D")]
    # 2D again with dual-batch decode (the CPU runs the micro-batches in turn): both ways, against their bounds
    assert set(dual) == {False, True} and {r["scenario"] for r in dual.values()} == {"2D"}
    assert dual[False]["vs_no_overlap"] == 1 and dual[True]["vs_no_overlap"] > 0
    for r in dual.values():
        assert r["m"] == 2 and r["bound"] and 0 < r["value"] <= 1.2 * r["bound"]
        assert r["rounds"] == 2 and r["value"] == pytest.approx(statistics.median(r["tok_s_by_round"]))
        assert r["cpu_join"] == "host"  # no graphs on the CPU: nothing to signal
    assert "2D (CPU experts joined by host; medians of 2 rounds): without overlap" in p.stderr
    assert dual[True]["way"] == "two micro-batches in turn" and not dual[True]["dual_stagger"]


def test_scenarios_checked_before_the_model_is_built():
    from hybrid.bench.concurrency import check

    b = to_settings(compose(["mode=bench", "bench=concurrency"])).bench  # a 32K long prompt
    decode_only = [parse_scenario(n) for n in ("1D", "2D", "4D")]
    check(b, decode_only, 4, 4, 2048)  # no long prompt among them: a short context is enough
    with pytest.raises(ConfigError, match="needs policy.kv.max_context > it"):
        check(b, decode_only + [parse_scenario("1P+1D")], 4, 4, 2048)
    with pytest.raises(ConfigError, match="need 4 requests running at once"):
        check(b, decode_only, 3, 8, 2048)


def test_too_many_requests_for_the_batch_cap_fail_clearly(tmp_path, tiny_dir):
    env = {**os.environ, "HYBRID_RUNS_DIR": str(tmp_path)}
    p = subprocess.run([sys.executable, "-m", "hybrid", "mode=bench", "bench=concurrency", "bench.roof_gb=0",
                        "bench.long_prompt_tokens=64", "policy.decode.batch_cap=2", "bench.scenarios=[1P+2D]"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode != 0 and "need 3 requests running at once" in p.stderr and "Traceback" not in p.stderr


def _fake_engine(s):
    """What measure reads of an engine before its scenarios run (they are stubbed)."""
    from types import SimpleNamespace

    import torch

    from hybrid.models import args_of

    return SimpleNamespace(device=torch.device("cpu"), model=SimpleNamespace(args=args_of(s.model)),
                           plan=SimpleNamespace(params=dict))


def test_each_sweep_point_replans_with_its_knobs_and_tags_its_records(monkeypatch):
    """bench.sweep given together: every combination, each on the engine replanned with the point's knobs (the rest
    of the policy as configured), its records tagged with them (the replan and the scenarios stubbed)."""
    from hybrid.bench import concurrency
    from hybrid.bench.records import Record
    from hybrid.engine import build

    s = to_settings(compose(["mode=bench", "bench=concurrency", "+hw=cpu_only", "bench.roof_gb=0",
                             "policy.prefill.beside_decode=true",
                             "bench.sweep={prefill.stream_cap_gbps:[null,20],decode.mapped_outputs:[true,false]}"]))
    replanned, measured = [], []
    monkeypatch.setattr(build, "replan", lambda engine, s2, hw: replanned.append(s2.policy) or len(replanned))
    monkeypatch.setattr(concurrency, "_at_point", lambda engine, s, point, *a: measured.append((engine, point)) or (
        engine, [Record("tpot_ratio", 1.0, "x", extra={"scenario": "1P+1D", **point})]))
    recs = concurrency.measure(_fake_engine(s), s)
    points = [{"prefill.stream_cap_gbps": cap, "decode.mapped_outputs": mapped}
              for cap in (None, 20) for mapped in (True, False)]
    assert measured == list(zip((1, 2, 3, 4), points))
    assert [(p.prefill.stream_cap_gbps, p.decode.mapped_outputs) for p in replanned] == [
        (cap, mapped) for cap in (None, 20.0) for mapped in (True, False)]
    assert all(p.prefill.beside_decode and p.kv == s.policy.kv for p in replanned)
    assert [r.extra for r in recs] == [{"scenario": "1P+1D", **point} for point in points]


@pytest.mark.parametrize("sweep, error", [
    ("{kv.max_batch:[2,4]}", "policy.kv.max_batch needs the model placed again"),
    ("{decode.batch_cap:[2]}", "need 4 requests running at once"),
])
def test_a_sweep_that_cannot_run_is_refused_before_the_model_is_built(monkeypatch, sweep, error):
    from hybrid.bench import concurrency
    from hybrid.engine import build

    monkeypatch.setattr(build, "build", lambda *a, **k: pytest.fail("built"))
    s = to_settings(compose(["mode=bench", "bench=concurrency", "+hw=cpu_only", "bench.scenarios=[1D,4D]",
                             f"bench.sweep={sweep}"]))
    with pytest.raises(ConfigError, match=error):
        concurrency.run(s)


def test_plot_draws_a_curve_per_other_setting(tmp_path, monkeypatch):
    """The 1P+nD scenario of fewest decodes along the first key with two values (no cap drawn last, as none)."""
    import matplotlib.axes

    from hybrid.bench import concurrency_plot
    from hybrid.bench.records import Record

    ticks = []
    real = matplotlib.axes.Axes.set_xticks
    monkeypatch.setattr(matplotlib.axes.Axes, "set_xticks", lambda self, at, names=None, **k: ticks.append(names)
                        or real(self, at, names, **k))
    recs = [Record(name, v + n, "x", extra={"scenario": f"1P+{n}D", "prefill.stream_cap_gbps": cap,
                                            "prefill.beside_cores": cores})
            for n in (2, 1) for cap in (None, 20.0, 10.0) for cores in (0, 1)
            for name, v in (("tpot_ratio", 1.1 + cores), ("ttft_s", 2.0))]
    recs.append(Record("ttft_s", 1.0, "s", extra={"scenario": "1P", "prefill.stream_cap_gbps": None}))
    png = tmp_path / "c.png"
    assert concurrency_plot.plot(recs, png) == png and png.stat().st_size
    assert ticks == [["10", "20", "none"]] * 2
    assert concurrency_plot.plot([Record("tpot_ratio", 1.0, "x", extra={"scenario": "1P+1D"})], png) is None


def test_plot_draws_the_dual_batch_ways_beside_their_bounds(tmp_path, monkeypatch):
    import matplotlib.axes

    from hybrid.bench import concurrency_plot
    from hybrid.bench.records import Record

    bars = []
    real_bar = matplotlib.axes.Axes.bar
    monkeypatch.setattr(matplotlib.axes.Axes, "bar", lambda self, x, h, *a, **k: bars.append((k.get("label"), h))
                        or real_bar(self, x, h, *a, **k))
    ways = ("without overlap", "overlapped in lockstep", "overlapped, half a step apart")
    recs = [Record("decode_tok_s", v, "tok/s", bound=b, m=n,
                   extra={"scenario": f"{n}D", "way": way, "tok_s_by_round": [v - 1, v + 1]})
            for n, base in ((2, 85.0), (4, 55.0)) for way, v, b in zip(ways, (base, base + 1, base * 1.3),
                                                                         (base, base * 1.1, base * 1.2))]
    recs.append(Record("decode_tok_s", 80.0, "tok/s", extra={"scenario": "2D"}))  # the main run's: no way, not drawn
    assert concurrency_plot.plot(recs, tmp_path / "d.png") == tmp_path / "d.png" and (tmp_path / "d.png").stat().st_size
    assert len(bars) == 6 and [label for label, _ in bars if label] == list(ways)
    assert [h for _, h in bars] == [85.0, 55.0, 86.0, 56.0, 85.0 * 1.3, 55.0 * 1.3]


def test_plot_takes_the_knob_that_was_swept_with_repeats(tmp_path, monkeypatch):
    """bench.sweep={prefill.beside_sms:[0,32,0,32,0]}: the SMs on the x axis (not the queue's, one value), a point
    per run, the curve through the medians of each setting's runs."""
    import matplotlib.axes

    from hybrid.bench import concurrency_plot
    from hybrid.bench.records import Record

    drawn = []  # the lines' (x, y), in the order drawn: the TPOT ratio's first
    real_plot = matplotlib.axes.Axes.plot

    def plot(self, *a, **k):
        drawn.append(a)
        return real_plot(self, *a, **k)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", plot)
    recs = [Record(name, v, "x", extra={"scenario": "1P+1D", "prefill.stream_queue_mb": 16, "prefill.beside_sms": sms})
            for sms, ratio in ((0, 1.2), (32, 1.1), (0, 1.16), (32, 1.04), (0, 1.18))
            for name, v in (("tpot_ratio", ratio), ("ttft_s", 2.0))]
    assert concurrency_plot.plot(recs, tmp_path / "s.png") == tmp_path / "s.png"
    xs, ys = drawn[0]
    assert list(xs) == [0, 1] and list(ys) == [1.18, pytest.approx(1.07)]  # medians of 3 and of 2 runs
