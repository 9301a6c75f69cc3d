"""`edgespec chat` in a pseudo-terminal, on SmolLM2: history (recalled, kept between sessions), multi-line messages,
drafted text in colour, and transcripts saved and loaded back into the cache."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pexpect

from edgespec.paths import history_path

STATS = re.compile(r"\[(\d+) prompt tokens(?: \((\d+) reused\))? in [0-9.]+s, (\d+) generated at [0-9.]+ tok/s"
                   r"[^\]]*, (stop|length|cancelled)\]")
UP = "\x1b[A"
ALT_ENTER = "\x1b\r"
DRAFT_ON, RESET = "\x1b[36m", "\x1b[0m"
QUESTION = "What is the capital of France?"
REPEAT = "Repeat exactly: the cat sat on the mat. the cat sat on the mat. the cat sat on the mat."


def chat_args(model: Path, *extra: str) -> list[str]:
    return ["-m", "edgespec.cli", "chat", "-m", str(model), "--ctx", "1024", "-n", "24", *extra]


def spawn(model: Path, *extra: str) -> pexpect.spawn:
    child = pexpect.spawn(sys.executable, chat_args(model, *extra), encoding="utf-8", timeout=120,
                          dimensions=(40, 200))
    child.expect(">>> ")
    return child


def ask(child: pexpect.spawn, keys: str) -> re.Match:
    """Type `keys` (Enter included), wait for the answer's stats line and the next prompt."""
    child.send(keys)
    child.expect(STATS)
    match, child.answer = child.match, child.before  # what the terminal got up to the stats line
    child.expect(">>> ")
    return match


def save(child: pexpect.spawn, path: Path) -> list[dict]:
    child.send(f"/save {path}\r")
    child.expect(r"saved \d+ messages")  # the command ran (the prompt is redrawn before it does)
    child.expect(">>> ")
    return json.loads(path.read_text(encoding="utf-8"))


def leave(child: pexpect.spawn) -> None:
    child.sendeof()  # Ctrl-D
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def users(messages: list[dict]) -> list[str]:
    return [m["content"] for m in messages if m["role"] == "user"]


def test_up_arrow_recalls_the_last_question_also_after_a_restart(smollm_path, tmp_path):
    child = spawn(smollm_path, "--proposer", "none")
    try:
        ask(child, QUESTION + "\r")
        ask(child, UP + "\r")  # recalled and answered again
        assert users(save(child, tmp_path / "one.json")) == [QUESTION, QUESTION]
        leave(child)
    finally:
        child.close(force=True)
    assert QUESTION in history_path().read_text(encoding="utf-8")  # in the test's own folder, not the user's

    child = spawn(smollm_path, "--proposer", "none")  # a new process: only the history file remembers
    try:
        ask(child, UP + UP + "\r")  # the newest entry is the /save command, the one before it the question
        messages = save(child, tmp_path / "two.json")
        assert users(messages) == [QUESTION] and messages[1]["role"] == "assistant" and messages[1]["content"]
        leave(child)
    finally:
        child.close(force=True)


def test_multi_line_messages_arrive_whole(smollm_path, tmp_path):
    child = spawn(smollm_path, "--proposer", "none")
    try:
        ask(child, '"""\rFirst line of the question.\r\rThird line."""\r')  # Enter inside a block adds a line
        ask(child, "Alpha" + ALT_ENTER + "Beta\r")
        assert users(save(child, tmp_path / "t.json")) == ["First line of the question.\n\nThird line.",
                                                          "Alpha\nBeta"]
        leave(child)
    finally:
        child.close(force=True)


def expected_drafted(smollm_path: Path) -> tuple[str, list[str]]:
    """The same answer in this process: its text, and the text of each run of accepted-proposal tokens."""
    from edgespec import Engine, GenerationConfig, LoadConfig

    with Engine(smollm_path, proposer="ngram", k=8, load=LoadConfig(n_ctx=1024)) as e:
        chunks = list(e.stream(e.chat_tokens([{"role": "user", "content": REPEAT}]), GenerationConfig(max_tokens=24)))
    return "".join(c.text for c in chunks), [c.text[:c.draft_chars] for c in chunks if c.draft_chars]


def test_show_draft_colours_drafted_tokens_on_a_terminal_and_not_in_a_pipe(smollm_path):
    """--show-draft colours exactly the text of accepted proposals; /draft off and on switch it; a pipe gets none."""
    text, drafted = expected_drafted(smollm_path)
    assert drafted and "".join(drafted) != text  # some of the answer was drafted, not all of it
    child = spawn(smollm_path, "--proposer", "ngram", "-k", "8", "--show-draft")
    try:
        stats = ask(child, REPEAT + "\r")
        shown = child.answer.replace("\r\n", "\n")
        child.send("/draft off\r")
        child.expect("drafted text plain")
        off = ask(child, "Once more, the same.\r")
        assert re.search(r"[1-9]\d*/\d+ drafted accepted", off.group(0)) and DRAFT_ON not in child.answer
        child.send("/draft on\r")
        child.expect("drafted text coloured")
        on = ask(child, "And again.\r")
        assert re.search(r"[1-9]\d*/\d+ drafted accepted", on.group(0)) and DRAFT_ON in child.answer
        leave(child)
    finally:
        child.close(force=True)
    assert int(stats.group(3)) > 0 and re.search(r"[1-9]\d*/\d+ drafted accepted", stats.group(0))
    assert re.findall(re.escape(DRAFT_ON) + "(.*?)" + re.escape(RESET), shown, re.S) == drafted

    p = subprocess.run([sys.executable, *chat_args(smollm_path, "--proposer", "ngram", "-k", "8", "--show-draft")],
                       input=REPEAT + "\n", capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "\x1b" not in p.stdout and p.stdout == text + "\n"


def test_save_then_load_restores_the_conversation_and_reuses_its_cache(smollm_path, tmp_path):
    saved = tmp_path / "chat.json"
    child = spawn(smollm_path, "--proposer", "none", "-s", "Answer in one short sentence.")
    try:
        first_prompt = int(ask(child, QUESTION + "\r").group(1))
        before = save(child, saved)
        leave(child)
    finally:
        child.close(force=True)
    assert [m["role"] for m in before] == ["system", "user", "assistant"]

    child = spawn(smollm_path, "--proposer", "none")  # a new process: an empty KV cache
    try:
        child.send(f"/load {saved}\r")
        child.expect("loaded 3 messages")
        child.expect(">>> ")
        stats = ask(child, "And of Italy?\r")
        prompt, reused = int(stats.group(1)), int(stats.group(2) or 0)
        # /load read the conversation into the cache: the next answer evaluates only its own message.
        assert reused > first_prompt and prompt - reused < 20, (prompt, reused, first_prompt)
        after = save(child, tmp_path / "after.json")
        child.send("/stats\r")
        child.expect(r"session: 1 answer, \d+ prompt tokens \(\d+ reused\)")
        child.expect(">>> ")
        leave(child)
    finally:
        child.close(force=True)
    assert after[:3] == before and users(after) == [QUESTION, "And of Italy?"]
