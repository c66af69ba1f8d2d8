"""The OpenAI-compatible HTTP server over the serving engine: `create_app` (hybrid/serve/app.py), `serve` and
`ServerThread` (hybrid/serve/server.py), the settings (ServerConfig, `server.*` in hybrid/config/schema.py), the
load driver (hybrid/serve/load.py)."""
from hybrid.config.schema import ServerConfig
from hybrid.serve.app import create_app
from hybrid.serve.server import ServerThread, serve

__all__ = ["ServerConfig", "ServerThread", "create_app", "serve"]
