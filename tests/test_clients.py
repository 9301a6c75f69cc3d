"""Editors and apps as they really call: request bodies copied from each client's source (tests/clients/*.json)
replayed against a real `edgespec serve` on 127.0.0.1, each answer checked for what that client reads."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_server import Server

CLIENTS = Path(__file__).parent / "clients"
CTX = 1024


def requests_of(client: str) -> dict[str, dict]:
    return {r["name"]: r for r in json.loads((CLIENTS / f"{client}.json").read_text())["requests"]}


@pytest.fixture(scope="module")
def server(qwen_draft_path):
    # A ping interval shorter than a prefill, so that every client here also reads streams with keep-alives; the
    # 0.5B coder has the FIM tokens and the chat template the clients need. A small context, since Continue asks
    # for 4096 tokens and the coder does not stop before the room runs out.
    s = Server(qwen_draft_path, "--ctx", str(CTX), "--slots", "2", "--sse-ping-interval", "0.05")
    yield s
    s.stop()


def post(server, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=300, **kw)


def sse(server, path: str, body: dict) -> tuple[list[dict], list[str]]:
    """The data events (parsed) and the raw lines of one streamed answer."""
    raw = []
    with httpx.stream("POST", server.url + path, json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        raw = list(r.iter_lines())
    events = [json.loads(line[6:]) for line in raw if line.startswith("data: ") and line != "data: [DONE]"]
    return events, raw


def test_llama_vim_warm_up_then_completion_reads_its_flat_fields(server):
    reqs = requests_of("llama_vim")
    warm = post(server, "/infill", reqs["ring_update_warmup"]["body"])
    assert warm.status_code == 200 and warm.json() == {}  # response_fields [""] selects nothing, as in llama.cpp
    fim = reqs["fim"]["body"]
    r = post(server, "/infill", fim)
    assert r.status_code == 200, r.text
    assert re.search(r'"content"\s*:"', r.text)  # llama.vim's own check of the raw body: compact JSON
    out = r.json()
    assert set(out) == set(fim["response_fields"]) - {"timings/prompt_per_token_ms"} | {"timings/prompt_per_token_ms"}
    assert out["timings/prompt_n"] >= 1 and out["tokens_cached"] > 0  # the warm-up's extra context was reused
    assert out["timings/predicted_n"] <= fim["n_predict"]
    for line in out["content"].split("\n")[1:]:  # n_indent 4: no later line starts with less indentation
        assert not line.strip() or len(line) - len(line.lstrip(" \t")) >= fim["n_indent"], out["content"]
    assert post(server, "/v1/chat/completions", reqs["inst_warmup"]["body"]).status_code == 200
    events, raw = sse(server, "/v1/chat/completions", {**reqs["inst_stream"]["body"], "max_tokens": 24})
    assert all(line.startswith(("data: ", ":")) or not line for line in raw)
    assert "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])


def test_the_issues_infill_stops_at_the_dedent_and_the_time_cap(server):
    body = {"input_prefix": "def add(a, b):\n", "input_suffix": "\n", "prompt": "    ", "n_predict": 128,
            "n_indent": 4, "t_max_predict_ms": 250, "temperature": 0}
    out = post(server, "/infill", body).json()
    assert "def " not in out["content"] and out["tokens_predicted"] < 128, out["content"]
    # t_max_predict_ms alone: the first newline after 1 ms ends a 128-token answer of many lines
    body = {"prompt": "# the numbers 1 to 100, one per line\n1\n2\n3\n", "n_predict": 128, "t_max_predict_ms": 1,
            "temperature": 0}
    out = post(server, "/completion", body).json()
    assert out["stop_type"] == "limit" and out["content"].endswith("\n") and out["tokens_predicted"] < 128, out
    # a line that never ends: half a second past the limit any token ends it (llama.cpp would decode all 512)
    body = {"prompt": "a " * 64, "n_predict": 512, "t_max_predict_ms": 1, "temperature": 0}
    out = post(server, "/completion", body).json()
    assert out["stop_type"] == "limit" and "\n" not in out["content"] and out["tokens_predicted"] < 512, out


def test_llama_vscode_models_props_tokenize_template_and_three_completions(server):
    reqs = requests_of("llama_vscode")
    models = httpx.get(server.url + "/v1/models").json()["data"]
    assert models[0]["owned_by"] == "llamacpp" and models[0]["meta"]["n_ctx"] == CTX  # so it asks /props
    assert httpx.get(server.url + "/props").json()["default_generation_settings"]["n_ctx"] == CTX
    tok = post(server, "/tokenize", reqs["tokenize"]["body"]).json()["tokens"]
    assert tok and all(isinstance(t, int) for t in tok)
    template = post(server, "/apply-template", reqs["apply_template"]["body"])
    assert template.status_code == 200 and "<|im_start|>" in template.json()["prompt"]
    assert post(server, "/infill", reqs["fim_prepare_extra_context"]["body"]).status_code == 200
    fim = reqs["fim"]["body"]
    out = post(server, "/infill", fim).json()
    assert isinstance(out, list) and len(out) == fim["n_cmpl"] and all("content" in o for o in out)
    assert out[0]["generation_settings"]["n_ctx"] == CTX and out[1]["tokens_cached"] > 0


def test_n_cmpl_completions_past_the_due_time_are_empty_not_late():
    # llama.vscode's 3 completions share one due time; one with no room for a token is skipped (the client drops
    # empty alternatives) instead of decoding one token past it, as each did before.
    import dataclasses

    from edgespec.config import ANSWER_SLACK, GenerationConfig
    from edgespec.engine import Chunk, Stats
    from edgespec.server.routes.llama import _later, _room_for_another, _skipped
    from edgespec.server.schemas import Request

    last = Chunk("x", [1, 2, 3], finish_reason="length", slot=0,
                 stats=Stats(prompt_tokens=50, completion_tokens=3, prefill_seconds=1.0, decode_seconds=0.2))
    now = time.perf_counter()
    assert _room_for_another(last, None) and _room_for_another(last, now + 5.0)
    assert not _room_for_another(last, now + 0.05)  # a token took 0.1 s
    assert _room_for_another(last, now + 0.3, need=0.2) and not _room_for_another(last, now + 0.3, need=0.4)
    one = Chunk("x", [1], finish_reason="length", slot=0, stats=Stats(completion_tokens=1, prefill_seconds=1.0))
    assert not _room_for_another(one, now + 0.5)  # one token: its whole time is the price
    skipped = _skipped(last, 50)
    assert (skipped.text, skipped.tokens, skipped.finish_reason, skipped.slot) == ("", [], "length", 0)
    assert skipped.stats.cached_prompt_tokens == 50 and skipped.stats.completion_tokens == 0
    req = Request(GenerationConfig(deadline=now + 2.0), (), False)
    later, need = _later(req, last)
    assert later.config.deadline == pytest.approx(now + 2.0 - ANSWER_SLACK) and need == 0.2  # the slack: the first's
    # with t_max_predict_ms, the first's window: its prediction (0.2 s) began 0.2 s ago, so 0.3 s of 0.5 are left
    windowed = dataclasses.replace(req, config=GenerationConfig(deadline=now + 2.0, time_limit=0.5))
    assert _later(windowed, last)[0].config.deadline == pytest.approx(now + 0.3, abs=0.05)
    assert _later(dataclasses.replace(req, config=GenerationConfig()), last)[0].config.deadline is None


def test_n_cmpl_alternatives_share_the_first_completions_prediction_window(server):
    # llama-server generates n_cmpl's completions in parallel slots, each within t_max_predict_ms of one start, so
    # they cost the client no wait of their own; one after another, the alternatives get what the first left of
    # that window, and none when it left no room for a token (no due time here: the window alone bounds them).
    fim = {k: v for k, v in requests_of("llama_vscode")["fim"]["body"].items() if k != "t_max_prompt_ms"}
    out = post(server, "/infill", {**fim, "t_max_predict_ms": 1}).json()
    assert len(out) == 3 and [(o["content"], o["stop_type"]) for o in out[1:]] == [("", "limit")] * 2, out


def test_n_cmpl_alternatives_start_from_the_row_the_prompts_evaluation_ended_on(server):
    # As llama-server's parallel completions share one evaluation of the prompt, the alternatives evaluate nothing:
    # not even the prompt's last token again (no time limits here, so none is skipped for want of time).
    fim = {k: v for k, v in requests_of("llama_vscode")["fim"]["body"].items() if not k.startswith("t_max")}
    out = post(server, "/infill", {**fim, "n_predict": 8}).json()
    assert len(out) == 3 and all(o["stop_type"] != "limit" or o["tokens_predicted"] == 8 for o in out), out
    assert [(o["timings"]["prompt_n"], o["tokens_cached"]) for o in out[1:]] == [(0, out[0]["tokens_evaluated"])] * 2


def test_continue_autocomplete_and_chat_with_max_tokens_4096(server):
    reqs = requests_of("continue")
    # Continue asks for 4096 tokens and aborts the fetch once its filters have a line (CompletionStreamer): the
    # stream is read as far as that, and the abort must end the generation (counted as cancelled).
    before = server.health()["generations"].get("cancelled", 0)
    text, events = "", []
    with httpx.stream("POST", server.url + "/completion", json=reqs["autocomplete_llamacpp"]["body"], timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
                text += events[-1]["content"]
                if "\n" in text.lstrip("\n") or events[-1]["stop"]:
                    break
    assert all(isinstance(e["content"], str) for e in events) and text.strip()
    assert all(e["stop"] is False for e in events[:-1])
    if not events[-1]["stop"]:
        deadline = time.monotonic() + 60
        while server.health()["generations"].get("cancelled", 0) == before and time.monotonic() < deadline:
            time.sleep(0.1)
        assert server.health()["generations"].get("cancelled", 0) == before + 1
    else:
        assert events[-1]["stop_type"] in ("eos", "word", "limit")
    body = reqs["chat_openai_provider"]["body"]
    assert body["max_tokens"] == 4096  # Continue's default, more than the context has room for
    # The question with a file attached, as Continue sends an @-mentioned file: most of the context is prompt, so
    # the answer reaches the end of the room in a few hundred tokens rather than a thousand.
    system, question = body["messages"]
    code = (Path(json.__file__).parent / "decoder.py").read_text()[:2400]
    messages = [system, {**question, "content": f"```python\n{code}\n```\n\n{question['content']}"}]
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    stream = c.chat.completions.create(model=body["model"], messages=messages, max_tokens=4096, stream=True,
                                       stream_options={"include_usage": True}, temperature=0)
    chunks = list(stream)
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens > 0 and usage.total_tokens <= CTX
    assert usage.prompt_tokens > CTX // 2
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")


def test_openai_refuses_what_it_does_not_honour_by_name(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    for extra, name in [({"n": 2}, "n"), ({"top_logprobs": 2}, "top_logprobs"),
                        ({"functions": [{"name": "f", "parameters": {"type": "object"}}]}, "functions"),
                        ({"response_format": {"type": "xml"}}, "response_format")]:
        with pytest.raises(openai.BadRequestError, match=f"'{name}'"):
            c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4, **extra)


def test_an_infill_is_answered_while_a_chat_streams_and_the_chat_keeps_its_cache(server):
    messages = [{"role": "user", "content": "Write a long explanation of Python decorators."}]
    done: dict[str, float] = {}
    first = threading.Event()
    usage: dict = {}

    def chat() -> None:  # all 160 tokens: a greedy answer may end after a few, before the infill is sent
        no_end = {str(t): -100 for t in (151643, 151645)}  # Qwen2.5's <|endoftext|> and <|im_end|>
        body = {"messages": messages, "max_tokens": 160, "temperature": 0, "stream": True, "logit_bias": no_end}
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    first.set()
                    e = json.loads(line[6:])
                    if e.get("usage"):
                        usage.update(e["usage"])
        done["chat"] = time.monotonic()

    t = threading.Thread(target=chat)
    t.start()
    assert first.wait(120)
    r = post(server, "/infill", {"input_prefix": "def square(x):\n    ", "input_suffix": "\n", "n_predict": 6,
                                 "temperature": 0})
    done["infill"] = time.monotonic()
    t.join()
    assert r.status_code == 200 and done["infill"] < done["chat"]  # served between the chat's cycles
    follow = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 1, "temperature": 0}).json()
    # the chat's slot still holds its prompt, with the row its evaluation ended on: all of it is reused
    assert follow["speculative"]["cached_prompt_tokens"] == follow["usage"]["prompt_tokens"]


def metrics(server) -> dict[tuple[str, tuple], float]:
    text = httpx.get(server.url + "/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_metrics_move_by_what_one_request_did(server):
    before = metrics(server)
    out = post(server, "/completion", {"prompt": "def fib(n):", "n_predict": 20, "temperature": 0}).json()
    after = metrics(server)

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("edgespec_requests_total", route="/completion", status="200") == 1
    assert delta("edgespec_generations_total", finish_reason="length" if out["stop_type"] == "limit" else "stop") == 1
    assert delta("edgespec_completion_tokens_total") == out["tokens_predicted"]
    assert delta("edgespec_prompt_tokens_total") == out["tokens_evaluated"]
    assert delta("edgespec_prompt_tokens_reused_total") == out["tokens_cached"]
    assert delta("edgespec_draft_tokens_total") == out["timings"]["draft_n"]
    assert delta("edgespec_draft_tokens_accepted_total") == out["timings"]["draft_n_accepted"]
    cycles = sum(after[k] - before.get(k, 0.0) for k in after if k[0] == "edgespec_cycles_total")
    assert cycles == out["speculative"]["cycles"]
    assert after[("edgespec_slots_busy", ())] == 0 and after[("edgespec_requests_waiting", ())] == 0


def test_a_long_prefill_streams_keep_alive_comments(server):
    events, raw = sse(server, "/completion", {"prompt": "word " * 600, "n_predict": 2, "stream": True})
    assert ": ping" in raw and events[-1]["stop"] is True
