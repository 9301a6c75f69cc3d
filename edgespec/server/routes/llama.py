"""llama.cpp's own routes: /completion, /infill (as the editors call it), /tokenize, /detokenize, /apply-template."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import threading
import time
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Iterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from edgespec.config import ANSWER_SLACK, LLAMA_N_PREDICT, LLAMA_TEMPERATURE, WIDEN_DELAY
from edgespec.errors import InvalidRequestError
from edgespec.prompts.fim import Continuation, Infill, accepted, continuation, healed, next_lines
from edgespec.server import logprobs, schemas
from edgespec.server.http import KEEPALIVE, SSE_HEADERS, guard, sse, sse_guard
from edgespec.server.service import Service, check_request, in_namespace, prompt_of, request_of, spec

if TYPE_CHECKING:
    from edgespec.config import GenerationConfig
    from edgespec.engine import Chunk
    from edgespec.engine.infill import InfillPrompt


class LlamaRoutes:
    def __init__(self, svc: Service) -> None:
        self.svc = svc
        # Per slot: the editor's request expected after the last answer there, and the prompt it came from.
        self.follows: dict[int, tuple[Continuation, InfillPrompt]] = {}
        # Per slot: the extra chunks the last budgeted completion there was sent and took none of. An editor's warm-up
        # of them there moves the slot's lines after them and is aborted by the next request, whose budget takes no
        # chunk not cached, so that request moves the lines back: such a warm-up leaves the slot be.
        self.declined: dict[int, frozenset[tuple[str, str]]] = {}

    def routes(self) -> list[Route]:
        return [Route("/completion", guard(self.completion), methods=["POST"]),
                Route("/infill", guard(self.infill), methods=["POST"]),
                Route("/tokenize", guard(self.tokenize), methods=["POST"]),
                Route("/detokenize", guard(self.detokenize), methods=["POST"]),
                Route("/apply-template", guard(self.apply_template), methods=["POST"])]

    async def completion(self, request: Request) -> Response:
        """llama.cpp's native /completion, as Continue and others call it."""
        body = await self.svc.body_of(request)
        eng = self.svc.engine()
        req = request_of(body, schemas.COMPLETION, eng, LLAMA_N_PREDICT, LLAMA_TEMPERATURE,
                         self.svc.cache_reuse(schemas.COMPLETION))
        await self.svc.preempt()
        return await self.respond(request, prompt_of(body, eng), req, "'prompt'")

    async def infill(self, request: Request) -> Response:
        """llama.cpp's /infill: prefix, suffix and extra files around the cursor, as llama.vim sends them; sized to
        t_max_prompt_ms against what the slot holds (engine.infill). The request an editor sends as soon as it shows
        the answer (the answer taken as typed: prompts.fim.accepted) is served by the prompt and tokens the answer
        left in the slot (prompts.fim.continuation), or else its prompt is evaluated in the background; after a pause
        the context the budget cut is widened. A warm-up of chunks the slot's last completion took none of leaves the
        slot be (`declined`). An answer ends before it repeats the lines below the cursor (prompts.fim.next_lines)."""
        arrival = time.perf_counter()
        body = await self.svc.body_of(request)
        eng = self.svc.engine()
        req = request_of(body, schemas.INFILL, eng, LLAMA_N_PREDICT, LLAMA_TEMPERATURE,
                         self.svc.cache_reuse(schemas.INFILL))
        c = req.config
        budget = schemas.prompt_budget(body) if c.max_tokens != 0 else None  # a warm-up evaluates all it is sent
        await self.svc.preempt(awaited=c.max_tokens != 0)
        layout = _layout(heals := _heals(body, c), c, self.svc.settings.fim_layout)
        infill, room = schemas.infill(body), min(c.max_tokens or LLAMA_N_PREDICT, eng.n_ctx // 2)  # for the answer
        follow, lead = self._follow(infill, c) if c.max_tokens else (None, "")
        held, heal = healed(infill, layout) if heals and not follow else (infill, "")
        ip = follow or eng.infill_prompt(held, room, budget, c.slot, c.cache_reuse, layout, warm_up=c.max_tokens == 0)
        ip = self._in_slot(ip, infill, budget, c.max_tokens == 0)
        due = arrival + budget + c.time_limit + ANSWER_SLACK if budget is not None and c.time_limit else None
        req = dataclasses.replace(req, config=dataclasses.replace(c, slot=ip.slot, deadline=due, heal=heal,
                                                                  repeats=next_lines(infill)))
        report = {"truncated": ip.kept.cut, "infill": {"layout": layout, "budget_tokens": ip.budget_tokens,
                                                       "continued": follow is not None, "healed": heal,
                                                       **ip.kept.to_dict()}}
        shown: dict[str, InfillPrompt] = {}

        def ahead(answer: str) -> Iterator[list[int]]:
            """The prompt of the request llama.vim and llama.vscode send as soon as they show the answer (none where
            it would be refused: its typed text over the room)."""
            if (nxt := accepted(infill, answer)) is not None:
                try:
                    nxt = healed(nxt, layout)[0] if heals else nxt  # as its own request will be laid out
                    shown["next"] = eng.infill_prompt(nxt, room, budget, ip.slot, c.cache_reuse, layout)
                except InvalidRequestError:
                    return
                yield shown["next"].tokens

        def wider() -> Iterator[list[int]]:
            widest = shown.get("next", ip)
            return widest.widening() if widest.kept.cut else iter(())

        def after(chunks: list[Chunk]) -> None:  # budgeted requests are an editor's: ready what comes next
            if budget is None or self.svc.draining:
                return
            answer = "".join(c.text for c in chunks)
            # an answer sent with a lead is not the text its tokens spell: the request after it is laid out afresh
            kept = not lead and self._keep(held, heal + answer, ip, chunks, layout)
            # the next requests' wider context: built aside, afresh, first; widened in place only without an aside
            build, widen = ip.aside(), wider if eng.pool.aside is None else None
            aside = None if build is None else functools.partial(self.svc.build_in_pause, eng, build)
            # the editor's next request first, then the suffix held in parts grown (engine.infill)
            now = lambda: itertools.chain(() if kept or lead else ahead(answer), ip.grown())  # noqa: E731
            self.svc.warm(widen, req.config, WIDEN_DELAY, now=now, aside=aside, parts_first=ip.grouped)

        return await self.respond(request, ip.tokens, req, "the infill prompt ('input_prefix', 'input_suffix', "
                                                           "'prompt', 'input_extra')", infill=True, report=report,
                                  after=after, lead=lead, again=self._again(held, infill, room, budget, ip, c, layout))

    def _again(self, held: Infill, infill: Infill, room: int, budget: float | None, ip: InfillPrompt,
               c: GenerationConfig, layout: str) -> Callable[[], list[int]] | None:
        """For a warm-up: its prompt laid out again where its generation starts, after the aside build it waits on
        (Service.run), which may put lines in front of what the slot holds. None for a completion."""
        if c.max_tokens != 0:
            return None
        eng = self.svc.engine()
        return lambda: self._in_slot(eng.infill_prompt(held, room, budget, ip.slot, c.cache_reuse, layout, True),
                                     infill, budget, True).tokens

    def _in_slot(self, ip: InfillPrompt, infill: Infill, budget: float | None, warm_up: bool) -> InfillPrompt:
        """`ip` as it runs in its slot. A completion leaves something else there (no follow-up kept) and notes the
        chunks it took none of where budgeted (`declined`); a warm-up of any of those leaves the slot be: its prompt
        is what the slot holds."""
        if not warm_up:
            self.follows.pop(ip.slot, None)
            self.declined[ip.slot] = frozenset(() if budget is None or ip.kept.extra_chunks[0] else infill.extra)
            return ip
        cached = self.svc.engine().slots[ip.slot].cache.tokens
        if not (cached and self.declined.get(ip.slot, frozenset()).intersection(infill.extra)):
            return ip
        kept = dataclasses.replace(ip.kept, extra_chunks=(0, len(infill.extra)))
        return dataclasses.replace(ip, tokens=list(cached), new_tokens=0, kept=kept)

    def _keep(self, held: Infill, written: str, ip: InfillPrompt, chunks: list[Chunk], layout: str) -> bool:
        """Keep the prompt that serves the editor's request after this answer (`chunks`, of the prompt `ip` laid out
        for `held`; `written`: their text and the healed word before it), where there is one
        (prompts.fim.continuation); whether there is."""
        m, last = self.svc.engine().target, chunks[-1]
        tokens, ended = [t for c in chunks for t in c.tokens], last.finish_reason == "stop"
        newline = m.tokenize("\n", add_special=False, parse_special=False) if ended and not last.stop_word else ()
        if cont := continuation(held, written, ip.tokens, tokens, m.vocab, m.token_bytes, layout, ended, newline):
            self.follows[ip.slot] = (cont, ip)
        return cont is not None

    def _follow(self, infill: Infill, c: GenerationConfig) -> tuple[InfillPrompt | None, str]:
        """The prompt an earlier answer left for this request (prompts.fim.Continuation), in the slot it asks for,
        and what the answer starts with that the prompt holds (its lead); (None, "") where none was left."""
        eng = self.svc.engine()
        for slot, (cont, ip) in list(self.follows.items()):
            if cont.serves(infill) and (c.slot is None or c.slot < 0 or c.slot % len(eng.slots) == slot):
                del self.follows[slot]
                new = len(cont.tokens) - eng.slots[slot].cache.shared_prefix(cont.tokens)
                return dataclasses.replace(ip, tokens=cont.tokens, new_tokens=new), cont.lead
        return None, ""

    async def respond(self, request: Request, prompt: list[int], req: schemas.Request, prompt_name: str,
                      infill: bool = False, report: dict[str, Any] | None = None,
                      after: Callable[[list[Chunk]], None] | None = None, lead: str = "",
                      again: Callable[[], list[int]] | None = None) -> Response:
        """Run the generation and answer as llama.cpp does; `report` joins the final object, `after` runs once the
        answer is complete, with its (first completion's) chunks; `lead` goes before a text that is not empty;
        `again` lays the prompt out anew where a generation not streamed starts (a warm-up's, after the work it
        waits on)."""
        check_request(self.svc.engine(), prompt, prompt_name, req)
        req = in_namespace(request, req)
        model, piece = self.svc.settings.model_name, self.svc.engine().target.token_piece
        cancel = self._cancel_event(infill)
        try:
            if not req.stream:
                results, answers, later, need = [], [], req, 0.0
                for i in range(req.n):  # n_cmpl: one after another in the slot that holds the prompt
                    if i == 1:
                        later, need = _later(req, chunks[-1])
                    if results and not _room_for_another(chunks[-1], later.config.deadline, need):
                        chunks = [_skipped(chunks[-1], len(prompt))]
                    else:
                        chunks = await self.svc.run(request, again or prompt, later, cancel, aside_first=infill)
                    answers.append(chunks := _led(chunks, lead))
                    final = _llama_final("".join(c.text for c in chunks), [t for c in chunks for t in c.tokens],
                                         chunks[-1], model, req) | (report or {}) | {"index": i}
                    if req.config.logprobs is not None:
                        final["completion_probabilities"] = logprobs.llama(
                            [lp for c in chunks for lp in c.logprobs or []], piece)
                    results.append(schemas.pick_fields(final, req.response_fields))
                if after is not None:
                    after(answers[0])
                return JSONResponse(results if req.n > 1 else results[0])
        finally:
            if not req.stream:
                self.svc.infills.discard(cancel)
        chunks = await self.svc.stream_chunks(prompt, req, cancel)

        async def events() -> AsyncIterator[str]:
            seen: list[Chunk] = []
            try:
                async for c in chunks:
                    if c is None:
                        yield KEEPALIVE
                    elif c.stats is not None:  # in a stream, the text came in the earlier events
                        final = _llama_final("", [], c, model, req) | (report or {})
                        yield sse(schemas.pick_fields(final, req.response_fields))
                        if after is not None:
                            after([*seen, c])
                    elif c.text or c.tokens:
                        c = c if any(s.text for s in seen) else _led([c], lead)[0]
                        seen.append(c)
                        event = {"content": c.text, "tokens": c.tokens, "stop": False}
                        if c.logprobs:
                            event["completion_probabilities"] = logprobs.llama(c.logprobs, piece)
                        yield sse(event)
            finally:
                self.svc.infills.discard(cancel)

        return StreamingResponse(sse_guard(events()), media_type="text/event-stream", headers=SSE_HEADERS)

    def _cancel_event(self, infill: bool) -> threading.Event:
        """A generation's cancel event; an /infill's cancels the older ones still running (--infill-cancel-older)."""
        cancel = threading.Event()
        if infill:
            for older in list(self.svc.infills) if self.svc.settings.infill_cancel_older else ():
                older.set()
            self.svc.infills.add(cancel)
        return cancel

    async def tokenize(self, request: Request) -> Response:
        body = await self.svc.body_of(request)
        content, add_special, parse_special, with_pieces = schemas.tokenize_request(body)
        m = self.svc.engine().target
        tokens = m.tokenize(content, add_special=add_special, parse_special=parse_special)
        if not with_pieces:
            return JSONResponse({"tokens": tokens})
        return JSONResponse({"tokens": [{"id": t, "piece": _piece(m.token_piece(t))} for t in tokens]})

    async def detokenize(self, request: Request) -> Response:
        body = await self.svc.body_of(request)
        schemas.only_fields(body, {"tokens"}, "/detokenize")
        m = self.svc.engine().target
        pieces = b"".join(m.token_piece(t) for t in schemas.token_list(body, "tokens", m.n_vocab))
        return JSONResponse({"content": pieces.decode("utf-8", "replace")})

    async def apply_template(self, request: Request) -> Response:
        body = await self.svc.body_of(request)
        schemas.only_fields(body, {"messages", "model"}, "/apply-template")
        return JSONResponse({"prompt": self.svc.engine().chat_text(schemas.messages(body))})


def _heals(body: dict[str, Any], c: GenerationConfig) -> bool:
    """Whether an /infill's typed text is healed (prompts.fim.healed): asked (token_healing), a completion, and no
    grammar (both would constrain the first tokens); in either layout, the middle's needing it most."""
    return schemas.flag(body, "token_healing", True) and c.max_tokens != 0 and c.grammar is None \
        and c.json_schema is None


def _layout(heals: bool, c: GenerationConfig, default: str) -> str:
    """An /infill's FIM layout: the server's, but llama.cpp's for a completion whose typed text is not healed. The
    middle layout unhealed completes far worse than llama.cpp's (docs/bench/editor.md); a warm-up is laid out as the
    completions after it will be, healed."""
    return default if heals or not c.max_tokens else "prefix"


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
            "cache_n": s.cached_prompt_tokens, "shifted_n": s.shifted_prompt_tokens, "prompt_n": evaluated,
            "prompt_ms": s.prefill_seconds * 1000,
            "prompt_per_token_ms": s.prefill_seconds * 1000 / evaluated if evaluated else 0,
            "prompt_per_second": evaluated / s.prefill_seconds if s.prefill_seconds else 0,
            "predicted_n": s.completion_tokens, "predicted_ms": s.decode_seconds * 1000,
            "predicted_per_token_ms": s.decode_seconds * 1000 / decoded if decoded else 0,
            "predicted_per_second": decoded / s.decode_seconds if s.decode_seconds else 0,
            "draft_n": s.drafted, "draft_n_accepted": s.accepted,
        },
        "speculative": spec(s, req),
    }


def _led(chunks: list[Chunk], lead: str) -> list[Chunk]:
    """`chunks` with `lead` before the first text in them (none where they hold no text)."""
    i = next((i for i, c in enumerate(chunks) if c.text), None)
    if not lead or i is None:
        return chunks
    return [*chunks[:i], dataclasses.replace(chunks[i], text=lead + chunks[i].text), *chunks[i + 1:]]


def _later(req: schemas.Request, first: Chunk) -> tuple[schemas.Request, float]:
    """n_cmpl's completions after the first, and the time one needs (as long as the first's prediction). llama-server
    generates them in parallel slots from the first's prompt, each within t_max_predict_ms of the same start, so the
    client waits on no more than that window; one after another, they share what the first left of it. Never the
    answer's slack past the client's budgets (ANSWER_SLACK): llama.vscode shows the first, the others only delay it."""
    c, s = req.config, first.stats
    need = s.decode_seconds if s is not None else 0.0
    ends = [] if c.deadline is None else [c.deadline - ANSWER_SLACK]
    if c.time_limit is not None:  # the first's window: from the end of its prefill (its first token)
        ends.append(time.perf_counter() - need + c.time_limit)
    return dataclasses.replace(req, config=dataclasses.replace(c, deadline=min(ends, default=None))), need


def _room_for_another(last: Chunk, due: float | None, need: float = 0.0) -> bool:
    """Whether one more of n_cmpl's completions can take `need` seconds and decode a token before `due`: a token
    costs what one did in the last completion (its whole time when it had one token)."""
    s = last.stats
    if due is None or s is None:
        return True
    per_token = s.decode_seconds / (s.completion_tokens - 1) if s.completion_tokens > 1 else \
        s.prefill_seconds + s.decode_seconds
    return time.perf_counter() + max(per_token, need) <= due


def _skipped(last: Chunk, prompt_tokens: int) -> Chunk:
    """An n_cmpl completion with no time left before the due time: empty, stopped at the limit (llama.vscode drops
    empty alternatives), its prompt still in the slot."""
    from edgespec.engine import Chunk, Stats
    return Chunk("", [], [], "length", Stats(prompt_tokens=prompt_tokens, cached_prompt_tokens=prompt_tokens),
                 slot=last.slot)


def _piece(data: bytes) -> str | list[int]:
    """A token's piece as llama.cpp's /tokenize gives it: text when it is valid UTF-8, else its bytes."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return list(data)
