"""The HTTP sidecar: OpenAI-compatible and llama.cpp-style routes over one speculative engine.

One engine serves every request, in worker threads (one per slot); requests wait in arrival order. A client that
goes away has its generation cancelled within one cycle. Safety first, since it listens on the user's machine:
loopback by default, Host-header check against DNS rebinding, API key, no CORS unless origins are listed, bounded
bodies and fields (server/http.py).
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware

from edgespec.config import SHUTDOWN_GRACE_SECONDS
from edgespec.server.http import Counted, Safety, Settings, http_error, is_loopback, unexpected
from edgespec.server.routes.admin import AdminRoutes
from edgespec.server.routes.llama import LlamaRoutes
from edgespec.server.routes.openai import OpenAIRoutes
from edgespec.server.service import Service

if TYPE_CHECKING:
    from edgespec.engine import Engine

__all__ = ["Settings", "create_app", "is_loopback", "serve"]

# Past the grace period, requests still running get this long before the socket closes, and open connections as
# long again before uvicorn drops them.
SHUTDOWN_BACKSTOP_SECONDS = 5


def create_app(settings: Settings, load_engine: Callable[[], Engine]) -> Starlette:
    """The ASGI app; `load_engine` runs in a thread at startup, /health says 503 until it is done."""
    svc = Service(settings, load_engine)
    routes = [*AdminRoutes(svc).routes(), *OpenAIRoutes(svc).routes(), *LlamaRoutes(svc).routes()]
    # Outermost first: every answer is counted, the 401, 403 and 413 of Safety too.
    middleware = [Middleware(Counted, metrics=svc.metrics, routes={r.path for r in routes}),
                  Middleware(Safety, settings=settings)]
    if settings.cors_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(settings.cors_origins),
                                     allow_methods=["GET", "POST"], allow_headers=["Authorization", "Content-Type"]))
    app = Starlette(routes=routes, middleware=middleware, lifespan=svc.lifespan,
                    exception_handlers={HTTPException: http_error, Exception: unexpected})
    app.state.shutdown, app.state.idle = svc.shutdown, svc.idle
    return app


class _Server(uvicorn.Server):
    """uvicorn's graceful shutdown, drained first. The first signal tells the app (it refuses new requests and bounds
    the old ones) and keeps the socket open, so that a request arriving meanwhile gets a 503 rather than a reset; the
    socket closes once nothing is in flight. A second signal ends the grace period and closes it at once (streams
    still finish properly), a third Ctrl-C forces the exit. Exit status 0: uvicorn itself re-raises a caught SIGTERM
    after shutting down, so the process ended 143."""

    def __init__(self, config: uvicorn.Config, on_signal: Callable[[], None], idle: Callable[[], bool],
                 drain_limit: float) -> None:
        super().__init__(config)
        self.on_signal, self.idle, self.drain_limit = on_signal, idle, drain_limit
        self.draining_since: float | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.on_signal()
        if self.draining_since is None:
            self.draining_since = time.monotonic()
        else:
            super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self.draining_since is not None and not self.should_exit:
            self.should_exit = self.idle() or time.monotonic() - self.draining_since > self.drain_limit
        return await super().on_tick(counter)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def serve(app: Starlette, settings: Settings, log_level: str, grace: float = SHUTDOWN_GRACE_SECONDS) -> None:
    """Run `app` until SIGTERM or Ctrl-C: requests in flight get `grace` seconds, then are cancelled."""
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=log_level,
                            timeout_graceful_shutdown=SHUTDOWN_BACKSTOP_SECONDS)
    _Server(config, lambda: app.state.shutdown(grace), app.state.idle, grace + SHUTDOWN_BACKSTOP_SECONDS).run()
