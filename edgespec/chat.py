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
) -> str:
    """The prompt text for `messages`, as the model's own template lays it out."""
    if not template:
        raise ChatTemplateError(
            f"{model_name} has no chat template in its GGUF metadata; use plain completion (no --chat)"
        )
    try:
        return _ENV.from_string(template).render(
            messages=list(messages),
            bos_token=bos_token,
            eos_token=eos_token,
            add_generation_prompt=add_generation_prompt,
        )
    except (jinja2.TemplateError, TypeError, ValueError) as e:
        raise ChatTemplateError(
            f"the chat template of {model_name} failed to render ({type(e).__name__}: {e}); "
            f"use plain completion (no --chat) or a GGUF with a working template"
        ) from e
