"""The prefill benchmark's parts that run without a GPU: the crossover and the plot (its bound's FLOP count:
tests/bench/test_bounds.py)."""
from __future__ import annotations

import pytest

from hybrid.bench import plot_bench
from hybrid.bench.prefill import crossover
from hybrid.bench.records import Record


def test_crossover_interpolates_where_the_curves_cross():
    slp = [(512, 0.2), (2048, 0.25)]
    cpu = [(512, 0.1), (2048, 0.4)]
    x = crossover(slp, cpu)
    assert 512 < x < 2048
    assert crossover([(512, 0.2)], [(512, 0.9)]) is None  # SLP wins everywhere measured


def test_plot_is_written_beside_the_json(tmp_path):
    recs = [Record("slp_ttft", t, "s", None, n) for n, t in ((512, 0.2), (2048, 0.3), (8192, 0.5))]
    recs += [Record("cpu_path_ttft", t, "s", None, n) for n, t in ((512, 0.1), (2048, 0.6))]
    png = plot_bench("prefill", recs, tmp_path / "prefill-x.json")
    assert png == tmp_path / "prefill-x.png" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_bench("kernels", recs, tmp_path / "k.json") is None


@pytest.mark.parametrize("missing", ["slp_ttft", "cpu_path_ttft"])
def test_plot_copes_with_one_series(tmp_path, missing):
    recs = [Record(n, 0.2, "s", None, 512) for n in ("slp_ttft", "cpu_path_ttft") if n != missing]
    assert plot_bench("prefill", recs, tmp_path / "p.json").exists()


def test_without_a_gpu_the_cpu_path_reports_its_flop_rate():
    from hybrid.config.compose import compose, to_settings
    from hybrid.hw.detect import detect
    from hybrid.engine.build import plan_for
    from hybrid.run import bench

    s = to_settings(compose(["+hw=cpu_only", "mode=bench", "bench=prefill", "bench.prompt_lengths=[8,16]",
                             "tracking.enabled=false"]))
    records = [r for r in bench(s, "cpu_only", detect(), plan_for(s, s.hw).cpu.kernel)["records"]
               if r["name"] == "cpu_path_ttft"]
    assert [r["m"] for r in records] == [8, 16]
    assert all(r["gflop_s"] == pytest.approx(r["gflop"] / r["value"]) for r in records)


def test_each_two_gpu_rank_is_placed_as_the_prefill_peer_on_the_shared_experts():
    """bench=prefill policy.prefill.gpus=2 (two GPUs; here its rank's placement on the CPU): the parent shares the
    routed experts once (build.shared_experts), a rank places the model through build.peer_model and reads its
    experts from that copy, and its prefill gives the engine's logits."""
    import torch

    from hybrid.bench.prefill_dual import rank_model
    from hybrid.config.compose import compose, to_settings
    from hybrid.engine.build import build, plan_for, shared_experts
    from hybrid.placement.passes import cpu_experts
    from hybrid.prefill.ring import expert_tensors

    s = to_settings(compose(["+hw=cpu_only", "mode=bench", "bench=prefill", "policy.kv.max_context=64"]))
    plan = plan_for(s, s.hw)
    arenas = shared_experts(s.model, plan, progress=False)
    model, _ = rank_model(torch.device("cpu"), s, plan, plan.cpu.threads, arenas)
    for layer, arena in zip(cpu_experts(model), arenas, strict=True):
        lo, hi = arena.data_ptr(), arena.data_ptr() + arena.numel()
        assert all(lo <= t.data_ptr() < hi for e in layer.host_experts for _, t in expert_tensors(e))
    prompt = list(range(2, 14))
    cache = model.new_cache(1, 64)
    got = model(torch.tensor([prompt]), torch.arange(len(prompt))[None], cache, torch.tensor([0]), last_only=True)
    want, _ = build(s, s.hw, progress=False).prefill(prompt)
    torch.testing.assert_close(got[0, -1], want)
