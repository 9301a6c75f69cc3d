"""The request schema on literal bodies: llama.cpp's conventions, and every field honoured or refused by name."""

from __future__ import annotations

import pytest

from edgespec.errors import InvalidRequestError
from edgespec.prompts import tools
from edgespec.server import schemas
from edgespec.server.schemas import COMPLETION, INFILL, OPENAI_CHAT, OPENAI_COMPLETIONS


def gen(body, route=COMPLETION, default_max=128, temperature=0.8):
    return schemas.generation(body, route, 4096, default_max, temperature)


@pytest.mark.parametrize("body, max_tokens", [
    ({}, 128), ({"n_predict": -1}, None), ({"n_predict": 0}, 0), ({"max_tokens": 4096}, 4096),
    ({"n_predict": 7, "max_tokens": 9}, 7), ({"max_completion_tokens": 5, "max_tokens": 9}, 5),
    ({"n_predict": None, "max_tokens": 9}, 9),
])
def test_length_fields_in_llama_cpp_order(body, max_tokens):
    assert gen(body).config.max_tokens == max_tokens


def test_llama_cpp_sampler_conventions():
    s = gen({"top_k": -5, "top_p": 0, "temperature": -1, "seed": -1}).config.sampling
    assert (s.top_k, s.top_p, s.temperature, s.greedy, s.seed) == (0, 0.0, 0.0, True, -1)


def test_a_sampler_left_out_is_off_and_temperature_left_out_is_one():
    s = gen({"samplers": ["top_k", "top_p", "infill"], "top_k": 40, "top_p": 0.99, "temperature": 0.1}).config.sampling
    assert (s.top_k, s.top_p, s.min_p, s.temperature, s.infill) == (40, 0.99, 0.0, 1.0, True)
    s = gen({"samplers": "kt", "temperature": 0.2}).config.sampling  # llama.cpp's letters
    assert (s.top_k, s.top_p, s.min_p, s.temperature, s.infill) == (40, 1.0, 0.0, 0.2, False)


@pytest.mark.parametrize("samplers, message", [
    (["temperature", "top_k"], "in that order only"),
    (["top_k", "beam"], "unknown names ['beam']"),
    (["infill", "top_k"], "infill last only"),
    ("kq", "letters are"),
    (7, "a list of names or a string"),
])
def test_samplers_edgespec_cannot_honour_are_refused(samplers, message):
    with pytest.raises(InvalidRequestError, match=message.replace("[", r"\[").replace("]", r"\]")):
        gen({"samplers": samplers})


@pytest.mark.parametrize("body, route, message", [
    ({"frobnicate": 1}, COMPLETION, "'frobnicate' is not a field /completion takes"),
    ({"response_fields": ["content"]}, OPENAI_CHAT, "'response_fields' is not a field /v1/chat/completions"),
    ({"input_prefix": "x"}, COMPLETION, "'input_prefix' is not a field /completion"),
    ({"logprobs": True, "top_logprobs": 30}, OPENAI_CHAT, "'top_logprobs' must be between 0 and 20"),
    ({"top_logprobs": 2}, OPENAI_CHAT, "'top_logprobs' needs 'logprobs': true"),
    ({"n_probs": 3}, OPENAI_CHAT, "'n_probs' is not a field /v1/chat/completions"),
    ({"post_sampling_probs": True}, COMPLETION, "'post_sampling_probs' true is refused unless false"),
    ({"grammar": "root ::= \"a\"", "json_schema": {"type": "object"}}, COMPLETION,
     "'grammar' and 'json_schema' were both given"),
    ({"response_format": {"type": "xml"}}, OPENAI_CHAT, "'response_format' .* must be"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}}, OPENAI_CHAT,
     "'response_format' schema must be a JSON schema object"),
    ({"logit_bias": {"abc": 1}}, OPENAI_CHAT, "'logit_bias' key 'abc' must be a token id"),
    ({"logit_bias": {"5": "x"}}, OPENAI_CHAT, "'logit_bias' value 'x' for '5' must be a number or false"),
    ({"repeat_penalty": 0}, COMPLETION, "repeat_penalty 0.0 must be in"),
    ({"functions": [{"name": "f"}]}, OPENAI_CHAT, "'functions' .* refused"),
    ({"speculative": {"proposer": "magic"}}, COMPLETION, "'speculative.proposer' 'magic'"),
    ({"speculative": {"depth": 3}}, COMPLETION, "'speculative' .* must be an object with any of proposer"),
    ({"stream_options": {"include_usage": True, "x": 1}}, OPENAI_CHAT, "'stream_options'"),
    ({"n_predict": -2}, COMPLETION, "'n_predict' must be between -1 and"),
])
def test_fields_not_honoured_are_refused_by_name(body, route, message):
    with pytest.raises(InvalidRequestError, match=message):
        gen(body, route)


@pytest.mark.parametrize("body, route, name", [
    ({"suffix": "x = 1;" * 20_000}, OPENAI_COMPLETIONS, "'suffix'"),
    ({"temperature": "9" * 100_000}, COMPLETION, "'temperature'"),
    ({"k" * 100_000: 1}, COMPLETION, "'kkk"),
])
def test_a_refused_value_is_named_by_its_start_not_echoed_whole(body, route, name):
    """A field can hold a whole file (a minified line as `suffix`): the error names the field and quotes the value's
    start, and stays a line long."""
    with pytest.raises(InvalidRequestError) as e:
        gen(body, route)
    assert str(e.value).startswith(name) and len(str(e.value)) < 400 and "..." in str(e.value), str(e.value)[:500]


def test_a_tool_name_that_is_a_whole_file_is_quoted_by_its_start():
    with pytest.raises(InvalidRequestError, match=r"tools\[0\]\.function\.name 'nnn") as e:
        tools.check_tools([{"type": "function", "function": {"name": "n" * 100_000}}], lambda schema, what: None)
    assert len(str(e.value)) < 400


def test_penalties_bias_probabilities_and_constraints_reach_the_config():
    r = schemas.generation({"repeat_penalty": 1.3, "repeat_last_n": -1, "frequency_penalty": 0.5,
                            "presence_penalty": 0.25, "logit_bias": [[7, False], ["hi", 2]], "n_probs": 3,
                            "json_schema": {"type": "object"}}, COMPLETION, 4096, 16, 0.8,
                           tokenize=lambda text: [11, 12], n_vocab=100)
    sc = r.config.sampling
    assert (sc.repeat_penalty, sc.repeat_last_n, sc.frequency_penalty, sc.presence_penalty) == (1.3, -1, 0.5, 0.25)
    assert sc.logit_bias == ((7, float("-inf")), (11, 2.0), (12, 2.0))
    assert r.config.logprobs == 3 and r.config.json_schema == {"type": "object"}
    assert r.settings["logit_bias"] == [[7, False], [11, 2.0], [12, 2.0]]
    chat = schemas.generation({"logprobs": True, "top_logprobs": 2, "logit_bias": {"5": -1.5},
                               "response_format": {"type": "json_schema", "json_schema": {
                                   "name": "x", "strict": True, "schema": {"type": "array"}}}},
                              OPENAI_CHAT, 4096, 16, 1.0)
    assert chat.config.logprobs == 2 and chat.config.sampling.logit_bias == ((5, -1.5),)
    assert chat.config.json_schema == {"type": "array"}
    assert schemas.generation({"logprobs": 0}, OPENAI_COMPLETIONS, 4096, 16, 1.0).config.logprobs == 0
    assert schemas.generation({"response_format": {"type": "json_object"}}, OPENAI_COMPLETIONS, 4096, 16,
                              1.0).config.json_schema == {"type": "object"}
    assert schemas.generation({"samplers": ["top_k"], "repeat_penalty": 1.5}, COMPLETION, 4096, 16,
                              0.8).config.sampling.repeat_penalty == 1.0  # penalties left out of the chain
    with pytest.raises(InvalidRequestError, match="'logit_bias' token id 100 is outside the vocabulary"):
        schemas.generation({"logit_bias": {"100": 1}}, OPENAI_CHAT, 4096, 16, 1.0, n_vocab=100)


@pytest.mark.parametrize("body, route", [
    ({"frequency_penalty": 0, "presence_penalty": 0.0, "logprobs": False, "n": 1, "user": "u",
      "model": "anything", "stream_options": {"include_usage": True}, "parallel_tool_calls": True}, OPENAI_CHAT),
    ({"repeat_penalty": 1.0, "repeat_last_n": 64, "n_probs": 0, "typical_p": 1, "mirostat": 0, "dry_multiplier": 0,
      "t_max_prompt_ms": -1, "n_keep": 0, "id_slot": -1, "cache_prompt": True, "return_tokens": True,
      "response_fields": ["content", "timings/prompt_n"], "speculative.n_min": 0, "json_schema": None}, COMPLETION),
])
def test_fields_at_values_that_change_nothing_are_accepted(body, route):
    gen(body, route)


def test_speculative_object_and_llama_cpp_n_max():
    c = gen({"speculative": {"proposer": "ngram", "k": 8}, "speculative.n_max": 4}).config
    assert (c.proposer, c.k) == ("ngram", 4)
    assert gen({"speculative": {"enabled": False}}).config.proposer == "none"


def test_prompt_budget_is_for_infill_and_refused_above_zero_elsewhere():
    assert schemas.prompt_budget({"t_max_prompt_ms": 500}) == 0.5
    assert schemas.prompt_budget({"t_max_prompt_ms": -1}) is None and schemas.prompt_budget({}) is None
    gen({"t_max_prompt_ms": 500}, INFILL)
    with pytest.raises(InvalidRequestError, match="'t_max_prompt_ms' sizes an /infill prompt"):
        gen({"t_max_prompt_ms": 500}, COMPLETION)


def test_cache_reuse_comes_from_the_request_else_the_route_default():
    assert gen({"n_cache_reuse": 64}).config.cache_reuse == 64
    assert schemas.generation({}, INFILL, 4096, 16, 0.8, default_cache_reuse=256).config.cache_reuse == 256
    assert gen({}).config.cache_reuse == 0
    with pytest.raises(InvalidRequestError, match="'n_cache_reuse' must be between 0"):
        gen({"n_cache_reuse": -1})


def test_time_limit_and_indent():
    c = gen({"t_max_predict_ms": 250, "n_indent": 4}).config
    assert (c.time_limit, c.min_indent) == (0.25, 4)
    assert gen({"t_max_predict_ms": 0}).config.time_limit is None and gen({"t_max_predict_ms": -1}).config.time_limit is None


def test_response_fields_flatten_under_their_full_path_and_skip_missing_ones():
    result = {"content": "x", "timings": {"prompt_n": 3, "predicted_n": 4}, "stop": True}
    assert schemas.pick_fields(result, ["timings/prompt_n", "content", "nope", "timings/nope/x"]) == {
        "timings/prompt_n": 3, "content": "x"}
    assert schemas.pick_fields(result, []) is result


def test_every_field_has_its_row_in_the_server_page():
    """docs/server.md's field table is FIELDS: a row per field, with what edgespec does with it, word for word."""
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "server.md").read_text()
    rows = {line.split("|")[1].strip(): line for line in page.splitlines() if line.startswith("| `")}
    missing = [name for name in schemas.FIELDS if f"`{name}`" not in rows]
    assert not missing, f"docs/server.md's field table lacks {missing}"
    stale = [name for name, f in schemas.FIELDS.items() if f.what not in rows[f"`{name}`"]]
    assert not stale, f"docs/server.md describes these fields otherwise than server/schemas.py: {stale}"
