"""Each benchmark's config node (conf/bench/, hybrid/config/bench.py): every option composes into its own dataclass,
a key of another benchmark or of the wrong type is refused naming it, and `bench.sweep` names policy keys whose
values the policy takes."""
from __future__ import annotations

import re
from dataclasses import asdict

import pytest
import yaml
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from hybrid.config import CONF_DIR, compose, to_settings
from hybrid.config.bench import BENCHES, points, policy_keys
from hybrid.config.compose import settings_of, unknown_override
from hybrid.errors import ConfigError

OPTIONS = sorted(p.stem for p in (CONF_DIR / "bench").glob("*.yaml"))


def test_every_benchmark_has_an_option_a_dataclass_and_a_runner():
    from hybrid.bench import BENCHES as RUNNERS

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        assert GlobalHydra.instance().config_loader().get_group_options("bench") == OPTIONS
    assert OPTIONS == sorted(BENCHES) == sorted(RUNNERS)


@pytest.mark.parametrize("name", OPTIONS)
def test_bench_option_is_its_dataclass_with_every_key(name):
    """conf/bench/NAME.yaml lists every key of its benchmark (so each can be overridden without `+`) at the
    dataclass's defaults, and composes into that dataclass."""
    raw = yaml.safe_load((CONF_DIR / "bench" / f"{name}.yaml").read_text())
    assert raw == asdict(BENCHES[name]()), f"conf/bench/{name}.yaml differs from {BENCHES[name].__name__}"
    b = to_settings(compose(["mode=bench", f"bench={name}"])).bench
    assert isinstance(b, BENCHES[name]) and b.name == name


def test_overrides_of_the_chosen_benchmark():
    b = to_settings(compose(["mode=bench", "bench=decode", "bench.contexts=[1024]", "bench.steps=3"])).bench
    assert (b.contexts, b.steps, b.graph_modes) == ([1024], 3, ["hostfn", "segments"])
    assert not hasattr(b, "ms") and not hasattr(b, "sweep")


def test_a_key_of_another_benchmark_is_refused_naming_the_keys_it_takes():
    """On the command line before Hydra composes (the default benchmark where none is chosen), and appended with
    `+` when the config becomes settings."""
    said = unknown_override(["mode=bench", "bench=decode", "bench.ms=[1]"])
    assert said == ("unknown config key bench.ms: bench=decode takes name, contexts, steps, batch, roof_gb, "
                    "graph_modes, numa")
    assert unknown_override(["bench.contexts=[1]"]).startswith("unknown config key bench.contexts: bench=kernels")
    assert unknown_override(["bench.ms=[1]"], config="tune").startswith("unknown config key bench.ms: bench=slo")
    assert unknown_override(["bench=decode", "bench.contexts=[1]", "bench.sweep={a:[1]}"]) == (
        "unknown config key bench.sweep: bench=decode takes name, contexts, steps, batch, roof_gb, graph_modes, numa")
    assert unknown_override(["bench=nope", "bench.x=1"]).startswith("bench=nope: no such benchmark (available: ")
    with pytest.raises(ConfigError, match="unknown config key bench.ms: bench=decode takes name, contexts"):
        settings_of(compose(["mode=bench", "bench=decode", "+bench.ms=[1]"]))


@pytest.mark.parametrize("overrides, error", [
    (["bench=decode", "bench.steps=abc"], "bench.steps: Value 'abc' of type 'str' could not be converted to Integer"),
    (["bench=slo", "bench.batches=[1,x]"], "bench.batches"),
    (["bench=kernels", "bench.torch_peers=maybe"], "bench.torch_peers"),
    (["bench=decode", "bench.contexts=[0]"], "bench.contexts must be >= 1"),
    (["bench=gpu_gemm", "bench.gemm_rows=[0]"], "bench.gemm_rows must be >= 1"),
    (["bench=decode", "bench.graph_modes=[always]"], "bench.graph_modes takes hostfn and/or segments"),
    (["bench=concurrency", "bench.scenarios=[1D,3X]"], "'3X' is not nD, 1P or 1P+nD"),
    (["bench=kernels", "bench.cpu_kernels=[amx_emulated]"], "bench.cpu_kernels takes amx"),
])
def test_a_bad_value_is_refused_naming_its_key(overrides, error):
    with pytest.raises(ConfigError, match=re.escape(error)):
        settings_of(compose(["mode=bench", *overrides]))


def test_sweep_names_policy_keys_nested_or_dotted():
    b = to_settings(compose(["mode=bench", "bench=concurrency",
                             "bench.sweep={prefill.beside_sms:[0,16,32],decode:{cpu_join:[signal,host]}}"])).bench
    assert b.sweep == {"prefill.beside_sms": [0, 16, 32], "decode.cpu_join": ["signal", "host"]}
    assert len(points(b.sweep)) == 6 and points(b.sweep)[1] == {"prefill.beside_sms": 0, "decode.cpu_join": "host"}
    assert points(None) == [{}] == points({})
    assert {"prefill.beside_sms", "cpu.threads", "adapt_to_hardware"} <= set(policy_keys())
    b = to_settings(compose(["mode=bench", "bench=prefill", "+bench.sweep.prefill.ring_len=[8,32]"])).bench
    assert b.sweep == {"prefill.ring_len": [8, 32]}


@pytest.mark.parametrize("sweep, error", [
    ("{beside_sms:[0,16]}", "bench.sweep: beside_sms is not a policy key (did you mean prefill.beside_sms?)"),
    ("{prefill.beside_sm:[0]}", "prefill.beside_sm is not a policy key (did you mean prefill.beside_sms"),
    ("{prefill.beside_sms:16}", "bench.sweep.prefill.beside_sms: a list of values"),
    ("{prefill.beside_sms:[]}", "bench.sweep.prefill.beside_sms: a list of values"),
    ("{prefill.beside_sms:[0,x]}", "bench.sweep at prefill.beside_sms x: Value 'x' of type 'str' could not be"),
    ("{prefill.beside_sms:[0,-1]}", "bench.sweep at prefill.beside_sms -1: policy.prefill.beside_sms must be >= 0"),
    ("{decode.cpu_join:[signal,hostfn]}", "decode.cpu_join must be one of null, signal, host, got 'hostfn'"),
    ("{prefill.stream_cap_gbps:[0]}", "policy.prefill.stream_cap_gbps must be > 0 GB/s or null"),
])
def test_sweep_refused_before_anything_runs(sweep, error):
    """An unknown key with the close ones named; every value built into the policy, its own checks' errors."""
    with pytest.raises(ConfigError) as e:
        settings_of(compose(["mode=bench", "bench=concurrency", f"bench.sweep={sweep}"]))
    assert error in str(e.value), str(e.value)

