"""The Engine: a target (and its proposers) loaded from one EngineConfig; the Python API for applications.

It wires the parts: the memory plan (planning), the models (backend, onnx), calibration (decoding.costs), the
proposers by name, the slots (engine.slots) and one generation (engine.generation). Prompts are laid out by
prompts.chat and prompts.fim.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterator, Sequence

from edgespec.backend import Grammar, Model, json_schema_gbnf
from edgespec.config import DEFAULT_FIM_LAYOUT, DEFAULT_MODEL, EngineConfig, GenerationConfig, LoadConfig
from edgespec.decoding.costs import CostTracker, PromptRate, calibrate
from edgespec.decoding.loop import Stats, planned
from edgespec.decoding.policy import DRAFT_P_MIN, Costs, draft_can_pay, draft_cannot_pay
from edgespec.decoding.rules import Rules, Start, pieces_of
from edgespec.engine import generation, recall
from edgespec.engine.generation import Chunk, Completion
from edgespec.engine.infill import AsideBuild, InfillPrompt, infill_prompt
from edgespec.engine.recall import PromptCache
from edgespec.engine.slots import Slot, SlotPool
from edgespec.errors import EdgespecError, InvalidRequestError, UnsupportedModelError
from edgespec.memory import MemoryBank, model_key, tokenizer_fingerprint
from edgespec.models import ProgressCallback
from edgespec.onnx import runtime as ort
from edgespec.onnx.files import is_onnx, locate
from edgespec.paths import calibration_dir, memory_dir
from edgespec.planning.plan import gpu_short_error, open_facts, settle
from edgespec.prompts import chat
from edgespec.prompts.fim import Infill, cursor_anchor
from edgespec.proposers import Proposer
from edgespec.proposers.auto import AutoProposer
from edgespec.proposers.draft import DraftProposer, check_compatible
from edgespec.proposers.memory import MemoryProposer
from edgespec.proposers.ngram import NgramProposer
from edgespec.remote.target import RemoteTarget

log = logging.getLogger(__name__)

# What the engine is waiting on while it loads (a message, and the fraction done when it is known), for a UI to show.
StatusCallback = Callable[[str, float | None], None]


class Engine:
    """A target model ready to generate; the Python API for applications."""

    def __init__(self, model: str | Path | EngineConfig = DEFAULT_MODEL, *, draft: str | Path | None = None,
                 proposer: str | Proposer = "auto", k: int | None = None, load: LoadConfig | None = None,
                 memory_budget: int | None = None, source: str | None = None,
                 progress: ProgressCallback | None = None, status: StatusCallback | None = None) -> None:
        """Load `model` (an EngineConfig, or a catalog name or GGUF path with the config's fields as options).

        `proposer` is "auto" (each cycle: n-gram lookup, the draft, or a plain
        step, whichever the calibrated costs say pays), "none", "ngram",
        "draft", or any object with the `Proposer` protocol. `k` is the most
        tokens proposed per cycle (default: the memory plan's Kmax for auto,
        DEFAULT_K otherwise). The context size, whether the draft loads and
        where layers go come from the memory plan unless `load` sets them.
        `progress` hears of model downloads, `status` of loading and calibration.
        """
        custom = None if isinstance(proposer, str) else proposer
        self.config = model if isinstance(model, EngineConfig) else EngineConfig(
            str(model), None if draft is None else str(draft), "none" if custom is not None else str(proposer), k,
            load or LoadConfig(), memory_budget, source)
        if custom is not None and self.config.load.n_seq > 1:
            raise InvalidRequestError(f"a Proposer object serves one generation at a time; use n_seq=1, not "
                                      f"{self.config.load.n_seq}, or a proposer by name")
        self.notes: list[str] = []  # decisions a person should hear about (dropped draft, smaller context)
        self.cost_tracker: CostTracker | None = None  # auto only: calibrated costs, corrected by each pass
        self._status: StatusCallback = status or (lambda message, fraction: None)
        settled = settle(self.config, progress)
        self.plan, self.load_config, self._draft_layers = settled.plan, settled.load, settled.draft_layers
        self._dropped, draft_path = settled.dropped, settled.draft
        self.notes += settled.notes
        self.remote = settled.remote  # the target's layers on RPC workers, when there are some: in a child process
        self.target = self._load(settled.target, self.load_config) if self.remote is None else RemoteTarget(
            settled.target, self.load_config, self.config.rpc, self.remote.worker_units)
        try:
            if (custom is not None or self.config.proposer != "none") and not self.target.can_trim:
                raise UnsupportedModelError(
                    f"{self.target.path.name} has a recurrent cache that cannot be rolled back, so it cannot "
                    f"verify drafts; use --proposer none")
            if self._dropped is not None:  # a draft the plan left out is still one the user named: check it
                with locate(self._dropped) if is_onnx(self._dropped) else open_facts(self._dropped) as unused:
                    check_compatible(self.target, unused)
            proposers = [custom] if custom is not None else self._make_proposers(draft_path)
        except BaseException:
            self.target.close()
            raise
        self.slots = [Slot(cache, p, index=i) for i, (cache, p) in enumerate(zip(self.target.sequences, proposers))]
        self.pool = SlotPool(self.slots, self.target.aside, _prompt_cache(self.config.cache_ram, self.target))
        c = self.costs  # the calibrated curve prices a prompt's new tokens, a probe a move; prefills correct both
        self.prompt_rate = PromptRate(*c.prompt_curve, self.pool.rerotation_seconds()) if c else PromptRate()
        self.target.padded = self.prompt_rate.padded  # type: ignore[method-assign]  # the sizes it pays to pad to
        if not self.target.can_shift:
            self.notes.append(f"{self.target.path.name} cannot shift its KV cache (sliding-window attention, or a "
                              f"recurrent state): a prompt is reused up to its first change only, whatever "
                              f"--cache-reuse or n_cache_reuse ask")
        # What this engine wrote, per namespace, beside the model cache (memory.py): files read at first use.
        self.memory = MemoryBank(memory_dir() / model_key(self.target.path), self._tokenizer_fingerprint) \
            if self.config.memory else None

    def _load(self, path: Path, cfg: LoadConfig) -> Model:
        """Load a model where the plan put it; a GPU that has lost the room since is an error with the numbers."""
        self._status(f"loading {path.name}", None)
        if is_onnx(path):  # onnxruntime reports its own failures: they are not llama.cpp's GPU running short
            return ort.OnnxModel(path, cfg, self.config.draft_device)  # type: ignore[return-value]
        try:
            return Model(path, cfg)
        except EdgespecError as e:
            if (short := gpu_short_error(self.plan, path, cfg.n_gpu_layers, e)) is not None:
                raise short from e
            raise

    def _make_proposers(self, draft_path: Path | None) -> list[Proposer | None]:
        """One proposer per slot (each on its own draft sequence), sharing the draft model and the costs."""
        name = self.config.proposer
        drafter = None
        if draft_path is not None:
            draft_model = self._load(draft_path, replace(self.load_config, n_gpu_layers=self._draft_layers, aside=0))
            try:
                drafter = DraftProposer(draft_model, self.target, p_min=DRAFT_P_MIN if name == "auto" else 0.0)
            except BaseException:
                draft_model.close()
                raise
        try:
            if name == "auto":
                drafter = self._calibrate(drafter)
            drafters = [None if drafter is None else drafter.on_sequence(i) for i in range(self.load_config.n_seq)]
            return [_PROPOSERS[name](self, d) for d in drafters]
        except BaseException:
            if drafter is not None:
                drafter.close()
            raise

    def _calibrate(self, drafter: DraftProposer | None) -> DraftProposer | None:
        """Calibrate this machine's costs; unload a draft that cannot pay even at DRAFT_ACCEPT_CEILING."""
        k_max = self.plan.k_max
        c = calibrate(self.target, drafter.model if drafter else None, k_max, calibration_dir(),
                      self.plan.budget.gpu_name or "cpu", progress=lambda name, done, total: self._status(
                          f"calibrating this machine, once: timing {name} (cached for next time)",
                          done / total))
        self.cost_tracker = CostTracker(c)
        if drafter is not None and not draft_can_pay(c, k_max):
            self.notes.append(f"draft {drafter.model.path.name} unloaded: {draft_cannot_pay(c)}")
            drafter.close()
            return None
        return drafter

    def _auto(self, drafter: DraftProposer | None) -> AutoProposer:
        assert self.cost_tracker is not None
        auto = AutoProposer(NgramProposer(self.target.is_eog), drafter, self.cost_tracker)
        if self.config.memory:
            auto.memory = MemoryProposer(self.target.is_eog)  # which memory it reads is set per generation
        return auto

    def _tokenizer_fingerprint(self) -> str:
        return tokenizer_fingerprint(self.target.vocab, self.target.token_piece, self.target.n_vocab)

    @property
    def proposer(self) -> Proposer | None:
        """The first slot's proposer (the only one unless n_seq > 1)."""
        return self.slots[0].proposer

    @property
    def draft_loaded(self) -> bool:
        return isinstance(p := self.proposer, DraftProposer) or isinstance(p, AutoProposer) and p.draft is not None

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
        if self.memory is not None:
            self.memory.close()  # saves what was written since the last save
        for slot in self.slots:
            if slot.proposer is not None:
                slot.proposer.close()
        self.target.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- prompts -------------------------------------------------------------

    def tokenize(self, prompt: str) -> list[int]:
        """A raw prompt's tokens: BOS as the model asks, special tokens parsed."""
        return self.target.tokenize(prompt, add_special=True, parse_special=True)

    def chat_text(self, messages: Sequence[chat.Message], add_generation_prompt: bool = True,
                  tools: Sequence[dict] | None = None) -> str:
        """`messages` (and the `tools` they may call) laid out by the model's own chat template."""
        return chat.model_text(self.target, messages, add_generation_prompt, tools)

    def chat_tokens(self, messages: Sequence[chat.Message], add_generation_prompt: bool = True,
                    tools: Sequence[dict] | None = None) -> list[int]:
        """Tokens of `messages` (and the `tools` they may call) laid out by the model's own chat template."""
        return chat.model_tokens(self.target, messages, add_generation_prompt, tools)

    def infill_prompt(self, infill: Infill, max_tokens: int, budget_seconds: float | None = None,
                      slot: int | None = None, cache_reuse: int = 0, layout: str = DEFAULT_FIM_LAYOUT,
                      warm_up: bool = False) -> InfillPrompt:
        """A fill-in-the-middle prompt leaving `max_tokens` of room: sized for `budget_seconds` of prompt evaluation
        against what the slot holds, or as llama.cpp sizes it; a `warm_up` keeps the slot's FIM part (engine.infill)."""
        return infill_prompt(self.target, self.pool, self.prompt_rate, infill, max_tokens, budget_seconds, slot,
                             cache_reuse, layout, warm_up)

    def build_aside(self, build: AsideBuild, cancel: threading.Event, step: Callable[[int], int],
                    room: Callable[[float], bool] = lambda seconds: True) -> bool:
        """Evaluate `build` into the aside sequence while nobody waits, in batches of `step(left)` tokens until `cancel`
        (engine.slots), then put it in front of its slot's lines where it goes there (engine.infill), in a pause with
        `room` for the re-rotation, which nothing aborts (else a later pause does). Whether all of it is done."""
        self.pool.aside_lines = build.lines if build.slot is None else ""  # lines a request never starts at alone
        if not self.pool.build_aside(build.tokens, cancel.is_set, step):
            return False
        if build.slot is not None and not room(self.prompt_rate.seconds(1, shifted=True)):
            return False  # the build held for the next pause
        if build.slot is not None and (t := self.pool.join_front(build.slot, build.head, build.follows)) is not None:
            self.prompt_rate.observe(1, t, shifted=True)  # a one-token prefill that shifted
        return True

    def check_fits(self, prompt: Sequence[int], prompt_name: str = "the prompt") -> None:
        """Raise ContextOverflowError, with the numbers, unless the prompt leaves room for one token; `prompt_name`
        is how the caller spells the prompt (the server names its request fields)."""
        generation.check_fits(prompt, self.n_ctx, prompt_name)

    # -- generation ------------------------------------------------------------

    def cancel(self) -> None:
        """Stop the running generations after their current cycle (thread-safe)."""
        self.pool.cancel_all()

    def generate(self, prompt: str | Sequence[int], config: GenerationConfig | None = None,
                 stop: Sequence[str] = (), cancel: threading.Event | None = None) -> Completion:
        text, tokens, last = [], [], None
        for last in self.stream(prompt, config, stop=stop, cancel=cancel):
            text.append(last.text)
            tokens.extend(last.tokens)
        assert last is not None and last.finish_reason is not None and last.stats is not None
        return Completion("".join(text), tokens, last.finish_reason, last.stats)

    def stream(self, prompt: str | Sequence[int], config: GenerationConfig | None = None,
               stop: Sequence[str] = (), cancel: threading.Event | None = None) -> Iterator[Chunk]:
        """Yield text as tokens are committed; the last chunk has finish_reason and stats.

        Each generation takes a free slot (engine.slots) and waits for one when all are busy; generations in
        different slots take turns, one cycle each. Setting `cancel` (or calling `Engine.cancel()`) ends it after
        its current cycle.
        """
        config = config or GenerationConfig()
        prompt_tokens = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        self.check_fits(prompt_tokens)  # a length past the room left is cut to it by loop.steps
        generation.proposer_for(self.slots[0], config)  # an impossible choice fails here, before any waiting
        rules = Rules.of(config.sampling, self.grammar(config), self.target.infill_keep)  # as does a bad grammar
        k = config.k if self.config.k is None or config.k is None else min(config.k, self.config.k)
        t = self.target
        anchor = cursor_anchor(prompt_tokens, t.vocab, t.token_bytes) if config.cache_reuse else None
        run = generation.Run(config, stop, cancel or threading.Event(), rules, self.plan.k_max, k, t.token_bytes,
                             self.pool.turns, anchor)
        memory = self.memory.get(config.memory) if self.memory is not None and config.memory is not None else None
        try:
            with self.pool.taken(prompt_tokens, run.cancel, config.slot) as slot:
                if slot is None:  # cancelled while it waited for a slot
                    yield Chunk("", [], [], "cancelled", Stats(prompt_tokens=len(prompt_tokens)))
                    return
                if config.reuse_prefix:  # a kept prompt, or the aside, where the slot would evaluate more
                    self.pool.ready(slot, lambda c: planned(c, prompt_tokens, config.cache_reuse, anchor))
                for chunk in generation.remembered(slot, prompt_tokens, memory,
                                                   generation.chunks(slot, prompt_tokens, run)):
                    # a prefill in the context's batches (a background one runs in small batches, at another rate)
                    if (s := chunk.stats) is not None and chunk.finish_reason != "cancelled" and not config.prompt_batch:
                        self.prompt_rate.observe(s.prompt_tokens - s.cached_prompt_tokens, s.prefill_seconds,
                                                 s.shifted_prompt_tokens > 0)
                    yield chunk
        finally:
            if rules is not None:
                rules.close()

    def grammar(self, config: GenerationConfig) -> Grammar | Start | None:
        """The generation's grammar, compiled against the target's vocabulary (None without one)."""
        return grammar_of(self.target, config)


def _prompt_cache(cache_ram: int | None, target: Model) -> PromptCache | None:
    """The prompt cache `cache_ram` asks for (engine.recall); none for a recurrent model, whose state is kept whole
    or not at all, or one in a child process (RPC workers)."""
    if (limit := recall.limit_mib(cache_ram)) == 0 or not target.can_trim or isinstance(target, RemoteTarget):
        return None
    return PromptCache(limit)


def grammar_of(target: Model, config: GenerationConfig) -> Grammar | Start | None:
    """`config`'s grammar compiled against `target`'s vocabulary, or its token healing's Start; None for neither."""
    if config.heal:
        return Start(config.heal.encode(), pieces_of(target))
    if config.json_schema is not None:
        return Grammar(target, json_schema_gbnf(config.json_schema, "json_schema"), what="json_schema")
    if config.grammar is not None:
        return Grammar(target, config.grammar, trigger=config.grammar_trigger)
    return None


# The proposers by name: each builds from the engine and the loaded draft (None when there is none).
_PROPOSERS: dict[str, Callable[[Engine, DraftProposer | None], Proposer | None]] = {
    "none": lambda engine, drafter: None,
    "ngram": lambda engine, drafter: NgramProposer(engine.target.is_eog),
    "draft": lambda engine, drafter: drafter,
    "auto": Engine._auto,
}
