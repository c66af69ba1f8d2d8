"""The HTTP server's settings: where it listens, who may call it, the name it serves the model under, how many
requests may queue for a KV slot, and how long a shutdown waits for the requests in flight."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from hybrid.errors import ConfigError


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000  # 0 = any free port
    api_key: Optional[str] = None  # set: every route but /health needs `Authorization: Bearer <api_key>`
    model_name: Optional[str] = None  # the `model` clients name; None = the model config's name
    max_waiting: int = 64  # requests queued for a KV slot; at this many, new ones get 429
    shutdown_grace_s: float = 30.0  # on SIGTERM/Ctrl-C: time the requests in flight get to finish

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"server port must be in 0..65535, got {self.port}")
        if self.max_waiting < 1:
            raise ConfigError(f"server max_waiting must be >= 1, got {self.max_waiting}")
        if self.shutdown_grace_s < 0:
            raise ConfigError(f"server shutdown_grace_s must be >= 0, got {self.shutdown_grace_s}")
        if self.api_key is not None and not self.api_key:
            raise ConfigError("server api_key must not be empty (None: no key)")
