"""`mode=replicas` (hybrid/serve/replicas.py) without starting anything: the replicas' and the gateways' command
lines from one config, and the checks before anything starts."""
from __future__ import annotations

import sys

import pytest

from hybrid.config.compose import compose, to_settings
from hybrid.errors import ConfigError
from hybrid.serve import replicas


def _s(*overrides):
    return to_settings(compose(["mode=replicas", *overrides]))


def test_each_replica_is_mode_serve_with_the_other_overrides():
    cmd = replicas.replica_command(8102, ["mode=replicas", "replicas.count=2", "server.port=9000", "model=tiny",
                                          "policy.kv.max_context=8192", "server.api_key=k", "hydra.run.dir=x"])
    assert cmd == [sys.executable, "-m", "hybrid", "mode=serve", "server.port=8102", "model=tiny",
                   "policy.kv.max_context=8192", "server.api_key=k"]


@pytest.mark.parametrize("gateway, module", [("sglang", "sglang_router.launch_router"),
                                             ("vllm", "vllm_router.launch_router")])
def test_the_gateway_command_line(gateway, module):
    pytest.importorskip(module.split(".")[0])
    s = _s(f"replicas.gateway={gateway}", "replicas.count=3", "replicas.base_port=9101", "replicas.policy=round_robin",
           "server.port=9100", "replicas.prometheus_port=9190", "replicas.gateway_args=[--log-level,warn]")
    cmd = replicas.gateway_command(s, "sk-1")
    assert cmd[:3] == [sys.executable, "-m", module]
    assert cmd[cmd.index("--worker-urls") + 1:cmd.index("--policy")] == [
        "http://127.0.0.1:9101", "http://127.0.0.1:9102", "http://127.0.0.1:9103"]
    args = dict(zip(cmd[3::1], cmd[4::1]))
    assert (args["--policy"], args["--port"], args["--prometheus-port"], args["--api-key"]) == (
        "round_robin", "9100", "9190", "sk-1")
    assert cmd[-2:] == ["--log-level", "warn"]
    assert "--api-key" not in replicas.gateway_command(s, None)
    assert replicas.gateway_command(_s("replicas.gateway=none"), None) is None


def test_checks_before_anything_starts(monkeypatch):
    with pytest.raises(ConfigError, match="replicas.gateway must be one of"):
        _s("replicas.gateway=nginx")
    with pytest.raises(ConfigError, match="replicas.count must be >= 1"):
        _s("replicas.count=0")
    with pytest.raises(ConfigError, match="server.port 8102 is among the replicas' ports"):
        replicas.check_ports(_s("server.port=8102"))
    monkeypatch.setattr(replicas.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match="pip install sglang-router"):
        replicas.gateway_command(_s("replicas.gateway=sglang"), None)


def _launch(tmp_path, tiny_dir, *overrides):
    import os
    import subprocess

    from tests.serve.deploy import ROOT, free_ports

    base = free_ports(3)
    env = {**os.environ, "HYBRID_RUNS_DIR": str(tmp_path), "HYBRID_TRACKING": "0"}
    return subprocess.Popen([sys.executable, "-m", "hybrid", "mode=replicas", "replicas.gateway=none",
                             f"replicas.base_port={base + 1}", f"server.port={base}", f"model.path={tiny_dir}",
                             "model.dtype=float32", *overrides], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_a_replica_not_ready_in_time_stops_the_rest(tmp_path, tiny_dir):
    p = _launch(tmp_path, tiny_dir, "replicas.ready_timeout_s=0.5")
    _, err = p.communicate(timeout=120)
    assert p.returncode == 2 and "not ready within 0.5 s" in err and "Traceback" not in err, err[-2000:]
    logs = list(tmp_path.glob("replicas/*/*/replica-0.log"))
    assert len(logs) == 1


def test_sigterm_while_starting_stops_them_cleanly(tmp_path, tiny_dir):
    import signal
    import time

    p = _launch(tmp_path, tiny_dir)
    end = time.monotonic() + 60
    while not list(tmp_path.glob("replicas/*/*/replica-1.log")) and time.monotonic() < end:
        time.sleep(0.1)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 0 and "stopped before everything was ready" in err, err[-2000:]
