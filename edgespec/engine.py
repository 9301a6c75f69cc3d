"""Generation: a step generator over the backend, streamed as text events.

Three levels, as in mlx-lm: `_steps` yields committed token ids, `Engine.stream`
turns them into `Chunk`s (text deltas, stop strings, stats), `Engine.generate`
collects a `Completion`. The CLI and the server use `stream`.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator, Literal, Sequence

import numpy as np

from edgespec import budget, chat, sampling, verify
from edgespec.backend import Model, ModelFacts, read_facts, supports_gpu_offload
from edgespec.budget import K_MAX_CAP, ModelMemory
from edgespec.config import DEFAULT_K, MAX_K, GenerationConfig, LoadConfig
from edgespec.controller import DRAFT_ACCEPT_CEILING, DRAFT_P_MIN, Costs, CostTracker, calibrate, draft_can_pay
from edgespec.errors import ContextOverflowError, InvalidRequestError, OutOfMemoryError, UnsupportedModelError
from edgespec.models import DEFAULT_MODEL, ProgressCallback, resolve
from edgespec.proposers import PROPOSERS, Proposal, Proposer
from edgespec.proposers.auto import AutoProposer
from edgespec.proposers.draft import DraftProposer
from edgespec.proposers.ngram import NgramProposer
from edgespec.text import TextStream

log = logging.getLogger(__name__)

FinishReason = Literal["stop", "length", "cancelled"]


@dataclass
class Stats:
    """Counters of one generation.

    The first token comes out of the prefill, so `tokens_per_second` is
    (completion_tokens - 1) / decode_seconds, as llama.cpp reports its eval rate.
    A cycle is one target pass after the prefill: the last token plus the draft.
    """

    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # reused from the previous call's KV cache
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


@dataclass
class Chunk:
    """One streamed event: new text and the token ids that produced it."""

    text: str
    tokens: list[int]
    from_draft: list[bool] = field(default_factory=list)  # per token: proposed and accepted, or the target's own
    finish_reason: FinishReason | None = None
    stats: Stats | None = None  # set on the last chunk


@dataclass
class Completion:
    text: str
    tokens: list[int]
    finish_reason: FinishReason
    stats: Stats = field(default_factory=Stats)


def memory_of(f: ModelFacts) -> ModelMemory:
    return ModelMemory(f.path.name, f.weights_bytes, f.n_layer, f.n_head_kv, f.head_dim_k, f.head_dim_v, f.n_vocab,
                       f.n_embd, f.n_ff, f.n_ctx_train)


class Engine:
    """A target model ready to generate; the Python API for applications."""

    def __init__(
        self,
        model: str | Path = DEFAULT_MODEL,
        *,
        draft: str | Path | None = None,
        proposer: str | Proposer = "auto",
        k: int | None = None,
        load: LoadConfig | None = None,
        memory_budget: int | None = None,
        source: str | None = None,
        progress: ProgressCallback | None = None,
    ) -> None:
        """Load `model` (a catalog name or GGUF path) and, optionally, a `draft` model.

        `proposer` is "auto" (each cycle: n-gram lookup, the draft, or a plain
        step, whichever the calibrated costs say pays), "none", "ngram",
        "draft", or any object with the `Proposer` protocol. `k` is the most
        tokens proposed per cycle (default: the memory plan's Kmax for auto,
        DEFAULT_K otherwise). The context size, whether the draft loads and
        where layers go come from the memory plan unless `load` sets them.
        """
        name = proposer if isinstance(proposer, str) else None
        if name is not None and name not in PROPOSERS:
            raise InvalidRequestError(f"unknown proposer {name!r}; use one of {', '.join(PROPOSERS)}")
        if name == "draft" and draft is None:
            raise InvalidRequestError("proposer 'draft' needs a draft model; pass --draft NAME|PATH")
        if k is not None and not 0 <= k <= MAX_K:
            raise InvalidRequestError(f"k {k} must be in 0..{MAX_K} (0 turns speculation off)")
        load = load or LoadConfig()
        self.notes: list[str] = []  # decisions a person should hear about (dropped draft, smaller context)
        if draft is not None and name in ("none", "ngram"):
            self.notes.append(f"draft {draft} is not used with proposer {name!r}")
            draft = None
        target_path = resolve(str(model), source=source, progress=progress)
        draft_path = resolve(str(draft), source=source, progress=progress) if draft is not None else None
        k_max = k if k is not None else (K_MAX_CAP if name == "auto" else DEFAULT_K)

        facts = read_facts(target_path)
        draft_facts = read_facts(draft_path) if draft_path is not None else None
        self.plan = budget.plan(memory_of(facts), memory_of(draft_facts) if draft_facts else None,
                                budget.detect_budget(supports_gpu_offload(), memory_budget),
                                n_ctx=load.n_ctx, k_max=k_max, n_ubatch=load.n_batch)
        self.notes += self.plan.notes
        if draft_path is not None and not self.plan.load_draft:
            if name == "draft":
                raise OutOfMemoryError(f"{self.plan.notes[-1]}; use --proposer auto or ngram, or a larger --memory-budget")
            draft_path = None
        gpu = load.n_gpu_layers if load.n_gpu_layers >= 0 else None
        self.load_config = replace(load, n_ctx=self.plan.n_ctx,
                                   n_gpu_layers=self.plan.target_gpu_layers if gpu is None else gpu)
        self.k = k_max
        self.cost_tracker: CostTracker | None = None  # auto only: calibrated costs, corrected by each pass
        self.target = Model(target_path, self.load_config)
        self.proposer: Proposer | None = None if isinstance(proposer, str) else proposer
        try:
            if name != "none" and not self.target.can_trim:
                raise UnsupportedModelError(
                    f"{self.target.path.name} has a recurrent cache that cannot be rolled back, so it cannot "
                    f"verify drafts; use --proposer none"
                )
            drafter = None
            if draft_path is not None:
                draft_load = replace(self.load_config, n_gpu_layers=self.plan.draft_gpu_layers if gpu is None else gpu)
                draft_model = Model(draft_path, draft_load)
                try:
                    drafter = DraftProposer(draft_model, self.target, p_min=DRAFT_P_MIN if name == "auto" else 0.0)
                except BaseException:
                    draft_model.close()
                    raise
            if name == "ngram":
                self.proposer = NgramProposer(self.target.is_eog)
            elif name == "draft":
                self.proposer = drafter
            elif name == "auto":
                self.proposer = self._auto(drafter, k_max)
        except BaseException:
            self.target.close()
            raise
        self._lock = threading.Lock()  # one generation at a time per engine
        self._running: threading.Event | None = None  # the cancel event of the generation under way
        self.reuse_prefix = True  # keep the KV prefix shared with the previous prompt (off only to measure it)

    def _auto(self, drafter: DraftProposer | None, k_max: int) -> AutoProposer:
        """Calibrate this machine's costs; unload a draft that cannot pay even at DRAFT_ACCEPT_CEILING."""
        try:
            c = calibrate(self.target, drafter.model if drafter else None, k_max)
        except BaseException:
            if drafter is not None:
                drafter.close()
            raise
        if drafter is not None and not draft_can_pay(c, k_max):
            self.notes.append(
                f"draft {drafter.model.path.name} unloaded: on this machine it would be slower than plain decoding "
                f"even at {DRAFT_ACCEPT_CEILING:.0%} acceptance (draft ÷ target per token "
                f"{c.draft_seconds_per_token / c.target_seconds[0]:.2f}, "
                f"verifying {c.batches[-1]} tokens costs {c.target_seconds[-1] / c.target_seconds[0]:.1f} single steps)"
            )
            drafter.close()
            drafter = None
        self.cost_tracker = CostTracker(c)
        return AutoProposer(NgramProposer(self.target.is_eog), drafter, self.cost_tracker)

    @property
    def costs(self) -> Costs | None:
        """The costs calibrated at load (auto only); the tracker holds their corrected form."""
        return self.cost_tracker.calibrated if self.cost_tracker is not None else None

    def close(self) -> None:
        if self.proposer is not None:
            self.proposer.close()
        self.target.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- prompts -------------------------------------------------------------

    def tokenize(self, prompt: str) -> list[int]:
        """A raw prompt's tokens: BOS as the model asks, special tokens parsed."""
        return self.target.tokenize(prompt, add_special=True, parse_special=True)

    def chat_text(self, messages: Sequence[chat.Message], add_generation_prompt: bool = True) -> str:
        """`messages` laid out by the model's own chat template."""
        m = self.target
        bos = m.token_text(m.vocab.bos) if m.vocab.bos is not None else ""
        eos = m.token_text(m.vocab.eos) if m.vocab.eos is not None else ""
        return chat.render(m.facts.chat_template, messages, bos_token=bos, eos_token=eos,
                           add_generation_prompt=add_generation_prompt, model_name=m.path.name)

    def chat_tokens(self, messages: Sequence[chat.Message], add_generation_prompt: bool = True) -> list[int]:
        """Tokens of `messages` laid out by the model's own chat template."""
        m = self.target
        tokens = m.tokenize(self.chat_text(messages, add_generation_prompt), add_special=True, parse_special=True)
        if len(tokens) > 1 and tokens[0] == tokens[1] == m.vocab.bos:
            tokens = tokens[1:]  # the template wrote the BOS the tokenizer also adds
        return tokens

    # -- generation ------------------------------------------------------------

    def cancel(self) -> None:
        """Stop the running generation after its current cycle (thread-safe)."""
        if (running := self._running) is not None:
            running.set()

    def generate(self, prompt: str | Sequence[int], config: GenerationConfig | None = None,
                 stop: Sequence[str] = (), cancel: threading.Event | None = None) -> Completion:
        text, tokens = [], []
        last = None
        for last in self.stream(prompt, config, stop=stop, cancel=cancel):
            text.append(last.text)
            tokens.extend(last.tokens)
        assert last is not None and last.finish_reason is not None and last.stats is not None
        return Completion("".join(text), tokens, last.finish_reason, last.stats)

    def stream(self, prompt: str | Sequence[int], config: GenerationConfig | None = None,
               stop: Sequence[str] = (), cancel: threading.Event | None = None) -> Iterator[Chunk]:
        """Yield text as tokens are committed; the last chunk has finish_reason and stats.

        Generations run one at a time; setting `cancel` (or calling `Engine.cancel()`
        for the one under way) ends this one after its current cycle.
        """
        config = config or GenerationConfig()
        prompt_tokens = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        self.check_fits(prompt_tokens, config.max_tokens)
        cancel = cancel or threading.Event()
        with self._lock:
            self._running = cancel
            try:
                yield from self._stream(prompt_tokens, config, stop, cancel)
            finally:
                self._running = None

    def _stream(self, prompt_tokens: list[int], config: GenerationConfig, stop: Sequence[str],
                cancel: threading.Event) -> Iterator[Chunk]:
        stats = Stats(prompt_tokens=len(prompt_tokens))
        if cancel.is_set():  # cancelled while it waited for the engine
            yield Chunk("", [], [], "cancelled", stats)
            return
        text = TextStream(stop)
        finish: FinishReason = "length"
        for tokens, from_draft, done in self._steps(prompt_tokens, config, stats, cancel):
            delta = []
            for i, t in enumerate(tokens):
                delta.append(text.push(self.target.token_bytes(t)))
                if text.stopped:  # nothing after a stop string is emitted, even within one block
                    tokens, from_draft, done = tokens[: i + 1], from_draft[: i + 1], "stop"
                    break
            if done is not None:
                finish = done
                delta.append(text.flush())
                yield Chunk("".join(delta), tokens, from_draft)
                break
            yield Chunk("".join(delta), tokens, from_draft)
        yield Chunk("", [], [], finish, stats)

    def _steps(self, prompt: list[int], config: GenerationConfig, stats: Stats, cancel: threading.Event
               ) -> Iterator[tuple[list[int], list[bool], FinishReason | None]]:
        """Committed tokens, one cycle at a time, with the finish reason on the last cycle.

        Invariant between cycles: the target cache holds committed[:-1]; the last
        committed token is decoded at the head of the next cycle's batch.
        """
        m = self.target
        sc = config.sampling
        rng = np.random.default_rng(sc.seed)
        t0 = time.perf_counter()
        logits = self._prefill(prompt, stats)
        stats.prefill_seconds = time.perf_counter() - t0
        t1 = time.perf_counter()
        try:
            first = sampling.sample(logits[-1], sc, rng)
            if m.is_eog(first):
                yield [], [], "stop"
                return
            committed = [*prompt, first]
            stats.completion_tokens = 1
            if config.max_tokens == 1:
                yield [first], [False], "length"
                return
            yield [first], [False], None
            if self.proposer is not None:
                self.proposer.begin(committed, sc, rng)
            while True:
                remaining = config.max_tokens - stats.completion_tokens
                # A cycle commits up to k+1 tokens and writes k+1 cache cells.
                k = max(0, min(self.k, remaining - 1, m.n_ctx - len(committed)))
                new, n_accepted = self._cycle(committed, k, sc, rng, stats)
                stop_at = next((i for i, t in enumerate(new) if m.is_eog(t)), None)
                if stop_at is not None:
                    new = new[:stop_at]
                from_draft = [i < n_accepted for i in range(len(new))]
                committed.extend(new)
                stats.completion_tokens += len(new)
                if stop_at is not None:
                    m.trim(len(committed) - 1)
                    yield new, from_draft, "stop"
                    return
                if stats.completion_tokens >= config.max_tokens:
                    yield new, from_draft, "length"
                    return
                if cancel.is_set():
                    yield new, from_draft, "cancelled"
                    return
                yield new, from_draft, None
        finally:
            stats.decode_seconds = time.perf_counter() - t1

    def _cycle(self, committed: list[int], k: int, sc: Any, rng: np.random.Generator,
               stats: Stats) -> tuple[list[int], int]:
        """Propose up to k tokens, verify them in one target pass; returns (new tokens, drafts accepted).

        Both caches are rolled back past the first rejection in `finally`, so an
        exception or a consumer that stops early leaves them consistent.
        """
        m = self.target
        n_keep = len(committed) - 1  # what the target cache holds if this cycle commits nothing
        n_accepted = 0
        proposer = self.proposer if k > 0 else None
        try:
            t = time.perf_counter()
            proposal = proposer.propose(committed, k) if proposer is not None else Proposal()
            draft = proposal.tokens[:k]
            t_verify = time.perf_counter()
            stats.draft_seconds += t_verify - t
            rows = m.decode([committed[-1], *draft], n_outputs=len(draft) + 1)
            if self.cost_tracker is not None:
                self.cost_tracker.observe(len(draft) + 1, time.perf_counter() - t_verify)
            if sc.greedy:
                n_accepted, nxt = verify.greedy(rows, draft)
            else:
                n_accepted, nxt = verify.sampled(rows, draft, proposal.dists, sc, rng)
            stats.verify_seconds += time.perf_counter() - t_verify
            stats.record(len(draft), n_accepted, proposal.source if draft else "none")
            n_keep = len(committed) + n_accepted
            return [*draft[:n_accepted], nxt], n_accepted
        finally:
            m.trim(n_keep)
            if proposer is not None:
                proposer.accept(n_accepted)

    def _prefill(self, prompt: list[int], stats: Stats) -> np.ndarray:
        """Evaluate the prompt, reusing the cached prefix; returns the last logits row."""
        m = self.target
        common = m.keep_prefix_of(prompt if self.reuse_prefix else ())  # () keeps nothing
        stats.cached_prompt_tokens = common
        return m.decode(prompt[common:], n_outputs=1)

    def check_fits(self, prompt: Sequence[int], max_tokens: int, prompt_name: str = "the prompt",
                   max_tokens_name: str = "--max-tokens") -> None:
        """Raise ContextOverflowError, with the numbers, unless prompt and answer fit the context.

        The names are how the caller spells the two inputs (the server names its request fields)."""
        n_ctx = self.target.n_ctx
        if not prompt:
            raise InvalidRequestError(f"{prompt_name} is empty; give at least one token of prompt")
        if len(prompt) >= n_ctx:
            raise ContextOverflowError(
                f"{prompt_name} has {len(prompt)} tokens but the context holds {n_ctx}; "
                f"shorten it or raise --ctx above {len(prompt)}"
            )
        if len(prompt) + max_tokens > n_ctx:
            raise ContextOverflowError(
                f"{max_tokens_name} {max_tokens} plus the prompt's {len(prompt)} tokens exceed the context of "
                f"{n_ctx}; use {max_tokens_name} {n_ctx - len(prompt)} or less, or raise --ctx"
            )
