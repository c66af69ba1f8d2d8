"""Running the app with uvicorn: `serve` in the foreground until SIGTERM or Ctrl-C, and `ServerThread` on a thread
of the calling process (tests, benchmarks).

    serve(engine, ServerConfig(port=8000, api_key="..."), "DeepSeek-V3")    # or serve(loader, ...)

Shutdown: the first SIGTERM/SIGINT stops taking requests (503; /health 503), gives those in flight
`shutdown_grace_s` to finish, aborts the rest, then stops uvicorn; a second signal aborts the requests in flight at
once (each gets its error: a 503 body, or an error event in its stream); a third stops waiting for their
connections. Whichever way, the engine's thread is stopped and joined (with the native threads idle) before serve()
returns (exit status 0); an engine step that does not end within ENGINE_STOP_S ends the process with status 130.
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
import threading
import time
from typing import Optional, Union

import uvicorn
from fastapi import FastAPI

from hybrid.engine.engine import Engine
from hybrid.serve.app import Loader, Service, create_app
from hybrid.config.schema import ServerConfig

log = logging.getLogger("hybrid.serve")

UVICORN_GRACE_S = 5.0  # after the drain: how long uvicorn waits for the last responses to be written
ENGINE_STOP_S = 30.0  # at exit: how long the engine's last step may take


class _Server(uvicorn.Server):
    """uvicorn, draining the app's requests on the first signal, aborting them on the second. The signals are
    handled, not re-raised at exit."""

    def __init__(self, config: uvicorn.Config, service: Service, grace_s: float):
        super().__init__(config)
        self.service, self.grace_s = service, grace_s
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self.signals = 0
        self._drains: list[asyncio.Task] = []

    async def serve(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig, frame) -> None:
        self.signals += 1
        if self.loop is None or self.signals > 2:
            self.should_exit = True
            self.force_exit = self.signals > 2
            return
        if self.signals == 1:
            log.info("shutting down: new requests get 503; up to %.1f s for the %d in flight", self.grace_s,
                     len(self.service.jobs))
        else:
            log.warning("second signal: aborting the %d request(s) in flight", len(self.service.jobs))
        self.loop.call_soon_threadsafe(self._start_drain, self.grace_s if self.signals == 1 else 0.0)

    def _start_drain(self, grace_s: float) -> None:
        self._drains.append(asyncio.ensure_future(self._drain(grace_s)))

    async def _drain(self, grace_s: float) -> None:
        try:
            await self.service.drain(grace_s)
        finally:
            self.should_exit = True


def serve(engine: Union[Engine, Loader], cfg: ServerConfig, model_name: str, log_level: str = "info") -> None:
    """Serves until SIGTERM/Ctrl-C (then drains, see above). `engine` may be a loader: the server answers /health
    with 503 while it builds the engine on a thread; if it fails, the server stops and its error is raised."""
    _log_to_stderr(log_level)
    app = create_app(engine, cfg, model_name)
    service: Service = app.state.service
    server = _Server(uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level=log_level, lifespan="on",
                                    timeout_graceful_shutdown=UVICORN_GRACE_S), service, cfg.shutdown_grace_s)

    def failed(_e: BaseException) -> None:
        server.should_exit = True
    service.on_load_failed = failed
    try:
        server.run()
    finally:
        _stop_engine(service)
    if service.load_error is not None:
        raise service.load_error


def _stop_engine(service: Service) -> None:
    """The engine's thread joined, so that the process never exits beside a step in native code. A step that does
    not end in time leaves no clean way out: the process ends at once, with status 130."""
    service.stop_engine(ENGINE_STOP_S)
    if service.loop is not None and service.loop.alive:
        log.error("the engine's step did not end within %.0f s: exiting without waiting for it", ENGINE_STOP_S)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)


def _log_to_stderr(level: str) -> None:
    """The server's own messages (load failures, shutdown) beside uvicorn's, unless logging is set up already."""
    if not log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
        log.addHandler(handler)
        log.setLevel(level.upper())


class ServerThread:
    """An app served by uvicorn on a thread of this process, on a port the OS picks: `url` is its base URL.

        with ServerThread(create_app(engine, cfg, "tiny")) as srv:
            client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="-")
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 grace_s: float = 5.0):
        self.app = app
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.host, self.port = host, self._sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        config = uvicorn.Config(app, log_level=log_level, log_config=None, lifespan="on",
                                timeout_graceful_shutdown=UVICORN_GRACE_S)
        self.server = _Server(config, app.state.service, grace_s)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]},
                                        name="hybrid-uvicorn", daemon=True)

    def start(self, timeout_s: float = 30.0) -> "ServerThread":
        self._thread.start()
        end = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > end:
                self.stop(1.0)
                raise RuntimeError(f"the server on {self.url} did not start (see the log)")
            time.sleep(0.01)
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout_s)
        self._sock.close()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

