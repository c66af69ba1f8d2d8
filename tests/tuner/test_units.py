"""The tuner's parts, in-process and fast: the search space per kind of profile and its version, which knobs need
a reload, the objectives, which overrides the trial worker gets, the written policy and the profile that selects
it."""
from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from hybrid.config.compose import to_settings
from hybrid.config.schema import PolicyConfig, register as register_engine
from hybrid.plan.plan import rebuildable
from hybrid.errors import ConfigError
from tuner import policy, space as sp, trial
from tuner.config import TuneConfig, flat_params, register as register_tuner
from tuner.select import pareto_front
from tuner.cutoff import spread
from tuner.study import counted, trial_overrides


@pytest.fixture
def tune_cfg(conf):
    """Compose conf/tune.yaml like `python -m tuner` (with the tuner's schema), then give the engine its own back."""
    def make(*overrides: str, hw: str = "cpu_only") -> TuneConfig:
        register_tuner()
        try:
            with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
                return to_settings(compose(config_name="tune", overrides=[f"+hw={hw}", *overrides]))
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
    space = sp.resolve(cfg, False, cores=4, kernels=["avx2", "generic"])
    assert space["cpu.threads"] == {"type": "int", "low": 1, "high": 4, "log": False}
    assert space["cpu.kernel"]["choices"] == [None, "avx2", "generic"]  # the AVX-512 ones dropped: this CPU lacks them
    no_bf16 = sp.resolve(cfg, False, cores=4, kernels=["avx512", "avx2", "generic"])  # AVX-512 without BF16
    assert no_bf16["cpu.kernel"]["choices"] == [None, "avx512", "avx2", "generic"]
    assert space["cpu.gemm_tile_tokens"]["choices"] == [None, 8, 16, 32, 64, 128]
    assert space["cpu.moe_backend"]["choices"] == ["native", "torch"]


def test_space_overridable_and_versioned(tune_cfg):
    base = tune_cfg()
    s0 = sp.resolve(base, False, 2, ["avx2"])
    name0 = sp.study_name(base, s0)
    assert name0.startswith("cpu_only-tiny-goodput-v")
    narrowed = tune_cfg("tuner.spaces.cpu_only.cpu.gemm_tile_tokens.choices=[16,64]",
                        "~tuner.spaces.cpu_only.cpu.moe_backend", "tuner.spaces.cpu_only.cpu.threads.high=4")
    s1 = sp.resolve(narrowed, False, 2, ["avx2"])
    assert s1["cpu.gemm_tile_tokens"]["choices"] == [16, 64] and "cpu.moe_backend" not in s1
    assert s1["cpu.threads"]["high"] == 4
    assert sp.study_name(narrowed, s1) != name0, "another space is another study"
    pareto = tune_cfg("tuner.objective=pareto")
    assert sp.directions(pareto) == ["minimize", "minimize"]
    assert sp.study_name(pareto, s0).startswith("cpu_only-tiny-pareto-v") and sp.study_name(pareto, s0) != name0
    assert sp.study_name(tune_cfg("workload.requests=8"), s0) != name0, "another load is another measurement"
    assert sp.study_name(tune_cfg("bench.new_tokens=8"), s0) == name0, "the workload's study ignores bench=slo"
    slo = tune_cfg("tuner.objective=decode_tok_s")
    assert sp.study_name(tune_cfg("tuner.objective=decode_tok_s", "bench.new_tokens=8"), s0) != \
        sp.study_name(slo, s0), "other bench sizes are other measurements"
    assert sp.study_name(tune_cfg("tuner.n_trials=99"), s0) == name0, "more trials: the same study"
    assert sp.study_name(tune_cfg("tuner.sampler=grid"), s0).startswith("cpu_only-tiny-goodput-grid-v")


def test_space_rejects_what_is_not_a_knob(tune_cfg):
    for bad in ("+tuner.spaces.gpu.nope={type:int,low:1,high:2}",
                "+tuner.spaces.cpu_only.cpu.nope={type:int,low:1,high:2}",
                "+tuner.spaces.cpu_only.cpu_threads={type:int,low:1,high:2}"):  # the flat name of before
        with pytest.raises(Exception, match="not a policy knob"):
            tune_cfg(bad)


def test_every_value_of_the_default_spaces_is_a_policy_value(tune_cfg):
    """Both kinds of profile, every choice and range end through the policy's schema (resolve checks them): the GPU
    space's `cuda_graphs: off` once read as YAML's false and failed its trials."""
    cfg = tune_cfg()
    for gpu in (False, True):
        space = sp.resolve(cfg, gpu, cores=4, kernels=["avx512_bf16", "avx2", "generic"])
        assert space, "a space to check"
    assert "off" in sp.resolve(cfg, True, 4, ["avx2"])["decode.cuda_graphs"]["choices"]
    # a value valid on its own though not beside the current policy's others (max_batch 4 < batch_cap 6): kept, the
    # trial that samples it with a larger batch cap is the one refused
    wide = tune_cfg("+tuner.spaces.gpu.kv.max_batch={type: int, low: 4, high: 8, reload: true}")
    assert sp.resolve(wide, True, 4, ["avx2"])["kv.max_batch"]["low"] == 4


def test_a_space_value_the_policy_refuses_fails_before_any_trial(tune_cfg):
    cases = [("tuner.spaces.gpu.decode.cuda_graphs.choices=[hostfn,false]", True, "quote it"),
             ("tuner.spaces.cpu_only.cpu.gemm_tile_tokens.choices=[16,0]", False, "gemm_tile_tokens"),
             ("tuner.spaces.cpu_only.cpu.threads.low=0", False, "cpu.threads")]
    for override, gpu, what in cases:
        with pytest.raises(ConfigError, match=what) as e:
            sp.resolve(tune_cfg(override), gpu, cores=4, kernels=["avx2"])
        assert str(e.value).startswith(f"tuner.spaces.{'gpu' if gpu else 'cpu_only'}.")


def test_space_knobs_join_by_path(tune_cfg):
    cfg = tune_cfg("+tuner.spaces.cpu_only.prefill.ring_len={type: categorical, choices: [16, 64]}",
                   "+tuner.spaces.cpu_only.kv.max_batch={type: int, low: 6, high: 8}")
    space = sp.resolve(cfg, False, 2, ["avx2"])
    assert space["prefill.ring_len"]["choices"] == [16, 64] and space["kv.max_batch"]["high"] == 8
    assert sp.reload_knobs(cfg, False, rebuildable()) == {"cpu.kernel", "cpu.moe_backend", "cpu.numa",
                                                          "kv.max_batch"}, "untagged: as the engine says"


def test_warm_start_is_the_current_policy(tune_cfg):
    cfg = tune_cfg("policy.cpu.gemm_tile_tokens=16", "policy.cpu.moe_backend=torch")
    space = sp.resolve(cfg, False, 2, ["avx512_bf16", "avx2", "generic"])
    assert sp.warm_start(cfg, space, cores=2) == {"cpu.threads": 2, "cpu.gemm_tile_tokens": 16,
                                                  "cpu.moe_backend": "torch", "cpu.kernel": None, "cpu.numa": None}
    cfg = tune_cfg("policy.cpu.gemm_tile_tokens=7")  # outside the space: left to the sampler
    assert "cpu.gemm_tile_tokens" not in sp.warm_start(cfg, space, cores=2)


def test_null_is_a_choice(tune_cfg):
    cfg = tune_cfg("+tuner.spaces.cpu_only.prefill.slp_group_experts={type: categorical, choices: [null, 1, 16]}",
                   "+tuner.spaces.cpu_only.prefill.ring_len={type: int, low: 2, high: 64}",
                   "policy.prefill.slp_group_experts=16")
    space = sp.resolve(cfg, False, 2, ["avx2"])
    start = sp.warm_start(cfg, space, cores=2)
    assert start["prefill.slp_group_experts"] == 16
    assert "prefill.ring_len" not in start, "null (auto) lies in no int range: left to the sampler"
    assert sp.warm_start(tune_cfg("+tuner.spaces.cpu_only.prefill.slp_group_experts={type: categorical, "
                                  "choices: [null, 16]}"), space, cores=2)["prefill.slp_group_experts"] is None
    cfg = tune_cfg("+tuner.spaces.cpu_only.prefill.ring_len={type: int, low: 2, high: 64}",
                   "policy.prefill.ring_len=8")
    assert sp.warm_start(cfg, sp.resolve(cfg, False, 2, ["avx2"]), cores=2)["prefill.ring_len"] == 8
    assert sp.as_override_value(None) == "null"
    assert policy.checked(PolicyConfig(), {"cpu.kernel": None, "prefill.ring_len": 8}).prefill.ring_len == 8


def test_enqueued_trials_nested_or_by_path(tune_cfg):
    cfg = tune_cfg("tuner.enqueue=[{cpu: {threads: 2, kernel: null}}, {cpu.gemm_tile_tokens: 16}]")
    space = sp.resolve(cfg, False, 2, ["avx2"])
    assert [sp.in_space(flat_params(e), space) for e in cfg.tuner.enqueue] == [
        {"cpu.threads": 2, "cpu.kernel": None}, {"cpu.gemm_tile_tokens": 16}]


def test_trials_get_the_users_overrides_but_not_the_tuners():
    got = trial_overrides(["+hw=cpu_only", "model=tiny", "tuner.n_trials=6", "+tuner.x=1", "mode=generate",
                           "bench=kernels", "output=text", "bench.new_tokens=8", "policy.cpu.threads=3",
                           "policy.kv.max_batch=4", "tracking.enabled=false"], {"cpu.threads": {}})
    assert got == ["+hw=cpu_only", "model=tiny", "bench.new_tokens=8", "policy.kv.max_batch=4",
                   "tracking.enabled=false"]
    assert trial.command("tuner.worker", got)[1:4] == ["-m", "tuner.worker", "+hw=cpu_only"]
    assert sp.as_override_value(None) == "null" and sp.as_override_value(True) == "true"


def test_trial_module_is_configurable_and_checked(tune_cfg):
    assert tune_cfg().tuner.trial_module == "tuner.worker"
    cfg = tune_cfg("tuner.trial_module=tests.tuner.faulty_bench")
    assert trial.command(cfg.tuner.trial_module, ["model=tiny"])[1:4] == ["-m", "tests.tuner.faulty_bench",
                                                                          "model=tiny"]
    with pytest.raises(Exception, match="tuner.trial_module must be a module name"):
        tune_cfg("tuner.trial_module='hybrid; rm'")


# ---------------------------------------------------------------------------------------------------- selection

def test_pareto_front():
    pts = [(0, 1.0, 9.0), (1, 2.0, 2.0), (2, 9.0, 1.0), (3, 3.0, 3.0), (4, 2.0, 2.5)]
    assert pareto_front(pts) == {0, 1, 2}


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


# ------------------------------------------------------------------------------------------- spaces, objectives

def test_a_gpu_profile_gets_the_gpu_space(tune_cfg):
    gpu, cpu = tune_cfg(hw="h200_xeon16"), tune_cfg()
    assert bool(gpu.hw.gpus) and not cpu.hw.gpus
    space = sp.resolve(gpu, bool(gpu.hw.gpus), cores=16, kernels=["avx512_bf16", "avx2", "generic"])
    assert set(space) == {"prefill.slp_cutoff_tokens", "prefill.ring_len", "prefill.chunk_tokens",
                          "prefill.slp_group_experts", "prefill.beside_decode", "prefill.stream_cap_gbps",
                          "prefill.stream_duty", "prefill.beside_cores", "prefill.cores_back_in_rests",
                          "prefill.beside_sms", "decode.batch_cap", "decode.cuda_graphs", "decode.dual_batch",
                          "gpu.experts_per_layer", "cpu.threads"}
    assert space["cpu.threads"]["high"] == 16 and space["decode.batch_cap"]["high"] <= gpu.policy.kv.max_batch
    assert sp.reload_knobs(gpu, True, rebuildable()) == set(), "a GPU trial never reloads the model"
    assert set(sp.resolve(cpu, bool(cpu.hw.gpus), 2, ["avx2"])) == {"cpu.threads", "cpu.gemm_tile_tokens",
                                                                     "cpu.moe_backend", "cpu.kernel", "cpu.numa"}
    assert sp.reload_knobs(cpu, False, rebuildable()) == {"cpu.kernel", "cpu.moe_backend", "cpu.numa"}
    bad = tune_cfg("tuner.spaces.cpu_only.cpu.kernel.reload=false")
    with pytest.raises(Exception, match="cannot change it without placing the model again"):
        sp.reload_knobs(bad, False, rebuildable())
    with pytest.raises(Exception, match="one space per kind"):
        tune_cfg("+tuner.spaces.tpu={}")


def test_objectives(tune_cfg):
    assert (sp.objective_metrics(tune_cfg()), sp.directions(tune_cfg())) == (["goodput_req_s"], ["maximize"])
    assert sp.limits(tune_cfg()) == {"errors": 0.0}, "a failed request makes a workload trial infeasible"
    ttft = tune_cfg("tuner.objective=ttft_p90", "workload.tpot_limit_s=0.05", "+tuner.limits.e2e_p90_s=9")
    assert sp.directions(ttft) == ["minimize"] and sp.limits(ttft) == {"errors": 0.0, "tpot_p90_s": 0.05,
                                                                       "e2e_p90_s": 9.0}
    pareto = tune_cfg("tuner.objective=pareto")
    assert sp.objective_metrics(pareto) == ["ttft_p90_s", "tpot_p90_s"]
    slo = tune_cfg("tuner.objective=decode_tok_s")
    assert slo.tuner.goal.measure == "slo" and sp.limits(slo) == {}
    assert sp.measured(slo) == {"bench": {"name": "slo", "prompt_tokens": 256, "new_tokens": 32, "batch": 1}}
    assert sp.measured(pareto)["workload"]["name"] == "chat"


def test_grid_and_crossover_lengths(tune_cfg):
    cfg = tune_cfg("tuner.sampler=grid", "tuner.spaces.cpu_only.cpu.threads.high=3",
                   "tuner.spaces.cpu_only.cpu.gemm_tile_tokens.choices=[8,64]")
    space = sp.resolve(cfg, False, 2, ["avx2"])
    grid = sp.grid(space)
    assert grid["cpu.threads"] == [1, 2, 3] and grid["cpu.gemm_tile_tokens"] == [8, 64]
    assert spread(32, 256, 5) == [32, 54, 91, 152, 256] and spread(64, 64, 5) == [64]
