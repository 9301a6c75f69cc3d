"""Chat templates from GGUF metadata, rendered in a sandbox (templates are untrusted)."""

from __future__ import annotations

import datetime
from typing import Any, Sequence

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


def model_text(model: Any, messages: Sequence[Message], add_generation_prompt: bool = True,
               tools: Sequence[dict] | None = None) -> str:
    """`messages` laid out by `model`'s own chat template (a backend.Model: its facts, vocabulary and tokens)."""
    bos = model.token_text(model.vocab.bos) if model.vocab.bos is not None else ""
    eos = model.token_text(model.vocab.eos) if model.vocab.eos is not None else ""
    return render(model.facts.chat_template, messages, bos_token=bos, eos_token=eos,
                  add_generation_prompt=add_generation_prompt, model_name=model.path.name, tools=tools)


def model_tokens(model: Any, messages: Sequence[Message], add_generation_prompt: bool = True,
                 tools: Sequence[dict] | None = None) -> list[int]:
    """The tokens of model_text."""
    tokens = model.tokenize(model_text(model, messages, add_generation_prompt, tools), add_special=True,
                            parse_special=True)
    if len(tokens) > 1 and tokens[0] == tokens[1] == model.vocab.bos:
        tokens = tokens[1:]  # the template wrote the BOS the tokenizer also adds
    return tokens
