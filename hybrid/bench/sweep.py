"""bench.sweep at run time: each point's settings, and the engine replanned for them around its placed model
(hybrid.engine.build.replan). The sweep's keys and values are checked with the config (hybrid/config/bench.py)."""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping, Optional

from hybrid.config.bench import with_knobs
from hybrid.config.schema import HybridConfig
from hybrid.errors import ConfigError


def check(sweep: Optional[Mapping[str, list]]) -> None:
    """Before the model is built: every swept key is one a replan changes around the placed model."""
    from hybrid.plan.plan import rebuildable

    placed = [key for key in sweep or {} if key not in rebuildable()]
    if placed:
        raise ConfigError(f"bench.sweep: policy.{placed[0]} needs the model placed again for each value; a sweep "
                          f"takes what a replan changes ({', '.join(sorted(rebuildable()))})")


def at(s: HybridConfig, point: Mapping[str, Any]) -> HybridConfig:
    """The settings with the point's knobs set on the policy (the rest as configured)."""
    return replace(s, policy=with_knobs(s.policy, point))


def replanned(engine, s: HybridConfig, point: Mapping[str, Any]):
    """The engine for the point's policy, around `engine`'s placed model (`engine` idle, and not used after)."""
    from hybrid.engine.build import replan

    return replan(engine, at(s, point), s.hw)
