"""Generation: a step generator over the backend, streamed as text events.

Three levels, as in mlx-lm: `_steps` yields committed token ids, `Engine.stream`
turns them into `Chunk`s (text deltas, stop strings, stats), `Engine.generate`
collects a `Completion`. The CLI and the server use `stream`.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator, Literal, Sequence

import numpy as np

from edgespec import chat, sampling
from edgespec.backend import Model
from edgespec.config import GenerationConfig, LoadConfig
from edgespec.errors import ContextOverflowError, InvalidRequestError
from edgespec.models import DEFAULT_MODEL, resolve
from edgespec.text import TextStream

log = logging.getLogger(__name__)

FinishReason = Literal["stop", "length", "cancelled"]


@dataclass
class Stats:
    """Counters of one generation.

    The first token comes out of the prefill, so `tokens_per_second` is
    (completion_tokens - 1) / decode_seconds, as llama.cpp reports its eval rate.
    """

    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # reused from the previous call's KV cache
    completion_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0

    @property
    def tokens_per_second(self) -> float:
        n = self.completion_tokens - 1
        return n / self.decode_seconds if n > 0 and self.decode_seconds > 0 else 0.0

    def to_dict(self) -> dict[str, float | int]:
        return {**asdict(self), "tokens_per_second": self.tokens_per_second}


@dataclass
class Chunk:
    """One streamed event: new text and the token ids that produced it."""

    text: str
    tokens: list[int]
    finish_reason: FinishReason | None = None
    stats: Stats | None = None  # set on the last chunk


@dataclass
class Completion:
    text: str
    tokens: list[int]
    finish_reason: FinishReason
    stats: Stats = field(default_factory=Stats)


class Engine:
    """A target model ready to generate; the Python API for applications."""

    def __init__(
        self,
        model: str | Path = DEFAULT_MODEL,
        *,
        load: LoadConfig | None = None,
        source: str | None = None,
        progress: bool = False,
    ) -> None:
        self.load_config = load or LoadConfig()
        self.target = Model(resolve(str(model), source=source, progress=progress), self.load_config)
        self._lock = threading.Lock()  # one generation at a time per engine
        self._cancel = threading.Event()

    def close(self) -> None:
        self.target.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- prompts -------------------------------------------------------------

    def tokenize(self, prompt: str) -> list[int]:
        """A raw prompt's tokens: BOS as the model asks, special tokens parsed."""
        return self.target.tokenize(prompt, add_special=True, parse_special=True)

    def chat_tokens(self, messages: Sequence[chat.Message], add_generation_prompt: bool = True) -> list[int]:
        """Tokens of `messages` laid out by the model's own chat template."""
        m = self.target
        bos = m.token_text(m.vocab.bos) if m.vocab.bos is not None else ""
        eos = m.token_text(m.vocab.eos) if m.vocab.eos is not None else ""
        text = chat.render(m.facts.chat_template, messages, bos_token=bos, eos_token=eos,
                           add_generation_prompt=add_generation_prompt, model_name=m.path.name)
        tokens = m.tokenize(text, add_special=True, parse_special=True)
        if len(tokens) > 1 and tokens[0] == tokens[1] == m.vocab.bos:
            tokens = tokens[1:]  # the template wrote the BOS the tokenizer also adds
        return tokens

    # -- generation ------------------------------------------------------------

    def cancel(self) -> None:
        """Stop the running generation after its current step (thread-safe)."""
        self._cancel.set()

    def generate(self, prompt: str | Sequence[int], config: GenerationConfig | None = None,
                 stop: Sequence[str] = ()) -> Completion:
        text, tokens = [], []
        last = None
        for last in self.stream(prompt, config, stop=stop):
            text.append(last.text)
            tokens.extend(last.tokens)
        assert last is not None and last.finish_reason is not None and last.stats is not None
        return Completion("".join(text), tokens, last.finish_reason, last.stats)

    def stream(self, prompt: str | Sequence[int], config: GenerationConfig | None = None,
               stop: Sequence[str] = ()) -> Iterator[Chunk]:
        """Yield text as tokens are committed; the last chunk has finish_reason and stats."""
        config = config or GenerationConfig()
        prompt_tokens = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        self._check_fits(prompt_tokens, config.max_tokens)
        with self._lock:
            self._cancel.clear()
            stats = Stats(prompt_tokens=len(prompt_tokens))
            text = TextStream(stop)
            finish: FinishReason = "length"
            for tokens, done in self._steps(prompt_tokens, config, stats):
                delta = "".join(text.push(self.target.token_bytes(t)) for t in tokens)
                if text.stopped:
                    finish = "stop"
                    yield Chunk(delta, tokens)
                    break
                if done is not None:
                    finish = done
                    delta += text.flush()
                    yield Chunk(delta, tokens)
                    break
                yield Chunk(delta, tokens)
            yield Chunk("", [], finish, stats)

    def _steps(self, prompt: list[int], config: GenerationConfig, stats: Stats
               ) -> Iterator[tuple[list[int], FinishReason | None]]:
        """Committed tokens, one step at a time, with the finish reason on the last step."""
        m = self.target
        sc = config.sampling
        rng = np.random.default_rng(sc.seed)
        t0 = time.perf_counter()
        logits = self._prefill(prompt, stats)
        stats.prefill_seconds = time.perf_counter() - t0
        t1 = time.perf_counter()
        try:
            for i in range(config.max_tokens):
                token = sampling.sample(logits[-1], sc, rng)
                if m.is_eog(token):
                    yield [], "stop"
                    return
                stats.completion_tokens += 1
                if i + 1 == config.max_tokens:
                    yield [token], "length"
                    return
                if self._cancel.is_set():
                    yield [token], "cancelled"
                    return
                yield [token], None
                logits = m.decode([token])
        finally:
            stats.decode_seconds = time.perf_counter() - t1

    def _prefill(self, prompt: list[int], stats: Stats) -> np.ndarray:
        """Evaluate the prompt, reusing the cached prefix; returns the last logits row."""
        m = self.target
        common = 0
        for a, b in zip(m.tokens, prompt):
            if a != b:
                break
            common += 1
        common = min(common, len(prompt) - 1)  # re-evaluate at least one token for its logits
        m.trim(common)
        stats.cached_prompt_tokens = common
        return m.decode(prompt[common:], n_outputs=1)

    def _check_fits(self, prompt: list[int], max_tokens: int) -> None:
        n_ctx = self.target.n_ctx
        if not prompt:
            raise InvalidRequestError("the prompt is empty; give at least one token of prompt")
        if len(prompt) >= n_ctx:
            raise ContextOverflowError(
                f"the prompt has {len(prompt)} tokens but the context holds {n_ctx}; "
                f"shorten the prompt or raise --ctx above {len(prompt)}"
            )
        if len(prompt) + max_tokens > n_ctx:
            raise ContextOverflowError(
                f"max_tokens {max_tokens} plus the prompt's {len(prompt)} tokens exceed the context of {n_ctx}; "
                f"use --max-tokens {n_ctx - len(prompt)} or less, or raise --ctx"
            )
