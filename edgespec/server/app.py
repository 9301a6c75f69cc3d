"""The HTTP sidecar: OpenAI-compatible and llama.cpp-style endpoints over one speculative engine.

One engine serves every request, one generation at a time, in a worker thread;
requests wait in arrival order. A client that goes away has its generation
cancelled within one cycle. Safety first, since it listens on the user's
machine: loopback by default, Host-header check against DNS rebinding, API key,
no CORS unless origins are listed, bounded bodies and fields.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import json
import logging
import signal
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Iterator

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from edgespec import errors
from edgespec.config import (
    DEFAULT_HOST,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_PORT,
    LLAMA_N_PREDICT,
    LLAMA_TEMPERATURE,
    OPENAI_CHAT_MAX_TOKENS,
    OPENAI_COMPLETIONS_MAX_TOKENS,
    OPENAI_TEMPERATURE,
    SHUTDOWN_GRACE_SECONDS,
)
from edgespec.server import schemas

if TYPE_CHECKING:
    from edgespec.engine import Chunk, Engine
    from edgespec.loop import Stats

log = logging.getLogger(__name__)

LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1"}
DISCONNECT_POLL_SECONDS = 0.1
# Connections still open this long after the grace period are dropped by uvicorn.
SHUTDOWN_BACKSTOP_SECONDS = 5
# A body over the limit is still read (and dropped) up to this size, so that the client reads the 413.
MAX_DRAIN_BYTES = 64 << 20
ROUTES_HELP = ("GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions, POST /completion, "
               "POST /infill")


@dataclass
class Settings:
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    api_key: str | None = None
    cors_origins: tuple[str, ...] = ()
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    infill_cancel_older: bool = False  # a newer /infill cancels older ones (editors retype constantly)
    model_name: str = "edgespec"


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class _Service:
    """The server's state and its route handlers: one engine, requests in arrival order."""

    def __init__(self, settings: Settings, load_engine: Callable[[], Engine]) -> None:
        self.settings, self.load_engine = settings, load_engine
        self.loaded: Engine | None = None
        self.load_error: str | None = None
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="engine")
        self.infills: set[threading.Event] = set()
        self.active: set[threading.Event] = set()  # cancel events of every request in flight
        self.finished: dict[str, int] = {}  # generations by finish reason, for /health
        self.draining = False  # a signal came: new requests get 503, those in flight get a grace period

    # -- lifetime ------------------------------------------------------------------

    def load(self) -> None:
        try:
            self.loaded = self.load_engine()
        except Exception as e:  # reported by /health and every endpoint, instead of a dead process
            log.exception("loading the model failed")
            self.load_error = str(e)

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        threading.Thread(target=self.load, name="load", daemon=True).start()
        yield
        for cancel in list(self.active):  # the grace period is over: end what still runs within a cycle
            cancel.set()
        self.executor.shutdown(wait=True, cancel_futures=True)  # the engine must be idle before it is freed
        if self.loaded is not None:
            self.loaded.close()

    def shutdown(self, grace: float) -> None:
        """Refuse new requests; cancel those still running after `grace` seconds (streams then finish)."""
        if self.draining:
            return
        self.draining = True
        timer = threading.Timer(grace, lambda: [e.set() for e in list(self.active)])
        timer.daemon = True
        timer.start()

    # -- helpers -------------------------------------------------------------------

    def engine(self) -> Engine:
        if self.draining:
            raise _Unavailable("the server is shutting down; send the request to a new instance")
        if self.loaded is None:
            raise _Unavailable(self.load_error or "the model is still loading; retry when GET /health says ok")
        return self.loaded

    async def body_of(self, request: Request) -> dict[str, Any]:
        limit = self.settings.max_body_bytes
        data = bytearray()
        n = 0
        async for piece in request.stream():
            n += len(piece)
            if n <= limit:
                data += piece
            elif n > MAX_DRAIN_BYTES:  # read on so that the client, still sending, gets to read the 413
                break
        if n > limit:
            raise _TooLarge(f"request body over {limit} bytes; send less context")
        try:
            body = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise errors.InvalidRequestError(f"malformed JSON body ({e})") from e
        if not isinstance(body, dict):
            raise errors.InvalidRequestError("the JSON body must be an object")
        return body

    def count(self, reason: str | None) -> None:
        self.finished[reason or "error"] = self.finished.get(reason or "error", 0) + 1

    async def run(self, request: Request, prompt: list[int], req: schemas.Request, cancel: threading.Event
                  ) -> tuple[str, list[Chunk]]:
        """Generate without streaming, cancelling if the client disconnects meanwhile."""
        eng = self.engine()
        loop = asyncio.get_running_loop()
        self.active.add(cancel)
        try:
            job = loop.run_in_executor(self.executor, lambda: list(eng.stream(prompt, req.config, req.stop, cancel)))
            while not job.done():
                if await request.is_disconnected():
                    cancel.set()
                await asyncio.wait([job], timeout=DISCONNECT_POLL_SECONDS)
            chunks = job.result()
        finally:
            self.active.discard(cancel)
        self.count(chunks[-1].finish_reason)
        return "".join(c.text for c in chunks), chunks

    def stream_chunks(self, prompt: list[int], req: schemas.Request, cancel: threading.Event
                      ) -> AsyncIterator[Chunk]:
        """Chunks from the worker thread as they come; closing the iterator (a disconnect) cancels."""
        eng = self.engine()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        done = object()

        def work() -> None:
            try:
                for chunk in eng.stream(prompt, req.config, req.stop, cancel):
                    loop.call_soon_threadsafe(queue.put_nowait, chunk)
                    if chunk.finish_reason is not None:
                        loop.call_soon_threadsafe(self.count, chunk.finish_reason)
            except Exception as e:
                loop.call_soon_threadsafe(queue.put_nowait, e)
            finally:
                loop.call_soon_threadsafe(queue.put_nowait, done)

        self.active.add(cancel)
        self.executor.submit(work)

        async def gen() -> AsyncIterator[Chunk]:
            try:
                while (item := await queue.get()) is not done:
                    if isinstance(item, Exception):
                        raise item
                    yield item
            finally:
                cancel.set()  # normal end: harmless; disconnect: stops the generation within a cycle
                self.active.discard(cancel)

        return gen()

    # -- endpoints -----------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        if self.draining:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        if self.load_error:
            return JSONResponse({"status": "error", "error": self.load_error}, status_code=500)
        if self.loaded is None:
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse({"status": "ok", "model": self.settings.model_name, "generations": dict(self.finished)})

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": self.settings.model_name, "object": "model", "created": 0, "owned_by": "edgespec"}]})

    async def completions(self, request: Request) -> Response:
        body = await self.body_of(request)
        eng = self.engine()
        req = schemas.generation(body, eng.n_ctx, OPENAI_COMPLETIONS_MAX_TOKENS, OPENAI_TEMPERATURE)
        return await self.openai_response(request, _prompt(body, eng), req, "'prompt'", chat=False)

    async def chat_completions(self, request: Request) -> Response:
        body = await self.body_of(request)
        eng = self.engine()
        prompt = eng.chat_tokens(schemas.messages(body))
        room = max(1, eng.n_ctx - len(prompt))
        req = schemas.generation(body, eng.n_ctx, min(OPENAI_CHAT_MAX_TOKENS, room), OPENAI_TEMPERATURE)
        return await self.openai_response(request, prompt, req, "'messages'", chat=True)

    async def completion(self, request: Request) -> Response:
        """llama.cpp's native /completion, as Continue and others call it."""
        body = await self.body_of(request)
        eng = self.engine()
        req = schemas.generation(body, eng.n_ctx, LLAMA_N_PREDICT, LLAMA_TEMPERATURE, "n_predict")
        return await self.llama_response(request, _prompt(body, eng), req, "'prompt'")

    async def infill(self, request: Request) -> Response:
        """llama.cpp's /infill: prefix, suffix and extra files around the cursor, as llama.vim sends them."""
        body = await self.body_of(request)
        eng = self.engine()
        req = schemas.generation(body, eng.n_ctx, LLAMA_N_PREDICT, LLAMA_TEMPERATURE, "n_predict")
        prompt = eng.infill_tokens(
            schemas.text_field(body, "input_prefix", "") or "", schemas.text_field(body, "input_suffix", "") or "",
            schemas.text_field(body, "prompt", "") or "", schemas.extra_chunks(body), req.config.max_tokens)
        return await self.llama_response(request, prompt, req, "the infill prompt ('input_prefix', 'input_suffix', "
                                                               "'prompt', 'input_extra')", infill=True)

    # -- responses -----------------------------------------------------------------

    async def openai_response(self, request: Request, prompt: list[int], req: schemas.Request, prompt_name: str,
                              chat: bool) -> Response:
        # Checked before a stream starts: a 400, not a broken stream.
        self.engine().check_fits(prompt, req.config.max_tokens, prompt_name, req.max_tokens_field)
        head = _OpenAIHead(f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", int(time.time()),
                           self.settings.model_name, chat)
        cancel = threading.Event()
        if not req.stream:
            text, chunks = await self.run(request, prompt, req, cancel)
            return JSONResponse(head.completion(text, chunks[-1]))
        chunks = self.stream_chunks(prompt, req, cancel)

        async def events() -> AsyncIterator[str]:
            first = True
            async for c in chunks:
                if c.finish_reason is None and not c.text:
                    continue
                yield f"data: {json.dumps(head.chunk(c, first))}\n\n"
                first = False

        async def sse() -> AsyncIterator[str]:
            async for event in _sse_guard(events()):
                yield event
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def llama_response(self, request: Request, prompt: list[int], req: schemas.Request, prompt_name: str,
                             infill: bool = False) -> Response:
        self.engine().check_fits(prompt, req.config.max_tokens, prompt_name, req.max_tokens_field)
        model = self.settings.model_name
        cancel = threading.Event()
        if infill and self.settings.infill_cancel_older:
            for older in list(self.infills):
                older.set()
        if infill:
            self.infills.add(cancel)
        try:
            if not req.stream:
                text, chunks = await self.run(request, prompt, req, cancel)
                return JSONResponse(_llama_final(text, chunks[-1], model))
        finally:
            if not req.stream:
                self.infills.discard(cancel)
        chunks = self.stream_chunks(prompt, req, cancel)

        async def events() -> AsyncIterator[str]:
            async for c in chunks:
                if c.stats is not None:
                    yield f"data: {json.dumps(_llama_final(c.text, c, model))}\n\n"
                elif c.text:
                    yield f"data: {json.dumps({'content': c.text, 'stop': False})}\n\n"

        async def sse() -> AsyncIterator[str]:
            try:
                async for event in _sse_guard(events()):
                    yield event
            finally:
                self.infills.discard(cancel)

        return StreamingResponse(sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def create_app(settings: Settings, load_engine: Callable[[], Engine]) -> Starlette:
    """The ASGI app; `load_engine` runs in a thread at startup, /health says 503 until it is done."""
    svc = _Service(settings, load_engine)
    routes = [
        Route("/health", svc.health, methods=["GET"]),
        Route("/v1/models", svc.models, methods=["GET"]),
        Route("/v1/completions", _guard(svc.completions), methods=["POST"]),
        Route("/v1/chat/completions", _guard(svc.chat_completions), methods=["POST"]),
        Route("/completion", _guard(svc.completion), methods=["POST"]),
        Route("/infill", _guard(svc.infill), methods=["POST"]),
    ]
    middleware = [Middleware(_Safety, settings=settings)]
    if settings.cors_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(settings.cors_origins),
                                     allow_methods=["GET", "POST"], allow_headers=["Authorization", "Content-Type"]))
    app = Starlette(routes=routes, middleware=middleware, lifespan=svc.lifespan,
                    exception_handlers={HTTPException: _http_error, Exception: _unexpected})
    app.state.shutdown = svc.shutdown
    return app


@dataclass(frozen=True)
class _OpenAIHead:
    """What every object of one OpenAI response repeats."""

    id: str
    created: int
    model: str
    chat: bool

    def _object(self, obj: str, choice: dict[str, Any]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": [choice]}

    def completion(self, text: str, last: Chunk) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": _openai_finish(last.finish_reason)}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice |= {"text": text, "logprobs": None}
        assert last.stats is not None
        return self._object("chat.completion" if self.chat else "text_completion", choice) | {
            "usage": _usage(last.stats), "speculative": _spec(last.stats)}

    def chunk(self, c: Chunk, first: bool) -> dict[str, Any]:
        finish = _openai_finish(c.finish_reason) if c.finish_reason else None
        if self.chat:
            delta: dict[str, Any] = {"content": c.text} if c.text or not finish else {}
            if first:
                delta["role"] = "assistant"
            event = self._object("chat.completion.chunk", {"index": 0, "delta": delta, "finish_reason": finish})
        else:
            event = self._object("text_completion", {"index": 0, "text": c.text, "logprobs": None,
                                                     "finish_reason": finish})
        if c.stats is not None:
            event |= {"usage": _usage(c.stats), "speculative": _spec(c.stats)}
        return event


class _Server(uvicorn.Server):
    """uvicorn's graceful shutdown, with the app told first (it refuses new requests and bounds the old ones)
    and exit status 0: uvicorn itself re-raises a caught SIGTERM after shutting down, so the process ended 143."""

    def __init__(self, config: uvicorn.Config, on_signal: Callable[[], None]) -> None:
        super().__init__(config)
        self.on_signal = on_signal

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.on_signal()
        super().handle_exit(sig, frame)

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
                            timeout_graceful_shutdown=int(grace) + SHUTDOWN_BACKSTOP_SECONDS)
    _Server(config, lambda: app.state.shutdown(grace)).run()


# -- errors ---------------------------------------------------------------------------


class _Unavailable(errors.EdgespecError):
    pass


class _TooLarge(errors.EdgespecError):
    pass


_STATUS = [(_Unavailable, 503), (_TooLarge, 413), (errors.InvalidRequestError, 400), (errors.ContextOverflowError, 400),
           (errors.ChatTemplateError, 400), (errors.UnsupportedModelError, 400), (errors.EdgespecError, 500)]


def _error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def _domain_error(e: errors.EdgespecError) -> JSONResponse:
    status = next(code for cls, code in _STATUS if isinstance(e, cls))
    return _error(status, str(e), "invalid_request_error" if status < 500 else "server_error")


def _internal_error(e: BaseException) -> JSONResponse:
    log.error("unexpected error while serving a request", exc_info=e)  # the traceback goes to the log only
    return _error(500, f"internal error ({type(e).__name__}: {e}); the server keeps serving, and the log has the "
                       f"details: please report it", "server_error")


def _guard(endpoint: Callable[[Request], Any]) -> Callable[[Request], Any]:
    """Domain errors to HTTP codes by type, anything else to a JSON 500; the server keeps serving."""

    async def wrapped(request: Request) -> Response:
        try:
            return await endpoint(request)
        except errors.EdgespecError as e:
            return _domain_error(e)
        except Exception as e:
            return _internal_error(e)

    return wrapped


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's 404 and 405 in OpenAI's error shape, naming what was asked."""
    assert isinstance(exc, HTTPException)
    what = "no such route" if exc.status_code == 404 else exc.detail
    return _error(exc.status_code, f"{request.method} {request.url.path}: {what}; the routes are {ROUTES_HELP}",
                  "invalid_request_error")


async def _unexpected(request: Request, exc: Exception) -> Response:
    return _internal_error(exc)


async def _sse_guard(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """Pass events through; an error midway becomes an error event instead of a cut connection."""
    try:
        async for event in events:
            yield event
    except errors.EdgespecError as e:
        yield f"data: {_domain_error(e).body.decode()}\n\n"
    except Exception as e:
        yield f"data: {_internal_error(e).body.decode()}\n\n"


def _prompt(body: dict[str, Any], eng: Engine) -> list[int]:
    """'prompt' as text, or as token ids (both APIs accept either)."""
    value = body.get("prompt")
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        bad = [t for t in value if not 0 <= t < eng.n_vocab]
        if bad:
            raise errors.InvalidRequestError(f"token ids must be in 0..{eng.n_vocab - 1}, got {bad[:4]}")
        return value
    return eng.tokenize(schemas.text_field(body, "prompt", required=True) or "")


def _openai_finish(reason: str | None) -> str:
    return {"stop": "stop", "length": "length"}.get(reason or "", "stop")


def _usage(s: Stats) -> dict[str, int]:
    return {"prompt_tokens": s.prompt_tokens, "completion_tokens": s.completion_tokens,
            "total_tokens": s.prompt_tokens + s.completion_tokens}


def _spec(s: Stats) -> dict[str, Any]:
    return {"drafted": s.drafted, "accepted": s.accepted, "acceptance_rate": round(s.acceptance_rate, 4),
            "cycles": s.cycles, "tokens_per_second": round(s.tokens_per_second, 2),
            "cached_prompt_tokens": s.cached_prompt_tokens}


def _llama_final(text: str, last: Chunk, model: str) -> dict[str, Any]:
    s = last.stats
    assert s is not None
    decoded = max(s.completion_tokens - 1, 0)
    return {
        "content": text, "stop": True, "model": model, "tokens_predicted": s.completion_tokens,
        "tokens_evaluated": s.prompt_tokens, "tokens_cached": s.cached_prompt_tokens,
        "stopped_eos": last.finish_reason == "stop", "stopped_limit": last.finish_reason == "length",
        "stopped_word": False, "truncated": False, "cancelled": last.finish_reason == "cancelled",
        "timings": {
            "prompt_n": s.prompt_tokens - s.cached_prompt_tokens, "prompt_ms": s.prefill_seconds * 1000,
            "prompt_per_second": (s.prompt_tokens - s.cached_prompt_tokens) / s.prefill_seconds if s.prefill_seconds else 0,
            "predicted_n": s.completion_tokens, "predicted_ms": s.decode_seconds * 1000,
            "predicted_per_second": decoded / s.decode_seconds if s.decode_seconds else 0,
            "draft_n": s.drafted, "draft_n_accepted": s.accepted,
        },
        "speculative": _spec(s),
    }


class _Safety:
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
                return await _error(403, f"Host header {host!r} is not a loopback name; a server bound to "
                                         f"{self.settings.host} only answers requests for localhost "
                                         f"(protection against DNS rebinding)", "forbidden")(scope, receive, send)
        key = self.settings.api_key
        if key and scope["path"] != "/health" and scope.get("method") != "OPTIONS":
            given = headers.get("authorization", "").removeprefix("Bearer ").strip() or headers.get("x-api-key", "")
            if not hmac.compare_digest(given.encode(), key.encode()):
                return await _error(401, "missing or wrong API key; send 'Authorization: Bearer KEY'",
                                    "authentication_error")(scope, receive, send)
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.settings.max_body_bytes):
            if length.isdigit() and int(length) <= MAX_DRAIN_BYTES:
                await _drain(receive)
            return await _error(413, f"request body of {length} bytes is over the limit of "
                                     f"{self.settings.max_body_bytes}; send less context (or raise "
                                     f"--max-body-bytes)", "invalid_request_error")(scope, receive, send)
        await self.app(scope, receive, send)


async def _drain(receive: Callable) -> None:
    """Read a request body to its end and drop it: a client still sending would otherwise get a broken pipe."""
    while True:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            return
