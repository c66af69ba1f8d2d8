"""`mode=replicas`'s settings (hybrid/serve/replicas.py runs them)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

from hybrid.errors import ConfigError

GATEWAYS = ("sglang", "vllm", "none")


@dataclass
class ReplicasConfig:
    """`mode=replicas`: `count` servers of this config (mode=serve, replica i on port base_port + i) behind a gateway
    on server.host:server.port (hybrid/serve/replicas.py)."""
    count: int = 2
    base_port: int = 8101
    gateway: str = "sglang"  # sglang (the SGLang Model Gateway, sglang-router) | vllm (vllm-router) | none
    policy: str = "cache_aware"  # the gateway's routing policy (cache_aware, round_robin, power_of_two, random, ...)
    prometheus_port: int = 29000  # the gateway's own Prometheus metrics (each replica keeps its /metrics)
    gateway_args: List[str] = field(default_factory=list)  # more command-line arguments for the gateway
    ready_timeout_s: float = 900.0  # how long each replica and the gateway may take to become ready

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ConfigError(f"replicas.count must be >= 1, got {self.count}")
        if self.gateway not in GATEWAYS:
            raise ConfigError(f"replicas.gateway must be one of {', '.join(GATEWAYS)}, got {self.gateway!r}")
        for knob in ("base_port", "prometheus_port"):
            if not 1 <= getattr(self, knob) <= 65535:
                raise ConfigError(f"replicas.{knob} must be in 1..65535, got {getattr(self, knob)}")
        if self.base_port + self.count - 1 > 65535:
            raise ConfigError(f"replicas.base_port {self.base_port} leaves no room for {self.count} replicas")
        if self.ready_timeout_s <= 0:
            raise ConfigError(f"replicas.ready_timeout_s must be > 0, got {self.ready_timeout_s}")
