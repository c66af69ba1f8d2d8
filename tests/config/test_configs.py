"""Every option of every config group composes and validates; bad overrides fail clearly, naming the knob.

Options are found on disk (conf/<group>/*.yaml), so a new yaml is tested without touching this file. Hardware is
not in the defaults list: a profile is appended with `+hw=NAME`.
"""
from __future__ import annotations

from dataclasses import asdict

import pytest
import yaml
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import ConfigCompositionException, HydraException, MissingConfigException
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException, ValidationError

from hybrid.config import CONF_DIR, HybridConfig, compose, to_settings
from hybrid.config.compose import unknown_override
from hybrid.errors import ConfigError
from hybrid.config.schema import KERNELS, CpuSpec, GpuSpec, Mode, PolicyConfig
from hybrid.model.args import ModelArgs
from hybrid.weights.presets import hf_config

GROUPS = ("model", "hw", "policy", "mode")


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def _yaml(group: str, name: str) -> dict:
    return yaml.safe_load((CONF_DIR / group / f"{name}.yaml").read_text()) or {}


def _settings(overrides: list[str]) -> HybridConfig:
    return to_settings(compose(overrides))


def _flat(tree: dict, prefix: str = "") -> dict:
    """{"cpu": {"threads": 2}} -> {"cpu.threads": 2}"""
    out = {}
    for key, value in tree.items():
        out.update(_flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {prefix + key: value})
    return out


def _needs_path(name: str) -> bool:
    """A model yaml for a checkpoint the user downloads: it gives no generated weights, so needs model.path."""
    return "synthetic" not in _yaml("model", name)


SYNTHETIC_MODELS = [m for m in _options("model") if not _needs_path(m)]
PATH_MODELS = [m for m in _options("model") if _needs_path(m)]


# --------------------------------------------------------------------------------------------- every option

def test_hydra_sees_the_same_options():
    """The options this file iterates over are exactly those Hydra offers (nothing hidden in a ConfigStore)."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        loader = GlobalHydra.instance().config_loader()
        for group in GROUPS:
            assert loader.get_group_options(group) == _options(group), group
    assert SYNTHETIC_MODELS and _options("hw") and _options("policy") and _options("mode")


def test_default_config():
    s = _settings([])
    assert s.model.name == "tiny" and s.model.synthetic is not None and s.model.path is None
    assert s.hw.name == "auto"
    assert s.policy == PolicyConfig() and s.mode == Mode.generate


def test_policy_null_is_auto():
    """The policy's knobs decided at build are null by default; a value or null again is taken on the command line."""
    p = _settings([]).policy
    assert (p.cpu.threads, p.cpu.kernel, p.prefill.ring_len, p.prefill.slp_chunk_tokens, p.prefill.slp_group_experts,
            p.gpu.memory_budget_gb) == (None,) * 6
    p = _settings(["policy.cpu.threads=2", "policy.cpu.kernel=generic", "policy.prefill.ring_len=8",
                   "policy.gpu.memory_budget_gb=40"]).policy
    assert (p.cpu.threads, p.cpu.kernel, p.prefill.ring_len, p.gpu.memory_budget_gb) == (2, "generic", 8, 40.0)
    assert _settings(["+hw=cpu_only", "policy.cpu.threads=null"]).policy.cpu.threads is None


def test_slp_cutoff_defaults_to_the_profiles_crossover():
    """policy.prefill.slp_cutoff_tokens null: the crossover measured for the hw profile, else 128; a value wins."""
    from hybrid.config.schema import DEFAULT_SLP_CUTOFF
    from hybrid.engine.probe import probe
    from hybrid.plan.resolve import resolve

    def slp_cutoff(p, hw):
        return resolve(p, hw, None, probe(hw)).prefill.slp_cutoff_tokens

    s = _settings(["+hw=h200_xeon16"])
    assert s.policy.prefill.slp_cutoff_tokens is None and s.hw.slp_crossover_tokens == 512
    assert slp_cutoff(s.policy, s.hw) == 512
    s = _settings(["+hw=h200_xeon16", "policy.prefill.slp_cutoff_tokens=64"])
    assert slp_cutoff(s.policy, s.hw) == 64
    s = _settings(["+hw=epyc2x_5090x2"])
    assert s.hw.slp_crossover_tokens is None and slp_cutoff(s.policy, s.hw) == DEFAULT_SLP_CUTOFF == 128
    with pytest.raises(ValueError, match="hw.slp_crossover_tokens must be >= 0"):
        _settings(["+hw=h200_xeon16", "hw.slp_crossover_tokens=-1"])


@pytest.mark.parametrize("name", _options("model"))
def test_model_yaml_names_itself(name):
    assert _yaml("model", name).get("name") == name, f"conf/model/{name}.yaml: `name` is not {name!r}"


@pytest.mark.parametrize("name", SYNTHETIC_MODELS)
def test_synthetic_model(name):
    s = _settings([f"model={name}"])
    spec = _yaml("model", name)["synthetic"]
    assert s.model.name == name and s.model.path is None
    assert s.model.synthetic == spec, f"model={name}: composed {s.model.synthetic}, the yaml says {spec}"
    # The spec is one the generator accepts: config.json fields of its preset, an architecture ModelArgs takes.
    args = ModelArgs.from_hf_config(hf_config(spec), f"conf/model/{name}.yaml")
    assert args.num_hidden_layers >= 1


@pytest.mark.parametrize("name", PATH_MODELS or [pytest.param("-", marks=pytest.mark.skip("no path model yaml"))])
def test_path_model_with_path(name, tmp_path):
    s = _settings([f"model={name}", f"model.path={tmp_path}"])
    assert s.model.path == str(tmp_path) and s.model.synthetic is None, s.model
    assert not s.model.in_memory


@pytest.mark.parametrize("name", PATH_MODELS or [pytest.param("-", marks=pytest.mark.skip("no path model yaml"))])
def test_path_model_without_path_fails(name):
    """A model the user downloads needs model.path: never a silent fallback to generated weights."""
    with pytest.raises((ValueError, MissingMandatoryValue)) as e:
        _settings([f"model={name}"])
    assert "model.path" in str(e.value), str(e.value)


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_r1", "kimi_k2"])
def test_release_models_take_a_path(name, tmp_path):
    if not (CONF_DIR / "model" / f"{name}.yaml").exists():
        pytest.skip(f"conf/model/{name}.yaml does not exist")
    assert name in PATH_MODELS, f"conf/model/{name}.yaml should name a downloaded checkpoint (model.path)"


@pytest.mark.parametrize("name", _options("hw"))
def test_hw_profile(name):
    s = _settings([f"+hw={name}"])
    assert s.hw.name == name, f"conf/hw/{name}.yaml: name {s.hw.name!r}"
    assert isinstance(s.hw.cpu, CpuSpec) and all(isinstance(g, GpuSpec) for g in s.hw.gpus)
    raw = _yaml("hw", name)
    assert len(s.hw.gpus) == len(raw.get("gpus", [])) and s.hw.cpu.isa == raw["cpu"]["isa"]


@pytest.mark.parametrize("name", _options("policy"))
def test_policy(name):
    s = _settings([f"policy={name}"])
    assert isinstance(s.policy, PolicyConfig)
    composed = _flat(asdict(s.policy))
    for key, value in _flat(_yaml("policy", name)).items():
        assert key in composed and composed[key] == value, f"policy={name}: {key}"
    if name == "default":
        assert s.policy == PolicyConfig(), "conf/policy/default.yaml differs from the schema's defaults"


@pytest.mark.parametrize("name", _options("mode"))
def test_mode(name):
    assert _settings([f"mode={name}"]).mode == Mode(name)


@pytest.mark.parametrize("hw", _options("hw"))
@pytest.mark.parametrize("model", SYNTHETIC_MODELS[:2])
def test_groups_combine(model, hw):
    overrides = [f"model={model}", f"+hw={hw}"] + [f"{g}={_options(g)[0]}" for g in ("policy", "mode")]
    s = _settings(overrides)
    assert (s.model.name, s.hw.name) == (model, hw), overrides


# ------------------------------------------------------------------------------------------------- failures

def test_unknown_key():
    with pytest.raises(ConfigCompositionException, match=r"policy\.prefill\.ring_lenn") as e:
        compose(["policy.prefill.ring_lenn=3"])
    assert "+policy.prefill.ring_lenn" in str(e.value)  # Hydra's hint; a schema node refuses it anyway


def test_unknown_key_appended_is_still_refused():
    """`+` must not smuggle a misspelt knob past the schema (it would be silently ignored)."""
    with pytest.raises((OmegaConfBaseException, HydraException, ValueError)) as e:
        to_settings(compose(["+policy.prefill.ring_lenn=3"]))
    assert "policy.prefill.ring_lenn" in str(e.value) + str(e.value.__cause__)


def test_policy_kernel_choices_are_the_native_variants():
    from hybrid.kernels.dispatch import VARIANTS

    assert KERNELS == VARIANTS


def test_unknown_override_is_named_in_one_line():
    """What the command lines check before Hydra composes (whose own error spans several lines)."""
    assert unknown_override(["policy.kv.max_context=128", "model=tiny", "+hw=cpu_only", "~policy.cpu",
                             "model.synthetic.num_hidden_layers=2", "hydra.run.dir=x", "--cfg", "job"]) is None
    assert unknown_override(["policy.kv.max_contxt=1"]) == (
        "unknown config key policy.kv.max_contxt (known: block_tokens, cache_gb, host_cache_gb, max_batch, max_context, "
        "prefix_cache)")
    assert "now policy.prefill.ring_len" in unknown_override(["policy.ring_len=8"])
    assert unknown_override(["hw.cpu.core=2"]).startswith("unknown config key hw.cpu.core (known: cores,")


@pytest.mark.parametrize("override, expect", [
    ("policy.decode.batch_cap=abc", "could not be converted to Integer"),
    ("policy.prefill.ring_len=auto", "could not be converted to Integer"),  # null is auto
    ("policy.adapt_to_hardware=maybe", "not a valid bool"),
    ("max_new_tokens=1.5", "could not be converted to Integer"),
    ("output=xml", "expected one of [text, json]"),
    ("model.dtype=float64", "expected one of [bfloat16, float32]"),
])
def test_wrong_type(override, expect):
    key, value = override.split("=")
    with pytest.raises(ConfigCompositionException) as e:
        compose([override])
    assert key in str(e.value), str(e.value)
    cause = e.value.__cause__
    assert isinstance(cause, ValidationError), repr(cause)
    assert expect in str(cause) and f"full_key: {key}" in str(cause), str(cause)


@pytest.mark.parametrize("overrides, knob", [
    (["policy.prefill.ring_len=0"], "policy.prefill.ring_len"),
    (["policy.prefill.slp_group_experts=0"], "policy.prefill.slp_group_experts"),
    (["policy.prefill.slp_chunk_tokens=0"], "policy.prefill.slp_chunk_tokens"),  # null is auto
    (["policy.prefill.chunk_tokens=0"], "policy.prefill.chunk_tokens"),
    (["policy.prefill.attention_chunk_tokens=-1"], "policy.prefill.attention_chunk_tokens"),  # 0: one call
    (["policy.prefill.beside_cores=-1"], "policy.prefill.beside_cores"),
    (["policy.prefill.stream_queue_mb=-1"], "policy.prefill.stream_queue_mb"),  # 0: no bound
    (["policy.prefill.beside_sms=-1"], "policy.prefill.beside_sms"),  # 0: every SM
    (["policy.prefill.stream_duty=0"], "policy.prefill.stream_duty"),  # a share of the time in (0, 1]
    (["policy.prefill.stream_duty=1.5"], "policy.prefill.stream_duty"),
    (["mode=bench", "bench=concurrency", "bench.sweep={prefill.stream_duty:[0.5,0]}"], "prefill.stream_duty 0"),
    (["policy.kv.max_batch=0"], "policy.kv.max_batch"),
    (["policy.kv.max_context=0"], "policy.kv.max_context"),
    (["policy.cpu.kernel=avx9"], "policy.cpu.kernel"),
    (["policy.cpu.kernel=auto"], "policy.cpu.kernel"),  # null is auto
    (["policy.cpu.threads=0"], "policy.cpu.threads"),  # null is all physical cores
    (["policy.cpu.moe_backend=numpy"], "policy.cpu.moe_backend"),
    (["policy.cpu.amx_min_tokens=0"], "policy.cpu.amx_min_tokens"),  # null: 4, or 1 under decode.batch_invariant
    (["policy.decode.cuda_graphs=always"], "policy.decode.cuda_graphs"),
    (["policy.gpu.memory_budget_gb=0"], "policy.gpu.memory_budget_gb"),  # null is all free memory
    (["policy.gpu.weights=int4"], "policy.gpu.weights"),
    (["policy.gpu.fp8_gemm=cutlass"], "policy.gpu.fp8_gemm"),
    (["policy.gpu.experts_per_layer=-1"], "policy.gpu.experts_per_layer"),
    (["max_new_tokens=0"], "max_new_tokens"),
    (["+hw=cpu_only", "hw.cpu.sockets=0"], "hw.cpu"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_invalid_value(overrides, knob):
    """Caught by a `__post_init__` check when the config becomes dataclasses; it composes fine."""
    cfg = compose(overrides)
    with pytest.raises(ValueError) as e:
        to_settings(cfg)
    # OmegaConf passes the ValueError through as raised: not wrapped in one of its own errors.
    assert not isinstance(e.value, OmegaConfBaseException), repr(e.value)
    assert knob in str(e.value), f"{overrides}: {e.value}"


@pytest.mark.parametrize("overrides, knob", [
    (["policy.decode.batch_cap=99"], "policy.decode.batch_cap"),  # > kv.max_batch (8)
    (["policy.kv.max_batch=4"], "policy.kv.max_batch"),  # < decode.batch_cap (6)
    (["policy.cpu.amx_min_tokens=4", "policy.decode.batch_invariant=true"], "policy.cpu.amx_min_tokens=4 contradicts"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_contradicting_knobs(overrides, knob):
    """Valid alone, refused together: by the plan's check (hybrid/plan/resolve.py), before anything is built."""
    from hybrid.plan.resolve import check

    with pytest.raises(ConfigError, match=knob):
        check(to_settings(compose(overrides)).policy)


def test_hw_without_plus():
    """hw is not in the defaults list: overriding it is Hydra's error, with the `+` form as the hint."""
    with pytest.raises(ConfigCompositionException, match="Could not override 'hw'") as e:
        compose(["hw=epyc2x_5090x2"])
    assert "+hw=epyc2x_5090x2" in str(e.value)


@pytest.mark.parametrize("override, group", [("model=nope", "model"), ("+hw=nope", "hw"), ("policy=nope", "policy")])
def test_unknown_option(override, group):
    with pytest.raises(MissingConfigException) as e:
        compose([override])
    msg = str(e.value)
    assert f"Could not find '{group}/nope'" in msg
    assert all(option in msg for option in _options(group)), msg  # the options are listed



@pytest.mark.parametrize("override, knob", [("top_p=0", "top_p"), ("top_p=1.5", "top_p"),
                                            ("temperature=-0.1", "temperature"), ("top_k=-1", "top_k")])
def test_invalid_sampling(override, knob):
    """generate mode's sampling settings are checked as a request's (SamplingParams), before anything is built."""
    from hybrid.run import generate_params

    s = to_settings(compose([override]))
    with pytest.raises(ConfigError, match=knob):
        generate_params(s)
