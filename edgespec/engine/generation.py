"""One generation in one slot: the loop's committed tokens turned into text `Chunk`s.

Three levels, as in mlx-lm: `decoding.loop.steps` yields committed token ids, `chunks` turns them into text deltas
(stop strings, indentation and time limits, stats on the last), and `Engine.generate` collects a `Completion`.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

from edgespec.config import TIME_LIMIT_GRACE, GenerationConfig
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
from edgespec.text import IndentLimit, TextStream


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
    # Leading characters of `text` released by tokens from an accepted proposal (a cycle commits its accepted
    # drafts before the target's own token). Text held back before (a possible stop string, a split UTF-8
    # character) counts with the token that releases it.
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
    text, indent = TextStream(run.stop), IndentLimit(config.min_indent)
    finish: FinishReason = "length"
    steps = run.turns(loop.steps(slot.cache, proposer_for(slot, config), prompt, config, stats, run.cancel,
                                 run.k_max, run.k, reuse=config.reuse_prefix, rules=run.rules,
                                 anchor=run.anchor))
    t_first = t_last = None
    cycle = 0.0  # the last cycle's seconds: a cycle that would end past the deadline or the time cap is not started
    try:
        for tokens, from_draft, done, probs in steps:
            now = time.perf_counter()
            t_first = t_first or now
            cycle, t_last = (now - t_last if t_last is not None else 0.0), now
            delta = []
            for i, t in enumerate(tokens):
                piece = run.token_bytes(t)
                delta.append(indent.push(text.push(piece)))
                due = config.deadline is not None and now + cycle > config.deadline
                late = due or config.time_limit is not None and (
                    now + cycle - t_first > config.time_limit + min(config.time_limit, TIME_LIMIT_GRACE) or
                    b"\n" in piece and now - t_first > config.time_limit)
                if text.stopped or indent.stopped or late:  # nothing after the end is emitted
                    tokens, from_draft = tokens[: i + 1], from_draft[: i + 1]
                    probs = None if probs is None else probs[: i + 1]
                    done = "stop" if text.stopped else "length"
                    break
            drafted = len("".join(delta[:sum(from_draft)]))
            if done is not None:
                finish = done
                delta.append(indent.push(text.flush()) + indent.flush())
                yield Chunk("".join(delta), tokens, from_draft, logprobs=probs, draft_chars=drafted)
                break
            yield Chunk("".join(delta), tokens, from_draft, logprobs=probs, draft_chars=drafted)
    finally:
        steps.close()
    full = finish == "length" and len(prompt) + stats.completion_tokens >= slot.cache.n_ctx
    yield Chunk("", [], [], finish, stats, text.matched, full, slot.index)


def _drafters(proposer: Proposer | None) -> list[DraftProposer]:
    """The draft models' proposers in a slot's proposer: they keep a KV cache of their own."""
    if isinstance(proposer, DraftProposer):
        return [proposer]
    if isinstance(proposer, AutoProposer) and proposer.draft is not None:
        return [proposer.draft]
    return []
