"""HTTP plumbing shared by every route: settings, errors as JSON by type, SSE framing, and the middleware that
checks the Host header, the API key and the body size before any route runs, and counts every answer."""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from edgespec import errors
from edgespec.config import (DEFAULT_FIM_LAYOUT, DEFAULT_HOST, DEFAULT_MAX_BODY_BYTES, DEFAULT_PORT,
                             DEFAULT_SSE_PING_SECONDS)
from edgespec.memory import namespace_of_key
from edgespec.server import metrics

log = logging.getLogger(__name__)

LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1"}
# A body over the limit is still read (and dropped) up to this size, so that the client reads the 413.
MAX_DRAIN_BYTES = 64 << 20
ROUTES_HELP = ("GET /health, /v1/models, /props, /metrics; POST /v1/completions, /v1/chat/completions, "
               "/completion, /infill, /tokenize, /detokenize, /apply-template")
KEEPALIVE = ": ping\n\n"  # an SSE comment: clients skip it, and it keeps idle-timeouts off a long prefill
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass
class Settings:
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    api_key: str | None = None
    cors_origins: tuple[str, ...] = ()
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    infill_cancel_older: bool = False  # a newer /infill cancels older ones (editors retype constantly)
    model_name: str = "edgespec"
    keepalive_seconds: float = DEFAULT_SSE_PING_SECONDS  # a stream silent this long gets a ': ping' comment
    api_keys: tuple[str, ...] = ()  # more keys besides api_key; each key's requests have a memory of their own
    cache_reuse: int | None = None  # --cache-reuse: every route's default n_cache_reuse (None: /infill's own)
    fim_layout: str = DEFAULT_FIM_LAYOUT  # where /infill puts the typed part of the cursor line


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class Unavailable(errors.EdgespecError):
    pass


class TooLarge(errors.EdgespecError):
    pass


_STATUS = [(Unavailable, 503), (errors.WorkerError, 503), (TooLarge, 413), (errors.InvalidRequestError, 400),
           (errors.ContextOverflowError, 400), (errors.ChatTemplateError, 400), (errors.UnsupportedModelError, 400),
           (errors.EdgespecError, 500)]


def error_response(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def domain_error(e: errors.EdgespecError) -> JSONResponse:
    status = next(code for cls, code in _STATUS if isinstance(e, cls))
    if isinstance(e, errors.ContextOverflowError):  # llama.cpp's type, with its numbers
        return JSONResponse({"error": {"message": str(e), "type": "exceed_context_size_error", "code": status,
                                       **e.details}}, status_code=status)
    return error_response(status, str(e), "invalid_request_error" if status < 500 else "server_error")


def internal_error(e: BaseException) -> JSONResponse:
    log.error("unexpected error while serving a request", exc_info=e)  # the traceback goes to the log only
    return error_response(500, f"internal error ({type(e).__name__}: {e}); the server keeps serving, and the log has the "
                       f"details: please report it", "server_error")


def guard(endpoint: Callable[[Request], Any]) -> Callable[[Request], Any]:
    """Domain errors to HTTP codes by type, anything else to a JSON 500; the server keeps serving."""

    async def wrapped(request: Request) -> Response:
        try:
            return await endpoint(request)
        except errors.EdgespecError as e:
            return domain_error(e)
        except Exception as e:
            return internal_error(e)

    return wrapped


async def http_error(request: Request, exc: Exception) -> Response:
    """Starlette's 404 and 405 in OpenAI's error shape, naming what was asked."""
    assert isinstance(exc, HTTPException)
    what = "no such route" if exc.status_code == 404 else exc.detail
    return error_response(exc.status_code, f"{request.method} {request.url.path}: {what}; the routes are {ROUTES_HELP}",
                  "invalid_request_error")


async def unexpected(request: Request, exc: Exception) -> Response:
    return internal_error(exc)


async def sse_guard(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """Pass events through; an error midway becomes llama.cpp's error event, `data: {"error": ...}` (which the
    openai package raises as APIError), and the stream ends there, without [DONE]."""
    try:
        async for event in events:
            yield event
    except errors.EdgespecError as e:
        yield f"data: {domain_error(e).body.decode()}\n\n"
    except Exception as e:
        yield f"data: {internal_error(e).body.decode()}\n\n"


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class Counted:
    """Counts every answer by route and status, for /metrics; other paths count as "other", so that a scanner
    cannot grow the label set."""

    def __init__(self, app: Any, metrics: metrics.Metrics, routes: set[str]) -> None:
        self.app, self.metrics, self.routes = app, metrics, routes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counted(message: dict) -> None:
            if message["type"] == "http.response.start":
                path = scope["path"]
                self.metrics.request(path if path in self.routes else "other", message["status"])
            await send(message)

        await self.app(scope, receive, counted)


class Safety:
    """Host check (DNS rebinding), API key and body size, before any endpoint runs."""

    def __init__(self, app: Any, settings: Settings) -> None:
        self.app, self.settings = app, settings
        self.loopback = is_loopback(settings.host)

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.loopback:
            host = headers.get("host", "")
            name = host.rsplit(":", 1)[0] if not host.startswith("[") else host[1:].split("]")[0]
            if not is_loopback(name):
                return await error_response(403, f"Host header {host!r} is not a loopback name; a server bound to "
                                         f"{self.settings.host} only answers requests for localhost "
                                         f"(protection against DNS rebinding)", "forbidden")(scope, receive, send)
        keys = [k for k in (self.settings.api_key, *self.settings.api_keys) if k]
        if keys and scope["path"] != "/health" and scope.get("method") != "OPTIONS":
            given = headers.get("authorization", "").removeprefix("Bearer ").strip() or headers.get("x-api-key", "")
            if not any([hmac.compare_digest(given.encode(), key.encode()) for key in keys]):  # all compared
                return await error_response(401, "missing or wrong API key; send 'Authorization: Bearer KEY'",
                                    "authentication_error")(scope, receive, send)
            # Nothing one key's requests wrote is proposed to another's: each key has its own memory namespace.
            scope.setdefault("state", {})["memory_namespace"] = namespace_of_key(given)
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.settings.max_body_bytes):
            if length.isdigit() and int(length) <= MAX_DRAIN_BYTES:
                await _drain(receive)
            return await error_response(413, f"request body of {length} bytes is over the limit of "
                                     f"{self.settings.max_body_bytes}; send less context (or raise "
                                     f"--max-body-bytes)", "invalid_request_error")(scope, receive, send)
        await self.app(scope, receive, send)


async def _drain(receive: Callable) -> None:
    """Read a request body to its end and drop it: a client still sending would otherwise get a broken pipe."""
    while True:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            return
