"""`python -m hybrid mode=bench bench=slo`: the SLO report card through the engine, as the tuner's trials run it."""
from __future__ import annotations

import json
import os
import subprocess
import sys


def hybrid(*args: str, runs) -> subprocess.CompletedProcess:
    env = {**os.environ, "HYBRID_RUNS_DIR": str(runs)}
    return subprocess.run([sys.executable, "-m", "hybrid", "mode=bench", "bench=slo", *args], capture_output=True,
                          text=True, env=env, timeout=300)


def test_slo_json_line(tmp_path):
    p = hybrid("output=json", "bench.prompt_tokens=16", "bench.new_tokens=4", "bench.repeats=2", "bench.batch=2",
               "bench.roof_gb=0.1", runs=tmp_path)
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
    assert os.path.exists(out["path"]), "the records are saved as JSON under runs/bench/"


def test_slo_bad_sizes_fail_clearly(tmp_path):
    p = hybrid("bench.batch=9", runs=tmp_path)  # policy.max_batch = 8
    assert p.returncode == 2 and "bench.batch (9) exceeds policy.max_batch (8)" in p.stderr
    assert "Traceback" not in p.stderr
