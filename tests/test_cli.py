"""`python -m hybrid` end to end, as a user runs it (a subprocess each)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def hybrid(*args: str, tmp_path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HYBRID_RUNS_DIR": str(tmp_path / "runs")}
    return subprocess.run([sys.executable, "-m", "hybrid", *args], capture_output=True, text=True, env=env,
                          timeout=300)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return tmp_path_factory.mktemp("cli")


def test_generate_json_on_embedded_default(runs):
    p = hybrid("output=json", "max_new_tokens=5", "prompt=Hello", tmp_path=runs)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["prompt_ids"][1:] and len(out["output_ids"]) == 5
    assert out["ttft_s"] > 0 and out["tpot_s"] > 0 and isinstance(out["text"], str)
    assert (runs / "runs" / "models").is_dir(), "the tiny checkpoint is generated under runs/models/"


def test_generate_text_streams_then_summarises(runs):
    p = hybrid("max_new_tokens=4", "prompt=Hi", "temperature=0.7", "top_p=0.9", "seed=1", tmp_path=runs)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("Hi") and "TTFT" in p.stdout and "TPOT" in p.stdout and "tok/s" in p.stdout


def test_profile_prints_resolved_config(runs):
    p = hybrid("+hw=epyc2x_5090x2", "--cfg", "job", tmp_path=runs)
    assert p.returncode == 0, p.stderr
    assert "name: epyc2x_5090x2" in p.stdout and "RTX 5090" in p.stdout and "ring_len" in p.stdout


def test_profile_the_machine_lacks_explains_and_stops(runs):
    p = hybrid("+hw=epyc2x_5090x2", tmp_path=runs)
    assert p.returncode == 2
    assert "GPUs: profile 'epyc2x_5090x2' needs 2" in p.stderr and "adapt_to_hardware" in p.stderr


def test_adapting_warns_and_runs(runs):
    p = hybrid("+hw=epyc2x_5090x2", "policy.adapt_to_hardware=true", "max_new_tokens=2", "output=json",
               tmp_path=runs)
    assert p.returncode == 0, p.stderr
    assert "warning: no GPU present" in p.stderr and json.loads(p.stdout.splitlines()[-1])["hw"] == "epyc2x_5090x2"


def test_bad_input_gets_one_clear_line(runs, tmp_path):
    p = hybrid(f"model.path={tmp_path}", tmp_path=runs)
    assert p.returncode == 2 and "config.json: not found" in p.stderr and "Traceback" not in p.stderr
    p = hybrid("policy.prefill.ring_len=0", tmp_path=runs)
    assert p.returncode == 2 and "policy.prefill.ring_len" in p.stderr and "Traceback" not in p.stderr
    p = hybrid("policy.kv.max_contxt=1", tmp_path=runs)
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        "error: unknown config key policy.kv.max_contxt (known: block_tokens, cache_gb, host_cache_gb, max_batch, "
        "max_context, prefix_cache)"]
    p = hybrid("policy.max_context=128", tmp_path=runs)  # a flat key of before: its path now
    assert p.returncode == 2 and "now policy.kv.max_context" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    p = hybrid("mode=bench", "bench=decode", "bench.ms=[1]", tmp_path=runs)  # a key of bench=kernels
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        "error: unknown config key bench.ms: bench=decode takes name, contexts, steps, batch, roof_gb, graph_modes, "
        "numa"]
    p = hybrid("mode=bench", "bench=concurrency", "bench.sweep={prefill.beside_sm:[0,16]}", tmp_path=runs)
    assert p.returncode == 2 and "prefill.beside_sm is not a policy key (did you mean prefill.beside_sms" in p.stderr
    assert "Traceback" not in p.stderr


def test_kernel_bench_writes_its_records_and_a_plot(runs):
    """bench=kernels on small shapes: every record beside its roof reading, the JSON and the PNG beside it."""
    p = hybrid("mode=bench", "bench=kernels", "output=json", "bench.hidden=256", "bench.inter=128",
               "bench.experts=8", "bench.top_k=2", "bench.ms=[1,4]", "bench.moe_tokens=[1,4]", "bench.pool_gb=0.02",
               "bench.repeats=1", "bench.torch_peers=false", "tracking.enabled=false", tmp_path=runs)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.strip().splitlines()[-1])
    names = [r["name"] for r in out["records"]]
    kernels = {r["kernel"] for r in out["records"] if r["name"] == "moe_layer"}  # the variants this CPU runs
    assert kernels and names[0] == "read_roof"
    assert names.count("fp8_gemm.gate_up") == names.count("moe_layer") == 2 * len(kernels)
    assert all(r["bound"] > 0 for r in out["records"][1:])
    assert out["plot"].endswith(".png") and open(out["plot"], "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.exists(out["path"])
