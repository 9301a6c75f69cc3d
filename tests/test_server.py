"""The sidecar as a real server on 127.0.0.1, driven by real clients (the openai package, raw HTTP)."""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import openai
import psutil
import pytest

KEY = "test-key-123"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # The log goes to a file: a pipe nobody reads fills up and blocks the server at its next log line.
        self.log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "edgespec.cli", "serve", "-m", str(model), "--port",
                                      str(self.port), "-q", *extra],
                                     stdout=subprocess.DEVNULL, stderr=self.log, text=True)
        self.statuses: list[int] = []
        deadline = time.time() + 300
        while time.time() < deadline:
            assert self.proc.poll() is None, self.stderr()
            try:
                r = httpx.get(self.url + "/health", timeout=2)
                self.statuses.append(r.status_code)
                if r.status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError("server did not become healthy")

    def stderr(self) -> str:
        """What the server has written to stderr so far."""
        self.log.seek(0)
        return self.log.read()

    def health(self) -> dict:
        return httpx.get(self.url + "/health").json()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


@pytest.fixture(scope="module")
def qwen_server(qwen_path):
    s = Server(qwen_path, "--ctx", "2048")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def smol_server(smollm_path):
    s = Server(smollm_path, "--ctx", "512", "--proposer", "none", "--api-key", KEY)
    yield s
    s.stop()


def client(server, key="unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120)


def test_health_is_503_while_loading_then_200(qwen_server):
    assert qwen_server.statuses[-1] == 200
    assert set(qwen_server.statuses) <= {503, 200}
    assert qwen_server.health()["status"] == "ok"


def test_openai_chat_and_completions(qwen_server):
    c = client(qwen_server)
    assert [m.id for m in c.models.list().data] == ["qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"]
    r = c.chat.completions.create(model="x", messages=[{"role": "user", "content": "Say just: hello"}],
                                  temperature=0, max_tokens=10)
    assert "hello" in r.choices[0].message.content.lower() and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert "acceptance_rate" in r.model_extra["speculative"]

    r = c.completions.create(model="x", prompt="def add(a, b):\n", temperature=0, max_tokens=12)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 12
    assert "return" in r.choices[0].text


def test_openai_streaming(qwen_server):
    c = client(qwen_server)
    parts, finish, usage = [], None, None
    for ev in c.chat.completions.create(model="x", messages=[{"role": "user", "content": "Count from 1 to 5."}],
                                        temperature=0, max_tokens=30, stream=True):
        if ev.choices:
            parts.append(ev.choices[0].delta.content or "")
            finish = ev.choices[0].finish_reason or finish
        usage = ev.usage or usage
    text = "".join(parts)
    assert "1" in text and "5" in text and finish in ("stop", "length") and usage.completion_tokens > 0

    texts = [ev.choices[0].text for ev in c.completions.create(model="x", prompt="import os\n", max_tokens=8,
                                                                temperature=0, stream=True)]
    assert "".join(texts).strip()


def test_sse_ends_with_done(qwen_server):
    with httpx.stream("POST", qwen_server.url + "/v1/completions", json={"prompt": "x = ", "max_tokens": 4,
                                                                        "stream": True}, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "length"


LLAMA_VIM_BODY = {
    "input_prefix": "def fibonacci(n: int) -> int:\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "input_suffix": "\n\nprint(fibonacci(10))\n",
    "input_extra": [{"filename": "utils.py", "text": "def square(x):\n    return x * x\n"}],
    "prompt": "    ",
    "n_predict": 48,
    "top_k": 40,
    "top_p": 0.99,
    "stream": False,
    "samplers": ["top_k", "top_p", "infill"],
    "cache_prompt": True,
    "t_max_prompt_ms": 500,
    "t_max_predict_ms": 1000,
    "temperature": 0,
}


def test_llama_vim_infill(qwen_server):
    # Without the time budgets first: the whole context is evaluated and the answer is not cut at a line by the
    # clock, whatever this CPU's speed, so it can be judged by its text.
    whole = LLAMA_VIM_BODY | {"t_max_prompt_ms": -1, "t_max_predict_ms": -1}
    r = httpx.post(qwen_server.url + "/infill", json=whole, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["content"].strip() and ("return" in out["content"] or "fibonacci" in out["content"])
    assert out["timings"]["predicted_n"] == out["tokens_predicted"] > 0 and not out["truncated"]
    # llama.vim's own body, budget included: its prompt comes from the KV cache, the row its evaluation ended on
    # included, so nothing is evaluated and nothing is cut
    again = httpx.post(qwen_server.url + "/infill", json=LLAMA_VIM_BODY, timeout=120).json()
    assert again["content"].strip() and not again["truncated"]
    assert again["tokens_cached"] == again["tokens_evaluated"] == out["tokens_evaluated"]
    assert again["timings"]["prompt_n"] == 0
    # llama.cpp's cache_prompt: false evaluates the whole prompt again
    fresh = httpx.post(qwen_server.url + "/infill", json=LLAMA_VIM_BODY | {"cache_prompt": False}, timeout=120).json()
    assert fresh["tokens_cached"] == 0 and fresh["timings"]["prompt_n"] == fresh["tokens_evaluated"]


def test_native_completion_with_timings(qwen_server):
    r = httpx.post(qwen_server.url + "/completion", json={"prompt": "# add two numbers\ndef", "n_predict": 8,
                                                         "temperature": 0}, timeout=60).json()
    assert r["stop"] is True and r["tokens_predicted"] == 8 and "predicted_per_second" in r["timings"]


@pytest.mark.parametrize("body, message", [
    ({"prompt": "x", "max_tokens": -5}, "'max_tokens' must be between -1 and 2147483647, got -5"),
    ({"prompt": "x", "max_tokens": 2**31}, "'max_tokens' must be between -1 and 2147483647"),
    ({"prompt": "x", "temperature": "hot"}, "'temperature' must be a number"),
    ({"prompt": "x", "top_p": 7}, "'top_p' must be between"),
    ({"prompt": "x", "n": 3}, "'n' 3 is refused unless 1"),
    ({"prompt": "x", "logprobs": 50}, "'logprobs' must be between 0 and 20"),
    ({"prompt": "x", "frequency_penalty": 500}, "'frequency_penalty' must be between -100 and 100"),
    ({"prompt": "x", "grammar": "root ::= foo"}, "grammar does not parse as GBNF"),
    ({"prompt": "x", "stream": True, "grammar": "root ::= foo"}, "grammar does not parse as GBNF"),
    ({"prompt": "x", "json_schema": {"type": "object", "properties": 5}},
     "json_schema is not a valid JSON Schema: 5 is not of type 'object'"),
    ({"prompt": "x", "json_schema": {"not": {"type": "string"}}}, "json_schema cannot be turned into a grammar"),
    ({"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "strng"}}}},
     "json_schema is not a valid JSON Schema"),
    ({"prompt": "x", "colour": "blue"}, "'colour' is not a field /v1/completions takes"),
    ({"prompt": "x", "response_fields": ["content"]}, "'response_fields' is not a field /v1/completions"),
    ({"prompt": "x", "cache_prompt": "yes"}, "'cache_prompt' must be true or false"),
    ({"prompt": 42}, "'prompt' must be a string"),
    ({"prompt": "word " * 3000, "max_tokens": 4}, "'prompt' has 3001 tokens"),
])
def test_bad_fields_are_400_and_the_server_keeps_serving(qwen_server, body, message):
    r = httpx.post(qwen_server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    assert qwen_server.health()["status"] == "ok"


def test_malformed_json_and_oversized_body(qwen_server):
    r = httpx.post(qwen_server.url + "/v1/chat/completions", content=b"{not json", timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
    r = httpx.post(qwen_server.url + "/infill", content=b"x" * (5 << 20), timeout=30)
    assert r.status_code == 413
    assert httpx.post(qwen_server.url + "/completion", json={"prompt": "a", "n_predict": 1}).status_code == 200


def test_foreign_host_header_is_403(qwen_server):
    conn = http.client.HTTPConnection("127.0.0.1", qwen_server.port, timeout=30)
    conn.request("GET", "/v1/models", headers={"Host": "attacker.example:8012"})
    r = conn.getresponse()
    assert r.status == 403 and b"DNS rebinding" in r.read()
    conn.request("GET", "/v1/models", headers={"Host": f"localhost:{qwen_server.port}"})
    assert conn.getresponse().status == 200


def test_no_cors_headers_unless_origins_are_listed(qwen_server):
    r = httpx.options(qwen_server.url + "/v1/chat/completions",
                      headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in r.headers


def test_api_key_is_required_when_set(smol_server):
    with pytest.raises(openai.AuthenticationError):
        client(smol_server, key="wrong").completions.create(model="x", prompt="hi", max_tokens=2)
    r = client(smol_server, key=KEY).completions.create(model="x", prompt="hi", max_tokens=2)
    assert r.usage.completion_tokens >= 1
    assert httpx.get(smol_server.url + "/health").status_code == 200  # health needs no key


def test_disconnect_mid_stream_frees_the_engine(qwen_server):
    before = qwen_server.health()["generations"].get("cancelled", 0)
    with httpx.stream("POST", qwen_server.url + "/v1/completions", timeout=60,
                      json={"prompt": "Write a very long story about a dragon.", "max_tokens": 1500,
                            "stream": True, "temperature": 0}) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 4:
                break  # leaving the block closes the connection mid-stream
    # 1500 tokens would take minutes here: the next request answering inside the timeout shows the engine was freed
    r = httpx.post(qwen_server.url + "/completion", json={"prompt": "1 + 1 =", "n_predict": 2}, timeout=60)
    assert r.status_code == 200
    assert qwen_server.health()["generations"].get("cancelled", 0) == before + 1


def test_bounded_load_every_request_completes_and_memory_stays_flat(smol_server):
    proc = psutil.Process(smol_server.proc.pid)
    c = client(smol_server, key=KEY)

    def burst(n_clients: int, n_requests: int) -> list[str]:
        failures: list[str] = []

        def one_client(i: int) -> None:
            for j in range(n_requests):
                try:
                    r = c.completions.create(model="x", prompt=f"Client {i} request {j}:", max_tokens=4,
                                             temperature=0)
                    if r.usage.completion_tokens < 1:
                        failures.append(f"{i}/{j}: empty")
                except Exception as e:  # every failure is reported, none may happen
                    failures.append(f"{i}/{j}: {e}")

        threads = [threading.Thread(target=one_client, args=(i,)) for i in range(n_clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        return failures

    assert burst(4, 5) == []  # warm up allocators and caches
    rss_before = proc.memory_info().rss
    served_before = sum(smol_server.health()["generations"].values())
    assert burst(8, 20) == []
    assert sum(smol_server.health()["generations"].values()) - served_before == 160
    growth = proc.memory_info().rss - rss_before
    assert growth < 64 * 2**20, f"RSS grew by {growth / 2**20:.1f} MiB over 160 requests"
