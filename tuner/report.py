"""What a study writes beside its trials' figures: each trial's MLflow params and config, the parent run's params,
and the best policy written as config and checked to compose.
"""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import yaml

from hybrid import tracking
from hybrid.config.compose import CONF_DIR
from tuner import policy as policy_file, space as sp
from tuner.config import TuneConfig
from tuner.storage import redact

# The figures of a trial shown on its progress line (and in the written policy's header)
SHOWN = ("goodput_req_s", "ttft_p90_s", "tpot_p90_s", "ttft_s", "tpot_s", "decode_tok_s", "errors")


def trial_settings(cfg: TuneConfig, fixed: dict[str, Any], params: dict[str, Any]):
    return dataclasses.replace(cfg, policy=policy_file.checked(cfg.policy, {**fixed, **params}))


def trial_params(cfg: TuneConfig, fixed: dict[str, Any], params: dict[str, Any], out) -> dict[str, str]:
    """A trial's MLflow params: its whole policy, the hw profile, the model, what it measured, threads and kernel
    it ran with."""
    s = trial_settings(cfg, fixed, params)
    report = out.report
    flat = {**tracking.flatten(s.hw, "hw."), **tracking.flatten(s.model, "model."),
            **tracking.flatten(s.policy, "policy."), **{k: str(v) for k, v in sp.flat_measured(cfg).items()}}
    flat.update({"run.threads": str(report.get("threads", "")), "run.kernel": str(report.get("kernel", ""))})
    return flat


def trial_config(cfg: TuneConfig, fixed: dict[str, Any], params: dict[str, Any]) -> str:
    from omegaconf import OmegaConf

    s = trial_settings(cfg, fixed, params)
    node = {"hw": asdict(s.hw), "model": asdict(s.model), "policy": asdict(s.policy),
            **sp.measured(cfg)}
    return OmegaConf.to_yaml(OmegaConf.create(json.loads(json.dumps(node, default=str))))


def parent_params(tuner) -> dict[str, str]:
    """The study's MLflow parent run's params."""
    c = tuner.cfg
    params = {"study": tuner.name, "storage": redact(tuner.url), "hw": c.hw.name, "model": c.model.name,
              "space": json.dumps(tuner.space), "reload": ",".join(sorted(tuner.reload)) or "-",
              "trial_overrides": " ".join(tuner.overrides) or "-"}
    params.update({f"tuner.{k}": str(v) for k, v in tracking.flatten(c.tuner).items()
                   if not k.startswith(("spaces", "storage", "enqueue"))})
    params.update({k: str(v) for k, v in sp.flat_measured(c).items()})
    return params


def write_policy(tuner, best) -> Path:
    """The best trial's policy written as conf/policy/<hw>.yaml, selected by the hw profile and checked to compose."""
    hw = tuner.cfg.hw.name
    tuned = policy_file.checked(tuner.cfg.policy, {**tuner.fixed, **best.params})
    m = best.user_attrs.get("metrics", {})
    metric = ", ".join(f"{k} = {fmt(m[k])}" for k in dict.fromkeys([*tuner.metrics, *SHOWN]) if k in m)
    if len(tuner.metrics) > 1:
        metric += " (the feasible Pareto front's best goodput)"
    header = policy_file.header(tuner.name, best.number, metric, redact(tuner.url))
    if tuner.crossover is not None:
        header.insert(4, f"cutoff: the measured crossover of the two prefill paths at "
                         f"{tuner.crossover['lengths']} tokens")
    path = policy_file.write(CONF_DIR, hw, tuned, header)
    hw_path, changed = policy_file.select_in_hw_profile(CONF_DIR, hw)
    print(f"policy written: {path}" + (f"; {hw_path} now selects it" if changed else ""), flush=True)
    verify(hw, tuned)
    return path


def verify(hw: str, tuned) -> None:
    """`python -m hybrid +hw=<hw>` composes the written policy (the same check a user makes by hand)."""
    p = subprocess.run([sys.executable, "-m", "hybrid", f"+hw={hw}", "--cfg", "job", "--package", "policy"],
                       capture_output=True, text=True, timeout=120)
    shown = yaml.safe_load(p.stdout.split("\n", 1)[1] if p.stdout.startswith("# @package") else p.stdout)
    got = (shown or {}).get("policy", shown)
    if p.returncode != 0 or got != asdict(tuned):
        raise RuntimeError(f"+hw={hw} does not compose the written policy:\n{p.stdout}{p.stderr}")
    print(f"checked: `python -m hybrid +hw={hw}` uses it", flush=True)


def fmt(v: float) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)
