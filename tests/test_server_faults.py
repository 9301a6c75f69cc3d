"""Faults a real `edgespec serve` on 127.0.0.1 must survive: odd bytes, oversized bodies, SIGTERM in flight,
half-sent requests, and its model file replaced, deleted or overwritten while it runs."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import socket
import threading
import time

import httpx
import pytest
from test_clients import metrics
from test_server import Server

GRACE = 1.0  # --shutdown-grace of the servers stopped here


@pytest.fixture(scope="module")
def smol(smollm_path):
    s = Server(smollm_path, "--ctx", "512", "--proposer", "none")
    yield s
    s.stop()


def completion(server: Server, body: dict, timeout: float = 60) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", json=body, timeout=timeout)


def test_nul_and_lone_surrogate_in_a_prompt_read_as_the_cli_reads_them(smol):
    # JSON carries a lone surrogate as the escape \ud800; it reads as U+FFFD, as in the CLI (text.to_utf8).
    raw = b'{"prompt": "a\\u0000b\\ud800c", "max_tokens": 2, "temperature": 0}'
    r = httpx.post(smol.url + "/v1/completions", content=raw, headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 200, r.text
    same = completion(smol, {"prompt": "a\x00b\ufffdc", "max_tokens": 2, "temperature": 0})
    assert r.json()["choices"][0]["text"] == same.json()["choices"][0]["text"]
    assert r.json()["usage"] == same.json()["usage"]


@pytest.mark.parametrize("chunked", [False, True])
def test_an_8_mib_body_gets_a_413_the_client_can_read(smol, chunked):
    body = b'{"prompt": "' + b"x" * (8 << 20) + b'"}'
    content = (body[i:i + 65536] for i in range(0, len(body), 65536)) if chunked else body
    r = httpx.post(smol.url + "/completion", content=content, headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 413
    assert "over" in r.json()["error"]["message"] and str(4 << 20) in r.json()["error"]["message"]
    assert smol.health()["status"] == "ok"


@pytest.mark.parametrize("method, path, status", [("GET", "/nope", 404), ("POST", "/v1/embeddings", 404),
                                                  ("GET", "/infill", 405), ("DELETE", "/completion", 405)])
def test_unknown_routes_and_methods_are_json_errors(smol, method, path, status):
    r = httpx.request(method, smol.url + path, timeout=30)
    assert r.status_code == status
    err = r.json()["error"]
    assert err["code"] == status and f"{method} {path}" in err["message"] and "/infill" in err["message"]


def test_a_half_sent_request_does_not_hold_up_the_others(smol):
    with socket.create_connection(("127.0.0.1", smol.port)) as half:
        half.sendall(b"POST /completion HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"prompt\": \"never fini")
        for _ in range(3):  # the half-open client holds its connection for the whole loop
            r = httpx.post(smol.url + "/completion", json={"prompt": "1 + 1 =", "n_predict": 2}, timeout=30)
            assert r.status_code == 200


def long_stream(s: Server, events: list[str]) -> threading.Thread:
    """A stream under way, its lines going to `events`: 1900 tokens outlast the waits of the tests here."""
    def read() -> None:
        body = {"prompt": "Count: 1, 2, 3, 4, 5, 6, 7, 8,", "max_tokens": 1900, "stream": True, "temperature": 0}
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=120) as r:
            events.extend(line for line in r.iter_lines() if line)

    reader = threading.Thread(target=read)
    reader.start()
    time.sleep(1.5)
    return reader


def assert_ended_properly(events: list[str]) -> None:
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2].removeprefix("data: "))
    assert last["choices"][0]["finish_reason"] is not None and "error" not in last
    assert last["usage"]["completion_tokens"] < 1900  # cut, not run to the end


def test_sigterm_ends_streams_properly_refuses_new_requests_and_exits_0(smollm_path):
    s = Server(smollm_path, "--ctx", "2048", "--proposer", "none", "--shutdown-grace", str(GRACE))
    events: list[str] = []
    reader = long_stream(s, events)
    t0 = time.monotonic()
    s.proc.send_signal(signal.SIGTERM)
    while httpx.get(s.url + "/health", timeout=10).status_code == 200:  # until the signal is handled
        time.sleep(0.01)
    # The socket stays open while the stream drains (uvicorn alone closes it within 0.1 s): a new request gets a
    # 503 that says why, not a reset.
    time.sleep(GRACE / 3)
    late = httpx.post(s.url + "/completion", json={"prompt": "hi", "n_predict": 1}, timeout=10)
    assert late.status_code == 503 and "shutting down" in late.json()["error"]["message"]
    rc = s.proc.wait(GRACE + 20)
    reader.join(30)
    assert rc == 0, s.stderr()
    assert time.monotonic() - t0 < GRACE + 15
    assert_ended_properly(events)


def test_a_second_ctrl_c_ends_the_grace_period_now_and_streams_still_end_properly(smollm_path):
    s = Server(smollm_path, "--ctx", "2048", "--proposer", "none", "--shutdown-grace", "600")
    events: list[str] = []
    reader = long_stream(s, events)
    try:
        s.proc.send_signal(signal.SIGINT)
        while httpx.get(s.url + "/health", timeout=10).status_code == 200:
            time.sleep(0.01)
        s.proc.send_signal(signal.SIGINT)
        rc = s.proc.wait(60)  # well inside the 600 s grace
        reader.join(30)
    finally:
        s.proc.kill()  # a no-op once it has exited
    assert rc == 0, s.stderr()
    assert_ended_properly(events)


STOPPED = 4.0  # seconds a server is kept stopped (SIGSTOP) between two requests


def pauses(server: Server) -> tuple[float, float]:
    """edgespec_pause_seconds' count and sum from /metrics."""
    samples = metrics(server)
    return samples[("edgespec_pause_seconds_count", ())], samples[("edgespec_pause_seconds_sum", ())]


@pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="no SIGSTOP on Windows")
def test_a_stopped_spell_is_not_counted_in_the_pause_background_work_is_sized_to(smol):
    # Ctrl-Z then fg, a debugger, a lockstep benchmark's freeze: the stopped seconds ran no background work, and
    # pauses counted with them would size its batches past the end of the next pause (server.service.Pauses).
    body = {"prompt": "hi", "max_tokens": 1}
    assert completion(smol, body).status_code == 200
    before = pauses(smol)
    smol.proc.send_signal(signal.SIGSTOP)
    try:
        time.sleep(STOPPED)
    finally:
        smol.proc.send_signal(signal.SIGCONT)
    assert completion(smol, body).status_code == 200
    count, seconds = (now - then for now, then in zip(pauses(smol), before))
    assert count == 1 and seconds < STOPPED / 2, (count, seconds)


@pytest.mark.parametrize("fault", ["replaced", "deleted", "overwritten in place"])
def test_model_file_changed_under_a_running_server_is_not_a_crash(fault, smollm_path, gemma_path, tmp_path):
    copy = tmp_path / "model.gguf"
    shutil.copy(smollm_path, copy)
    s = Server(copy, "--ctx", "256", "--proposer", "none")
    try:
        body = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}
        before = completion(s, body).json()["choices"][0]["text"]
        if fault == "replaced":
            other = tmp_path / "other.gguf"
            shutil.copy(gemma_path, other)
            other.replace(copy)  # as a re-fetch does: a new file renamed over the old one
        elif fault == "deleted":
            copy.unlink()
        else:
            with open(gemma_path, "rb") as src, open(copy, "wb") as dst:  # `cp other.gguf model.gguf`
                shutil.copyfileobj(src, dst)
        for _ in range(3):
            r = completion(s, body)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == before  # the weights in use are the ones loaded
        assert s.proc.poll() is None and s.health()["status"] == "ok"
    finally:
        s.stop()


@pytest.mark.parametrize("awaited", [False, True])
def test_a_background_job_that_fails_is_logged_once_where_no_handler_awaits_it(awaited, caplog):
    from edgespec.server.http import Settings
    from edgespec.server.service import Service

    svc = Service(Settings(), lambda: None)

    async def fail() -> None:
        job = asyncio.get_running_loop().create_future()
        svc._background(threading.Event(), job, awaited=awaited)
        job.set_exception(RuntimeError("decode failed"))
        await asyncio.sleep(0)  # the done callbacks run
        if awaited:  # its handler reads the error and answers with it
            with pytest.raises(RuntimeError):
                job.result()

    asyncio.run(fail())
    logged = [r for r in caplog.records if "background evaluation failed: decode failed" in r.getMessage()]
    assert len(logged) == (0 if awaited else 1) and not svc.background
