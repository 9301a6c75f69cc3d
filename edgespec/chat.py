"""Chat templates from GGUF metadata, rendered in a sandbox (templates are untrusted)."""

from __future__ import annotations

import datetime
from typing import Any, Iterator, Sequence

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from edgespec.errors import ChatTemplateError

Message = dict[str, Any]


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


# The same environment transformers uses for chat templates, so templates behave alike.
_ENV = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
_ENV.globals.update(raise_exception=_raise, strftime_now=_strftime_now)


def render(
    template: str | None,
    messages: Sequence[Message],
    *,
    bos_token: str = "",
    eos_token: str = "",
    add_generation_prompt: bool = True,
    model_name: str = "the model",
    tools: Sequence[dict[str, Any]] | None = None,
) -> str:
    """The prompt text for `messages` (and the `tools` they may call), as the model's own template lays it out."""
    if not template:
        raise ChatTemplateError(
            f"{model_name} has no chat template in its GGUF metadata; use plain completion (no --chat)"
        )
    if tools and not supports_tools(template):
        raise ChatTemplateError(f"the chat template of {model_name} does not lay out tools; use a model whose "
                                f"template does (the Qwen2.5 family), or describe the tools in the prompt")
    try:
        return _ENV.from_string(template).render(
            messages=list(messages),
            bos_token=bos_token,
            eos_token=eos_token,
            add_generation_prompt=add_generation_prompt,
            **({"tools": list(tools)} if tools else {}),
        )
    except (jinja2.TemplateError, TypeError, ValueError) as e:
        raise ChatTemplateError(
            f"the chat template of {model_name} failed to render ({type(e).__name__}: {e}); "
            f"use plain completion (no --chat) or a GGUF with a working template"
        ) from e


def supports_tools(template: str | None) -> bool:
    """Whether a template reads the `tools` variable (templates that do not would drop them silently)."""
    return bool(template) and "tools" in template  # type: ignore[operator]


class ChatSession:
    """Multi-turn state over one engine. Each turn re-renders the conversation, and
    the engine's prefix reuse means only the new tokens are evaluated; when the
    context fills, the oldest turns are dropped (the system prompt stays)."""

    def __init__(self, engine: Any, config: Any, system: str | None = None, stop: Sequence[str] = ()) -> None:
        self.engine, self.config, self.system, self.stop = engine, config, system, tuple(stop)
        self.turns: list[Message] = []
        self.last_stats: Any = None
        self.last_finish: str | None = None
        self.notices: list[str] = []  # things the person should be told (dropped turns)

    def messages(self) -> list[Message]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + self.turns

    def reset(self) -> None:
        self.turns.clear()
        self.last_stats = None

    def send(self, text: str) -> Iterator[Any]:
        """Stream the answer to `text` as engine Chunks; a partial answer (cancelled) is kept."""
        self.turns.append({"role": "user", "content": text})
        try:
            tokens = self._fit()
        except BaseException:
            self.turns.pop()
            raise
        answer: list[str] = []
        try:  # an answer longer than the room left ends at the context's end ("length")
            for chunk in self.engine.stream(tokens, self.config, stop=self.stop):
                answer.append(chunk.text)
                if chunk.stats is not None:
                    self.last_stats, self.last_finish = chunk.stats, chunk.finish_reason
                yield chunk
        finally:
            self.turns.append({"role": "assistant", "content": "".join(answer)})

    def _fit(self) -> list[int]:
        """The prompt tokens, after dropping the oldest turns until an answer has room."""
        n_ctx = self.engine.n_ctx
        want = min(self.config.max_tokens or n_ctx, n_ctx // 4)
        tokens = self.engine.chat_tokens(self.messages())
        dropped = 0
        while len(tokens) + want > n_ctx and len(self.turns) > 1:
            del self.turns[:2]  # a user message and its answer
            dropped += 1
            tokens = self.engine.chat_tokens(self.messages())
        if dropped:
            self.notices.append(f"context full ({n_ctx} tokens): dropped the {dropped} oldest turn(s)")
        return tokens
