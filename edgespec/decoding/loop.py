"""The speculative loop: prefill with prefix reuse, one cycle (propose, verify, roll back), a generation's steps.

It runs on anything with the `Target` surface: the engine runs it on a llama.cpp
model, scripts/replay_auto.py on recorded outputs with a simulated clock.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator, Literal, NamedTuple, Protocol, Sequence, TypeVar

import numpy as np

from edgespec.decoding import parts
from edgespec.decoding import reuse as chunks
from edgespec.decoding import sampling, verify
from edgespec.config import GenerationConfig, SamplingConfig
from edgespec.decoding.policy import k_cap
from edgespec.proposers import Proposal, Proposer
from edgespec.decoding.rules import Rules
from edgespec.decoding.sampling import TokenLogprob

FinishReason = Literal["stop", "length", "cancelled"]
Clock = Callable[[], float]
_Model = TypeVar("_Model", bound="FirstSequence")  # a model opened with `with` is itself (requires-python 3.10)


class Step(NamedTuple):
    tokens: list[int]  # committed this cycle
    from_draft: list[bool]  # per token: proposed and accepted
    finish: FinishReason | None = None  # set on the last step
    logprobs: list[TokenLogprob] | None = None  # per token, when the generation asked for them


class Target(Protocol):
    """What the loop needs of the target model (backend.KVSequence has it)."""

    n_ctx: int
    tokens: list[int]  # what the cache holds, position by position
    can_shift: bool  # whether cached entries can move to new positions (chunk reuse)

    def decode(self, tokens: Sequence[int], n_outputs: int = 1) -> np.ndarray: ...

    def evaluate(self, prompt: Sequence[int], runs: Sequence[tuple[int, int, int]] = (), n_outputs: int = 1,
                 stop: Callable[[], bool] | None = None, step: int | None = None) -> np.ndarray | None: ...

    def trim(self, n_keep: int) -> int: ...

    def prompt_row(self, prompt: Sequence[int]) -> np.ndarray | None: ...

    def is_eog(self, token: int) -> bool: ...


class KeptRow:
    """A cache mirrored in `tokens`: the prefix it shares with a prompt, and the logits row that ended its last
    evaluation, kept while the positions it was computed over stay: a prompt evaluated again (n_cmpl's other
    completions, a regenerate) samples its first token from it instead of decoding its last token again, as
    llama-server's parallel completions share one evaluation."""

    tokens: list[int]
    _row: tuple[int, np.ndarray] | None = None  # (positions it follows, the row)

    def prompt_row(self, prompt: Sequence[int]) -> np.ndarray | None:
        """The kept row, as (1, n_vocab), when it follows exactly `prompt` (the cache is trimmed to it); else None."""
        n = len(prompt)
        if self._row is None or self._row[0] != n or self.tokens[:n] != list(prompt):
            return None
        self.trim(n)
        return self._row[1][None].copy()

    def trim(self, n_keep: int) -> int: ...

    def shared_prefix(self, tokens: Sequence[int]) -> int:
        """Length of the cache's longest prefix shared with `tokens`, short of their last token
        (which must be decoded again for its logits)."""
        held, n = self.tokens, max(0, min(len(self.tokens), len(tokens) - 1))
        if held[:n] == list(tokens[:n]):  # the usual case, compared in C
            return n
        return next(i for i, (a, b) in enumerate(zip(held, tokens)) if a != b)  # they part before n

    def keep_prefix_of(self, tokens: Sequence[int]) -> int:
        """Trim the cache to `shared_prefix(tokens)`; returns how many cached tokens were kept."""
        n = self.shared_prefix(tokens)
        self.trim(n)
        return n

    def _keep_row(self, rows: np.ndarray | None) -> None:
        """After an evaluation that ended at the cache's end: its last row (none when it stopped early)."""
        self._row = (len(self.tokens), rows[-1].copy()) if rows is not None and len(rows) else None

    def _dropped(self, at: int) -> None:
        """Positions from `at` on left the cache: a row computed over any of them no longer holds."""
        if self._row is not None and at < self._row[0]:
            self._row = None


class FirstSequence:
    """A model used as its own first KV sequence (`sequences[0]`), as the draft proposer and calibration use it;
    the llama.cpp model and the ONNX draft (onnx.runtime.OnnxModel) share it."""

    sequences: list

    @property
    def tokens(self) -> list[int]:
        return self.sequences[0].tokens

    @property
    def n_past(self) -> int:
        return self.sequences[0].n_past

    def decode(self, tokens: Sequence[int], n_outputs: int = 1) -> np.ndarray:
        return self.sequences[0].decode(tokens, n_outputs)

    def evaluate(self, prompt: Sequence[int], runs: Sequence[tuple[int, int, int]] = (), n_outputs: int = 1,
                 stop: Callable[[], bool] | None = None, step: int | None = None) -> np.ndarray | None:
        return self.sequences[0].evaluate(prompt, runs, n_outputs, stop, step)

    def trim(self, n_keep: int) -> int:
        return self.sequences[0].trim(n_keep)

    def pos_max(self) -> int:
        return self.sequences[0].pos_max()

    def prompt_row(self, prompt: Sequence[int]) -> np.ndarray | None:
        return self.sequences[0].prompt_row(prompt)

    def shared_prefix(self, tokens: Sequence[int]) -> int:
        return self.sequences[0].shared_prefix(tokens)

    def keep_prefix_of(self, tokens: Sequence[int]) -> int:
        return self.sequences[0].keep_prefix_of(tokens)

    def close(self) -> None: ...

    def __enter__(self: _Model) -> _Model:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class Stats:
    """Counters of one generation.

    The first token comes out of the prefill, so `tokens_per_second` is
    (completion_tokens - 1) / decode_seconds, as llama.cpp reports its eval rate.
    A cycle is one target pass after the prefill: the last token plus the draft.
    """

    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # reused from the previous call's KV cache
    shifted_prompt_tokens: int = 0  # of those, reused at a new position (chunk reuse)
    completion_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    cycles: int = 0
    drafted: int = 0
    accepted: int = 0
    drafted_at: list[int] = field(default_factory=list)  # per draft position
    accepted_at: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    cycles_by_proposer: dict[str, int] = field(default_factory=dict)  # "none" counts plain steps

    @property
    def tokens_per_second(self) -> float:
        n = self.completion_tokens - 1
        return n / self.decode_seconds if n > 0 and self.decode_seconds > 0 else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_per_cycle(self) -> float:
        """Draft tokens accepted per target pass (each pass also commits one target token)."""
        return self.accepted / self.cycles if self.cycles else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]

    @property
    def other_seconds(self) -> float:
        return max(0.0, self.decode_seconds - self.draft_seconds - self.verify_seconds)

    def record(self, drafted: int, accepted: int, source: str) -> None:
        self.cycles += 1
        self.cycles_by_proposer[source] = self.cycles_by_proposer.get(source, 0) + 1
        self.drafted += drafted
        self.accepted += accepted
        while len(self.drafted_at) < drafted:
            self.drafted_at.append(0)
            self.accepted_at.append(0)
        for i in range(drafted):
            self.drafted_at[i] += 1
            self.accepted_at[i] += i < accepted

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k not in ("drafted_at", "accepted_at")}
        for name in ("tokens_per_second", "acceptance_rate", "mean_accepted_per_cycle", "acceptance_by_position",
                     "other_seconds"):
            d[name] = getattr(self, name)
        return d


def prefill(target: Target, prompt: Sequence[int], stats: Stats, reuse: bool = True, min_chunk: int = 0,
            stop: Callable[[], bool] | None = None, step: int | None = None, anchor: int | None = None
            ) -> np.ndarray | None:
    """Evaluate the prompt, keeping what the cache holds of it: the common prefix (nothing if not `reuse`) and, with
    `min_chunk` > 0 where the cache can shift, every later run of at least that many tokens that only moved and
    starts before `anchor` (decoding.reuse), in batches of `step` tokens. The last logits row; None if `stop` ended
    the evaluation early. A prompt the cache holds with its last row (KeptRow) is not evaluated at all."""
    if reuse and (row := target.prompt_row(prompt)) is not None:
        stats.cached_prompt_tokens, stats.shifted_prompt_tokens = len(prompt), 0
        return row
    kept = planned(target, prompt, min_chunk, anchor) if reuse else chunks.plan((), prompt)
    stats.cached_prompt_tokens = kept.reused
    stats.shifted_prompt_tokens = kept.moved
    if isinstance(kept, parts.PartsPlan):
        return target.hold(prompt, kept, stop, step)  # type: ignore[attr-defined]
    return target.evaluate(prompt, [(r.start, r.source, r.length) for r in kept.runs], 1, stop, step)


def planned(target: Target, prompt: Sequence[int], min_chunk: int = 0, anchor: int | None = None) -> chunks.Reuse:
    """What of `target`'s cache `prefill` keeps for `prompt`: the common prefix, and with `min_chunk` > 0 where the
    cache can shift, the runs that only moved (decoding.reuse.plan); its `new` tokens are the ones evaluated. With
    `min_chunk` > 0, a FIM prompt the cache holds as parts is planned so (decoding.parts), and any other keeps only
    what the parts' cache holds before them."""
    if min_chunk and (grouped := getattr(target, "grouped", None)) is not None and (p := grouped(prompt)) is not None:
        return p
    held, plain = target.tokens, getattr(target, "plain", len(target.tokens))
    held = held[:plain] if plain < len(held) else held  # no copy of a cache that holds no parts: a fit plans often
    return chunks.plan(held, prompt, min_chunk if target.can_shift else 0, anchor)


def cycle(target: Target, proposer: Proposer | None, committed: list[int], k: int, sc: SamplingConfig,
          rng: np.random.Generator, stats: Stats, clock: Clock = time.perf_counter, rules: Rules | None = None,
          n_probs: int | None = None) -> tuple[list[int], int, list[TokenLogprob] | None]:
    """Propose up to k tokens, verify them in one target pass; returns (new tokens, drafts accepted, their
    logprobs when `n_probs` is not None: each token's and the `n_probs` best of its row).

    The target cache is rolled back past the first rejection in `finally` (and the
    proposer told, so it rolls back its own), so an exception or a consumer that
    stops early leaves both consistent. Under a grammar a proposal ends at the first
    token the grammar forbids, since the target could not commit it: cut before it, or,
    when the draft sampled it, just after it, as rejecting it draws from the residual.
    """
    n_keep = len(committed) - 1  # what the target cache holds if this cycle commits nothing
    n_accepted, seconds = 0, None  # seconds stays None if the verify pass never ran
    try:
        t = clock()
        proposal = proposer.propose(committed, k) if proposer is not None else Proposal()
        draft, dists = proposal.tokens, proposal.dists
        if len(draft) > k:
            raise ValueError(f"proposer {proposal.source!r} proposed {len(draft)} tokens, more than the cap k={k}")
        if rules is not None and (n_ok := rules.admits(draft)) < len(draft):
            n_ok += dists is not None
            draft, dists = draft[:n_ok], None if dists is None else dists[:n_ok]
        t_verify = clock()
        stats.draft_seconds += t_verify - t
        rows = target.decode([committed[-1], *draft], n_outputs=len(draft) + 1)
        seconds = clock() - t_verify
        if sc.greedy:
            n_accepted, nxt = verify.greedy(rows, draft, rules, committed)
        else:
            n_accepted, nxt = verify.sampled(rows, draft, dists, sc, rng, rules, committed)
        stats.verify_seconds += clock() - t_verify
        stats.record(len(draft), n_accepted, proposal.source if draft else "none")
        n_keep = len(committed) + n_accepted
        new = [*draft[:n_accepted], nxt]
        probs = None if n_probs is None else [sampling.logprob(rows[i], t, n_probs) for i, t in enumerate(new)]
        return new, n_accepted, probs
    finally:
        target.trim(n_keep)
        if proposer is not None:
            proposer.accept(n_accepted, seconds)


def _pick(row: np.ndarray, history: Sequence[int], sc: SamplingConfig, rng: np.random.Generator,
          rules: Rules | None) -> int:
    """The token after `history` from one row (the prefill's last), committed to the rules' grammar."""
    if rules is None:
        return sampling.sample(row, sc, rng)
    token = rules.token(row, history, rng)
    rules.accept(token)
    return token


def steps(target: Target, proposer: Proposer | None, prompt: list[int], config: GenerationConfig, stats: Stats,
          cancel: threading.Event, k_max: int, user_k: int | None = None, reuse: bool = True,
          clock: Clock = time.perf_counter, rules: Rules | None = None, anchor: int | None = None) -> Iterator[Step]:
    """Committed tokens, one cycle at a time, with the finish reason on the last cycle.

    Invariant between cycles: the target cache holds committed[:-1]; the last
    committed token is decoded at the head of the next cycle's batch. `rules`
    (a grammar, penalties, logit bias) shape every row the target is read at; `anchor`: where cached runs stop
    moving (prefill).
    """
    sc, n_probs, rng = config.sampling, config.logprobs, config.sampling.rng()
    room = target.n_ctx - len(prompt)
    limit = room if config.max_tokens is None else min(config.max_tokens, room)
    t0 = clock()
    logits = prefill(target, prompt, stats, reuse, config.cache_reuse, cancel.is_set, config.prompt_batch, anchor)
    stats.prefill_seconds = clock() - t0
    t1 = clock()
    if logits is None:  # cancelled while the prompt was evaluated: what was evaluated stays for the next request
        yield Step([], [], "cancelled")
        return
    if limit == 0:  # the prompt is in the cache (for the next request to reuse); nothing more
        yield Step([], [], "length")
        return
    try:
        first = _pick(logits[-1], prompt, sc, rng, rules)
        probs = None if n_probs is None else [sampling.logprob(logits[-1], first, n_probs)]
        if target.is_eog(first):
            yield Step([], [], "stop")
            return
        committed = [*prompt, first]
        stats.completion_tokens = 1
        if limit == 1:
            yield Step([first], [False], "length", probs)
            return
        yield Step([first], [False], None, probs)
        if proposer is not None:
            proposer.begin(committed, sc, rng)
        while True:
            k = k_cap(target.n_ctx - len(committed), limit - stats.completion_tokens, k_max, user_k)
            new, n_accepted, probs = cycle(target, proposer, committed, k, sc, rng, stats, clock, rules, n_probs)
            stop_at = next((i for i, t in enumerate(new) if target.is_eog(t)), None)
            if stop_at is not None:
                new = new[:stop_at]
                probs = None if probs is None else probs[:stop_at]
            from_draft = [i < n_accepted for i in range(len(new))]
            committed.extend(new)
            stats.completion_tokens += len(new)
            if stop_at is not None:
                target.trim(len(committed) - 1)
                yield Step(new, from_draft, "stop", probs)
                return
            if stats.completion_tokens >= limit:
                yield Step(new, from_draft, "length", probs)
                return
            if cancel.is_set():
                yield Step(new, from_draft, "cancelled", probs)
                return
            yield Step(new, from_draft, None, probs)
    finally:
        stats.decode_seconds = clock() - t1
