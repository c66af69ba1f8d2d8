"""The tuner's parts, in-process and fast: the search space and its version, which overrides trials get, which
trial wins, the written policy and the profile that selects it, a trial's subprocess and its deadline."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from hybrid.config.compose import to_settings
from hybrid.config.schema import PolicyConfig, register as register_engine
from tests.tuner.conftest import alive
from tuner import policy, space as sp, trial
from tuner.config import TuneConfig, flat_params, register as register_tuner
from tuner.select import knee, pareto_front
from tuner.study import counted, trial_overrides


@pytest.fixture
def tune_cfg(conf):
    """Compose conf/tune.yaml like `python -m tuner` (with the tuner's schema), then give the engine its own back."""
    def make(*overrides: str) -> TuneConfig:
        register_tuner()
        try:
            with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
                return to_settings(compose(config_name="tune", overrides=["+hw=cpu_only", *overrides]))
        finally:
            register_engine()
    return make


def engine_cfg(conf: Path, *overrides: str):
    register_engine()
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        return to_settings(compose(config_name="config", overrides=list(overrides)))


# ------------------------------------------------------------------------------------------------------- space

def test_space_from_conf_resolved_for_the_machine(tune_cfg):
    cfg = tune_cfg()
    assert isinstance(cfg, TuneConfig) and cfg.bench.name == "slo" and cfg.hw.name == "cpu_only"
    assert cfg.policy == PolicyConfig(), "the engine's values survive the tuner's schema"
    space = sp.resolve(cfg, cores=4, kernels=["avx2", "generic"])
    assert space["cpu.threads"] == {"type": "int", "low": 1, "high": 4, "log": False}
    assert space["cpu.kernel"]["choices"] == [None, "avx2", "generic"]  # avx512_bf16 dropped: this CPU lacks it
    assert space["cpu.gemm_tile_tokens"]["choices"] == [8, 16, 32, 64, 128]
    assert space["cpu.moe_backend"]["choices"] == ["native", "torch"]


def test_space_overridable_and_versioned(tune_cfg):
    base = tune_cfg()
    s0 = sp.resolve(base, 2, ["avx2"])
    name0 = sp.study_name(base, s0)
    assert name0.startswith("cpu_only-tiny-constrained-v")
    narrowed = tune_cfg("tuner.space.cpu.gemm_tile_tokens.choices=[16,64]", "~tuner.space.cpu.moe_backend",
                        "tuner.space.cpu.threads.high=4")
    s1 = sp.resolve(narrowed, 2, ["avx2"])
    assert s1["cpu.gemm_tile_tokens"]["choices"] == [16, 64] and "cpu.moe_backend" not in s1
    assert s1["cpu.threads"]["high"] == 4
    assert sp.study_name(narrowed, s1) != name0, "another space is another study"
    pareto = tune_cfg("tuner.objective=pareto")
    assert sp.directions(pareto) == ["minimize", "minimize"]
    assert sp.study_name(pareto, s0).startswith("cpu_only-tiny-pareto-v") and sp.study_name(pareto, s0) != name0
    assert sp.study_name(tune_cfg("bench.new_tokens=8"), s0) != name0, "other bench sizes are other measurements"
    assert sp.study_name(tune_cfg("tuner.n_trials=99"), s0) == name0, "more trials: the same study"


def test_space_rejects_what_is_not_a_knob(tune_cfg):
    for bad in ("+tuner.space.nope={type:int,low:1,high:2}", "+tuner.space.cpu.nope={type:int,low:1,high:2}",
                "+tuner.space.cpu_threads={type:int,low:1,high:2}"):  # the flat name of before
        with pytest.raises(Exception, match="not a policy knob"):
            tune_cfg(bad)


def test_space_knobs_join_by_path(tune_cfg):
    cfg = tune_cfg("+tuner.space.prefill.ring_len={type: categorical, choices: [16, 64]}",
                   "+tuner.space.kv.max_batch={type: int, low: 6, high: 8}")
    space = sp.resolve(cfg, 2, ["avx2"])
    assert space["prefill.ring_len"]["choices"] == [16, 64] and space["kv.max_batch"]["high"] == 8
    assert trial.command([], {"prefill.ring_len": "16"})[-1] == "policy.prefill.ring_len=16"


def test_warm_start_is_the_current_policy(tune_cfg):
    cfg = tune_cfg("policy.cpu.gemm_tile_tokens=16", "policy.cpu.moe_backend=torch")
    space = sp.resolve(cfg, 2, ["avx512_bf16", "avx2", "generic"])
    assert sp.warm_start(cfg, space, cores=2) == {"cpu.threads": 2, "cpu.gemm_tile_tokens": 16,
                                                  "cpu.moe_backend": "torch", "cpu.kernel": None}
    cfg = tune_cfg("policy.cpu.gemm_tile_tokens=7")  # outside the space: left to the sampler
    assert "cpu.gemm_tile_tokens" not in sp.warm_start(cfg, space, cores=2)


def test_null_is_a_choice(tune_cfg):
    cfg = tune_cfg("+tuner.space.prefill.slp_group_experts={type: categorical, choices: [null, 1, 16]}",
                   "+tuner.space.prefill.ring_len={type: int, low: 2, high: 64}",
                   "policy.prefill.slp_group_experts=16")
    space = sp.resolve(cfg, 2, ["avx2"])
    start = sp.warm_start(cfg, space, cores=2)
    assert start["prefill.slp_group_experts"] == 16
    assert "prefill.ring_len" not in start, "null (auto) lies in no int range: left to the sampler"
    assert sp.warm_start(tune_cfg("+tuner.space.prefill.slp_group_experts={type: categorical, choices: [null, 16]}"),
                         space, cores=2)["prefill.slp_group_experts"] is None
    cfg = tune_cfg("+tuner.space.prefill.ring_len={type: int, low: 2, high: 64}", "policy.prefill.ring_len=8")
    assert sp.warm_start(cfg, sp.resolve(cfg, 2, ["avx2"]), cores=2)["prefill.ring_len"] == 8
    assert sp.as_override_value(None) == "null"
    assert policy.checked(PolicyConfig(), {"cpu.kernel": None, "prefill.ring_len": 8}).prefill.ring_len == 8


def test_enqueued_trials_nested_or_by_path(tune_cfg):
    cfg = tune_cfg("tuner.enqueue=[{cpu: {threads: 2, kernel: null}}, {cpu.gemm_tile_tokens: 16}]")
    space = sp.resolve(cfg, 2, ["avx2"])
    assert [sp.in_space(flat_params(e), space) for e in cfg.tuner.enqueue] == [
        {"cpu.threads": 2, "cpu.kernel": None}, {"cpu.gemm_tile_tokens": 16}]


def test_trials_get_the_users_overrides_but_not_the_tuners():
    got = trial_overrides(["+hw=cpu_only", "model=tiny", "tuner.n_trials=6", "+tuner.x=1", "mode=generate",
                           "bench=kernels", "output=text", "bench.new_tokens=8", "policy.cpu.threads=3",
                           "policy.kv.max_batch=4", "tracking.enabled=false"], {"cpu.threads": {}})
    assert got == ["+hw=cpu_only", "model=tiny", "bench.new_tokens=8", "policy.kv.max_batch=4",
                   "tracking.enabled=false"]
    cmd = trial.command(got, {"cpu.threads": "2", "cpu.kernel": sp.as_override_value(None)})
    assert cmd[1:6] == ["-m", "hybrid", "mode=bench", "bench=slo", "output=json"]
    assert cmd[-2:] == ["policy.cpu.threads=2", "policy.cpu.kernel=null"]


def test_trial_module_is_configurable_and_checked(tune_cfg):
    assert tune_cfg().tuner.trial_module == "hybrid"
    cfg = tune_cfg("tuner.trial_module=tests.tuner.faulty_bench")
    cmd = trial.command([], {}, cfg.tuner.trial_module)
    assert cmd[1:4] == ["-m", "tests.tuner.faulty_bench", "mode=bench"]
    with pytest.raises(Exception, match="tuner.trial_module must be a module name"):
        tune_cfg("tuner.trial_module='hybrid; rm'")


# ---------------------------------------------------------------------------------------------------- selection

def test_pareto_front_and_knee():
    pts = [(0, 1.0, 9.0), (1, 2.0, 2.0), (2, 9.0, 1.0), (3, 3.0, 3.0), (4, 2.0, 2.5)]
    assert pareto_front(pts) == {0, 1, 2}
    assert knee([(n, (a, b)) for n, a, b in pts if n in {0, 1, 2}], ["minimize", "minimize"]) == 1
    assert knee([(0, (5.0,)), (1, (7.0,))], ["maximize"]) == 1


def test_counted_trials():
    from types import SimpleNamespace as T

    from optuna.trial import TrialState as S

    trials = [T(state=S.COMPLETE, user_attrs={}), T(state=S.FAIL, user_attrs={"failure": "crash"}),
              T(state=S.FAIL, user_attrs={"failure": "deadline"}), T(state=S.FAIL, user_attrs={}),  # stale
              T(state=S.FAIL, user_attrs={"failure": "interrupted"}), T(state=S.RUNNING, user_attrs={}),
              T(state=S.WAITING, user_attrs={})]
    assert counted(trials) == 3


# ------------------------------------------------------------------------------------------------------- policy

def test_written_policy_is_what_plus_hw_composes(conf):
    tuned = policy.checked(PolicyConfig(), {"cpu.threads": 1, "cpu.gemm_tile_tokens": 16, "cpu.moe_backend": "torch",
                                            "prefill.ring_len": 16})
    path = policy.write(conf, "cpu_only", tuned, policy.header("s-v1", 3, "decode_tok_s = 100", "sqlite:///x"))
    text = path.read_text()
    assert text.startswith("# The tuned policy") and "trial: 3" in text
    assert "cpu:\n  # Threads of the CPU" in text and "\n  threads: 1\n" in text and "\n  kernel: null\n" in text
    default = (conf / "policy" / "default.yaml").read_text()
    comments = [line.strip() for line in default.splitlines() if line.lstrip().startswith("#")]
    assert all(c in text for c in comments[3:]), "every knob's and group's comment of default.yaml is carried"
    hw_path, changed = policy.select_in_hw_profile(conf, "cpu_only")
    assert changed and "override /policy@_global_.policy: cpu_only" in hw_path.read_text()
    before = hw_path.read_text()
    assert policy.select_in_hw_profile(conf, "cpu_only") == (hw_path, False) and hw_path.read_text() == before

    assert engine_cfg(conf, "+hw=cpu_only").policy == tuned
    assert engine_cfg(conf, "+hw=cpu_only", "policy.cpu.threads=2").policy.cpu.threads == 2  # still overridable
    assert engine_cfg(conf, "+hw=cpu_only", "policy=default").policy == PolicyConfig()  # an explicit choice wins
    assert engine_cfg(conf, "+hw=epyc2x_5090x2").policy == PolicyConfig()  # other profiles: untouched
    assert engine_cfg(conf).policy == PolicyConfig()  # no profile: the default


def test_policy_checked_by_the_schema():
    with pytest.raises(ValueError, match=r"policy\.decode\.batch_cap"):
        policy.checked(PolicyConfig(), {"decode.batch_cap": 99})
    with pytest.raises(Exception, match=r"cpu\.threads"):
        policy.checked(PolicyConfig(), {"cpu.threads": "many"})
    with pytest.raises(Exception, match="cpu_threads"):  # not a knob
        policy.checked(PolicyConfig(), {"cpu_threads": 2})


# -------------------------------------------------------------------------------------------------- a trial run

def _py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_trial_outcomes(tmp_path):
    records = {"records": [{"name": "ttft_s", "value": 0.5, "unit": "s"},
                           {"name": "decode_tok_s", "value": 10.0, "unit": "tok/s", "bound": 20.0,
                            "fraction_of_bound": 0.5}]}
    ok = trial.run(_py(f"print('noise'); print({json.dumps(json.dumps(records))})"), dict(os.environ), 30, tmp_path / "ok.log")
    assert ok.status == "ok" and ok.metrics == {"ttft_s": 0.5, "decode_tok_s": 10.0, "decode_tok_s.of_bound": 0.5}
    crash = trial.run(_py("import sys; sys.exit('error: bad knob')"), dict(os.environ), 30, tmp_path / "crash.log")
    assert crash.status == "crash" and crash.returncode == 1 and trial.reason(crash.detail) == "error: bad knob"
    oom = trial.run(_py("raise MemoryError('x')"), dict(os.environ), 30, tmp_path / "oom.log")
    assert oom.status == "oom"
    silent = trial.run(_py("pass"), dict(os.environ), 30, tmp_path / "silent.log")
    assert silent.status == "crash" and "without records" in silent.detail


def test_trial_deadline_kills_the_process_group(tmp_path):
    pids = tmp_path / "pids"
    code = ("import os, subprocess, time\n"
            "child = subprocess.Popen(['sleep', '120'])\n"
            f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{child.pid}}')\n"
            "time.sleep(120)\n")
    t0 = time.monotonic()
    out = trial.run(_py(code), dict(os.environ), 2.0, tmp_path / "t.log")
    assert out.status == "deadline" and time.monotonic() - t0 < 20
    leader, child = map(int, pids.read_text().split())
    assert leader == out.pid
    deadline = time.monotonic() + 5
    while (alive(leader) or alive(child)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(leader) and not alive(child), "the trial's whole process group is gone"
