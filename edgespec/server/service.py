"""The server's state: one engine loaded in the background, its worker threads, and the requests in flight.

Routes (server/routes) ask it for the engine, run generations through it (one worker per slot; the rest wait in
arrival order) and build their generation settings from the request with the helpers below it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import logging
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Iterable

from starlette.applications import Starlette
from starlette.requests import Request

from edgespec import errors
from edgespec.config import (ANSWER_QUIET, BACKGROUND_BATCH, INFILL_CACHE_REUSE, PAUSE_TICK_CAP, PAUSES_KEPT,
                             QUIET_TICK_SECONDS, GenerationConfig)
from edgespec.decoding import costs
from edgespec.decoding.rules import pieces_of
from edgespec.server import metrics, schemas
from edgespec.server.http import MAX_DRAIN_BYTES, Settings, TooLarge, Unavailable

if TYPE_CHECKING:
    from edgespec.decoding.loop import Stats
    from edgespec.engine import Chunk, Engine
    from edgespec.engine.infill import AsideBuild

log = logging.getLogger(__name__)

DISCONNECT_POLL_SECONDS = 0.1


class Pauses:
    """The pauses from an answer someone waited on to the next awaited request, in the time this process ran:
    background batches are sized to end within them (costs.pause_batch). While one lasts a thread ticks its clock,
    each tick counting at most PAUSE_TICK_CAP: a stopped process ran no background work, and a pause counted with
    the stop would promise batches time the next pause does not hold. A read also counts at most that since the
    last tick, so a worker that runs on the moment the process resumes, before the ticker, does not see the stop."""

    def __init__(self, observe: Callable[[float], None]) -> None:
        self.since: float | None = None  # the clock when the last answer ended; None while one is awaited
        self.seen: collections.deque[float] = collections.deque(maxlen=PAUSES_KEPT)
        self.observe = observe  # each pause that ends (the metrics)
        self._ran, self._tick = 0.0, time.perf_counter()
        self.stops = 0  # ticks that found the process stopped for longer than a tick counts
        self._lock = threading.Lock()
        self._ticker: threading.Thread | None = None

    def _clock(self) -> float:
        """Seconds this process ran, as ticks count them (under the lock)."""
        now = time.perf_counter()
        self._ran += min(now - self._tick, PAUSE_TICK_CAP)
        self.stops += now - self._tick > PAUSE_TICK_CAP
        self._tick = now
        return self._ran

    def _ticks(self) -> None:
        while True:
            time.sleep(QUIET_TICK_SECONDS)
            with self._lock:
                self._clock()
                if self.since is None:
                    self._ticker = None
                    return

    def answered(self) -> None:
        with self._lock:
            self.since = self._clock()
            if self._ticker is None:
                self._ticker = threading.Thread(target=self._ticks, name="pause clock", daemon=True)
                self._ticker.start()

    def awaited(self) -> None:
        """A request someone waits on came: the pause since the last answer ends."""
        with self._lock:
            if self.since is None:
                return
            pause, self.since = self._clock() - self.since, None
            self.seen.append(pause)
        self.observe(pause)

    def ran(self) -> float:
        """Seconds this process ran, by this clock: a stop counts at most PAUSE_TICK_CAP."""
        with self._lock:
            return self._clock()

    @property
    def elapsed(self) -> float:
        """Seconds this pause has run (0 while a request runs)."""
        with self._lock:
            return 0.0 if self.since is None else self._clock() - self.since


class Service:
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
        # Prompt evaluations nobody waits on (an editor's warm-up, widening a cut context): each request preempts
        # them. Their cancel events, and the jobs that end when they have given the engine back.
        self.background: dict[threading.Event, asyncio.Future] = {}
        # The aside build the last budgeted /infill answer asked for (Engine.build_aside), None once done: an editor's
        # warm-up runs it before its own chunks, which a budgeted completion rarely carries.
        self.aside_build: Callable[[threading.Event], bool] | None = None
        self.pauses = Pauses(self.metrics.pauses.observe)

    def load(self) -> None:
        try:
            engine = self.load_engine()
            if engine.target.vocab.fim_pre is not None:  # /infill's token healing indexes the vocabulary: not then
                pieces_of(engine.target)
            self.executor = ThreadPoolExecutor(len(engine.slots), thread_name_prefix="engine")
            self.loaded = engine
        except Exception as e:  # reported by /health and every endpoint, instead of a dead process
            log.exception("loading the model failed")
            self.load_error = str(e)

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        threading.Thread(target=self.load, name="load", daemon=True).start()
        yield
        for cancel in [*self.active, *self.background]:  # the grace period is over: end what still runs
            cancel.set()
        if self.executor is not None:  # the engine must be idle before it is freed
            self.executor.shutdown(wait=True, cancel_futures=True)
        if self.loaded is not None:
            self.loaded.close()

    def shutdown(self, grace: float) -> None:
        """Refuse new requests; cancel those still running after `grace` seconds (streams then finish). Called again
        (a second Ctrl-C), it cancels them now."""
        if self.draining:
            for cancel in list(self.active):
                cancel.set()
            return
        self.draining = True
        for cancel in list(self.background):  # nobody waits on background work: it ends now
            cancel.set()
        timer = threading.Timer(grace, lambda: [e.set() for e in list(self.active)])
        timer.daemon = True
        timer.start()

    def idle(self) -> bool:
        """Nothing in flight: a draining server may close its socket."""
        return not self.active

    def engine(self) -> Engine:
        if self.draining:
            raise Unavailable("the server is shutting down; send the request to a new instance")
        if self.loaded is None:
            raise Unavailable(self.load_error or "the model is still loading; retry when GET /health says ok")
        return self.loaded

    async def body_of(self, request: Request) -> dict[str, Any]:
        return await read_body(request, self.settings.max_body_bytes)

    def count(self, last: Chunk) -> None:
        reason = last.finish_reason
        self.finished[reason or "error"] = self.finished.get(reason or "error", 0) + 1
        if last.stats is not None:
            self.metrics.generation(last.stats, reason)

    def submit(self, job: Callable[[], Any]) -> asyncio.Future:
        """Run `job` on an engine worker (one per slot), counted in the queue metrics."""
        assert self.executor is not None  # set before the engine is, and engine() checked that
        return asyncio.get_running_loop().run_in_executor(self.executor, self.metrics.queued(job))

    def cache_reuse(self, route: str) -> int:
        """A route's n_cache_reuse when the request leaves it out: --cache-reuse, else chunk reuse for /infill only
        (editors' completions, where a moved chunk's nearly-fresh KV is worth a re-evaluation saved)."""
        if self.settings.cache_reuse is not None:
            return self.settings.cache_reuse
        return INFILL_CACHE_REUSE if route == schemas.INFILL else 0

    async def preempt(self, awaited: bool = True) -> None:
        """Stop the background evaluations and wait for them to give the engine back (their batch in flight is
        aborted; what they evaluated before it stays in the cache, for this request to reuse). An `awaited` request
        (not an editor's warm-up) ends the pause since the last answer."""
        if awaited:
            self.pauses.awaited()
        # Until none is left: a warm-up whose handler was waiting on the same job may register meanwhile, and
        # this request would then queue behind all of its evaluation.
        while jobs := list(self.background.items()):
            for cancel, _ in jobs:
                cancel.set()
            if self.loaded is not None:
                self.loaded.target.abort()
            await asyncio.wait([job for _, job in jobs])

    def warm(self, prompts: Callable[[], Iterable[list[int]]] | None, config: GenerationConfig, delay: float = 0.0,
             now: Callable[[], Iterable[list[int]]] = lambda: (),
             aside: Callable[[threading.Event], bool] | None = None, parts_first: bool = False) -> None:
        """While nobody waits, until the next request: first `aside` (a build beside the slots, Engine.build_aside)
        if there is one, then each of `now` into the cache of `config`'s slot, then from `delay` seconds of quiet
        each of `prompts` there (each the one before it with more context: what was evaluated stays usable). With
        `parts_first` (a slot that holds its FIM prompt as parts) `now` comes before `aside`, each while this pause
        is expected to hold the move it ends with, which nothing aborts."""
        eng, cancel = self.engine(), threading.Event()
        config = dataclasses.replace(config, max_tokens=0, prompt_batch=BACKGROUND_BATCH, memory=None)
        self.aside_build = aside  # the last answer's: a build an earlier one asked for may be stale

        room = self.pause_room if parts_first else None

        def work() -> None:
            if cancel.wait(ANSWER_QUIET):
                return
            done = _evaluated(eng, config, now(), cancel, room) and self.build_aside(aside, cancel) if parts_first \
                else self.build_aside(aside, cancel) and _evaluated(eng, config, now(), cancel)
            if done and prompts is not None and not _quiet_for(delay, cancel):
                _evaluated(eng, config, prompts(), cancel)

        self._background(cancel, self.submit(work), awaited=False)

    def background_batches(self) -> TimedBatches:
        """For one aside build: tokens for its next batch, `left` to evaluate, sized to end within this pause."""
        assert self.loaded is not None  # not engine(): a build runs on while a draining server cancels it
        return TimedBatches(self.loaded.prompt_rate, self.pauses)

    def build_in_pause(self, eng: Engine, build: AsideBuild, cancel: threading.Event) -> bool:
        """Evaluate `build` aside (Engine.build_aside) in batches sized to this pause, until done or `cancel`: whether
        it is done. The batch a request stopped is timed too (TimedBatches.aborted)."""
        batches = self.background_batches()
        done = eng.build_aside(build, cancel, batches, self.pause_room)
        if not done and cancel.is_set():
            batches.aborted()
        return done

    def pause_room(self, seconds: float) -> bool:
        """Whether this pause is expected to hold `seconds` more of work that cannot be aborted."""
        return costs.pause_holds(self.pauses.elapsed, tuple(self.pauses.seen), seconds)

    def build_aside(self, build: Callable[[threading.Event], bool] | None, cancel: threading.Event) -> bool:
        """Run an aside build until done or `cancel` (counted in /metrics); whether it is done."""
        if build is None:
            return True
        done = build(cancel)
        self.metrics.aside_builds.labels("done" if done else "stopped").inc()
        if done and self.aside_build is build:
            self.aside_build = None
        return done

    def _background(self, cancel: threading.Event, job: asyncio.Future, awaited: bool = True) -> None:
        """Track `job` until it ends; one no handler awaits (not `awaited`) has its error logged here."""
        self.background[cancel] = job
        job.add_done_callback(lambda _: self.background.pop(cancel, None))
        if not awaited:
            job.add_done_callback(_log_failure)

    async def run(self, request: Request, prompt: list[int] | Callable[[], list[int]], req: schemas.Request,
                  cancel: threading.Event, aside_first: bool = False) -> list[Chunk]:
        """Generate without streaming, cancelling if the client disconnects meanwhile. A warm-up (n_predict 0)
        runs as background work: after the requests in flight, in small batches, preempted by the next request;
        with `aside_first` (an editor's warm-up), after the aside build the last /infill answer asked for, if it is
        not done. A `prompt` given as a function is read when the generation starts, after that build."""
        eng = self.engine()
        warm_up = req.config.max_tokens == 0
        if warm_up:  # after the requests in flight: beside one, sharing the engine, it holds the answer back
            while self.active - self.background.keys():
                await asyncio.sleep(DISCONNECT_POLL_SECONDS)
        else:
            # a warm-up that came after this request's preempt, before its job; not as awaited: the route ended the
            # pause, and n_cmpl's alternatives, each run here, would count pauses of no time
            await self.preempt(awaited=False)
        self.active.add(cancel)
        try:
            config, build = _as_background(req.config), self.aside_build if aside_first and warm_up else None

            def generate() -> list[Chunk]:
                self.build_aside(build, cancel)
                return list(eng.stream(prompt() if callable(prompt) else prompt, config, req.stop, cancel))

            job = self.submit(generate)
            if warm_up:
                self._background(cancel, job)
            while not job.done():
                if await request.is_disconnected():
                    cancel.set()
                await asyncio.wait([job], timeout=DISCONNECT_POLL_SECONDS)
            chunks = job.result()
        finally:
            self.active.discard(cancel)
            if not warm_up:
                self.pauses.answered()
        self.count(chunks[-1])
        return chunks

    async def stream_chunks(self, prompt: list[int], req: schemas.Request, cancel: threading.Event
                            ) -> AsyncIterator[Chunk | None]:
        """Chunks from the worker thread as they come, None after each `keepalive_seconds` without one
        (a long prefill); closing the iterator (a disconnect) cancels. Preempts as `run` does, before its job."""
        eng = self.engine()
        await self.preempt(awaited=False)  # a warm-up that came after the route's preempt would go first
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        done = object()

        def work() -> None:
            try:
                for chunk in eng.stream(prompt, _as_background(req.config), req.stop, cancel):
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
                self.pauses.answered()

        return gen()


async def read_body(request: Request, limit: int) -> dict[str, Any]:
    """A request's JSON object, of at most `limit` bytes."""
    data = bytearray()
    n = 0
    async for piece in request.stream():
        n += len(piece)
        if n <= limit:
            data += piece
        elif n > MAX_DRAIN_BYTES:  # read on so that the client, still sending, gets to read the 413
            break
    if n > limit:
        raise TooLarge(f"request body over {limit} bytes; send less context")
    try:
        body = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise errors.InvalidRequestError(f"malformed JSON body ({e})") from e
    if not isinstance(body, dict):
        raise errors.InvalidRequestError("the JSON body must be an object")
    return body


def _evaluated(eng: Engine, config: GenerationConfig, prompts: Iterable[list[int]], cancel: threading.Event,
               room: Callable[[float], bool] | None = None) -> bool:
    """Evaluate each of `prompts` into `config`'s slot while nobody waits, until `cancel`: whether not cancelled. One
    that would drop the FIM prompt the slot holds as parts is left out; with `room`, none is started where the pause
    is not expected to hold the move it ends with, which nothing aborts (a request would wait on it)."""
    for prompt in prompts:
        if cancel.is_set():
            return False
        if config.slot is not None and (room is not None or eng.pool.holds_parts(config.slot)):  # else nothing to price
            if (plan := eng.pool.background_plan(config.slot, prompt, config.cache_reuse)) is None:
                continue  # parts the pauses built for the lines to come: not dropped by work nobody waits on
            if room is not None and plan.moved and not room(eng.prompt_rate.background_seconds(plan.new, True)):
                return True  # a later pause grows the parts
        for _ in eng.stream(prompt, config, (), cancel):
            pass
    return not cancel.is_set()


def _quiet_for(seconds: float, cancel: threading.Event) -> bool:
    """Wait `seconds` of this process's running time, in ticks: a server stopped meanwhile (SIGSTOP, a debugger, a
    lockstep benchmark) does not find the pause over the moment it resumes, as the next request arrives. True when
    `cancel` came first."""
    for _ in range(math.ceil(seconds / QUIET_TICK_SECONDS)):
        if cancel.wait(QUIET_TICK_SECONDS):
            return True
    return cancel.is_set()


class TimedBatches:
    """A build's batch sizes, each sized to end within the pause (costs.pause_batch). Each call times the batch
    before it (all a build does between them) for `rate`'s background scale, in the time the process ran: a batch
    that a stop (a lockstep benchmark's freeze) held up would price the next ones dear. `aborted` times the batch a
    request stopped, which ran at least that long."""

    def __init__(self, rate: costs.PromptRate, pauses: Pauses) -> None:
        self.rate, self.pauses = rate, pauses
        self.last: tuple[int, float, int] | None = None  # the batch in flight: its tokens, start, Pauses.stops then

    def __call__(self, left: int) -> int:
        now = self.pauses.ran()
        if self.last is not None:
            self.rate.observe_background(self.last[0], now - self.last[1])
        n = costs.pause_batch(self.pauses.elapsed, tuple(self.pauses.seen), self.rate.background_seconds, left,
                              BACKGROUND_BATCH)
        self.last = (n, now, self.pauses.stops)
        return n

    def aborted(self) -> None:
        """The batch in flight was stopped by a request: it would have taken longer than it ran, unless the process
        was stopped meanwhile (the tick a stop counts would make a bound of it that the batch never ran)."""
        ran = self.pauses.ran()
        if self.last is not None and self.pauses.stops == self.last[2]:
            self.rate.observe_background(self.last[0], ran - self.last[1], at_least=True)
        self.last = None


def _log_failure(job: asyncio.Future) -> None:
    """A background job's error, where no handler awaits the job to answer with it."""
    if not job.cancelled() and (e := job.exception()) is not None:
        log.error("background evaluation failed: %s", e, exc_info=e)


def _as_background(config: GenerationConfig) -> GenerationConfig:
    """A warm-up's evaluation in small batches, so that the next request preempts it within one."""
    return dataclasses.replace(config, prompt_batch=BACKGROUND_BATCH) if config.max_tokens == 0 else config


def prompt_of(body: dict[str, Any], eng: Engine) -> list[int]:
    """'prompt' as text, or as token ids (both APIs accept either)."""
    value = body.get("prompt")
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        bad = [t for t in value if not 0 <= t < eng.n_vocab]
        if bad:
            raise errors.InvalidRequestError(f"token ids must be in 0..{eng.n_vocab - 1}, got {bad[:4]}")
        return value
    return eng.tokenize(schemas.text_field(body, "prompt", required=True) or "")


def request_of(body: dict[str, Any], route: str, eng: Engine, default_max_tokens: int | None,
               default_temperature: float, default_cache_reuse: int = 0) -> schemas.Request:
    return schemas.generation(body, route, eng.n_ctx, default_max_tokens, default_temperature,
                              lambda text: eng.target.tokenize(text, add_special=False, parse_special=True),
                              eng.n_vocab, default_cache_reuse)


def check_request(eng: Engine, prompt: list[int], prompt_name: str, req: schemas.Request) -> None:
    """What would fail a generation at its start, checked before a stream starts: a 400, not a broken stream."""
    eng.check_fits(prompt, prompt_name)
    grammar = eng.grammar(req.config)
    if grammar is not None:
        grammar.close()


def in_namespace(request: Request, req: schemas.Request) -> schemas.Request:
    """The request's generation in the memory namespace of its API key (Safety found it; the local one when the
    server has no key), unless it asked for no memory."""
    namespace = request.scope.get("state", {}).get("memory_namespace")
    if namespace is None or req.config.memory is None:
        return req
    return dataclasses.replace(req, config=dataclasses.replace(req.config, memory=namespace))


def spec(s: Stats, req: schemas.Request) -> dict[str, Any]:
    """The speculation figures of one generation, with the proposer and k cap it asked for (null: the server's)."""
    return {"proposer": req.config.proposer, "k": req.config.k, "drafted": s.drafted, "accepted": s.accepted,
            "acceptance_rate": round(s.acceptance_rate, 4), "cycles": s.cycles,
            "cycles_by_proposer": dict(s.cycles_by_proposer), "tokens_per_second": round(s.tokens_per_second, 2),
            "cached_prompt_tokens": s.cached_prompt_tokens, "shifted_prompt_tokens": s.shifted_prompt_tokens}
