"""`python -m hybrid mode=bench bench=slo`: the SLO report card through the engine, as the tuner's trials run it;
the bytes a decode step reads (its bound) after placement."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from hybrid.bench import bounds
from hybrid.bench.slo import bytes_per_decode_step, run
from hybrid.config.compose import compose, to_settings
from hybrid.placement.passes import cpu_experts, experts_to_cpu_kernels, pin_experts, place
from hybrid.placement.staging import Staging
from hybrid.model.moe import RoutedExperts
from hybrid.weights.checkpoint import Checkpoint
from hybrid.weights.loader import load_model

SMALL = ["bench.prompt_tokens=16", "bench.new_tokens=4", "bench.batch=2"]


def hybrid(*args: str, runs) -> subprocess.CompletedProcess:
    env = {**os.environ, "HYBRID_RUNS_DIR": str(runs)}
    return subprocess.run([sys.executable, "-m", "hybrid", "mode=bench", "bench=slo", *args], capture_output=True,
                          text=True, env=env, timeout=300)


def test_slo_json_line(tmp_path, tiny_dir):
    p = hybrid("output=json", *SMALL, "bench.repeats=2", "bench.roof_gb=0.1", runs=tmp_path)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.strip().splitlines()
    assert len(lines) == 1, "output=json: one line on stdout"
    out = json.loads(lines[0])
    recs = {r["name"]: r for r in out["records"]}
    assert out["bench"] == "slo" and out["hw"] == "auto" and out["threads"] >= 1
    assert [recs[n]["unit"] for n in ("ttft_s", "tpot_s", "prefill_tok_s", "decode_tok_s")] == \
        ["s", "s", "tok/s", "tok/s"]
    assert all(recs[n]["value"] > 0 for n in ("ttft_s", "tpot_s", "prefill_tok_s", "decode_tok_s"))
    assert recs["ttft_s"]["prompt_tokens"] == 16 and recs["ttft_s"]["batch"] == 2
    assert recs["tpot_s"]["p50_ms"] <= recs["tpot_s"]["max_ms"]
    d = recs["decode_tok_s"]
    assert d["bound"] > 0 and 0 < d["fraction_of_bound"] == d["value"] / d["bound"] and recs["read_roof"]["value"] > 0
    args = Checkpoint(tiny_dir).args  # the default model's
    assert d["bytes_per_step"] in [pytest.approx(bounds.decode_step_bytes(args, 2, cpu)) for cpu in (True, False)]
    assert os.path.exists(out["path"]), "the records are saved as JSON under runs/bench/"


def test_slo_bad_sizes_fail_clearly(tmp_path):
    p = hybrid("bench.batch=7", runs=tmp_path)  # policy.decode.batch_cap = 6
    assert p.returncode == 2 and "bench.batch (7) exceeds policy.decode.batch_cap (6)" in p.stderr
    assert "Traceback" not in p.stderr


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_decode_bytes_count_the_routed_experts_placement_took_out_of_the_tree(tiny_dir):
    """Placed as build() places it beside a GPU (staged hand-off, experts in host arenas), the routed experts are no
    longer in the module tree: the bytes a step reads still count them, from the model's arguments, and are never 0
    (a walk of the tree found 0 on a GPU machine, and the bound divided by it)."""
    model = load_model(Checkpoint(tiny_dir), torch.bfloat16, progress=False)
    a, batch = model.args, 2
    staging = Staging(a.hidden_size, a.num_experts_per_tok, stage_on_cpu=True)
    experts_to_cpu_kernels(model, staging=staging)
    pin_experts(model, pin=False)
    place(model, torch.device("cpu"))
    layers = cpu_experts(model)
    assert len(layers) == a.n_moe_layers and not any(isinstance(m, RoutedExperts) for m in model.modules())

    on_gpu = SimpleNamespace(model=model, device=torch.device("cuda", 0))  # the engine build() makes beside a GPU
    got = bytes_per_decode_step(on_gpu, batch)
    per_layer = _nbytes(t for e in layers[0].host_experts for t in e.state_dict().values())
    k, e = a.num_experts_per_tok, a.n_routed_experts
    want = len(layers) * per_layer * (1 - (1 - k / e) ** batch)
    assert got > 0 and got == pytest.approx(want) and got == bounds.decode_step_bytes(a, batch, whole_model=False)
    assert bounds.decode_tok_s_bound(got, 10.0, batch) == pytest.approx(batch * 10e9 / want)

    on_cpu = SimpleNamespace(model=model, device=torch.device("cpu"))  # runs the rest too: all but the embedding
    rest = _nbytes(t for n, t in model.state_dict().items() if n != "model.embed_tokens.weight")
    assert bytes_per_decode_step(on_cpu, batch) == pytest.approx(want + rest)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_slo_on_a_gpu_profile_is_bounded_by_the_routed_experts(tiny_dir):
    s = to_settings(compose(["+hw=h200_xeon16", "policy=default",
                             "policy.adapt_to_hardware=true", "mode=bench", "bench=slo", *SMALL,
                             "bench.repeats=1", "bench.roof_gb=0.1", "tracking.enabled=false"]))
    recs = {r.name: r for r in run(s)}
    d, roof = recs["decode_tok_s"], recs["read_roof"].value
    want = bounds.decode_step_bytes(Checkpoint(tiny_dir).args, 2, whole_model=False)  # the default model's
    assert d.extra["bytes_per_step"] == pytest.approx(want) and want > 0
    assert d.bound == pytest.approx(bounds.decode_tok_s_bound(want, roof, 2)) and d.value > 0
    assert all(recs[n].value > 0 for n in ("ttft_s", "tpot_s", "prefill_tok_s"))
