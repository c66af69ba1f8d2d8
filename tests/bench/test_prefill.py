"""The prefill benchmark's parts that run without a GPU: the crossover, the plot, the FLOP count of its bound."""
from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from hybrid.bench import plot_bench
from hybrid.bench.prefill import attention_flops, crossover, prefill_flops
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


@pytest.mark.parametrize("n", [16, 64])
def test_prefill_flops_agree_with_torchs_flop_counter(tiny_model, n):
    tokens = torch.randint(2, 300, (1, n), generator=torch.Generator().manual_seed(n))
    with FlopCounterMode(display=False) as counter:
        tiny_model(tokens, torch.arange(n)[None], last_only=True)
    # the counter also sees the router and the masked half of the attention square, which the bound leaves out
    assert 1.0 <= counter.get_total_flops() / prefill_flops(tiny_model.args, n) < 1.05



def test_attention_flops_are_the_quadratic_part_of_the_prefill_count(tiny_model):
    a = tiny_model.args
    one_token = 2 * a.num_attention_heads * (a.qk_head_dim + a.v_head_dim)  # scores + values, attending itself
    assert attention_flops(a, 1, layers=1) == one_token
    assert attention_flops(a, 100) == a.num_hidden_layers * one_token * 100 * 101 / 2
    rest = [prefill_flops(a, n) - attention_flops(a, n) for n in (10, 20, 30)]
    assert rest[2] - rest[1] == pytest.approx(rest[1] - rest[0])  # what is left grows linearly with the prompt
