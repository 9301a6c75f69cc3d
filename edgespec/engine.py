"""The Engine: a target (and a proposer) loaded from one EngineConfig; generation, chat and FIM prompts.

Three levels, as in mlx-lm: `loop.steps` yields committed token ids, `Engine.stream`
turns them into `Chunk`s (text deltas, stop strings, stats), `Engine.generate`
collects a `Completion`. The CLI and the server use `stream`.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator, Sequence

from edgespec import budget, chat, fim, loop
from edgespec.backend import Model, ModelFacts, read_facts, supports_gpu_offload
from edgespec.budget import ModelMemory, Plan
from edgespec.config import DEFAULT_MODEL, EngineConfig, GenerationConfig, LoadConfig
from edgespec.costs import CostTracker, calibrate
from edgespec.errors import ContextOverflowError, InvalidRequestError, OutOfMemoryError, UnsupportedModelError
from edgespec.loop import FinishReason, Stats
from edgespec.models import ProgressCallback, resolve
from edgespec.models.store import calibration_dir
from edgespec.policy import DRAFT_ACCEPT_CEILING, DRAFT_P_MIN, Costs, draft_can_pay
from edgespec.proposers import Proposer
from edgespec.proposers.auto import AutoProposer
from edgespec.proposers.draft import DraftProposer
from edgespec.proposers.ngram import NgramProposer
from edgespec.text import TextStream

log = logging.getLogger(__name__)

__all__ = ["Chunk", "Completion", "Engine", "FinishReason", "Stats", "plan_memory"]


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


def plan_memory(target: Path, draft: Path | None, load: LoadConfig, k_max: int,
                memory_budget: int | None = None) -> Plan:
    """How `target` (and `draft`) fit the memory this machine has, or `memory_budget` bytes of it."""
    facts = read_facts(target)
    draft_facts = read_facts(draft) if draft is not None else None
    return budget.plan(memory_of(facts), memory_of(draft_facts) if draft_facts else None,
                       budget.detect_budget(supports_gpu_offload(), memory_budget),
                       n_ctx=load.n_ctx, k_max=k_max, n_ubatch=load.n_batch)


class Engine:
    """A target model ready to generate; the Python API for applications."""

    def __init__(self, model: str | Path | EngineConfig = DEFAULT_MODEL, *, draft: str | Path | None = None,
                 proposer: str | Proposer = "auto", k: int | None = None, load: LoadConfig | None = None,
                 memory_budget: int | None = None, source: str | None = None,
                 progress: ProgressCallback | None = None) -> None:
        """Load `model` (an EngineConfig, or a catalog name or GGUF path with the config's fields as options).

        `proposer` is "auto" (each cycle: n-gram lookup, the draft, or a plain
        step, whichever the calibrated costs say pays), "none", "ngram",
        "draft", or any object with the `Proposer` protocol. `k` is the most
        tokens proposed per cycle (default: the memory plan's Kmax for auto,
        DEFAULT_K otherwise). The context size, whether the draft loads and
        where layers go come from the memory plan unless `load` sets them.
        """
        custom = None if isinstance(proposer, str) else proposer
        self.config = model if isinstance(model, EngineConfig) else EngineConfig(
            str(model), None if draft is None else str(draft), "none" if custom is not None else str(proposer), k,
            load or LoadConfig(), memory_budget, source)
        self.notes: list[str] = []  # decisions a person should hear about (dropped draft, smaller context)
        self.cost_tracker: CostTracker | None = None  # auto only: calibrated costs, corrected by each pass
        target_path, draft_path = self._resolve(progress)
        self.target = Model(target_path, self.load_config)
        try:
            if (custom is not None or self.config.proposer != "none") and not self.target.can_trim:
                raise UnsupportedModelError(
                    f"{self.target.path.name} has a recurrent cache that cannot be rolled back, so it cannot "
                    f"verify drafts; use --proposer none")
            self.proposer = custom or self._make_proposer(draft_path)
        except BaseException:
            self.target.close()
            raise
        self._lock = threading.Lock()  # one generation at a time per engine
        self._running: threading.Event | None = None  # the cancel event of the generation under way

    def _resolve(self, progress: ProgressCallback | None) -> tuple[Path, Path | None]:
        """Fetch or find both models, plan their memory, and settle what loads where."""
        cfg = self.config
        draft = cfg.draft
        if draft is not None and cfg.proposer in ("none", "ngram"):
            self.notes.append(f"draft {draft} is not used with proposer {cfg.proposer!r}")
            draft = None
        target_path = resolve(cfg.model, source=cfg.source, progress=progress)
        draft_path = resolve(draft, source=cfg.source, progress=progress) if draft is not None else None
        self.plan = plan_memory(target_path, draft_path, cfg.load, cfg.k_max, cfg.memory_budget)
        self.notes += self.plan.notes
        if draft_path is not None and not self.plan.load_draft:
            if cfg.proposer == "draft":
                raise OutOfMemoryError(f"{self.plan.notes[-1]}; use --proposer auto or ngram, or a larger "
                                       f"--memory-budget")
            draft_path = None
        gpu = cfg.load.n_gpu_layers if cfg.load.n_gpu_layers >= 0 else None
        self.load_config = replace(cfg.load, n_ctx=self.plan.n_ctx,
                                   n_gpu_layers=self.plan.target_gpu_layers if gpu is None else gpu)
        self._draft_layers = self.plan.draft_gpu_layers if gpu is None else gpu
        return target_path, draft_path

    def _make_proposer(self, draft_path: Path | None) -> Proposer | None:
        name = self.config.proposer
        drafter = None
        if draft_path is not None:
            draft_model = Model(draft_path, replace(self.load_config, n_gpu_layers=self._draft_layers))
            try:
                drafter = DraftProposer(draft_model, self.target, p_min=DRAFT_P_MIN if name == "auto" else 0.0)
            except BaseException:
                draft_model.close()
                raise
        try:
            return _PROPOSERS[name](self, drafter)
        except BaseException:
            if drafter is not None:
                drafter.close()
            raise

    def _auto(self, drafter: DraftProposer | None) -> AutoProposer:
        """Calibrate this machine's costs; unload a draft that cannot pay even at DRAFT_ACCEPT_CEILING."""
        k_max = self.plan.k_max
        c = calibrate(self.target, drafter.model if drafter else None, k_max, calibration_dir())
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

    @property
    def n_ctx(self) -> int:
        return self.target.n_ctx

    @property
    def n_vocab(self) -> int:
        return self.target.n_vocab

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

    def infill_tokens(self, prefix: str, suffix: str, prompt: str = "", extra: Sequence[tuple[str, str]] = (),
                      max_tokens: int = 0) -> list[int]:
        """A fill-in-the-middle prompt from the model's FIM tokens, cut to leave `max_tokens` of room."""
        m = self.target
        return fim.infill_tokens(m.vocab, lambda text: m.tokenize(text, add_special=False, parse_special=False),
                                 prefix, suffix, prompt, extra, budget=m.n_ctx - max_tokens)

    def check_fits(self, prompt: Sequence[int], max_tokens: int, prompt_name: str = "the prompt",
                   max_tokens_name: str = "--max-tokens") -> None:
        """Raise ContextOverflowError, with the numbers, unless prompt and answer fit the context.

        The names are how the caller spells the two inputs (the server names its request fields)."""
        n_ctx = self.n_ctx
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
        steps = loop.steps(self.target, self.proposer, prompt_tokens, config, stats, cancel, self.plan.k_max,
                           self.config.k, reuse=config.reuse_prefix)
        for tokens, from_draft, done in steps:
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


# The proposers by name: each builds from the engine and the loaded draft (None when there is none).
_PROPOSERS: dict[str, Callable[[Engine, DraftProposer | None], Proposer | None]] = {
    "none": lambda engine, drafter: None,
    "ngram": lambda engine, drafter: NgramProposer(engine.target.is_eog),
    "draft": lambda engine, drafter: drafter,
    "auto": Engine._auto,
}
