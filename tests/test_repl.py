"""The chat's pieces without a model: multi-line messages, transcripts, session figures, colouring, the wait line."""

import io
import json
import re
import time
from types import SimpleNamespace

import pytest

from edgespec.cli import terminal
from edgespec.engine.session import SessionTotals, read_transcript, write_transcript
from edgespec.errors import TranscriptError
from edgespec.decoding.loop import Stats
from edgespec.cli.repl import open_block, unwrap


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("text, still_open", [
    ('"""', True), ('"""first line\nsecond', True), ('  """x', True), ('"""x"""', False), ('"""\nx\n"""', False),
    ("plain", False), ('say """', False),
])
def test_open_block(text, still_open):
    assert open_block(text) is still_open


@pytest.mark.parametrize("text, message", [
    ('"""\nline one\nline two\n"""', "line one\nline two"), ('"""one line"""', "one line"),
    ('"""\nunclosed\n', "unclosed"), ("  plain  ", "plain"), ("a\nb", "a\nb"),
])
def test_unwrap(text, message):
    assert unwrap(text) == message


def test_plain_reader_reads_a_block_whole(monkeypatch):
    from edgespec.cli.repl import PlainReader

    monkeypatch.setattr("sys.stdin", io.StringIO('"""\nfirst\n\nsecond\n"""\nnext\n'))
    monkeypatch.setattr("sys.stdout", io.StringIO())
    reader = PlainReader()
    assert unwrap(reader.read()) == "first\n\nsecond"
    assert reader.read() == "next"
    with pytest.raises(EOFError):
        reader.read()


def test_transcript_round_trip(tmp_path):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo\nthere"},
                {"role": "assistant", "content": "Hi."}]
    path = tmp_path / "chat.json"
    write_transcript(path, messages)
    assert json.loads(path.read_text(encoding="utf-8")) == messages  # OpenAI's messages shape, nothing else
    assert read_transcript(path) == messages
    path.write_text(json.dumps({"model": "x", "messages": messages[1:]}))  # a request body loads too
    assert read_transcript(path) == messages[1:]


@pytest.mark.parametrize("content, words", [
    ("not json", ["is not JSON", "/load takes a file written by /save"]),
    ('{"a": 1}', ["holds no list of messages"]),
    ('[{"role": "tool", "content": "x"}]', ["message 0", "needs a role (system, user or assistant)"]),
    ('[{"role": "user", "content": [1]}]', ["message 0", "string content"]),
    ('[{"role": "user", "content": "x"}, {"role": "system", "content": "y"}]', ["message 1", "only the first"]),
])
def test_bad_transcripts_are_one_line(tmp_path, content, words):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(TranscriptError) as e:
        read_transcript(path)
    assert "\n" not in str(e.value) and str(path) in str(e.value)
    for w in words:
        assert w in str(e.value)
    with pytest.raises(TranscriptError, match="cannot read the transcript"):
        read_transcript(tmp_path / "missing.json")
    with pytest.raises(TranscriptError, match="cannot write the transcript"):
        write_transcript(tmp_path / "no" / "such" / "dir.json", [])


def test_session_totals_sum_every_answer():
    totals = SessionTotals()
    assert totals.line() == "session: no answer yet"
    for prompt, cached, done, seconds, cycles, drafted, accepted in ((20, 0, 11, 1.0, 10, 4, 2),
                                                                    (40, 30, 21, 1.0, 10, 16, 12)):
        totals.add(Stats(prompt_tokens=prompt, cached_prompt_tokens=cached, completion_tokens=done,
                         decode_seconds=seconds, cycles=cycles, drafted=drafted, accepted=accepted))
    assert totals.line() == ("session: 2 answers, 60 prompt tokens (30 reused), 32 generated at 15.0 tok/s, "
                             "14/20 drafted accepted (70%), 0.70 per cycle")


def chunk(text, draft_chars=0, stats=None):
    return SimpleNamespace(text=text, draft_chars=draft_chars, stats=stats)


CHUNKS = [chunk("The"), chunk(" cat sat on", 8), chunk(" the mat.", 0)]


def test_print_stream_colours_drafted_text_on_a_terminal_only(monkeypatch):
    monkeypatch.delenv("NO_COLOR", raising=False)
    out = Tty()
    monkeypatch.setattr("sys.stdout", out)
    last = terminal.print_stream(iter(CHUNKS), show_draft=True, wait=None)
    assert last is CHUNKS[-1]
    assert out.getvalue() == "The\x1b[36m cat sat\x1b[0m on the mat.\n"
    out = Tty()
    monkeypatch.setattr("sys.stdout", out)
    terminal.print_stream(iter(CHUNKS), show_draft=False, wait=None)
    assert out.getvalue() == "The cat sat on the mat.\n"
    monkeypatch.setenv("NO_COLOR", "1")
    out = Tty()
    monkeypatch.setattr("sys.stdout", out)
    terminal.print_stream(iter(CHUNKS), show_draft=True, wait=None)
    assert out.getvalue() == "The cat sat on the mat.\n"
    monkeypatch.delenv("NO_COLOR")
    out = io.StringIO()  # a pipe
    monkeypatch.setattr("sys.stdout", out)
    terminal.print_stream(iter(CHUNKS), show_draft=True, wait=None)
    assert out.getvalue() == "The cat sat on the mat.\n"


def test_spinner_shows_a_long_wait_on_a_terminal_and_clears_it():
    out = Tty()
    with terminal.Spinner(stream=out, delay=0.05) as s:
        s.update("calibrating this machine, once: timing m.gguf", 0.25)
        time.sleep(0.4)
    text = out.getvalue()
    assert re.search(r"\| calibrating this machine, once: timing m\.gguf 25% \(0s\)", text)
    assert text.endswith("\r\x1b[2K")  # the line is gone when the wait ends


def test_spinner_is_silent_for_short_waits_and_off_a_terminal():
    out = Tty()
    with terminal.Spinner(stream=out, delay=5) as s:
        s.update("loading")
        time.sleep(0.2)
    assert out.getvalue() == ""
    piped = io.StringIO()
    with terminal.Spinner(stream=piped, delay=0) as s:
        s.update("loading")
        time.sleep(0.2)
    assert piped.getvalue() == ""
