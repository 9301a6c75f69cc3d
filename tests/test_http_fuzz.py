"""Every POST route's body, fuzzed against a real server: never a 500, never a traceback, and every
error is JSON that names a field of the body (or says the body is not a JSON object).

Bounded and reproducible: `derandomize=True` and EXAMPLES bodies per route, on Qwen2.5-Coder-0.5B (it has
the FIM tokens /infill needs) with a 128-token context, so that a valid body generates little.
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_server import Server

EXAMPLES = 100

SAMPLING = ["temperature", "top_k", "top_p", "min_p", "seed", "stop", "stream", "cache_prompt", "model", "samplers",
            "n_indent", "t_max_predict_ms", "id_slot", "speculative", "speculative.n_max", "logprobs", "tools",
            "frequency_penalty"]
OPENAI = ["n", "stream_options", "response_format", "user"]
LLAMA = ["n_predict", "response_fields", "return_tokens", "n_probs", "grammar"]
FIELDS = {
    "/v1/completions": ["prompt", "max_tokens", "max_completion_tokens", *SAMPLING, *OPENAI],
    "/v1/chat/completions": ["messages", "max_tokens", "max_completion_tokens", *SAMPLING, *OPENAI],
    "/completion": ["prompt", *SAMPLING, *LLAMA],
    "/infill": ["input_prefix", "input_suffix", "input_extra", "prompt", *SAMPLING, *LLAMA],
}

# Text with what breaks naive servers: NUL, a lone surrogate, control and non-BMP characters.
texts = st.one_of(st.text(max_size=40), st.sampled_from(["", "\x00", "a\ud800b", "\udcff", "def f(x):\n", "🦙" * 3]))
numbers = st.one_of(st.integers(-3, 12), st.integers(), st.floats(allow_nan=True, allow_infinity=True))
scalars = st.one_of(st.none(), st.booleans(), numbers, texts)
json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                            st.dictionaries(texts, inner, max_size=3)), max_leaves=6)
messages = st.lists(st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "developer", "tool", ""]),
                           "content": st.one_of(texts, json_values)}),
    json_values), max_size=3)
extra = st.lists(st.one_of(st.fixed_dictionaries({"filename": st.one_of(texts, json_values), "text": texts}),
                           json_values), max_size=3)
SPECIAL = {"messages": st.one_of(messages, json_values), "input_extra": st.one_of(extra, json_values),
           "prompt": st.one_of(texts, st.lists(st.integers(-2, 200_000), max_size=4), json_values)}


short = st.integers(1, 6)
prompts = st.one_of(st.text(min_size=1, max_size=40), st.sampled_from(["\x00", "a\ud800b", "\udcff", "def f(x):\n"]))
VALID = {  # a body each route answers, which the fuzzer then changes in up to three fields
    "/v1/completions": st.fixed_dictionaries({"prompt": prompts, "max_tokens": short}),
    "/v1/chat/completions": st.fixed_dictionaries({"messages": st.lists(st.fixed_dictionaries(
        {"role": st.just("user"), "content": texts}), min_size=1, max_size=2), "max_tokens": short}),
    "/completion": st.fixed_dictionaries({"prompt": prompts, "n_predict": short}),
    "/infill": st.fixed_dictionaries({"input_prefix": texts, "input_suffix": texts, "n_predict": short}),
}


def bodies(route: str) -> st.SearchStrategy:
    fields = st.dictionaries(st.sampled_from(FIELDS[route]), json_values, max_size=3).flatmap(
        lambda d: st.fixed_dictionaries({k: SPECIAL.get(k, st.one_of(json_values, numbers)) for k in d}))
    changed = st.tuples(VALID[route], fields, st.dictionaries(texts, json_values, max_size=1)).map(
        lambda t: {**t[0], **t[2], **t[1]})
    anything = st.tuples(fields, st.dictionaries(texts, json_values, max_size=2)).map(lambda t: {**t[1], **t[0]})
    return st.one_of(changed.map(lambda d: json.dumps(d).encode()),
                     changed.map(lambda d: json.dumps(d).encode()),  # listed twice: most bodies are near-valid
                     anything.map(lambda d: json.dumps(d).encode()),
                     json_values.map(lambda v: json.dumps(v).encode()),  # not an object
                     st.binary(max_size=30))  # not JSON, or not UTF-8


@pytest.fixture(scope="module")
def server(qwen_draft_path):
    s = Server(qwen_draft_path, "--ctx", "128")
    yield s
    s.stop()


def check(server: Server, route: str, raw: bytes) -> None:
    r = httpx.post(server.url + route, content=raw, headers={"content-type": "application/json"}, timeout=120)
    assert r.status_code != 500 and "Traceback" not in r.text, (raw, r.text)
    if r.status_code == 200:
        if r.headers["content-type"].startswith("text/event-stream"):
            events = [line.removeprefix("data: ") for line in r.text.splitlines() if line.startswith("data: ")]
            assert all(e == "[DONE]" or "error" not in json.loads(e) for e in events), (raw, r.text)
        else:
            json.loads(r.text)
        return
    assert r.status_code in (400, 413), (raw, r.status_code, r.text)
    message = r.json()["error"]["message"]
    try:
        body = json.loads(raw)
    except ValueError:
        assert message.startswith("malformed JSON body"), (raw, message)
        return
    if not isinstance(body, dict):
        assert message == "the JSON body must be an object", (raw, message)
        return
    # a field the body sent, or one of the route's that it left out (e.g. "'prompt' is required")
    assert any(f"'{k}'" in message or repr(k) in message or f"{k}[" in message for k in [*body, *FIELDS[route]]), (
        raw, message)


def fuzz(route: str):
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(raw=bodies(route))
    def run(server, raw: bytes) -> None:
        check(server, route, raw)

    return run


test_fuzz_completions = fuzz("/v1/completions")
test_fuzz_chat_completions = fuzz("/v1/chat/completions")
test_fuzz_completion = fuzz("/completion")
test_fuzz_infill = fuzz("/infill")


def test_the_server_is_still_healthy_after_the_fuzzing(server):
    assert server.health()["status"] == "ok"
    assert "unexpected error" not in server.stderr(), server.stderr()[-3000:]
    r = httpx.post(server.url + "/infill", json={"input_prefix": "def add(a, b):\n    return ", "input_suffix": "\n",
                                                 "n_predict": 4, "temperature": 0}, timeout=60)
    assert r.status_code == 200 and r.json()["content"]
