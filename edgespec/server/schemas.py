"""Request fields to engine settings: every number bounded, every error naming field, value and range."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from edgespec.config import DEFAULT_MIN_P, DEFAULT_TOP_K, DEFAULT_TOP_P, GenerationConfig, SamplingConfig
from edgespec.errors import InvalidRequestError

MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
MAX_EXTRA_CHUNKS = 64


def number(body: dict[str, Any], key: str, default: float | None, lo: float, hi: float, integer: bool = False,
           aliases: Sequence[str] = ()) -> Any:
    """body[key] (or an alias) checked for type and range; `default` when absent or null."""
    value = body.get(key)
    for alias in aliases:
        if value is None:
            value = body.get(alias)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and isinstance(value, float)
                                                                           and not value.is_integer()):
        raise InvalidRequestError(f"'{key}' must be {'an integer' if integer else 'a number'}, got {value!r}")
    if math.isnan(value) or not lo <= value <= hi:
        raise InvalidRequestError(f"'{key}' must be between {lo:g} and {hi:g}, got {value!r}")
    return int(value) if integer else float(value)


def text_field(body: dict[str, Any], key: str, default: str | None = None, required: bool = False) -> str | None:
    value = body.get(key, default)
    if value is None and required:
        raise InvalidRequestError(f"'{key}' is required")
    if value is not None and not isinstance(value, str):
        raise InvalidRequestError(f"'{key}' must be a string, got {type(value).__name__}")
    return value


def stops(body: dict[str, Any]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise InvalidRequestError("'stop' must be a string or a list of strings")
    if len(items) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_LENGTH for s in items):
        raise InvalidRequestError(f"'stop' takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_LENGTH} chars")
    return tuple(items)


@dataclass(frozen=True)
class Request:
    config: GenerationConfig
    stop: tuple[str, ...]
    stream: bool
    max_tokens_field: str  # as the request spelled it, for errors: 'max_tokens', 'n_predict', or the default


def generation(body: dict[str, Any], n_ctx: int, default_max_tokens: int, default_temperature: float,
               length_field: str = "max_tokens") -> Request:
    """The fields OpenAI's and llama.cpp's endpoints share (llama.cpp spells max_tokens n_predict).

    Defaults follow each API: temperature 1.0 for OpenAI's, 0.8 for llama.cpp's. `length_field` is the
    route's own name for the length, named in errors when the request left it out.
    """
    max_tokens = number(body, "max_tokens", None, 1, n_ctx, integer=True, aliases=("max_completion_tokens",))
    if max_tokens is None:
        n_predict = number(body, "n_predict", None, -1, n_ctx, integer=True)
        max_tokens = default_max_tokens if n_predict in (None, -1) else n_predict
    given = [k for k in ("max_tokens", "max_completion_tokens", "n_predict") if body.get(k) is not None]
    field_name = f"'{given[0] if given else length_field}'"
    if max_tokens < 1:
        raise InvalidRequestError(f"'n_predict' must be -1 (up to the context) or between 1 and {n_ctx}, got {max_tokens}")
    if body.get("n", 1) != 1:
        raise InvalidRequestError(f"'n' must be 1 (one completion per request), got {body.get('n')!r}")
    sampling = SamplingConfig(
        temperature=number(body, "temperature", default_temperature, 0.0, 2.0),
        top_k=number(body, "top_k", DEFAULT_TOP_K, 0, 1000, integer=True),
        top_p=number(body, "top_p", DEFAULT_TOP_P, 1e-6, 1.0),
        min_p=number(body, "min_p", DEFAULT_MIN_P, 0.0, 1.0),
        seed=number(body, "seed", None, -(2**63), 2**63 - 1, integer=True),
    )
    stream, cache_prompt = flag(body, "stream", False), flag(body, "cache_prompt", True)
    return Request(GenerationConfig(max_tokens=max_tokens, sampling=sampling, reuse_prefix=cache_prompt), stops(body),
                   stream, field_name)


def flag(body: dict[str, Any], key: str, default: bool) -> bool:
    """body[key] as a boolean; `default` when absent or null."""
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidRequestError(f"'{key}' must be true or false, got {value!r}")
    return value


def messages(body: dict[str, Any]) -> list[dict[str, str]]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise InvalidRequestError("'messages' must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "developer"):
            raise InvalidRequestError(f"messages[{i}] needs a role of system, user or assistant")
        content = m.get("content", "")
        if isinstance(content, list):  # OpenAI's content parts: keep the text ones
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
        if not isinstance(content, str):
            raise InvalidRequestError(f"messages[{i}].content must be a string or a list of text parts")
        out.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
    return out


def extra_chunks(body: dict[str, Any]) -> list[tuple[str, str]]:
    """llama.cpp's input_extra: [{filename, text}, ...]."""
    extra = body.get("input_extra") or []
    if not isinstance(extra, list) or len(extra) > MAX_EXTRA_CHUNKS:
        raise InvalidRequestError(f"'input_extra' must be a list of at most {MAX_EXTRA_CHUNKS} {{filename, text}} objects")
    out = []
    for i, chunk in enumerate(extra):
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text", ""), str) \
                or not isinstance(chunk.get("filename", "tmp"), str):
            raise InvalidRequestError(f"input_extra[{i}] must be an object with string 'filename' and 'text'")
        out.append((chunk.get("filename", "tmp"), chunk.get("text", "")))
    return out
