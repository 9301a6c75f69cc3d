"""The chat CLI in a real terminal, piped chat, `complete`, and errors that leave a session usable."""

import re
import subprocess
import sys

import pexpect
from click.testing import CliRunner

from edgespec import backend
from edgespec.cli.commands import cli

STATS = re.compile(r"\[(\d+) prompt tokens(?: \((\d+) reused\))? in [0-9.]+s, (\d+) generated at [0-9.]+ tok/s"
                   r"[^\]]*, (stop|length|cancelled)\]")


def test_terminal_session_reuses_caches_survives_ctrl_c_and_exits(qwen_path, qwen_draft_path):
    child = pexpect.spawn(sys.executable, ["-m", "edgespec.cli", "chat", "-m", str(qwen_path), "--draft",
                                           str(qwen_draft_path), "--ctx", "2048", "-n", "48"],
                          encoding="utf-8", timeout=180, dimensions=(40, 200))
    try:
        child.expect(">>> ")
        child.sendline("Write a haiku about the sea.")
        child.expect(STATS)
        first_prompt = int(child.match.group(1))
        child.expect(">>> ")

        child.sendline("Now one about mountains.")
        child.expect(STATS)
        prompt, reused = int(child.match.group(1)), int(child.match.group(2) or 0)
        # The second turn evaluates only what is new: its message, the template around it, and the
        # tail of the previous answer; everything before comes from the KV cache.
        assert prompt > first_prompt and reused >= first_prompt
        assert prompt - reused < 30, (prompt, reused)
        child.expect(">>> ")

        question = "Write a very long essay on the history of computing, with many sections."
        child.sendline(question)
        child.expect(re.escape(question) + r"[^\n]*\n")  # the line as the editor shows it, through its last redraw
        child.expect(r"\w+ \w+ \w+ \w+")  # the answer is streaming
        child.sendintr()
        child.expect(STATS)
        assert child.match.group(4) == "cancelled"
        child.expect(">>> ")

        child.sendline("What is 2 + 2? Answer with the number only.")
        child.expect(STATS)
        assert child.match.group(4) == "stop" and "4" in child.before
        child.expect(">>> ")

        child.sendline("/stats")
        child.expect(STATS)
        child.expect(">>> ")
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0


def test_piped_chat_answers_once(smollm_path):
    p = subprocess.run([sys.executable, "-m", "edgespec.cli", "chat", "-m", str(smollm_path), "--proposer", "none",
                        "-n", "16", "--ctx", "512"], input="Say hello.\n", capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() and STATS.search(p.stderr)


def test_chat_keeps_an_explicit_max_tokens_and_defaults_to_the_context(smollm_path, monkeypatch):
    from edgespec.engine.session import ChatSession

    seen = []
    init = ChatSession.__init__

    def spy(self, engine, config, **kw):
        seen.append((config.max_tokens, engine.n_ctx))
        init(self, engine, config, **kw)

    monkeypatch.setattr(ChatSession, "__init__", spy)
    for extra in (["-n", "256"], []):  # 256 is generate's default, and was once taken for "not given"
        r = CliRunner().invoke(cli, ["chat", "-m", str(smollm_path), "--proposer", "none", "--ctx", "512", "--once",
                                     "-q", *extra], input="Hi\n")
        assert r.exit_code == 0, r.output
    assert seen == [(256, 512), (None, 512)]  # None: until the context ends


def test_complete_reads_stdin(smollm_path):
    r = CliRunner().invoke(cli, ["complete", "-m", str(smollm_path), "--proposer", "none", "-n", "8", "-q",
                                 "--ctx", "512"], input="The capital of France is")
    assert r.exit_code == 0, r.output
    assert "Paris" in r.stdout


def test_wrong_model_path_in_chat_is_one_line():
    r = CliRunner().invoke(cli, ["chat", "-m", "/no/such/model.gguf", "-q"], input="hi\n")
    assert r.exit_code == 1 and r.stderr.count("\n") == 1 and "does not exist" in r.stderr


def test_incompatible_draft_in_chat_is_one_line(qwen_path, smollm_path):
    r = CliRunner().invoke(cli, ["chat", "-m", str(qwen_path), "--draft", str(smollm_path), "-q"], input="hi\n")
    assert r.exit_code == 1 and r.stderr.count("\n") == 1 and smollm_path.name in r.stderr


def test_broken_template_keeps_the_session_usable(smollm_path, monkeypatch):
    real = backend.Model._read_facts

    def broken(self):
        from dataclasses import replace

        return replace(real(self), chat_template="{% for m in messages %}{{ m.content | nosuchfilter }}{% endfor %}")

    monkeypatch.setattr(backend.Model, "_read_facts", broken)
    r = CliRunner().invoke(cli, ["chat", "-m", str(smollm_path), "--proposer", "none", "-q", "--ctx", "512",
                                 "--interactive"], input="hello\n/stats\nhello again\n/exit\n")
    assert r.exit_code == 0, r.output
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 2 and "chat template" in errors[0] and "failed to render" in errors[0]
    assert "no answer yet" in r.stdout


def test_full_context_drops_the_oldest_turns(smollm_path):
    from edgespec import Engine, GenerationConfig, LoadConfig
    from edgespec.engine.session import ChatSession

    with Engine(smollm_path, proposer="none", load=LoadConfig(n_ctx=512)) as e:
        session = ChatSession(e, GenerationConfig(max_tokens=8), system="Be brief.")
        filler = "Remember this list: " + ", ".join(f"item {i}" for i in range(60)) + "."
        for _ in range(4):
            list(session.send(filler))
        assert any("dropped the" in n for n in session.notices)
        assert session.messages()[0] == {"role": "system", "content": "Be brief."}
        assert len(e.chat_tokens(session.messages())) + 8 <= 512
