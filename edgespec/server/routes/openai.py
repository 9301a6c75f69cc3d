"""OpenAI's routes: /v1/completions and /v1/chat/completions (tools, logprobs, streams with usage)."""

from __future__ import annotations

import dataclasses
import json
import math
import threading
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from edgespec import errors
from edgespec.backend import json_schema_gbnf
from edgespec.config import OPENAI_CHAT_MAX_TOKENS, OPENAI_COMPLETIONS_MAX_TOKENS, OPENAI_TEMPERATURE
from edgespec.prompts import tools
from edgespec.server import logprobs, schemas
from edgespec.server.http import KEEPALIVE, SSE_HEADERS, guard, sse, sse_guard
from edgespec.server.service import Service, check_request, in_namespace, prompt_of, request_of, spec

if TYPE_CHECKING:
    from edgespec.decoding.loop import Stats
    from edgespec.engine import Chunk, Engine


class OpenAIRoutes:
    def __init__(self, svc: Service) -> None:
        self.svc = svc

    def routes(self) -> list[Route]:
        return [Route("/v1/completions", guard(self.completions), methods=["POST"]),
                Route("/v1/chat/completions", guard(self.chat_completions), methods=["POST"])]

    async def completions(self, request: Request) -> Response:
        body = await self.svc.body_of(request)
        eng = self.svc.engine()
        req = request_of(body, schemas.OPENAI_COMPLETIONS, eng, OPENAI_COMPLETIONS_MAX_TOKENS, OPENAI_TEMPERATURE,
                         self.svc.cache_reuse(schemas.OPENAI_COMPLETIONS))
        await self.svc.preempt()
        return await self.respond(request, prompt_of(body, eng), req, "'prompt'", chat=False)

    async def chat_completions(self, request: Request) -> Response:
        body = await self.svc.body_of(request)
        eng = self.svc.engine()
        req = request_of(body, schemas.OPENAI_CHAT, eng, OPENAI_CHAT_MAX_TOKENS, OPENAI_TEMPERATURE,
                         self.svc.cache_reuse(schemas.OPENAI_CHAT))
        await self.svc.preempt()
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
        return await self.respond(request, prompt, req, "'messages'", chat=True, with_tools=plan is not None)

    async def respond(self, request: Request, prompt: list[int], req: schemas.Request, prompt_name: str,
                              chat: bool, with_tools: bool = False) -> Response:
        eng = self.svc.engine()
        check_request(eng, prompt, prompt_name, req)
        req = in_namespace(request, req)
        head = _OpenAIHead(f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", int(time.time()),
                           self.svc.settings.model_name, chat, eng.target.token_piece, with_tools)
        cancel = threading.Event()
        if not req.stream:
            chunks = await self.svc.run(request, prompt, req, cancel)
            return JSONResponse(head.completion(chunks, req))
        chunks = await self.svc.stream_chunks(prompt, req, cancel)

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
                yield sse(head.chunk(c, first, req, calls, offset))
                first, offset = False, offset + len(c.text)
                if c.stats is not None and req.include_usage:
                    yield sse(head.usage_chunk(c))
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse_guard(events()), media_type="text/event-stream", headers=SSE_HEADERS)


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
            "usage": _usage(last.stats), "speculative": spec(last.stats, req)}

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
            event |= {"usage": _usage(c.stats), "speculative": spec(c.stats, req)}
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
