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
import dataclasses
import hmac
import ipaddress
import json
import logging
import math
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

from edgespec import __version__, errors, tools
from edgespec.backend import json_schema_gbnf, library_version
from edgespec.memory import namespace_of_key
from edgespec.config import (
    DEFAULT_HOST,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_PORT,
    DEFAULT_SSE_PING_SECONDS,
    LLAMA_N_PREDICT,
    LLAMA_TEMPERATURE,
    OPENAI_CHAT_MAX_TOKENS,
    OPENAI_COMPLETIONS_MAX_TOKENS,
    OPENAI_TEMPERATURE,
    SHUTDOWN_GRACE_SECONDS,
)
from edgespec.server import logprobs, metrics, schemas

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
        # One worker per engine slot: generations in slots interleave by cycle, the rest wait in arrival order.
        self.executor: ThreadPoolExecutor | None = None
        self.infills: set[threading.Event] = set()
        self.active: set[threading.Event] = set()  # cancel events of every request in flight
        self.finished: dict[str, int] = {}  # generations by finish reason, for /health
        self.draining = False  # a signal came: new requests get 503, those in flight get a grace period
        self.metrics = metrics.Metrics()

    # -- lifetime ------------------------------------------------------------------

    def load(self) -> None:
        try:
            engine = self.load_engine()
            self.executor = ThreadPoolExecutor(len(engine.slots), thread_name_prefix="engine")
            self.loaded = engine
        except Exception as e:  # reported by /health and every endpoint, instead of a dead process
            log.exception("loading the model failed")
            self.load_error = str(e)

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        threading.Thread(target=self.load, name="load", daemon=True).start()
        yield
        for cancel in list(self.active):  # the grace period is over: end what still runs within a cycle
            cancel.set()
        if self.executor is not None:  # the engine must be idle before it is freed
            self.executor.shutdown(wait=True, cancel_futures=True)
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

    def count(self, last: Chunk) -> None:
        reason = last.finish_reason
        self.finished[reason or "error"] = self.finished.get(reason or "error", 0) + 1
        if last.stats is not None:
            self.metrics.generation(last.stats, reason)

    def submit(self, job: Callable[[], Any]) -> asyncio.Future:
        """Run `job` on an engine worker (one per slot), counted in the queue metrics."""
        assert self.executor is not None  # set before the engine is, and engine() checked that
        return asyncio.get_running_loop().run_in_executor(self.executor, self.metrics.queued(job))

    async def run(self, request: Request, prompt: list[int], req: schemas.Request, cancel: threading.Event
                  ) -> list[Chunk]:
        """Generate without streaming, cancelling if the client disconnects meanwhile."""
        eng = self.engine()
        self.active.add(cancel)
        try:
            job = self.submit(lambda: list(eng.stream(prompt, req.config, req.stop, cancel)))
            while not job.done():
                if await request.is_disconnected():
                    cancel.set()
                await asyncio.wait([job], timeout=DISCONNECT_POLL_SECONDS)
            chunks = job.result()
        finally:
            self.active.discard(cancel)
        self.count(chunks[-1])
        return chunks

    def stream_chunks(self, prompt: list[int], req: schemas.Request, cancel: threading.Event
                      ) -> AsyncIterator[Chunk | None]:
        """Chunks from the worker thread as they come, None after each `keepalive_seconds` without one
        (a long prefill); closing the iterator (a disconnect) cancels."""
        eng = self.engine()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        done = object()

        def work() -> None:
            try:
                for chunk in eng.stream(prompt, req.config, req.stop, cancel):
                    loop.call_soon_threadsafe(queue.put_nowait, chunk)
                    if chunk.finish_reason is not None:
                        loop.call_soon_threadsafe(self.count, chunk)
            except Exception as e:
                loop.call_soon_threadsafe(queue.put_nowait, e)
            finally:
                loop.call_soon_threadsafe(queue.put_nowait, done)

        self.active.add(cancel)
        self.submit(work)

        async def gen() -> AsyncIterator[Chunk | None]:
            try:
                while True:
                    try:
                        item = await asyncio.wait_for(queue.get(), self.settings.keepalive_seconds)
                    except asyncio.TimeoutError:
                        yield None
                        continue
                    if item is done:
                        return
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
        """OpenAI's list, with llama.cpp's owner and `meta`: llama.vscode reads them to find the context size."""
        model: dict[str, Any] = {"id": self.settings.model_name, "object": "model", "created": 0,
                                 "owned_by": "llamacpp"}
        if self.loaded is not None:
            f = self.loaded.target.facts
            model["meta"] = {"n_ctx": self.loaded.n_ctx, "n_ctx_train": f.n_ctx_train, "n_vocab": f.n_vocab,
                             "n_embd": f.n_embd, "size": f.weights_bytes}
        return JSONResponse({"object": "list", "data": [model]})

    async def props(self, request: Request) -> Response:
        """llama.cpp's /props: what llama.vscode and others read to learn the context and the template."""
        eng = self.engine()
        m = eng.target
        defaults = schemas.generation({}, schemas.COMPLETION, eng.n_ctx, LLAMA_N_PREDICT, LLAMA_TEMPERATURE)
        return JSONResponse({
            "default_generation_settings": {"params": defaults.settings, "n_ctx": eng.n_ctx},
            "total_slots": len(eng.slots), "model_alias": self.settings.model_name, "model_path": str(m.path),
            "modalities": {"vision": False, "audio": False},
            "chat_template": m.facts.chat_template or "",
            "bos_token": m.token_text(m.vocab.bos) if m.vocab.bos is not None else "",
            "eos_token": m.token_text(m.vocab.eos) if m.vocab.eos is not None else "",
            "build_info": f"edgespec {__version__}, llama-cpp-python {library_version()}",
            "speculative": {"proposer": eng.config.proposer, "k_max": eng.plan.k_max,
                            "draft": eng.config.draft, "draft_loaded": eng.draft_loaded,
                            "memory": eng.memory is not None},
            "endpoint_metrics": True, "endpoint_slots": False, "endpoint_props": True,
        })

    async def tokenize(self, request: Request) -> Response:
        body = await self.body_of(request)
        content, add_special, parse_special, with_pieces = schemas.tokenize_request(body)
        m = self.engine().target
        tokens = m.tokenize(content, add_special=add_special, parse_special=parse_special)
        if not with_pieces:
            return JSONResponse({"tokens": tokens})
        return JSONResponse({"tokens": [{"id": t, "piece": _piece(m.token_piece(t))} for t in tokens]})

    async def detokenize(self, request: Request) -> Response:
        body = await self.body_of(request)
        schemas.only_fields(body, {"tokens"}, "/detokenize")
        m = self.engine().target
        pieces = b"".join(m.token_piece(t) for t in schemas.token_list(body, "tokens", m.n_vocab))
        return JSONResponse({"content": pieces.decode("utf-8", "replace")})

    async def apply_template(self, request: Request) -> Response:
        body = await self.body_of(request)
        schemas.only_fields(body, {"messages", "model"}, "/apply-template")
        return JSONResponse({"prompt": self.engine().chat_text(schemas.messages(body))})

    async def metrics_text(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type=metrics.CONTENT_TYPE)

    async def completions(self, request: Request) -> Response:
        body = await self.body_of(request)
        eng = self.engine()
        req = _generation(body, schemas.OPENAI_COMPLETIONS, eng, OPENAI_COMPLETIONS_MAX_TOKENS, OPENAI_TEMPERATURE)
        return await self.openai_response(request, _prompt(body, eng), req, "'prompt'", chat=False)

    async def chat_completions(self, request: Request) -> Response:
        body = await self.body_of(request)
        eng = self.engine()
        req = _generation(body, schemas.OPENAI_CHAT, eng, OPENAI_CHAT_MAX_TOKENS, OPENAI_TEMPERATURE)
        plan = None
        if body.get("tools"):
            plan = tools.choose(tools.check_tools(body["tools"], lambda p, what: json_schema_gbnf(p, what)),
                                body.get("tool_choice"), schemas.flag(body, "parallel_tool_calls", True),
                                json_schema_gbnf)
            req = _with_tools(req, plan, eng)
        elif body.get("tool_choice") not in (None, "none", "auto"):
            raise errors.InvalidRequestError(f"'tool_choice' {json.dumps(body['tool_choice'])} needs 'tools'; "
                                             f"send the tools it may call")
        prompt = eng.chat_tokens(schemas.messages(body), tools=plan.tools if plan else None)
        return await self.openai_response(request, prompt, req, "'messages'", chat=True, with_tools=plan is not None)

    async def completion(self, request: Request) -> Response:
        """llama.cpp's native /completion, as Continue and others call it."""
        body = await self.body_of(request)
        eng = self.engine()
        req = _generation(body, schemas.COMPLETION, eng, LLAMA_N_PREDICT, LLAMA_TEMPERATURE)
        return await self.llama_response(request, _prompt(body, eng), req, "'prompt'")

    async def infill(self, request: Request) -> Response:
        """llama.cpp's /infill: prefix, suffix and extra files around the cursor, as llama.vim sends them."""
        body = await self.body_of(request)
        eng = self.engine()
        req = _generation(body, schemas.INFILL, eng, LLAMA_N_PREDICT, LLAMA_TEMPERATURE)
        room = req.config.max_tokens if req.config.max_tokens else LLAMA_N_PREDICT  # kept free for the answer
        prompt = eng.infill_tokens(
            schemas.text_field(body, "input_prefix", "") or "", schemas.text_field(body, "input_suffix", "") or "",
            schemas.text_field(body, "prompt", "") or "", schemas.extra_chunks(body), min(room, eng.n_ctx // 2))
        return await self.llama_response(request, prompt, req, "the infill prompt ('input_prefix', 'input_suffix', "
                                                               "'prompt', 'input_extra')", infill=True)

    # -- responses -----------------------------------------------------------------

    async def openai_response(self, request: Request, prompt: list[int], req: schemas.Request, prompt_name: str,
                              chat: bool, with_tools: bool = False) -> Response:
        eng = self.engine()
        _check_request(eng, prompt, prompt_name, req)
        req = _in_namespace(request, req)
        head = _OpenAIHead(f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", int(time.time()),
                           self.settings.model_name, chat, eng.target.token_piece, with_tools)
        cancel = threading.Event()
        if not req.stream:
            chunks = await self.run(request, prompt, req, cancel)
            return JSONResponse(head.completion(chunks, req))
        chunks = self.stream_chunks(prompt, req, cancel)

        async def events() -> AsyncIterator[str]:
            first, calls, offset = True, _CallBuffer() if with_tools else None, 0
            async for c in chunks:
                if c is None:
                    yield KEEPALIVE
                    continue
                if calls is not None:
                    c = calls.push(c)
                if c.finish_reason is None and not c.text and not c.logprobs:
                    continue
                yield _sse(head.chunk(c, first, req, calls, offset))
                first, offset = False, offset + len(c.text)
                if c.stats is not None and req.include_usage:
                    yield _sse(head.usage_chunk(c))
            yield "data: [DONE]\n\n"

        return StreamingResponse(_sse_guard(events()), media_type="text/event-stream", headers=SSE_HEADERS)

    async def llama_response(self, request: Request, prompt: list[int], req: schemas.Request, prompt_name: str,
                             infill: bool = False) -> Response:
        _check_request(self.engine(), prompt, prompt_name, req)
        req = _in_namespace(request, req)
        model, piece = self.settings.model_name, self.engine().target.token_piece
        cancel = threading.Event()
        if infill and self.settings.infill_cancel_older:
            for older in list(self.infills):
                older.set()
        if infill:
            self.infills.add(cancel)
        try:
            if not req.stream:
                results = []
                for i in range(req.n):  # n_cmpl: one after another in the slot that holds the prompt
                    chunks = await self.run(request, prompt, req, cancel)
                    final = _llama_final("".join(c.text for c in chunks), [t for c in chunks for t in c.tokens],
                                         chunks[-1], model, req) | {"index": i}
                    if req.config.logprobs is not None:
                        final["completion_probabilities"] = logprobs.llama(
                            [lp for c in chunks for lp in c.logprobs or []], piece)
                    results.append(schemas.pick_fields(final, req.response_fields))
                return JSONResponse(results if req.n > 1 else results[0])
        finally:
            if not req.stream:
                self.infills.discard(cancel)
        chunks = self.stream_chunks(prompt, req, cancel)

        async def events() -> AsyncIterator[str]:
            try:
                async for c in chunks:
                    if c is None:
                        yield KEEPALIVE
                    elif c.stats is not None:  # in a stream, the text came in the earlier events
                        yield _sse(schemas.pick_fields(_llama_final("", [], c, model, req), req.response_fields))
                    elif c.text or c.tokens:
                        event = {"content": c.text, "tokens": c.tokens, "stop": False}
                        if c.logprobs:
                            event["completion_probabilities"] = logprobs.llama(c.logprobs, piece)
                        yield _sse(event)
            finally:
                self.infills.discard(cancel)

        return StreamingResponse(_sse_guard(events()), media_type="text/event-stream", headers=SSE_HEADERS)


def create_app(settings: Settings, load_engine: Callable[[], Engine]) -> Starlette:
    """The ASGI app; `load_engine` runs in a thread at startup, /health says 503 until it is done."""
    svc = _Service(settings, load_engine)
    routes = [
        Route("/health", svc.health, methods=["GET"]),
        Route("/v1/models", svc.models, methods=["GET"]),
        Route("/props", _guard(svc.props), methods=["GET"]),
        Route("/metrics", svc.metrics_text, methods=["GET"]),
        Route("/v1/completions", _guard(svc.completions), methods=["POST"]),
        Route("/v1/chat/completions", _guard(svc.chat_completions), methods=["POST"]),
        Route("/completion", _guard(svc.completion), methods=["POST"]),
        Route("/infill", _guard(svc.infill), methods=["POST"]),
        Route("/tokenize", _guard(svc.tokenize), methods=["POST"]),
        Route("/detokenize", _guard(svc.detokenize), methods=["POST"]),
        Route("/apply-template", _guard(svc.apply_template), methods=["POST"]),
    ]
    # Outermost first: every answer is counted, the 401, 403 and 413 of _Safety too.
    middleware = [Middleware(_Counted, metrics=svc.metrics, routes={r.path for r in routes}),
                  Middleware(_Safety, settings=settings)]
    if settings.cors_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(settings.cors_origins),
                                     allow_methods=["GET", "POST"], allow_headers=["Authorization", "Content-Type"]))
    app = Starlette(routes=routes, middleware=middleware, lifespan=svc.lifespan,
                    exception_handlers={HTTPException: _http_error, Exception: _unexpected})
    app.state.shutdown = svc.shutdown
    return app


@dataclass(frozen=True)
class _OpenAIHead:
    """What every object of one OpenAI response repeats, and how its tokens are written."""

    id: str
    created: int
    model: str
    chat: bool
    piece: logprobs.Piece
    tools: bool = False  # tool calls are parsed out of the text

    def _object(self, obj: str, choice: dict[str, Any]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": [choice]}

    def _logprobs(self, lps: list[Any] | None, req: schemas.Request, offset: int = 0) -> dict[str, Any] | None:
        if req.config.logprobs is None:
            return None
        return logprobs.chat(lps or [], self.piece) if self.chat else logprobs.completions(lps or [], self.piece,
                                                                                           offset)

    def completion(self, chunks: list[Chunk], req: schemas.Request) -> dict[str, Any]:
        last, text = chunks[-1], "".join(c.text for c in chunks)
        finish = _openai_finish(last.finish_reason)
        lps = self._logprobs([lp for c in chunks for lp in c.logprobs or []], req)
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
        if self.chat:
            content, calls = tools.parse(text) if self.tools else (text, [])
            choice["message"] = {"role": "assistant", "content": content}
            if calls:
                choice["message"]["tool_calls"] = calls
                choice["finish_reason"] = "tool_calls"
            choice["logprobs"] = lps
        else:
            choice |= {"text": text, "logprobs": lps}
        assert last.stats is not None
        return self._object("chat.completion" if self.chat else "text_completion", choice) | {
            "usage": _usage(last.stats), "speculative": _spec(last.stats, req)}

    def usage_chunk(self, last: Chunk) -> dict[str, Any]:
        """stream_options.include_usage: a last chunk with the usage and no choices, as OpenAI sends it."""
        assert last.stats is not None
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [], "usage": _usage(last.stats)}

    def chunk(self, c: Chunk, first: bool, req: schemas.Request, calls: _CallBuffer | None = None,
              offset: int = 0) -> dict[str, Any]:
        finish = _openai_finish(c.finish_reason) if c.finish_reason else None
        lps = self._logprobs(c.logprobs, req, offset) if c.logprobs or finish is None else None
        if self.chat:
            delta: dict[str, Any] = {"content": c.text} if c.text or not finish else {}
            if first:
                delta["role"] = "assistant"
            if finish and calls is not None and calls.calls:
                delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls.calls)]
                finish = "tool_calls"
            event = self._object("chat.completion.chunk", {"index": 0, "delta": delta, "logprobs": lps,
                                                           "finish_reason": finish})
        else:
            event = self._object("text_completion", {"index": 0, "text": c.text, "logprobs": lps,
                                                     "finish_reason": finish})
        if c.stats is not None:
            event |= {"usage": _usage(c.stats), "speculative": _spec(c.stats, req)}
        return event


class _CallBuffer:
    """A stream's text from the first tool-call tag on, held back and sent as tool_calls when the answer ends
    (as text after all if it does not parse: a call cut off by the length limit). The tag may come as one
    token or as several, so text that could be its start waits for the next chunk."""

    def __init__(self) -> None:
        self.held: str | None = None
        self.calls: list[dict[str, Any]] = []
        self._tail = ""  # text that may be the start of the tag

    def push(self, c: Chunk) -> Chunk:
        out, self._tail = self._tail + c.text, ""
        if self.held is not None:
            self.held, out = self.held + out, ""
        elif (i := out.find(tools.OPEN)) >= 0:
            out, self.held = out[:i], out[i:]
        else:
            keep = next((n for n in range(min(len(tools.OPEN) - 1, len(out)), 0, -1)
                         if out.endswith(tools.OPEN[:n])), 0)
            out, self._tail = out[: len(out) - keep], out[len(out) - keep:]
        if c.finish_reason is not None:
            out, self._tail = out + self._tail, ""
            if self.held is not None:
                _, self.calls = tools.parse(self.held)
                if not self.calls:
                    out += self.held
        return dataclasses.replace(c, text=out)


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
    if isinstance(e, errors.ContextOverflowError):  # llama.cpp's type, with its numbers
        return JSONResponse({"error": {"message": str(e), "type": "exceed_context_size_error", "code": status,
                                       **e.details}}, status_code=status)
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
    """Pass events through; an error midway becomes llama.cpp's error event, `data: {"error": ...}` (which the
    openai package raises as APIError), and the stream ends there, without [DONE]."""
    try:
        async for event in events:
            yield event
    except errors.EdgespecError as e:
        yield f"data: {_domain_error(e).body.decode()}\n\n"
    except Exception as e:
        yield f"data: {_internal_error(e).body.decode()}\n\n"


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _piece(data: bytes) -> str | list[int]:
    """A token's piece as llama.cpp's /tokenize gives it: text when it is valid UTF-8, else its bytes."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return list(data)


def _prompt(body: dict[str, Any], eng: Engine) -> list[int]:
    """'prompt' as text, or as token ids (both APIs accept either)."""
    value = body.get("prompt")
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        bad = [t for t in value if not 0 <= t < eng.n_vocab]
        if bad:
            raise errors.InvalidRequestError(f"token ids must be in 0..{eng.n_vocab - 1}, got {bad[:4]}")
        return value
    return eng.tokenize(schemas.text_field(body, "prompt", required=True) or "")


def _generation(body: dict[str, Any], route: str, eng: Engine, default_max_tokens: int | None,
                default_temperature: float) -> schemas.Request:
    return schemas.generation(body, route, eng.n_ctx, default_max_tokens, default_temperature,
                              lambda text: eng.target.tokenize(text, add_special=False, parse_special=True),
                              eng.n_vocab)


def _check_request(eng: Engine, prompt: list[int], prompt_name: str, req: schemas.Request) -> None:
    """What would fail a generation at its start, checked before a stream starts: a 400, not a broken stream."""
    eng.check_fits(prompt, prompt_name)
    grammar = eng.grammar(req.config)
    if grammar is not None:
        grammar.close()


def _in_namespace(request: Request, req: schemas.Request) -> schemas.Request:
    """The request's generation in the memory namespace of its API key (_Safety found it; the local one when the
    server has no key), unless it asked for no memory."""
    namespace = request.scope.get("state", {}).get("memory_namespace")
    if namespace is None or req.config.memory is None:
        return req
    return dataclasses.replace(req, config=dataclasses.replace(req.config, memory=namespace))


def _with_tools(req: schemas.Request, plan: tools.ToolPlan, eng: Engine) -> schemas.Request:
    """The request's generation under its tool plan: the calls' grammar, or the call tag forbidden."""
    c = req.config
    if plan.gbnf is not None and (c.grammar or c.json_schema is not None):
        raise errors.InvalidRequestError("'tools' with a response_format, grammar or json_schema: the calls have "
                                         "their own grammar; send one or the other")
    if plan.forbid_open:
        tag = eng.target.tokenize(tools.OPEN, add_special=False, parse_special=True)
        if len(tag) != 1:  # a bias can forbid one token, not a sequence
            raise errors.InvalidRequestError(f"'tool_choice' \"none\" needs {tools.OPEN} to be one token of the "
                                             f"model's vocabulary; it is {len(tag)} here: leave tools out instead")
        config = dataclasses.replace(c, sampling=dataclasses.replace(
            c.sampling, logit_bias=c.sampling.logit_bias + ((tag[0], -math.inf),)))
    else:
        config = dataclasses.replace(c, grammar=plan.gbnf, grammar_trigger=tools.OPEN if plan.lazy else None)
    return dataclasses.replace(req, config=config)


def _openai_finish(reason: str | None) -> str:
    return {"stop": "stop", "length": "length"}.get(reason or "", "stop")


def _usage(s: Stats) -> dict[str, int]:
    return {"prompt_tokens": s.prompt_tokens, "completion_tokens": s.completion_tokens,
            "total_tokens": s.prompt_tokens + s.completion_tokens}


def _spec(s: Stats, req: schemas.Request) -> dict[str, Any]:
    """The speculation figures of one generation, with the proposer and k cap it asked for (null: the server's)."""
    return {"proposer": req.config.proposer, "k": req.config.k, "drafted": s.drafted, "accepted": s.accepted,
            "acceptance_rate": round(s.acceptance_rate, 4), "cycles": s.cycles,
            "cycles_by_proposer": dict(s.cycles_by_proposer), "tokens_per_second": round(s.tokens_per_second, 2),
            "cached_prompt_tokens": s.cached_prompt_tokens}


def _llama_final(text: str, tokens: list[int], last: Chunk, model: str, req: schemas.Request) -> dict[str, Any]:
    """llama.cpp's final /completion object (and the old stopped_* flags some clients still read)."""
    s = last.stats
    assert s is not None
    evaluated = s.prompt_tokens - s.cached_prompt_tokens
    decoded = max(s.completion_tokens - 1, 0)
    stop_type = {"stop": "word" if last.stop_word else "eos", "length": "limit"}.get(last.finish_reason or "", "none")
    return {
        "index": 0, "content": text, "tokens": tokens if req.return_tokens else [], "id_slot": last.slot,
        "stop": True, "model": model, "tokens_predicted": s.completion_tokens, "tokens_evaluated": s.prompt_tokens,
        "generation_settings": req.settings, "has_new_line": "\n" in text, "truncated": last.truncated,
        "stop_type": stop_type, "stopping_word": last.stop_word, "tokens_cached": s.cached_prompt_tokens,
        "stopped_eos": stop_type == "eos", "stopped_limit": stop_type == "limit", "stopped_word": stop_type == "word",
        "cancelled": last.finish_reason == "cancelled",
        "timings": {
            "cache_n": s.cached_prompt_tokens, "prompt_n": evaluated, "prompt_ms": s.prefill_seconds * 1000,
            "prompt_per_token_ms": s.prefill_seconds * 1000 / evaluated if evaluated else 0,
            "prompt_per_second": evaluated / s.prefill_seconds if s.prefill_seconds else 0,
            "predicted_n": s.completion_tokens, "predicted_ms": s.decode_seconds * 1000,
            "predicted_per_token_ms": s.decode_seconds * 1000 / decoded if decoded else 0,
            "predicted_per_second": decoded / s.decode_seconds if s.decode_seconds else 0,
            "draft_n": s.drafted, "draft_n_accepted": s.accepted,
        },
        "speculative": _spec(s, req),
    }


class _Counted:
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
        keys = [k for k in (self.settings.api_key, *self.settings.api_keys) if k]
        if keys and scope["path"] != "/health" and scope.get("method") != "OPTIONS":
            given = headers.get("authorization", "").removeprefix("Bearer ").strip() or headers.get("x-api-key", "")
            if not any([hmac.compare_digest(given.encode(), key.encode()) for key in keys]):  # all compared
                return await _error(401, "missing or wrong API key; send 'Authorization: Bearer KEY'",
                                    "authentication_error")(scope, receive, send)
            # Nothing one key's requests wrote is proposed to another's: each key has its own memory namespace.
            scope.setdefault("state", {})["memory_namespace"] = namespace_of_key(given)
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
