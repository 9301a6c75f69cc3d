"""One generation in one slot: the loop's committed tokens turned into text `Chunk`s.

Three levels, as in mlx-lm: `decoding.loop.steps` yields committed token ids, `chunks` turns them into text deltas
(stop strings, indentation and time limits, stats on the last), and `Engine.generate` collects a `Completion`.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, NamedTuple, Sequence

from edgespec.config import TIME_LIMIT_GRACE, WHOLE_LINES_MIN_CHARS, GenerationConfig
from edgespec.decoding import loop
from edgespec.decoding.loop import FinishReason, Stats
from edgespec.decoding.rules import Rules
from edgespec.decoding.sampling import TokenLogprob
from edgespec.engine.slots import Slot
from edgespec.errors import ContextOverflowError, InvalidRequestError
from edgespec.memory import PROMPT_TAIL, Memory
from edgespec.proposers import Proposer
from edgespec.proposers.auto import AutoProposer
from edgespec.proposers.draft import DraftProposer
from edgespec.text import IndentLimit, RepeatLimit, TextStream


@dataclass
class Chunk:
    """One streamed event: new text and the token ids that produced it."""

    text: str
    tokens: list[int]
    from_draft: list[bool] = field(default_factory=list)  # per token: proposed and accepted, or the target's own
    finish_reason: FinishReason | None = None
    stats: Stats | None = None  # set on the last chunk
    stop_word: str = ""  # last chunk: the stop string that ended it
    truncated: bool = False  # last chunk: it ended because the context was full
    slot: int = -1  # last chunk: the slot it ran in
    logprobs: list[TokenLogprob] | None = None  # per token, when the generation asked for them
    # Characters of `text` released by tokens from an accepted proposal: they lead it, as a cycle commits its
    # accepted drafts before the target's own token (but for a line a time limit held back, which goes out ahead of
    # them). Text held back before (a possible stop string, a split UTF-8 character) counts with the token that
    # releases it.
    draft_chars: int = 0


@dataclass
class Completion:
    text: str
    tokens: list[int]
    finish_reason: FinishReason
    stats: Stats = field(default_factory=Stats)


def check_fits(prompt: Sequence[int], n_ctx: int, prompt_name: str = "the prompt") -> None:
    """Raise ContextOverflowError, with the numbers, unless the prompt leaves room for one token. An answer longer
    than the room left just ends there, with finish reason "length" (as in llama.cpp)."""
    if not prompt:
        raise InvalidRequestError(f"{prompt_name} is empty; give at least one token of prompt")
    if len(prompt) >= n_ctx:
        raise ContextOverflowError(
            f"{prompt_name} has {len(prompt)} tokens but the context holds {n_ctx}; "
            f"shorten it or raise --ctx above {len(prompt)}", n_prompt_tokens=len(prompt), n_ctx=n_ctx)


def proposer_for(slot: Slot, config: GenerationConfig) -> Proposer | None:
    """The proposer a generation asked for: the slot's own, or a part of its auto proposer."""
    own, name = slot.proposer, config.proposer
    if config.k == 0 or name == "none":
        return None
    if name is None or (own is not None and name == own.name):
        return own
    part = getattr(own, name, None) if isinstance(own, AutoProposer) else None
    if part is None:
        loaded = own.name if own is not None else "none"
        raise InvalidRequestError(f"proposer {name!r} is not available: this engine runs {loaded!r}"
                                  f"{' without a draft model' if name == 'draft' else ''}; ask for "
                                  f"{loaded!r} or 'none', or start it with --proposer auto"
                                  f"{' --draft NAME' if name == 'draft' else ''}")
    return part


def remembered(slot: Slot, prompt: list[int], memory: Memory | None, chunks: Iterator[Chunk]) -> Iterator[Chunk]:
    """`chunks`, with the slot's auto proposer reading `memory` meanwhile; what the generation wrote goes into that
    memory before the last chunk goes out (a consumer may stop reading at it)."""
    reader = slot.proposer.memory if isinstance(slot.proposer, AutoProposer) else None
    if reader is not None:
        reader.memory = memory
    written: list[int] = []
    for chunk in chunks:
        written += chunk.tokens
        if chunk.finish_reason is not None and memory is not None:
            memory.add([*prompt[-PROMPT_TAIL:], *written])
        yield chunk


@dataclass(frozen=True)
class Run:
    """What one generation runs with, besides its slot: the engine's caps and how tokens become bytes."""

    config: GenerationConfig
    stop: Sequence[str]
    cancel: threading.Event
    rules: Rules | None
    k_max: int  # the plan's cap on a cycle's proposal
    k: int | None  # the tighter of the engine's -k and the request's k
    token_bytes: Callable[[int], bytes]
    turns: Callable[[Iterator[loop.Step]], Iterator[loop.Step]]  # the slot pool's turn-taking
    anchor: int | None = None  # where the prompt's cached runs stop moving (prompts.fim.cursor_anchor)


def chunks(slot: Slot, prompt: list[int], run: Run) -> Iterator[Chunk]:
    """The generation's text as it is committed; the last chunk has the finish reason and stats."""
    stats = Stats(prompt_tokens=len(prompt))
    if run.cancel.is_set():  # cancelled while it waited for the engine
        yield Chunk("", [], [], "cancelled", stats)
        return
    config = run.config
    for drafter in _drafters(slot.proposer):
        drafter.cache_reuse, drafter.reuse_anchor = config.cache_reuse, run.anchor
    text, limits = TextStream(run.stop), (IndentLimit(config.min_indent), RepeatLimit(config.repeats))
    lines = WholeLines(config.time_limit is not None)
    finish: FinishReason = "length"
    steps = run.turns(loop.steps(slot.cache, proposer_for(slot, config), prompt, config, stats, run.cancel,
                                 run.k_max, run.k, reuse=config.reuse_prefix, rules=run.rules,
                                 anchor=run.anchor))
    t_first = t_last = None
    healed = config.heal.encode()  # the typed text the first tokens hold again (token healing): not sent back
    cycle = 0.0  # the last cycle's seconds: a cycle that would end past the deadline or the time cap is not started
    try:
        for tokens, from_draft, done, probs in steps:
            now = time.perf_counter()
            t_first = t_first or now
            cycle, t_last = (now - t_last if t_last is not None else 0.0), now
            out: list[Token] = []
            ended: FinishReason | None = None  # where the text or the clock ends the generation here
            for i, t in enumerate(tokens):
                piece = run.token_bytes(t)
                if healed:
                    piece, healed = piece[len(healed):], healed[len(piece):]
                out += _filtered(lines.push(Token(t, from_draft[i], None if probs is None else probs[i], piece)),
                                 text, limits)
                if text.stopped or _limited(limits) or _late(config, now, cycle, t_first, piece):
                    ended = "stop" if text.stopped else "length"
                    break
            else:
                if lines.held and config.time_limit is not None and now - t_first > config.time_limit:
                    ended = "length"  # the line under way at the limit, after whole lines: dropped
            if ended is None and done is not None:  # the loop's end (end of text, max_tokens): the line goes out
                out += _filtered(lines.release(), text, limits)
            drafted = sum(len(tk.text) for tk in out if tk.from_draft)
            chunk = Chunk("".join(tk.text for tk in out), [tk.id for tk in out], [tk.from_draft for tk in out],
                          logprobs=None if probs is None else [tk.prob for tk in out], draft_chars=drafted)
            if (ended or done) is not None:
                finish = ended or done
                chunk.text += _through(limits, text.flush(), flush=True)
                yield chunk
                break
            yield chunk
    finally:
        steps.close()
    full = finish == "length" and len(prompt) + stats.completion_tokens >= slot.cache.n_ctx
    yield Chunk("", [], [], finish, stats, text.matched, full, slot.index)


def _late(config: GenerationConfig, now: float, cycle: float, t_first: float, piece: bytes) -> bool:
    """Whether the clock ends the generation at a token of `piece` committed at `now`: the deadline, or
    t_max_predict_ms (a newline past it, or a line past it by TIME_LIMIT_GRACE, as long again at most)."""
    if config.deadline is not None and now + cycle > config.deadline:
        return True
    limit = config.time_limit
    return limit is not None and (now + cycle - t_first > limit + min(limit, TIME_LIMIT_GRACE) or
                                  b"\n" in piece and now - t_first > limit)


def _filtered(tokens: list[Token], text: TextStream, limits: Sequence[IndentLimit | RepeatLimit]) -> list[Token]:
    """`tokens` with what the text filters release for each (stop strings, indentation, repeats); none after an end
    they find."""
    return [tk._replace(text=_through(limits, text.push(tk.piece))) for tk in tokens
            if not (text.stopped or _limited(limits))]


def _through(limits: Sequence[IndentLimit | RepeatLimit], text: str, flush: bool = False) -> str:
    """What the line filters release of `text`, in order; with `flush`, all they hold at the end too."""
    for limit in limits:
        text = limit.push(text) + (limit.flush() if flush else "")
    return text


def _limited(limits: Sequence[IndentLimit | RepeatLimit]) -> bool:
    return any(limit.stopped for limit in limits)


class Token(NamedTuple):
    id: int
    from_draft: bool
    prob: TokenLogprob | None
    piece: bytes
    text: str = ""  # what the text filters released for it (stop strings, indentation)


class WholeLines:
    """Under a time limit (t_max_predict_ms), the tokens of the line under way once whole lines with text in them
    (WHOLE_LINES_MIN_CHARS) have gone out: the limit drops that line instead of waiting for its end (llama.cpp
    waits), so an editor's answer comes at its limit and in whole lines."""

    def __init__(self, active: bool) -> None:
        self.active = active
        self.held: list[Token] = []
        self._shown = 0  # visible bytes of the whole lines that went out
        self._line = 0  # visible bytes that went out since the last newline

    @property
    def whole(self) -> bool:
        """Whole lines with enough text in them have gone out."""
        return self._shown >= WHOLE_LINES_MIN_CHARS

    def push(self, token: Token) -> list[Token]:
        """The tokens that may go out now, `token` last."""
        if not self.active:
            return [token]
        if not self.whole:
            head, newline, tail = token.piece.rpartition(b"\n")
            if newline:
                self._shown, self._line = self._shown + self._line + _visible(head), _visible(tail)
            else:
                self._line += _visible(tail)
            return [token]
        self.held.append(token)
        return self.release() if b"\n" in token.piece else []

    def release(self) -> list[Token]:
        out, self.held = self.held, []
        return out


def _visible(data: bytes) -> int:
    return len(b"".join(data.split()))


def _drafters(proposer: Proposer | None) -> list[DraftProposer]:
    """The draft models' proposers in a slot's proposer: they keep a KV cache of their own."""
    if isinstance(proposer, DraftProposer):
        return [proposer]
    if isinstance(proposer, AutoProposer) and proposer.draft is not None:
        return [proposer.draft]
    return []
