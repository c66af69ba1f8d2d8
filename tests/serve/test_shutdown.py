"""SIGTERM on a server run by serve() in its own process: new requests get 503 at once, a request in flight that
can finish within shutdown_grace_s does, one that cannot is aborted at the end of the grace (an error event in its
stream), and the process exits with status 0."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from tests.serve.conftest import MODEL

ROOT = Path(__file__).resolve().parents[2]
GRACE_S = 2.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stream(url: str, max_tokens: int, got: dict, started: threading.Event) -> None:
    """Streams a completion, recording the text, finish_reason and any error event."""
    body = {"model": MODEL, "prompt": "drain", "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    got.update(text="", finish=None, error=None, done=False)
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            started.set()
            if line == "data: [DONE]":
                got["done"] = True
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                got["error"] = chunk["error"]
            else:
                got["text"] += chunk["choices"][0]["text"]
                got["finish"] = chunk["choices"][0]["finish_reason"] or got["finish"]


def test_sigterm_finishes_what_it_can_aborts_the_rest_and_exits_0(tiny_dir, tmp_path):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "tests.serve.serve_tiny", str(tiny_dir), str(port), str(GRACE_S)],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        end = time.monotonic() + 120
        while True:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < end, "the server did not become ready"
            time.sleep(0.1)
        short, long = {}, {}
        started = [threading.Event(), threading.Event()]
        threads = [threading.Thread(target=_stream, args=(url, 6, short, started[0])),
                   threading.Thread(target=_stream, args=(url, 100, long, started[1]))]  # 100 steps >= 5 s
        for t in threads:
            t.start()
        assert all(e.wait(30) for e in started)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "late", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_draining"
        h = httpx.get(f"{url}/health")
        assert h.status_code == 503 and h.json()["status"] == "draining"
        for t in threads:
            t.join(30)
        assert short["finish"] == "length" and short["error"] is None and short["done"], short
        assert long["error"] is not None and "shutting down" in long["error"]["message"] and long["done"], long
        assert proc.wait(30) == 0, (tmp_path / "server.log").read_text()
        assert GRACE_S - 0.5 < time.monotonic() - t0 < GRACE_S + 10
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def _wait_ready(proc, url: str, log_path: Path, headers: dict) -> None:
    end = time.monotonic() + 120
    while True:
        assert proc.poll() is None, log_path.read_text()
        try:
            if httpx.get(f"{url}/health", timeout=1, headers=headers).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < end, "the server did not become ready"
        time.sleep(0.1)


def _long(url: str, headers: dict, stream: bool, got: dict, started: threading.Event, max_tokens: int = 3000) -> None:
    body = {"model": MODEL, "prompt": "cut", "max_tokens": max_tokens, "temperature": 0, "stream": stream,
            "ignore_eos": True}
    if not stream:  # its answer comes at its end
        started.set()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers, timeout=60) as r:
        got["status"] = r.status_code
        if not stream:
            got["body"] = json.loads(r.read())
            return
        got["events"] = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                got["events"].append(line[6:])
                started.set()


def test_a_second_signal_ends_cleanly_and_the_key_stays_out_of_runs(tmp_path):
    """`python -m hybrid mode=serve` with the native MoE kernels: SIGTERM twice while requests run aborts them with
    errors in OpenAI's shape (an error event in the stream, a 503 body), stops and joins the engine and its native
    threads, and exits 0 — no abort. The API key given on the command line is nowhere under the run's directory."""
    port, key = _free_port(), "sk-never-on-disk-5f3a"
    url, headers = f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {key}"}
    log_path, run_dir = tmp_path / "server.log", tmp_path / "run"
    env = {**os.environ, "HYBRID_TRACKING": "0"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "hybrid", "mode=serve", f"server.port={port}",
                                 f"server.api_key={key}", f"hydra.run.dir={run_dir}"],
                                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        _wait_ready(proc, url, log_path, headers)
        streamed, whole = {}, {}
        started = [threading.Event(), threading.Event()]
        threads = [threading.Thread(target=_long, args=(url, headers, True, streamed, started[0])),
                   threading.Thread(target=_long, args=(url, headers, False, whole, started[1]))]
        for t in threads:
            t.start()
        assert all(e.wait(30) for e in started)
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(60)
        assert proc.wait(60) in (0, 130), log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log_path.read_text()
    assert "terminate called" not in text and "Traceback" not in text, text
    error = json.loads(streamed["events"][-2])["error"]
    assert streamed["events"][-1] == "[DONE]" and "shutting down" in error["message"], streamed["events"][-3:]
    assert whole["status"] == 503 and "shutting down" in whole["body"]["error"]["message"], whole
    written = [p for p in run_dir.rglob("*") if p.is_file()]
    assert all(key not in p.read_text(errors="replace") for p in written), written


def test_a_cancelled_handler_answers_json_not_plain_text(tiny_model, tiny_tok):
    """A handler cancelled by uvicorn (its graceful shutdown timing out) still ends with OpenAI's error shape."""
    from hybrid.engine.engine import Engine
    from tests.serve.conftest import PLAN, running

    engine = Engine(tiny_model, PLAN, tiny_tok)
    step = engine.step

    def slow():
        time.sleep(0.2)
        return step()
    engine.step = slow
    streamed, whole = {}, {}
    started = [threading.Event(), threading.Event()]
    with running(engine) as srv:
        srv.server.config.timeout_graceful_shutdown = 0.5
        threads = [threading.Thread(target=_long, args=(srv.url, {}, True, streamed, started[0], 100)),
                   threading.Thread(target=_long, args=(srv.url, {}, False, whole, started[1], 100))]
        for t in threads:
            t.start()
        assert all(e.wait(30) for e in started)
        time.sleep(0.3)
    for t in threads:
        t.join(30)
    assert whole["status"] == 503 and whole["body"]["error"]["code"] == "aborted", whole
    assert streamed["events"][-1] == "[DONE]" and json.loads(streamed["events"][-2])["error"]["code"] == "aborted"
