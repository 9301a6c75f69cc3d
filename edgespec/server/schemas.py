"""Request fields to engine settings, as llama.cpp's server reads them; every field is honoured or refused.

`FIELDS` lists every field a generation route knows: what edgespec does with it,
or, for a field it does not implement, the value at which that field changes
nothing (a request may send it at that value). A field outside the list, or a
field edgespec does not implement at another value, is refused by name with a
400, never silently ignored. The README's endpoint table is this list.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from edgespec.config import (
    ANSWER_SLACK,
    DEFAULT_MIN_P,
    DEFAULT_REPEAT_LAST_N,
    DEFAULT_TOP_K,
    DEFAULT_TOP_P,
    MAX_K,
    MAX_LOGPROBS,
    MEMORY_LOCAL,
    PROPOSERS,
    WHOLE_LINES_MIN_CHARS,
    GenerationConfig,
    SamplingConfig,
)
from edgespec.prompts import tools
from edgespec.prompts.fim import Infill
from edgespec.errors import InvalidRequestError, shown

MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
MAX_EXTRA_CHUNKS = 64
MAX_RESPONSE_FIELDS = 64
MAX_COMPLETIONS = 8  # n_cmpl

OPENAI_CHAT, OPENAI_COMPLETIONS, COMPLETION, INFILL = "/v1/chat/completions", "/v1/completions", "/completion", "/infill"
ROUTES = (OPENAI_CHAT, OPENAI_COMPLETIONS, COMPLETION, INFILL)
LLAMA_ROUTES = (COMPLETION, INFILL)

# llama.cpp's default sampler chain, in order; a `samplers` list is honoured when it keeps this order.
SAMPLER_CHAIN = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")
SAMPLER_ALIASES = {"top-k": "top_k", "topk": "top_k", "top-p": "top_p", "topp": "top_p", "nucleus": "top_p",
                   "min-p": "min_p", "minp": "min_p", "temp": "temperature", "typ-p": "typ_p", "typp": "typ_p",
                   "typ": "typ_p", "top-n-sigma": "top_n_sigma", "topnsigma": "top_n_sigma"}
SAMPLER_CHARS = {"e": "penalties", "d": "dry", "s": "top_n_sigma", "k": "top_k", "y": "typ_p", "p": "top_p",
                 "m": "min_p", "x": "xtc", "t": "temperature", "i": "infill"}
# Samplers edgespec has; the others in SAMPLER_CHAIN do nothing at their defaults (refused otherwise, below).
OWN_SAMPLERS = ("penalties", "top_k", "top_p", "min_p", "temperature")


@dataclass(frozen=True)
class Field:
    what: str  # for the README: what edgespec does with it
    routes: tuple[str, ...] = ROUTES
    no_op: Callable[[Any], bool] | None = None  # not implemented: the values at which it changes nothing


def _is(*values: Any) -> Callable[[Any], bool]:
    """null or one of `values` (numbers compared by value, booleans only with booleans)."""

    def same(v: Any, x: Any) -> bool:
        if isinstance(v, bool) or isinstance(x, bool):
            return v is x
        if isinstance(v, (int, float)) and isinstance(x, (int, float)):
            return v == x
        return type(v) is type(x) and v == x

    return lambda v: v is None or any(same(v, x) for x in values)


def _empty(v: Any) -> bool:
    return v is None or v == [] or v == {} or v == ""


_OAI = (OPENAI_CHAT, OPENAI_COMPLETIONS)
FIELDS: dict[str, Field] = {
    # -- the prompt -------------------------------------------------------------------------------------------
    "messages": Field("the chat, laid out by the model's own template (text parts of content lists)", (OPENAI_CHAT,)),
    "prompt": Field("text or token ids; on /infill, text placed just before the cursor's prefix",
                    (OPENAI_COMPLETIONS, COMPLETION, INFILL)),
    "input_prefix": Field("code before the cursor", (INFILL,)),
    "input_suffix": Field("code after the cursor", (INFILL,)),
    "input_extra": Field("other files' chunks [{filename, text}], as repository context", (INFILL,)),
    "token_healing": Field("where the typed text ('prompt') ends inside a word (in the middle layout with the "
                           "blank or mark before it, and in blanks or marks too), the word is left out of the prompt "
                           "and the answer's first tokens must spell it, so the model writes it in tokens of its own "
                           "(token healing; default true, not with a grammar or a continued answer; false keeps the "
                           "typed text whole, in llama.cpp's layout)",
                           (INFILL,)),
    # -- length and stopping ----------------------------------------------------------------------------------
    "n_predict": Field("most tokens; -1 until the context ends, 0 evaluates the prompt into the cache only; more "
                       "than the room left ends at the context's end with finish reason length"),
    "max_tokens": Field("as n_predict (llama.cpp reads n_predict, then max_completion_tokens, then max_tokens)"),
    "max_completion_tokens": Field("as n_predict"),
    "stop": Field("up to 16 strings; the text ends before the first one"),
    "t_max_predict_ms": Field("once this many ms have passed since the first token, the next newline ends it, or "
                              f"at once where whole lines with {WHOLE_LINES_MIN_CHARS} visible characters came (the "
                              "line under way is dropped); no cycle starts that would end as long again later (half "
                              "a second at most); an /infill with t_max_prompt_ms too ends before a cycle that would "
                              f"end {ANSWER_SLACK:g} s past both budgets from its arrival"),
    "n_indent": Field("a line after the first with less indentation than this ends it (not streamed)"),
    # -- sampling ---------------------------------------------------------------------------------------------
    "temperature": Field("0 or less is greedy; at most 100"),
    "top_k": Field("0 or less turns it off"),
    "top_p": Field("1 turns it off, 0 keeps the top token"),
    "min_p": Field("0 turns it off"),
    "seed": Field("-1 is random; any other integer reproduces the sample"),
    "samplers": Field("names or letters; penalties, top_k, top_p, min_p, temperature honoured (one left out is off, "
                      "temperature left out samples at 1, as in llama.cpp), in llama.cpp's order; the other "
                      "names do nothing at their defaults; infill (llama.cpp's infill sampler) honoured last"),
    "n": Field("refused unless 1: one answer per request", _OAI, _is(1)),
    # -- caching, slots, speculation -----------------------------------------------------------------------------
    "cache_prompt": Field("reuse the KV prefix the slot shares with this prompt (default true)"),
    "id_slot": Field("prefer this slot (modulo the slot count) when it is free, else the free slot sharing the "
                     "longest prefix, as with -1 (llama.cpp waits for the slot named; editors send 0 for every "
                     "completion, which would queue them behind a chat)"),
    "speculative": Field('{"proposer": auto|none|ngram|draft, "k": cap, "enabled": bool} for this request; '
                         'echoed in the response\'s speculative stats'),
    "speculative.n_max": Field("llama.cpp's spelling of speculative.k"),
    "memory": Field("false: this request's text is neither proposed from nor added to the server's cross-request "
                    "memory (default true; it has effect where the server keeps one, as GET /props says: a loopback "
                    "bind or --memory); each API key has a memory of its own"),
    # -- responses --------------------------------------------------------------------------------------------
    "stream": Field("server-sent events; ': ping' comments keep a long prefill's connection alive"),
    "stream_options": Field("include_usage: a last chunk with usage and no choices", _OAI),
    "response_fields": Field("the final JSON holds only these paths; a/b moves b of object a to the top level "
                             "under the key a/b", LLAMA_ROUTES),
    "n_cmpl": Field("completions of one prompt (1 to 8), an array of results when more than 1; not with stream",
                    LLAMA_ROUTES),
    "return_tokens": Field("the generated token ids in 'tokens'", LLAMA_ROUTES),
    "timings_per_token": Field("refused unless false: per-token timings are not kept", LLAMA_ROUTES, _is(False)),
    # -- accepted, no effect by design --------------------------------------------------------------------------
    "model": Field("accepted and not used: the server serves the one model it loaded (GET /v1/models)"),
    "user": Field("accepted and not used: an end-user id for the provider's abuse monitoring", _OAI),
    "t_max_prompt_ms": Field("/infill: the time the prompt's evaluation may take: whole lines nearest the cursor "
                             "first, as many as the measured evaluation rate allows beyond what the slot's cache "
                             "already holds, never fewer than the 8 lines before the cursor (what was cut is "
                             "reported); a warm-up (n_predict 0) evaluates all of "
                             "its context instead, preempted by the next request; refused above 0 on the other "
                             "routes, whose prompt arrives whole (llama.cpp does not implement it)"),
    "n_keep": Field("accepted and not used: it only matters for context shifting, which edgespec does not do "
                    "(an answer ends at the context's end, as in llama.cpp by default)"),
    "n_discard": Field("accepted and not used: as n_keep"),
    "dry_base": Field("accepted: no effect while dry_multiplier is 0"),
    "dry_allowed_length": Field("accepted: no effect while dry_multiplier is 0"),
    "dry_penalty_last_n": Field("accepted: no effect while dry_multiplier is 0"),
    "dry_sequence_breakers": Field("accepted: no effect while dry_multiplier is 0"),
    "xtc_threshold": Field("accepted: no effect while xtc_probability is 0"),
    "mirostat_tau": Field("accepted: no effect while mirostat is 0"),
    "mirostat_eta": Field("accepted: no effect while mirostat is 0"),
    "dynatemp_exponent": Field("accepted: no effect while dynatemp_range is 0"),
    "min_keep": Field("accepted: edgespec's filters always keep at least one token; larger values refused",
                      no_op=_is(0, 1)),
    "echo": Field("refused unless false: the prompt is not echoed", (OPENAI_COMPLETIONS,), _is(False)),
    "best_of": Field("refused unless 1: one answer per request", (OPENAI_COMPLETIONS,), _is(1)),
    "suffix": Field("refused: use /infill for fill-in-the-middle", (OPENAI_COMPLETIONS,), _empty),
    # -- penalties, bias, probabilities: applied to every verified row ----------------------------------------------
    "repeat_penalty": Field("a token among the last repeat_last_n (prompt included) has its logit divided by this "
                            "(multiplied when negative), as llama.cpp; 1 is off"),
    "repeat_last_n": Field("the tokens the penalties look back over (default 64); -1 all, 0 off"),
    "frequency_penalty": Field("subtracted from a token's logit once per time it occurs in that window"),
    "presence_penalty": Field("subtracted from a token's logit once if it occurs in that window"),
    "logit_bias": Field('added to logits: {"id": bias} (OpenAI), [[id, bias]] or [["text", bias]] (llama.cpp, '
                        'every token of the text); false or -inf forbids the token'),
    "logprobs": Field("the target's own log-probabilities of the tokens committed (drafted or not), from the rows "
                      "it verified: true on chat, the number of alternatives (0-20) on /v1/completions", _OAI),
    "top_logprobs": Field("alternatives per token (0-20) with chat's logprobs: true", (OPENAI_CHAT,)),
    "n_probs": Field("completion_probabilities with this many alternatives per token (0-20), as llama.cpp",
                     LLAMA_ROUTES),
    "post_sampling_probs": Field("refused unless false: probabilities are the model's own, before the samplers",
                                 LLAMA_ROUTES, _is(False)),
    # -- constraints: a grammar applied to every verified row --------------------------------------------------------
    "response_format": Field('{"type": "json_object"} (any JSON object, or the schema in "schema"), {"type": '
                             '"json_schema", "json_schema": {"schema": ...}} (strict or not, the output follows it), '
                             'or {"type": "text"}', _OAI),
    "grammar": Field("a GBNF grammar (llama.cpp's format) the output follows"),
    "json_schema": Field("a JSON schema the output follows, through llama.cpp's converter"),
    "tools": Field("function tools, laid out by the model's own template; calls come back as tool_calls, their "
                   "arguments following each function's parameters schema", (OPENAI_CHAT,)),
    "tool_choice": Field("auto (default: text, or calls once one opens), required, none, or "
                         '{"type": "function", "function": {"name": ...}}', (OPENAI_CHAT,)),
    "parallel_tool_calls": Field("whether more than one call may follow the first (default true)", (OPENAI_CHAT,)),
    "functions": Field("refused: the deprecated form of tools; send tools", _OAI, _empty),
    "function_call": Field("refused: the deprecated form of tool_choice; send tool_choice", _OAI, _is("none", "auto")),
    "ignore_eos": Field("refused unless false: not implemented", no_op=_is(False)),
    "typical_p": Field("refused unless 1: not implemented", no_op=_is(1.0)),
    "tfs_z": Field("refused unless 1: not implemented", no_op=_is(1.0)),
    "top_n_sigma": Field("refused unless negative: not implemented",
                         no_op=lambda v: v is None or isinstance(v, (int, float)) and v < 0),
    "mirostat": Field("refused unless 0: not implemented", no_op=_is(0)),
    "dry_multiplier": Field("refused unless 0: not implemented", no_op=_is(0.0)),
    "xtc_probability": Field("refused unless 0: not implemented", no_op=_is(0.0)),
    "dynatemp_range": Field("refused unless 0: not implemented", no_op=_is(0.0)),
    "lora": Field("refused unless empty: edgespec loads no adapters", LLAMA_ROUTES, _empty),
    "n_cache_reuse": Field("keep cached runs of at least this many tokens at their new position (KV shifting), "
                           "after insertions too; 0 keeps the common prefix only. Default: --cache-reuse, else 16 "
                           "on /infill and 0 elsewhere. A shifted entry was computed with other text before it: "
                           "the output is close to a fresh evaluation's, not identical"),
    "return_progress": Field("refused unless false: not implemented", LLAMA_ROUTES, _is(False)),
    "speculative.n_min": Field("refused unless 0: auto decides per cycle whether a bet pays", no_op=_is(0)),
    "speculative.p_min": Field("refused unless 0: auto sets the draft's own cut-off", no_op=_is(0.0)),
}


def check_fields(body: dict[str, Any], route: str) -> None:
    """Refuse, by name, a field this route does not know or does not implement at the value sent."""
    if route in _OAI and body.get("response_fields") in ([], [""]):  # llama.vim's chat warm-up: selects nothing
        body = {k: v for k, v in body.items() if k != "response_fields"}
    for key, value in body.items():
        f = FIELDS.get(key)
        if f is None or route not in f.routes:
            raise InvalidRequestError(f"{shown(key)} is not a field {route} takes; remove it (the README's endpoint "
                                      f"table lists every field edgespec honours or accepts)")
        if f.no_op is not None and not f.no_op(value):
            raise InvalidRequestError(f"'{key}' {shown(value, json.dumps)} is {f.what}; remove the field")


def number(body: dict[str, Any], key: str, default: float | None, lo: float, hi: float, integer: bool = False,
           aliases: Sequence[str] = ()) -> Any:
    """body[key] (or the first alias present), checked for type and range; `default` when absent or null."""
    name, value = key, body.get(key)
    for alias in aliases:
        if value is None:
            name, value = alias, body.get(alias)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and isinstance(value, float)
                                                                           and not value.is_integer()):
        raise InvalidRequestError(f"'{name}' must be {'an integer' if integer else 'a number'}, got {shown(value)}")
    if math.isnan(value) or not lo <= value <= hi:
        bounds = f"{int(lo)} and {int(hi)}" if integer else f"{lo:g} and {hi:g}"
        raise InvalidRequestError(f"'{name}' must be between {bounds}, got {value!r}")
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
    return tuple(s for s in items if s)


def flag(body: dict[str, Any], key: str, default: bool) -> bool:
    """body[key] as a boolean; `default` when absent or null."""
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidRequestError(f"'{key}' must be true or false, got {shown(value)}")
    return value


@dataclass(frozen=True)
class Request:
    config: GenerationConfig
    stop: tuple[str, ...]
    stream: bool
    response_fields: tuple[str, ...] = ()
    return_tokens: bool = False
    include_usage: bool = False
    settings: dict[str, Any] = field(default_factory=dict)  # as llama.cpp's generation_settings
    n: int = 1  # n_cmpl: completions of the prompt


def generation(body: dict[str, Any], route: str, n_ctx: int, default_max_tokens: int | None,
               default_temperature: float, tokenize: Callable[[str], list[int]] | None = None,
               n_vocab: int = 2**31 - 1, default_cache_reuse: int = 0) -> Request:
    """The fields every generation route shares, with llama.cpp's meanings (OpenAI's where they differ).
    `tokenize` turns logit_bias's text keys into tokens."""
    check_fields(body, route)
    max_tokens = number(body, "n_predict", None, -1, 2**31 - 1, integer=True,
                        aliases=("max_completion_tokens", "max_tokens"))
    if max_tokens is None:
        max_tokens = default_max_tokens
    elif max_tokens == -1:
        max_tokens = None
    sampling = _sampling(body, default_temperature, _logit_bias(body, n_vocab, tokenize))
    time_limit = number(body, "t_max_predict_ms", None, -1, 2**63 - 1, integer=True)
    if route != INFILL and (number(body, "t_max_prompt_ms", -1, -1, 2**63 - 1, integer=True) or -1) > 0:
        raise InvalidRequestError(f"'t_max_prompt_ms' sizes an /infill prompt's context; {route} gets its prompt "
                                  f"whole and cannot cut it: leave the field out or send -1")
    proposer, k = _speculative(body)
    config = GenerationConfig(
        max_tokens=max_tokens, sampling=sampling, reuse_prefix=flag(body, "cache_prompt", True),
        time_limit=time_limit / 1000 if time_limit and time_limit > 0 else None,
        min_indent=number(body, "n_indent", 0, 0, 2**31 - 1, integer=True), proposer=proposer, k=k,
        slot=number(body, "id_slot", None, -1, 2**31 - 1, integer=True), logprobs=_logprobs(body, route),
        memory=MEMORY_LOCAL if flag(body, "memory", True) else None,
        cache_reuse=number(body, "n_cache_reuse", default_cache_reuse, 0, 2**31 - 1, integer=True),
        **_constraint(body))
    options = body.get("stream_options")
    if options is not None and not (isinstance(options, dict) and set(options) <= {"include_usage"}):
        raise InvalidRequestError(f"'stream_options' {shown(options)}: only {{\"include_usage\": bool}} is supported")
    settings = {"n_predict": -1 if max_tokens is None else max_tokens, "temperature": sampling.temperature,
                "top_k": sampling.top_k, "top_p": sampling.top_p, "min_p": sampling.min_p,
                "seed": -1 if sampling.seed is None else sampling.seed, "n_indent": config.min_indent,
                "t_max_predict_ms": -1 if time_limit is None else time_limit, "cache_prompt": config.reuse_prefix,
                "n_cache_reuse": config.cache_reuse,
                "samplers": list(_samplers(body)), "repeat_penalty": sampling.repeat_penalty,
                "repeat_last_n": sampling.repeat_last_n, "frequency_penalty": sampling.frequency_penalty,
                "presence_penalty": sampling.presence_penalty, "n_probs": config.logprobs or 0,
                "logit_bias": [[t, b if math.isfinite(b) else False] for t, b in sampling.logit_bias],
                "grammar": config.grammar or "", "json_schema": config.json_schema or {}}
    n, stream = number(body, "n_cmpl", 1, 1, MAX_COMPLETIONS, integer=True), flag(body, "stream", False)
    if n > 1 and stream:
        raise InvalidRequestError(f"'n_cmpl' {n} with 'stream': true is not supported; stream one completion, "
                                  f"or ask for {n} without streaming")
    settings["n_ctx"] = n_ctx
    return Request(config, stops(body), stream, _response_fields(body), flag(body, "return_tokens", False),
                   flag(options or {}, "include_usage", False), settings, n)


def _sampling(body: dict[str, Any], default_temperature: float,
              logit_bias: tuple[tuple[int, float], ...] = ()) -> SamplingConfig:
    """llama.cpp's conventions: top_k <= 0 off, temperature <= 0 greedy, seed -1 random; a sampler left out of
    `samplers` is off (temperature left out samples at 1, penalties left out are off)."""
    chain = _samplers(body)
    penalties = "penalties" in chain
    temperature = max(0.0, number(body, "temperature", default_temperature, -math.inf, 100.0))
    return SamplingConfig(
        temperature=temperature if "temperature" in chain else 1.0,
        top_k=max(0, number(body, "top_k", DEFAULT_TOP_K, -(2**31), 2**31 - 1, integer=True)) if "top_k" in chain else 0,
        top_p=number(body, "top_p", DEFAULT_TOP_P, 0.0, 1.0) if "top_p" in chain else 1.0,
        min_p=number(body, "min_p", DEFAULT_MIN_P, 0.0, 1.0) if "min_p" in chain else 0.0,
        seed=number(body, "seed", None, -(2**63), 2**63 - 1, integer=True),
        repeat_penalty=number(body, "repeat_penalty", 1.0, 0.0, 100.0) if penalties else 1.0,
        repeat_last_n=number(body, "repeat_last_n", DEFAULT_REPEAT_LAST_N, -1, 2**31 - 1, integer=True),
        frequency_penalty=number(body, "frequency_penalty", 0.0, -100.0, 100.0) if penalties else 0.0,
        presence_penalty=number(body, "presence_penalty", 0.0, -100.0, 100.0) if penalties else 0.0,
        logit_bias=logit_bias,
        infill="infill" in chain,
    )


def _logit_bias(body: dict[str, Any], n_vocab: int,
                tokenize: Callable[[str], list[int]] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"id": bias} or llama.cpp's [[id or text, bias]]; false (or -inf) forbids; text biases each of
    its tokens."""
    value = body.get("logit_bias")
    if _empty(value):
        return ()
    if isinstance(value, dict):
        pairs = list(value.items())
    elif isinstance(value, list) and all(isinstance(p, list) and len(p) == 2 for p in value):
        pairs = [(k, b) for k, b in value]
    else:
        raise InvalidRequestError(f"'logit_bias' must be {{\"token id\": bias}} or [[id or text, bias], ...], "
                                  f"got {shown(value, json.dumps)}")
    out = []
    for key, bias in pairs:
        if bias is False:
            bias = -math.inf
        elif isinstance(bias, bool) or not isinstance(bias, (int, float)) or math.isnan(bias):
            raise InvalidRequestError(f"'logit_bias' value {shown(bias)} for {shown(key)} must be a number or false")
        if isinstance(key, int) and not isinstance(key, bool) or isinstance(key, str) and key.lstrip("-").isdigit():
            ids = [int(key)]
        elif isinstance(key, str) and tokenize is not None:
            ids = tokenize(key)
        else:
            raise InvalidRequestError(f"'logit_bias' key {shown(key)} must be a token id (or, on llama.cpp's routes, "
                                      f"text)")
        bad = [t for t in ids if not 0 <= t < n_vocab]
        if bad:
            raise InvalidRequestError(f"'logit_bias' token id {bad[0]} is outside the vocabulary (0..{n_vocab - 1})")
        out += [(t, float(bias)) for t in ids]
    return tuple(out)


def _logprobs(body: dict[str, Any], route: str) -> int | None:
    """How many alternatives each token's log-probability comes with; None when none were asked for."""
    if route == OPENAI_CHAT:
        top = number(body, "top_logprobs", None, 0, MAX_LOGPROBS, integer=True)
        if not flag(body, "logprobs", False):
            if top:
                raise InvalidRequestError("'top_logprobs' needs 'logprobs': true")
            return None
        return top or 0
    if route == OPENAI_COMPLETIONS:
        value = body.get("logprobs")
        if value is False:
            return None
        return number(body, "logprobs", None, 0, MAX_LOGPROBS, integer=True)
    n = number(body, "n_probs", 0, 0, MAX_LOGPROBS, integer=True)
    return n or None


def _constraint(body: dict[str, Any]) -> dict[str, Any]:
    """grammar / json_schema / response_format as GenerationConfig fields (one of them at most)."""
    given = [k for k in ("grammar", "json_schema", "response_format") if not _empty(body.get(k))
             and body.get(k) != {"type": "text"}]
    if len(given) > 1:
        raise InvalidRequestError(f"{' and '.join(repr(k) for k in given)} were both given; send one constraint")
    grammar, schema, fmt = body.get("grammar"), body.get("json_schema"), body.get("response_format")
    if not _empty(grammar):
        if not isinstance(grammar, str):
            raise InvalidRequestError("'grammar' must be a string of GBNF rules")
        return {"grammar": grammar}
    if not _empty(schema):
        if not isinstance(schema, dict):
            raise InvalidRequestError(f"'json_schema' must be a JSON schema object, got {shown(schema, json.dumps)}")
        return {"json_schema": schema}
    if _empty(fmt):
        return {}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return {}
    if kind == "json_object":
        schema = fmt.get("schema", {"type": "object"})
    elif kind == "json_schema" and isinstance(fmt.get("json_schema"), dict):
        schema = fmt["json_schema"].get("schema", {"type": "object"})
    else:
        raise InvalidRequestError(f"'response_format' {json.dumps(fmt)[:120]} must be {{\"type\": \"text\"}}, "
                                  f"{{\"type\": \"json_object\"}} or {{\"type\": \"json_schema\", "
                                  f"\"json_schema\": {{\"name\": ..., \"schema\": {{...}}}}}}")
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"'response_format' schema must be a JSON schema object, got "
                                  f"{shown(schema, json.dumps)}")
    return {"json_schema": schema}


def _samplers(body: dict[str, Any]) -> tuple[str, ...]:
    """The `samplers` chain as canonical names (llama.cpp takes names or a string of letters)."""
    value = body.get("samplers")
    if value is None:
        return SAMPLER_CHAIN
    if isinstance(value, str):
        names = [SAMPLER_CHARS.get(c) for c in value]
        if None in names:
            raise InvalidRequestError(f"'samplers' {shown(value)}: letters are {''.join(SAMPLER_CHARS)}")
    elif isinstance(value, list) and all(isinstance(n, str) for n in value):
        names = [SAMPLER_ALIASES.get(n.lower(), n.lower()) for n in value]
        unknown = [n for n in names if n not in SAMPLER_CHAIN and n != "infill"]
        if unknown:
            raise InvalidRequestError(f"'samplers' has unknown names {shown(unknown)}; use names from "
                                      f"{', '.join(SAMPLER_CHAIN)}, infill")
    else:
        raise InvalidRequestError("'samplers' must be a list of names or a string of letters")
    if "infill" in names[:-1]:
        raise InvalidRequestError(f"'samplers' {shown(value)}: edgespec applies infill last only (as llama.vim and "
                                  f"llama.vscode send it); move it to the end")
    own = [n for n in names if n in OWN_SAMPLERS]
    if own != [n for n in SAMPLER_CHAIN if n in own]:
        raise InvalidRequestError(f"'samplers' {shown(value)}: edgespec applies {', '.join(OWN_SAMPLERS)} in that "
                                  f"order only (llama.cpp's default); reorder them")
    return tuple(names)  # type: ignore[arg-type]


def _speculative(body: dict[str, Any]) -> tuple[str | None, int | None]:
    """(proposer, k) from the `speculative` object or llama.cpp's flat speculative.n_max."""
    spec = body.get("speculative")
    if spec is None:
        spec = {}
    if not isinstance(spec, dict) or not set(spec) <= {"proposer", "k", "enabled"}:
        raise InvalidRequestError(f"'speculative' {shown(spec)} must be an object with any of proposer "
                                  f"({', '.join(PROPOSERS)}), k (0..{MAX_K}) and enabled (true/false)")
    proposer = spec.get("proposer")
    if proposer is not None and proposer not in PROPOSERS:
        raise InvalidRequestError(f"'speculative.proposer' {shown(proposer)}: use one of {', '.join(PROPOSERS)}")
    k = number(spec, "k", None, 0, MAX_K, integer=True)
    n_max = number(body, "speculative.n_max", None, 0, MAX_K, integer=True)
    k = n_max if k is None else k if n_max is None else min(k, n_max)
    if not flag(spec, "enabled", True):
        proposer = "none"
    return proposer, k


def _response_fields(body: dict[str, Any]) -> tuple[str, ...]:
    value = body.get("response_fields")
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > MAX_RESPONSE_FIELDS or not all(isinstance(p, str) for p in value):
        raise InvalidRequestError(f"'response_fields' must be a list of at most {MAX_RESPONSE_FIELDS} paths "
                                  f"like \"content\" or \"timings/prompt_n\"")
    return tuple(value)


def pick_fields(result: dict[str, Any], paths: Sequence[str]) -> dict[str, Any]:
    """llama.cpp's response_fields: only these paths, each under its own full path as key; missing ones left out."""
    if not paths:
        return result
    out: dict[str, Any] = {}
    for path in paths:
        current: Any = result
        for key in path.split("/"):
            if not isinstance(current, dict) or key not in current:
                break
            current = current[key]
        else:
            out[path] = current
    return out


def messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """OpenAI's messages for the template: text content, an assistant's tool_calls, a tool's result."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise InvalidRequestError("'messages' must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "developer", "tool"):
            raise InvalidRequestError(f"messages[{i}] needs a role of system, user, assistant or tool")
        content = m.get("content", "")
        if content is None:
            content = ""
        if isinstance(content, list):  # OpenAI's content parts: text only
            kinds = {p.get("type") if isinstance(p, dict) else type(p).__name__ for p in content}
            if kinds - {"text"}:
                raise InvalidRequestError(f"messages[{i}].content has parts of type {sorted(map(str, kinds - {'text'}))}; "
                                          f"this server reads text parts only")
            content = "".join(p.get("text", "") for p in content)
        if not isinstance(content, str):
            raise InvalidRequestError(f"messages[{i}].content must be a string or a list of text parts")
        msg: dict[str, Any] = {"role": "system" if m["role"] == "developer" else m["role"], "content": content}
        if m.get("tool_calls"):
            calls = m["tool_calls"]
            if m["role"] != "assistant" or not isinstance(calls, list) or not all(
                    isinstance(c, dict) and isinstance(c.get("function"), dict)
                    and isinstance(c["function"].get("name"), str) for c in calls):
                raise InvalidRequestError(f"messages[{i}].tool_calls must be an assistant's list of {{\"type\": "
                                          f"\"function\", \"function\": {{\"name\", \"arguments\"}}}}")
            msg = tools.for_template({**msg, "tool_calls": calls})
        for key in ("tool_call_id", "name"):
            if isinstance(m.get(key), str):
                msg[key] = m[key]
        out.append(msg)
    return out


def infill(body: dict[str, Any]) -> Infill:
    """What /infill's request holds around the cursor."""
    return Infill(text_field(body, "input_prefix", "") or "", text_field(body, "input_suffix", "") or "",
                  text_field(body, "prompt", "") or "", tuple(extra_chunks(body)))


def prompt_budget(body: dict[str, Any]) -> float | None:
    """t_max_prompt_ms in seconds; None when absent, -1 or 0 (no budget)."""
    ms = number(body, "t_max_prompt_ms", None, -1, 2**63 - 1, integer=True)
    return ms / 1000 if ms is not None and ms > 0 else None


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


def only_fields(body: dict[str, Any], known: set[str], route: str) -> None:
    """The check_fields of a route that is not a generation's: its few fields, nothing else."""
    for key in body:
        if key not in known:
            raise InvalidRequestError(f"{shown(key)} is not a field {route} takes; its fields are "
                                      f"{', '.join(sorted(known))}")


def tokenize_request(body: dict[str, Any]) -> tuple[str, bool, bool, bool]:
    """/tokenize: (content, add_special, parse_special, with_pieces) with llama.cpp's defaults."""
    only_fields(body, {"content", "add_special", "parse_special", "with_pieces"}, "/tokenize")
    return (text_field(body, "content", "") or "", flag(body, "add_special", False),
            flag(body, "parse_special", True), flag(body, "with_pieces", False))


def token_list(body: dict[str, Any], key: str, n_vocab: int) -> list[int]:
    value = body.get(key, [])
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise InvalidRequestError(f"'{key}' must be a list of token ids")
    bad = [t for t in value if not 0 <= t < n_vocab]
    if bad:
        raise InvalidRequestError(f"token ids must be in 0..{n_vocab - 1}, got {bad[:4]}")
    return value
