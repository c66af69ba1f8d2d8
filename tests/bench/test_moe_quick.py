import re

import pytest

from hybrid.bench import moe_quick


def test_the_quick_moe_bench_times_each_variant_against_the_roof(capsys):
    moe_quick.main(["--experts", "8", "--distinct", "2", "--tokens-per-expert", "2", "--top-k", "4", "--threads", "2",
                    "--kernels", "generic,nonesuch", "--repeats", "1", "--roof-gb", "0.1"])
    out = capsys.readouterr().out
    assert "read roof" in out and "8 experts (2 distinct), T = 4, 2 tokens per expert" in out
    line = next(x for x in out.splitlines() if x.startswith("generic"))
    assert "GB/s" in line and "of the roof" in line and "TFLOP/s" in line
    assert "nonesuch: not on this CPU, skipped" in out
    # where the threads' time went besides their tasks, as shares of threads x time
    waiting, idle = map(float, re.search(r"waiting +([\d.]+)%  idle at the end +([\d.]+)%", line).groups())
    assert 0 <= waiting <= 100 and 0 <= idle <= 100, line
    # and in the tasks' stages
    stages = re.search(r"prep +([\d.]+)%  gate/up +([\d.]+)%  SiLU +([\d.]+)%  down +([\d.]+)%  sums +([\d.]+)%",
                       line).groups()
    prep, gate_up, silu, down, sums = map(float, stages)
    assert gate_up > 0 and down > 0 and 0 <= prep and 0 <= silu and 0 <= sums, line
    assert waiting + idle + prep + gate_up + silu + down + sums <= 101, line


def test_the_bytes_are_those_of_the_experts_a_token_picked(capsys):
    """4 tokens x top-16 over 64 experts, drawn with the run's seed: ~44 experts picked, and the bytes (and GB/s)
    are theirs, not the 64's."""
    moe_quick.main(["--experts", "64", "--distinct", "2", "--tokens-per-expert", "1", "--top-k", "16", "--threads",
                    "1", "--kernels", "generic", "--repeats", "1", "--roof-gb", "0.1", "--routing", "random"])
    out = capsys.readouterr().out
    used, gb = re.search(r"(\d+) experts used, ([\d.]+) GB of experts read", out).groups()
    assert 16 <= int(used) < 64 and float(gb) == round(int(used) * 3 * 2048 * 7168 / 1e9, 1), out


def test_random_routing_varies_the_tokens_per_expert_around_the_mean(capsys):
    args = ["--experts", "16", "--distinct", "2", "--tokens-per-expert", "4", "--top-k", "4", "--threads", "2",
            "--kernels", "generic", "--repeats", "1", "--roof-gb", "0.1"]
    moe_quick.main(args + ["--routing", "random"])
    out = capsys.readouterr().out
    lo, hi = map(int, re.search(r"4 tokens per expert \(random: (\d+)-(\d+)\)", out).groups())
    assert lo <= 4 <= hi and lo < hi, out  # 64 picks over 16 experts, drawn with the run's seed
    moe_quick.main(args)
    assert "4 tokens per expert (balanced: 4-4)" in capsys.readouterr().out


def test_order_ways_each_get_a_line_and_a_bad_way_is_named(capsys):
    args = ["--experts", "8", "--distinct", "2", "--tokens-per-expert", "2", "--top-k", "4", "--threads", "2",
            "--kernels", "generic", "--repeats", "1", "--roof-gb", "0.1", "--routing", "random"]
    moe_quick.main(args + ["--order", "longest,ids"])
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("generic")]
    assert [re.search(r"lag 2 (\w+) ", x).group(1) for x in lines] == ["longest", "ids"], lines
    with pytest.raises(SystemExit):
        moe_quick.main(args + ["--order", "longest,shortest"])
    assert "--order: ways are 'longest' and 'ids', not 'longest,shortest'" in capsys.readouterr().err
