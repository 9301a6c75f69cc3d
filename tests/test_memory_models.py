"""Cross-request memory on real models: greedy output with memory is the target's own (near-tie rule of
test_speculative), one API key's text is never proposed to another's on a real server, and the CLI's switches."""

from __future__ import annotations

import json
import stat

import httpx
import pytest
from click.testing import CliRunner
from test_server import KEY, Server
from test_speculative import CODE, LOAD, check_lossless

from edgespec import Engine, EngineConfig
from edgespec.cli.commands import cli
from edgespec.memory import Memory, files, model_key, namespace_of_key
from edgespec.paths import MEMORY_ENV

# The same openings with other names and types: the memory then holds a continuation that is wrong from some
# point on, so rejections happen inside memory proposals too.
VARIANTS = [
    "def binary_search(values: list[str], wanted: str) -> int:\n",
    "class LFUCache:\n    def __init__(self, capacity: int):\n",
]
CASES = [("code", t) for t in CODE] + [("chat", "Explain what a hash map is in two sentences."),
                                       ("chat", "List three differences between TCP and UDP.")]


def test_greedy_output_with_memory_is_the_targets_own(qwen_draft_path, tmp_path, monkeypatch, capsys):
    """On the 0.5B coder as the target: the memory's bookkeeping does not depend on the model's size."""
    monkeypatch.setenv(MEMORY_ENV, str(tmp_path))
    with Engine(EngineConfig(str(qwen_draft_path), load=LOAD)) as engine:
        stats = []
        generate = engine.generate

        def recording(*args, **kwargs):
            out = generate(*args, **kwargs)
            stats.append(out.stats)
            return out

        monkeypatch.setattr(engine, "generate", recording)
        refs: dict = {}  # the target alone, without memory: the same for both passes
        first = check_lossless(engine, CASES, refs=refs)  # fills the memory
        stats.clear()
        second = check_lossless(engine, CASES + [("code", t) for t in VARIANTS], refs=refs)  # proposes from it
        used = sum(s.cycles_by_proposer.get("memory", 0) for s in stats)
        accepted = sum(s.accepted for s in stats)
        with capsys.disabled():
            print(f"\nwith memory: {first[0]}/{len(CASES)} then {second[0]}/{len(CASES) + len(VARIANTS)} identical to "
                  f"target-only greedy output; {used} memory cycles, {accepted} drafted tokens accepted"
                  + "".join(f"\n  {n}" for n in first[1] + second[1]))
        # How many cycles the memory wins depends on this machine's calibrated curve and on what an earlier
        # rejection taught the policy, not on the bookkeeping: what must hold is that its proposals were verified,
        # and the output stayed the target's.
        assert used > 0
        assert second[0] >= (len(CASES) + len(VARIANTS)) // 3


def completion(server: Server, key: str, **fields) -> dict:
    body = {"prompt": "The three most important rules of writing clear documentation are", "n_predict": 48,
            "temperature": 0, **fields}
    r = httpx.post(server.url + "/completion", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_one_api_keys_text_is_never_proposed_to_another(smollm_path, tmp_path, monkeypatch):
    monkeypatch.setenv(MEMORY_ENV, str(tmp_path))
    other = "second-key-456"
    server = Server(smollm_path, "--ctx", "512", "--api-key", KEY, "--api-key", other)
    try:
        assert httpx.get(server.url + "/props", headers={"Authorization": f"Bearer {KEY}"}).json()[
            "speculative"]["memory"] is True
        first = completion(server, KEY)
        assert "memory" not in first["speculative"]["cycles_by_proposer"]
        # The same prompt under the other key: the first key's answer would match all the way, yet is not proposed.
        assert "memory" not in completion(server, other)["speculative"]["cycles_by_proposer"]
        again = completion(server, KEY)
        assert again["speculative"]["cycles_by_proposer"].get("memory", 0) > 0  # the first key's own memory
        assert "memory" not in completion(server, KEY, memory=False)["speculative"]["cycles_by_proposer"]
    finally:
        server.stop()
    folder = tmp_path / model_key(smollm_path)
    names = sorted(p.name for p in folder.iterdir())
    assert names == sorted(f"{namespace_of_key(k)}.mem" for k in (KEY, other))  # the keys themselves are not stored
    for p in folder.iterdir():
        assert stat.S_IMODE(p.stat().st_mode) == 0o600
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert Memory(folder / f"{namespace_of_key(other)}.mem", lambda: "unused").n_entries in (0, 1)


def test_no_memory_writes_nothing_and_memory_show_and_clear(smollm_path, tmp_path, monkeypatch):
    monkeypatch.setenv(MEMORY_ENV, str(tmp_path))
    args = ["generate", "-m", str(smollm_path), "-p", "Write a haiku about the sea.", "-n", "24", "-q"]
    assert CliRunner().invoke(cli, [*args, "--no-memory"]).exit_code == 0
    assert files(tmp_path) == []
    assert CliRunner().invoke(cli, args).exit_code == 0
    [f] = files(tmp_path)
    assert f.namespace == "local" and f.entries == 1 and f.model == model_key(smollm_path)
    shown = CliRunner().invoke(cli, ["memory", "show", "--json"])
    assert json.loads(shown.output)["files"][0]["entries"] == 1
    assert "removed 1 memory file" in CliRunner().invoke(cli, ["memory", "clear"]).output
    assert files(tmp_path) == []


@pytest.mark.parametrize("host, expected", [("127.0.0.1", True), ("0.0.0.0", False)])
def test_serve_keeps_a_memory_only_on_a_loopback_bind(host, expected, monkeypatch):
    """The engine config `serve` builds, without starting it: memory follows the bind unless a flag says so."""
    from edgespec.cli import commands as cli_module

    seen = {}

    def fake_create_app(settings, load):
        raise SystemExit(0)

    monkeypatch.setattr("edgespec.server.create_app", fake_create_app)
    real = cli_module.engine_config
    monkeypatch.setattr(cli_module, "engine_config", lambda o, **kw: seen.setdefault("c", real(o, **kw)))
    CliRunner().invoke(cli, ["serve", "--host", host, "--api-key", "k", "-q"])
    assert seen["c"].memory is expected
    seen.clear()
    CliRunner().invoke(cli, ["serve", "--host", host, "--api-key", "k", "-q", "--memory"])
    assert seen["c"].memory is True
