"""The server and its benchmark as users start them: `python -m hybrid mode=serve` (healthy once loaded, then the
`openai` client, then SIGTERM and exit status 0) and `python -m hybrid mode=bench bench=serve`."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

from tests.serve.test_shutdown import _free_port

ROOT = Path(__file__).resolve().parents[2]


def _env(runs: Path) -> dict:
    return {**os.environ, "HYBRID_RUNS_DIR": str(runs), "HYBRID_TRACKING": "0",
            "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def test_mode_serve_answers_the_openai_client_and_stops_on_sigterm(tmp_path):
    port = _free_port()
    p = subprocess.Popen([sys.executable, "-m", "hybrid", "mode=serve", f"server.port={port}", "model.dtype=float32",
                          "server.model_name=tiny-served", "policy.kv.max_context=256"], cwd=ROOT,
                         env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url, seen = f"http://127.0.0.1:{port}", set()
        end = time.monotonic() + 180
        while time.monotonic() < end:
            try:
                status = httpx.get(f"{url}/health", timeout=2).status_code
                seen.add(status)
                if status == 200:
                    break
            except httpx.TransportError:
                pass
            assert p.poll() is None, p.stderr.read()
            time.sleep(0.1)
        assert 200 in seen, f"never healthy: {seen}"
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["tiny-served"]
        out = client.completions.create(model="tiny-served", prompt="The three laws", max_tokens=5, temperature=0)
        assert out.usage.completion_tokens >= 1 and out.choices[0].finish_reason in ("stop", "length")
    finally:
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
    assert p.returncode == 0, err[-2000:]


def test_bench_serve_drives_the_server_at_each_concurrency(tmp_path):
    p = subprocess.run([sys.executable, "-m", "hybrid", "mode=bench", "bench=serve", "output=json",
                        "bench.concurrency=[1,2]", "workload.requests=4", "workload.prompt_tokens=[8,32]",
                        "workload.output_tokens=[2,4]"], cwd=ROOT, env=_env(tmp_path), capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    report = json.loads(p.stdout.strip().splitlines()[-1])
    by = {(r["name"], r["m"]): r for r in report["records"]}
    for c in (1, 2):
        assert by[("errors", c)]["value"] == 0 and by[("ttft_s", c)]["completed"] == 4
        assert by[("throughput_req_s", c)]["value"] > 0 and 0 <= by[("slo_attainment", c)]["value"] <= 1
        assert by[("ttft_s", c)]["value"] <= by[("ttft_s", c)]["p99"]


def test_a_workload_too_long_for_the_kv_cache_is_refused(tmp_path):
    p = subprocess.run([sys.executable, "-m", "hybrid", "mode=bench", "bench=serve", "workload=rag"], cwd=ROOT,
                       env=_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "policy.kv.max_context >= 8256" in p.stderr and "Traceback" not in p.stderr
