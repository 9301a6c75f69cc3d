"""The target spread over llama.cpp RPC workers on loopback (`edgespec worker` processes started here), the proposer
kept local: the same greedy output as on this machine alone, the workers in the plan, and a worker lost mid-request
ending that request with an error that names it, while the server goes on."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from click.testing import CliRunner
from test_server import Server, free_port

from edgespec import Engine, EngineConfig, GenerationConfig, LoadConfig
from edgespec.backend import supports_rpc
from edgespec.cli.commands import cli
from edgespec.errors import WorkerError
from edgespec.remote import probe

pytestmark = pytest.mark.skipif(not supports_rpc(), reason="llama-cpp-python was built without RPC: install it "
                                                           "with CMAKE_ARGS=\"-DGGML_RPC=on\" (the README's test "
                                                           "command does)")
PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"


class Worker:
    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "edgespec.cli", "worker", "--port", str(self.port),
                                      "--threads", "1", "--device", "CPU"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 60
        while True:
            assert self.proc.poll() is None, self.proc.stderr.read()
            try:
                probe.probe(self.endpoint, timeout=1)
                return
            except WorkerError:
                assert time.time() < deadline, "worker did not start"
                time.sleep(0.2)

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


@pytest.fixture
def workers():
    ws = [Worker(), Worker()]
    yield ws
    for w in ws:
        if w.proc.poll() is None:
            w.kill()


def test_greedy_output_over_two_workers_is_the_local_output(smollm_path, workers):
    """SmolLM2's 31 layer units: 5 here, 13 on one worker, 13 (with the output layer) on the other. Neither side
    repacks weights, so the same kernels run and the tokens must be the same."""
    load = LoadConfig(n_ctx=512, n_threads=1, repack=False)
    config = GenerationConfig(max_tokens=24, memory=None)
    with Engine(EngineConfig(str(smollm_path), proposer="none", load=load, memory=False)) as local:
        expected = local.generate(PROMPT, config).tokens
    remote_config = EngineConfig(str(smollm_path), proposer="ngram", k=4, load=load, memory=False,
                                 rpc=tuple(w.endpoint for w in workers), rpc_layers=(13, 13))
    with Engine(remote_config) as remote:
        assert remote.remote is not None and remote.remote.worker_units == (13, 13)
        assert remote.generate(PROMPT, config).tokens == expected
        assert remote.generate(PROMPT + "# again\n", config).finish_reason in ("length", "stop")


def test_plan_lists_the_workers_and_their_memory(smollm_path, workers):
    endpoints = ",".join(w.endpoint for w in workers)
    r = CliRunner().invoke(cli, ["plan", "-m", str(smollm_path), "--rpc", endpoints, "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert [w["endpoint"] for w in data["rpc_workers"]] == [w.endpoint for w in workers]
    assert all(w["free_bytes"] > 0 and w["rtt_ms"] >= 0 for w in data["rpc_workers"])
    assert {lay["layout"] for lay in data["rpc_layouts"]} >= {"all on this machine", "split by free memory"}


def test_an_unreachable_worker_is_one_clear_error(smollm_path):
    port = free_port()
    r = CliRunner().invoke(cli, ["generate", "-m", str(smollm_path), "-p", "hi", "-q", "--rpc", f"127.0.0.1:{port}",
                                 "--rpc-layers", "10"])
    assert r.exit_code == 1 and f"RPC worker 127.0.0.1:{port} cannot be reached" in r.output


def test_a_worker_lost_mid_request_ends_it_with_an_error_and_the_server_keeps_serving(smollm_path, workers):
    endpoints = ",".join(w.endpoint for w in workers)
    server = Server(smollm_path, "--ctx", "512", "--proposer", "none", "--rpc", endpoints, "--rpc-layers", "13,13")
    try:
        body = {"prompt": PROMPT, "n_predict": 400, "temperature": 0, "stream": True}
        events = []
        with httpx.stream("POST", server.url + "/completion", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                    if len(events) == 3:
                        workers[1].kill()
        assert "error" in events[-1], events[-1]
        assert workers[1].endpoint in events[-1]["error"]["message"]
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        # while the worker is down a request gets the same clear error; once it is back, the target loads again
        r = httpx.post(server.url + "/completion", json={**body, "stream": False, "n_predict": 4}, timeout=120)
        assert r.status_code == 503 and workers[1].endpoint in r.json()["error"]["message"]
        workers[1] = Worker(workers[1].port)
        r = httpx.post(server.url + "/completion", json={**body, "stream": False, "n_predict": 4}, timeout=120)
        assert r.status_code == 200 and r.json()["tokens_predicted"] == 4
    finally:
        server.stop()
