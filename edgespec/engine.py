"""The Engine: a target (and a proposer) loaded from one EngineConfig; generation, chat and FIM prompts.

Three levels, as in mlx-lm: `loop.steps` yields committed token ids, `Engine.stream`
turns them into `Chunk`s (text deltas, stop strings, stats), `Engine.generate`
collects a `Completion`. The CLI and the server use `stream`.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Generator, Iterator, Sequence

from edgespec import budget, chat, costs, fim, loop, ort
from edgespec.backend import Grammar, KVSequence, Model, ModelFacts, devices, open_facts, read_facts
from edgespec.budget import ModelMemory, Plan
from edgespec.config import DEFAULT_MODEL, EngineConfig, GenerationConfig, LoadConfig
from edgespec.costs import CostTracker, calibrate
from edgespec.errors import (ContextOverflowError, EdgespecError, InvalidRequestError, OutOfMemoryError,
                             UnsupportedModelError)
from edgespec.loop import FinishReason, Stats
from edgespec.models import ProgressCallback, resolve
from edgespec.memory import PROMPT_TAIL, MemoryBank, model_key, tokenizer_fingerprint
from edgespec.models.store import calibration_dir, memory_dir
from edgespec.onnx_files import OnnxDraftFiles, is_onnx, locate
from edgespec.policy import DRAFT_ACCEPT_CEILING, DRAFT_P_MIN, Costs, draft_can_pay
from edgespec.proposers import Proposer
from edgespec.proposers.auto import AutoProposer
from edgespec.proposers.draft import DraftProposer, check_compatible
from edgespec.proposers.memory import MemoryProposer
from edgespec.proposers.ngram import NgramProposer
from edgespec.rules import Rules
from edgespec.sampling import TokenLogprob
from edgespec.text import IndentLimit, TextStream

log = logging.getLogger(__name__)

SLOT_POLL_SECONDS = 0.1  # a generation waiting for a slot checks its cancel event this often
# What the engine is waiting on while it loads (a message, and the fraction done when it is known), for a UI to show.
StatusCallback = Callable[[str, float | None], None]

__all__ = ["Chunk", "Completion", "Engine", "FinishReason", "Stats", "plan_memory"]


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


def memory_of(f: ModelFacts) -> ModelMemory:
    return ModelMemory(f.path.name, f.weights_bytes, f.n_layer, f.n_head_kv, f.head_dim_k, f.head_dim_v, f.n_vocab,
                       f.n_embd, f.n_ff, f.n_ctx_train)


def plan_memory(target: Path, draft: Path | None, load: LoadConfig, k_max: int,
                memory_budget: int | None = None, draft_gpu_layers: int | None = None,
                keep_draft: bool = False, draft_device: str = "auto") -> Plan:
    """How `target` (and `draft`) are laid out in the memory this machine has, or `memory_budget` bytes of it.

    Layouts are priced from calibrations cached on this machine where there are some, else modelled;
    `load.n_gpu_layers` (>= 0) and `draft_gpu_layers` fix the layers instead of letting the plan choose.
    An ONNX draft sits where its execution provider runs (`draft_device`) and is kept for calibration to
    price: there is no modelled curve for onnxruntime.
    """
    facts = read_facts(target)
    found = devices()
    b = budget.detect_budget(found, memory_budget)
    onnx_note, draft_key = None, None
    onnx = draft is not None and is_onnx(draft)
    if onnx and draft_gpu_layers is not None:
        raise InvalidRequestError(f"--draft-gpu-layers {draft_gpu_layers} places a GGUF draft's layers; {draft} is "
                                  f"an ONNX draft: place it with --draft-device instead")
    if draft is not None and not onnx and draft_device != "auto":
        raise InvalidRequestError(f"--draft-device {draft_device} picks an ONNX draft's execution provider; "
                                  f"{draft} runs in llama.cpp: place it with --draft-gpu-layers instead")
    if onnx:
        assert draft is not None
        files = locate(draft)
        where = ort.planned_device(draft_device)
        draft_mem = onnx_memory(files)
        draft_gpu_layers = draft_mem.units if where in ort.GPU_DEVICES and b.gpu_bytes else 0
        keep_draft = True
        counted = "GPU memory" if draft_gpu_layers else "RAM"
        onnx_note = (f"draft {files.name} runs in onnxruntime on {where}; its memory is counted in {counted}; "
                     f"calibration at load prices it")
        draft_key = f"onnxruntime-{where}"  # as OnnxModel.device_key: its calibration is kept per provider
    else:
        draft_mem = memory_of(read_facts(draft)) if draft is not None else None
    paths = {"target": target, "draft": draft}

    def measured(which: str, layers: int) -> tuple[float, ...] | None:
        path = paths[which]
        if path is None:
            return None
        if which == "draft" and draft_key is not None:
            return costs.measured(calibration_dir(), path, 0, load, draft_key)
        return costs.measured(calibration_dir(), path, layers, load, b.gpu_name or "cpu")

    p = budget.plan(memory_of(facts), draft_mem, b,
                    n_ctx=load.n_ctx, k_max=k_max, n_ubatch=load.n_batch, n_seq=load.n_seq,
                    target_gpu_layers=load.n_gpu_layers if load.n_gpu_layers >= 0 else None,
                    draft_gpu_layers=draft_gpu_layers, measured=measured, keep_draft=keep_draft)
    if onnx_note is not None:
        p.notes.append(onnx_note)
    if (idle := budget.idle_gpu_note(found)) is not None:
        p.notes.insert(0, idle)
    return p


def onnx_memory(files: OnnxDraftFiles) -> ModelMemory:
    h = files.hyper
    return ModelMemory(files.name, files.weights_bytes, h["n_layer"], h["n_head_kv"], h["head_dim"], h["head_dim"],
                       h["n_vocab"], h["n_embd"], h["n_ff"], h["n_ctx_train"])


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
        target_path, draft_path = self._resolve(progress)
        self.target = self._load(target_path, self.load_config)
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
        self.slots = [_Slot(cache, p) for cache, p in zip(self.target.sequences, proposers)]
        self._free = threading.Condition()  # guards Slot.busy; notified when a slot is released
        self._turn = FairLock()  # one target pass at a time: generations in other slots interleave by cycle
        self._running: set[threading.Event] = set()  # cancel events of the generations under way
        # What this engine wrote, per namespace, beside the model cache (memory.py): files read at first use.
        self.memory = MemoryBank(memory_dir() / model_key(self.target.path), self._tokenizer_fingerprint) \
            if self.config.memory else None

    def _resolve(self, progress: ProgressCallback | None) -> tuple[Path, Path | None]:
        """Fetch or find both models, plan their memory, and settle what loads where."""
        cfg = self.config
        draft = cfg.draft
        if draft is not None and cfg.proposer in ("none", "ngram"):
            self.notes.append(f"draft {draft} is not used with proposer {cfg.proposer!r}")
            draft = None
        target_path = resolve(cfg.model, source=cfg.source, progress=progress)
        draft_path = None if draft is None else Path(draft) if is_onnx(draft) else resolve(
            draft, source=cfg.source, progress=progress)
        self._dropped: Path | None = None  # a draft the plan did not load
        self.plan = plan_memory(target_path, draft_path, cfg.load, cfg.k_max, cfg.memory_budget,
                                cfg.draft_gpu_layers, keep_draft=cfg.proposer == "draft", draft_device=cfg.draft_device)
        self.notes += self.plan.notes
        if draft_path is not None and not self.plan.load_draft:
            if cfg.proposer == "draft":
                raise OutOfMemoryError(f"{self.plan.notes[-1]}; use --proposer auto or ngram, or a larger "
                                       f"--memory-budget")
            self._dropped, draft_path = draft_path, None
        if self.plan.budget.gpu_bytes:
            self.notes.append(f"layout on {self.plan.budget.gpu_name or self.plan.budget.device}: "
                              f"{self.plan.chosen.description} ({self.plan.reason})")
        self.load_config = replace(cfg.load, n_ctx=self.plan.n_ctx, n_gpu_layers=self.plan.target_gpu_layers)
        self._draft_layers = self.plan.draft_gpu_layers
        return target_path, draft_path

    def _load(self, path: Path, cfg: LoadConfig) -> Model:
        """Load a model where the plan put it; a GPU that has lost the room since is an error with the numbers."""
        self._status(f"loading {path.name}", None)
        if is_onnx(path):  # onnxruntime reports its own failures: they are not llama.cpp's GPU running short
            return ort.OnnxModel(path, cfg, self.config.draft_device)  # type: ignore[return-value]
        try:
            return Model(path, cfg)
        except EdgespecError as e:
            b = self.plan.budget
            if not (cfg.n_gpu_layers and b.gpu_bytes):
                raise
            now = budget.detect_budget(devices()).gpu_bytes
            planned = self.plan.chosen.gpu_bytes if self.plan.chosen else 0
            raise OutOfMemoryError(
                f"{path.name} did not load with {cfg.n_gpu_layers} layers on {b.gpu_name or b.device} ({e}): the "
                f"plan counted on {planned / budget.GiB:.2f} GiB of its memory, {b.gpu_bytes / budget.GiB:.2f} GiB "
                f"was free then and {now / budget.GiB:.2f} GiB is free now; close what took it, or pass "
                f"--gpu-layers N with fewer layers (or --memory-budget)") from e

    def _make_proposers(self, draft_path: Path | None) -> list[Proposer | None]:
        """One proposer per slot (each on its own draft sequence), sharing the draft model and the costs."""
        name = self.config.proposer
        drafter = None
        if draft_path is not None:
            draft_model = self._load(draft_path, replace(self.load_config, n_gpu_layers=self._draft_layers))
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
            self.notes.append(
                f"draft {drafter.model.path.name} unloaded: on this machine it would be slower than plain decoding "
                f"even at {DRAFT_ACCEPT_CEILING:.0%} acceptance (draft ÷ target per token "
                f"{c.draft_seconds_per_token / c.target_seconds[0]:.2f}, "
                f"verifying {c.batches[-1]} tokens costs {c.target_seconds[-1] / c.target_seconds[0]:.1f} single steps)"
            )
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
        p = self.proposer
        return isinstance(p, DraftProposer) or isinstance(p, AutoProposer) and p.draft is not None

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
        m = self.target
        bos = m.token_text(m.vocab.bos) if m.vocab.bos is not None else ""
        eos = m.token_text(m.vocab.eos) if m.vocab.eos is not None else ""
        return chat.render(m.facts.chat_template, messages, bos_token=bos, eos_token=eos,
                           add_generation_prompt=add_generation_prompt, model_name=m.path.name, tools=tools)

    def chat_tokens(self, messages: Sequence[chat.Message], add_generation_prompt: bool = True,
                    tools: Sequence[dict] | None = None) -> list[int]:
        """Tokens of `messages` (and the `tools` they may call) laid out by the model's own chat template."""
        m = self.target
        tokens = m.tokenize(self.chat_text(messages, add_generation_prompt, tools), add_special=True,
                            parse_special=True)
        if len(tokens) > 1 and tokens[0] == tokens[1] == m.vocab.bos:
            tokens = tokens[1:]  # the template wrote the BOS the tokenizer also adds
        return tokens

    def infill_tokens(self, prefix: str, suffix: str, prompt: str = "", extra: Sequence[tuple[str, str]] = (),
                      max_tokens: int = 0) -> list[int]:
        """A fill-in-the-middle prompt from the model's FIM tokens, cut to leave `max_tokens` of room."""
        m = self.target
        return fim.infill_tokens(m.vocab, lambda text: m.tokenize(text, add_special=False, parse_special=False),
                                 prefix, suffix, prompt, extra, budget=m.n_ctx - max_tokens)

    def check_fits(self, prompt: Sequence[int], prompt_name: str = "the prompt") -> None:
        """Raise ContextOverflowError, with the numbers, unless the prompt leaves room for one token.

        An answer longer than the room left just ends there, with finish reason "length" (as in llama.cpp);
        `prompt_name` is how the caller spells the prompt (the server names its request fields)."""
        n_ctx = self.n_ctx
        if not prompt:
            raise InvalidRequestError(f"{prompt_name} is empty; give at least one token of prompt")
        if len(prompt) >= n_ctx:
            raise ContextOverflowError(
                f"{prompt_name} has {len(prompt)} tokens but the context holds {n_ctx}; "
                f"shorten it or raise --ctx above {len(prompt)}", n_prompt_tokens=len(prompt), n_ctx=n_ctx)

    # -- generation ------------------------------------------------------------

    def cancel(self) -> None:
        """Stop the running generations after their current cycle (thread-safe)."""
        for running in list(self._running):
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

        Each generation takes a free slot (the one whose cache shares the longest
        prefix with the prompt, else the least recently used) and waits for one when
        all are busy; generations in different slots take turns, one cycle each.
        Setting `cancel` (or calling `Engine.cancel()`) ends it after its current cycle.
        """
        config = config or GenerationConfig()
        prompt_tokens = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        self.check_fits(prompt_tokens)  # a length past the room left is cut to it by loop.steps
        self._proposer_for(self.slots[0], config)  # an impossible choice fails here, before any waiting
        rules = Rules.of(config.sampling, self.grammar(config))  # so does a grammar that does not parse
        try:
            yield from self._generation(prompt_tokens, config, stop, cancel, rules)
        finally:
            if rules is not None:
                rules.close()

    def grammar(self, config: GenerationConfig) -> Grammar | None:
        """The generation's grammar, compiled against the target's vocabulary (None without one)."""
        if config.json_schema is not None:
            return Grammar.from_json_schema(self.target, config.json_schema)
        if config.grammar is not None:
            return Grammar(self.target, config.grammar, trigger=config.grammar_trigger)
        return None

    def _generation(self, prompt_tokens: list[int], config: GenerationConfig, stop: Sequence[str],
                    cancel: threading.Event | None, rules: Rules | None) -> Iterator[Chunk]:
        cancel = cancel or threading.Event()
        self._running.add(cancel)
        try:
            slot = self._acquire(prompt_tokens, cancel, config.slot)
            if slot is None:  # cancelled while it waited for a slot
                yield Chunk("", [], [], "cancelled", Stats(prompt_tokens=len(prompt_tokens)))
                return
            try:
                yield from self._remembered(slot, prompt_tokens, config,
                                            self._stream(slot, prompt_tokens, config, stop, cancel, rules))
            finally:
                with self._free:
                    slot.busy, slot.last_used = False, time.monotonic()
                    self._free.notify()
        finally:
            self._running.discard(cancel)

    def _remembered(self, slot: _Slot, prompt: list[int], config: GenerationConfig,
                    chunks: Iterator[Chunk]) -> Iterator[Chunk]:
        """`chunks`, with the slot's auto proposer reading the memory of this generation's namespace meanwhile; what
        it wrote goes into that memory before the last chunk goes out (a consumer may stop reading at it)."""
        memory = self.memory.get(config.memory) if self.memory is not None and config.memory is not None else None
        reader = slot.proposer.memory if isinstance(slot.proposer, AutoProposer) else None
        if reader is not None:
            reader.memory = memory
        written: list[int] = []
        for chunk in chunks:
            written += chunk.tokens
            if chunk.finish_reason is not None and memory is not None:
                memory.add([*prompt[-PROMPT_TAIL:], *written])
            yield chunk

    def _acquire(self, prompt: list[int], cancel: threading.Event, wanted: int | None) -> _Slot | None:
        """A free slot: `wanted` (modulo the slot count) if it is free, else the one whose cache shares the
        longest prefix with `prompt`, else the least recently used; None if cancelled while all were busy."""
        with self._free:
            while not (free := [s for s in self.slots if not s.busy]):
                if cancel.is_set():
                    return None
                self._free.wait(SLOT_POLL_SECONDS)
            preferred = self.slots[wanted % len(self.slots)] if wanted is not None and wanted >= 0 else None
            slot = preferred if preferred in free else max(
                free, key=lambda s: (s.cache.shared_prefix(prompt), -s.last_used))
            slot.busy = True
            return slot

    def _proposer_for(self, slot: _Slot, config: GenerationConfig) -> Proposer | None:
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

    def _stream(self, slot: _Slot, prompt_tokens: list[int], config: GenerationConfig, stop: Sequence[str],
                cancel: threading.Event, rules: Rules | None) -> Iterator[Chunk]:
        stats = Stats(prompt_tokens=len(prompt_tokens))
        if cancel.is_set():  # cancelled while it waited for the engine
            yield Chunk("", [], [], "cancelled", stats)
            return
        text, indent = TextStream(stop), IndentLimit(config.min_indent)
        finish: FinishReason = "length"
        k = config.k if self.config.k is None or config.k is None else min(config.k, self.config.k)
        steps = self._turns(loop.steps(slot.cache, self._proposer_for(slot, config), prompt_tokens, config, stats,
                                       cancel, self.plan.k_max, k, reuse=config.reuse_prefix, rules=rules))
        t_first = None
        try:
            for tokens, from_draft, done, probs in steps:
                now = time.perf_counter()
                t_first = t_first or now
                delta = []
                for i, t in enumerate(tokens):
                    piece = self.target.token_bytes(t)
                    delta.append(indent.push(text.push(piece)))
                    late = config.time_limit is not None and b"\n" in piece and now - t_first > config.time_limit
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
        full = finish == "length" and len(prompt_tokens) + stats.completion_tokens >= self.n_ctx
        yield Chunk("", [], [], finish, stats, text.matched, full, slot.cache.seq_id)

    def _turns(self, steps: Iterator[loop.Step]) -> Generator[loop.Step, None, None]:
        """Each step of a generation under the turn lock, released while the consumer has it."""
        try:
            while True:
                with self._turn:
                    step = next(steps, None)
                if step is None:
                    return
                yield step
        finally:
            with self._turn:
                steps.close()  # type: ignore[attr-defined]


@dataclass(eq=False)
class _Slot:
    """A KV sequence of the target and the proposer that speculates on it."""

    cache: KVSequence
    proposer: Proposer | None
    busy: bool = False
    last_used: float = 0.0


class FairLock:
    """A lock taken in arrival order, so a generation that releases it and asks again waits behind the others."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queue: collections.deque[object] = collections.deque()
        self._held = False

    def __enter__(self) -> None:
        me = object()
        with self._cond:
            self._queue.append(me)
            while self._held or self._queue[0] is not me:
                self._cond.wait()
            self._queue.popleft()
            self._held = True

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._held = False
            self._cond.notify_all()


# The proposers by name: each builds from the engine and the loaded draft (None when there is none).
_PROPOSERS: dict[str, Callable[[Engine, DraftProposer | None], Proposer | None]] = {
    "none": lambda engine, drafter: None,
    "ngram": lambda engine, drafter: NgramProposer(engine.target.is_eog),
    "draft": lambda engine, drafter: drafter,
    "auto": Engine._auto,
}
