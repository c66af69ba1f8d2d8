"""The tuned policy as config: conf/policy/<hw>.yaml (the full PolicyConfig, nested as conf/policy/default.yaml is,
with its comments, checked by the schema before it is written), and one line in conf/hw/<hw>.yaml that makes
`+hw=<hw>` select it:

    defaults:
      - override /policy@_global_.policy: <hw>

(`+hw=NAME` adds the hw profile to the defaults list; from inside it, `override /policy@_global_.policy` replaces
config.yaml's `policy: default`, at the package `policy`. A plain `override /policy: <hw>` fails: relative to the
hw profile its package would be `hw.policy`. An explicit `policy=...` on the command line still wins.)
"""
from __future__ import annotations

import dataclasses
import re
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf

from hybrid.config.schema import PolicyConfig
from hybrid.locking import write_atomic
from hybrid.plan.resolve import check
from tuner.config import flat_params

OVERRIDE = "override /policy@_global_.policy"
INDENT = "  "


def checked(base: Any, params: dict[str, Any]) -> Any:
    """base (the PolicyConfig, or one of its groups) with params (knob path -> value, or nested) applied, through
    the schema (types, the __post_init__ checks) and, for a whole policy, the knobs' checks against each other."""
    merged = OmegaConf.merge(OmegaConf.structured(type(base)), asdict(base))
    for path, value in flat_params(params).items():
        OmegaConf.update(merged, path, value, merge=False)
    out = OmegaConf.to_object(merged)
    if isinstance(out, PolicyConfig):
        check(out)
    return out


def write(conf_dir: Path, hw: str, policy: PolicyConfig, header: list[str]) -> Path:
    path = conf_dir / "policy" / f"{hw}.yaml"
    comments = {}
    default = conf_dir / "policy" / "default.yaml"
    if default.exists():  # carry default.yaml's comments above each group and knob
        comments = _knob_comments(default.read_text())
    lines = [f"# {h}" if h else "#" for h in header]
    lines.append("")
    lines += _lines(policy, comments)
    text = "\n".join(lines) + "\n"
    # what we wrote reads back as the same policy
    if OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(PolicyConfig), yaml.safe_load(text))) != policy:
        raise RuntimeError(f"{path}: the written policy does not read back as the tuned one")
    write_atomic(path, text)  # tuners finishing together: one whole file, never two interleaved
    return path


def select_in_hw_profile(conf_dir: Path, hw: str) -> tuple[Path, bool]:
    """Make conf/hw/<hw>.yaml select policy <hw> (idempotent). Returns the path and whether it changed."""
    path = conf_dir / "hw" / f"{hw}.yaml"
    text = path.read_text()
    line = f"  - {OVERRIDE}: {hw}"
    pattern = re.compile(rf"^\s*-\s*{re.escape(OVERRIDE)}\s*:\s*(\S+)\s*$", re.M)
    m = pattern.search(text)
    if m:
        if m.group(1) == hw:
            return path, False
        new = pattern.sub(line, text, count=1)
    elif re.search(r"^defaults:\s*$", text, re.M):
        new = re.sub(r"^defaults:\s*$", "defaults:\n" + line, text, count=1, flags=re.M)
    else:
        lines = text.splitlines(keepends=True)
        i = 0
        while i < len(lines) and lines[i].lstrip().startswith("#"):
            i += 1
        block = (f"# The tuned policy for this machine (written by `python -m tuner +hw={hw}`): conf/policy/{hw}.yaml\n"
                 f"defaults:\n{line}\n")
        new = "".join(lines[:i]) + block + "".join(lines[i:])
    write_atomic(path, new)
    return path, True


def header(study: str, trial: int, metric: str, storage: str) -> list[str]:
    return [f"The tuned policy for this machine, written by `python -m tuner` on {time.strftime('%Y-%m-%d %H:%M')}.",
            f"study: {study} ({storage})",
            f"trial: {trial}",
            f"measured: {metric}",
            "Machine-specific: re-tune on another machine. Knobs as in conf/policy/default.yaml."]


def _lines(node: Any, comments: dict[str, list[str]], prefix: str = "") -> list[str]:
    """The policy as YAML lines, groups nested, each key under its comments (re-indented to its depth)."""
    out, indent = [], INDENT * prefix.count(".")
    for f in dataclasses.fields(node):
        value, path = getattr(node, f.name), prefix + f.name
        out += [indent + c for c in comments.get(path, [])]
        if dataclasses.is_dataclass(value):
            out.append(f"{indent}{f.name}:")
            out += _lines(value, comments, path + ".")
        else:
            out.append(indent + yaml.safe_dump({f.name: value}, default_flow_style=True).strip().strip("{}"))
    return out


def _knob_comments(text: str) -> dict[str, list[str]]:
    """The comment lines (stripped of their indent) above each key of a policy yaml, by dotted path."""
    out, pending, stack = {}, [], []  # stack: (indent, key) of the groups the next key may lie in
    for line in text.splitlines():
        body = line.lstrip()
        depth = len(line) - len(body)
        if body.startswith("#"):
            pending.append(body)
        elif re.match(r"^[a-z_][a-z0-9_]*:", body):
            while stack and stack[-1][0] >= depth:
                stack.pop()
            key = body.split(":")[0]
            out[".".join([k for _, k in stack] + [key])] = pending
            stack.append((depth, key))
            pending = []
        else:
            pending = []
    return out
