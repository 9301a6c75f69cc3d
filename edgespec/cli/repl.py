"""The interactive `edgespec chat`: line editing and a history kept per user (prompt_toolkit) on a terminal,
plain lines from a pipe, slash commands, and answers streamed with drafted text marked on request."""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Any, Callable

from prompt_toolkit import PromptSession
from prompt_toolkit.formatted_text import FormattedText
from prompt_toolkit.history import FileHistory, History, InMemoryHistory
from prompt_toolkit.key_binding import KeyBindings

from edgespec.engine.session import ChatSession, read_transcript, write_transcript
from edgespec.errors import EdgespecError
from edgespec.cli.terminal import Spinner, is_terminal, paint, print_stream, read_stdin, say, stats_line

BLOCK = '"""'  # a line starting with it opens a multi-line message, closed by the next one
PROMPT, MORE = ">>> ", "... "
HELP = (f"{BLOCK} starts and ends a multi-line message (or Alt-Enter for a new line); up/down: history\n"
        "/stats  figures of the last answer and the session   /draft on|off  colour drafted text\n"
        "/save FILE  /load FILE  the conversation as JSON   /system TEXT  set the system prompt\n"
        "/reset  forget the conversation   /exit  leave (or Ctrl-D); Ctrl-C stops an answer")
EXIT = ("/exit", "/quit", "/bye")


def open_block(text: str) -> bool:
    """Whether `text` opened a multi-line message and has not closed it yet."""
    return text.lstrip().startswith(BLOCK) and text.count(BLOCK) == 1


def unwrap(text: str) -> str:
    """A message without its multi-line quotes; other text as typed."""
    text = text.strip()
    if text.startswith(BLOCK):
        text = text[len(BLOCK):]
        text = text[: -len(BLOCK)] if text.endswith(BLOCK) else text
    return text.strip()


class PlainReader:
    """Lines from standard input (a pipe, a file), a multi-line message read up to its closing quotes."""

    def __init__(self) -> None:
        if hasattr(sys.stdin, "reconfigure"):
            sys.stdin.reconfigure(errors="replace")  # an invalid byte typed or pasted reads as U+FFFD

    def read(self) -> str:
        sys.stdout.write(paint(PROMPT, "green", "bold"))
        sys.stdout.flush()
        text = self._line()
        while open_block(text):
            try:
                text += "\n" + self._line()
            except EOFError:
                break  # an unclosed block at the end of the input is still a message
        return text

    @staticmethod
    def _line() -> str:
        line = sys.stdin.readline()
        if not line:
            raise EOFError
        return line.rstrip("\r\n")


class TerminalReader:
    """prompt_toolkit on a terminal: cursor movement, the history file, Enter inside a block adds a line."""

    def __init__(self, history: Path) -> None:
        keys = KeyBindings()

        @keys.add("enter")
        def _enter(event: Any) -> None:
            buffer = event.current_buffer
            if open_block(buffer.text):
                buffer.insert_text("\n")
            else:
                buffer.validate_and_handle()

        @keys.add("escape", "enter")  # Alt-Enter (Esc then Enter on terminals without Alt)
        def _newline(event: Any) -> None:
            event.current_buffer.insert_text("\n")

        self.session: PromptSession[str] = PromptSession(
            history=_history(history), multiline=True, key_bindings=keys,
            prompt_continuation=lambda width, line, wrapped: MORE.rjust(width))

    def read(self) -> str:
        return self.session.prompt(FormattedText([("ansigreen bold", PROMPT)]))


def _history(path: Path) -> History:
    """The history file, or one kept in memory (with a note) where its folder cannot be made."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(exist_ok=True)
        return FileHistory(str(path))
    except OSError as e:
        say(f"note: history is not kept: cannot write {path} ({e.strerror or e}); set EDGESPEC_STATE_DIR to a "
            f"folder you can write", "yellow")
        return InMemoryHistory()


class Repl:
    """Reads messages and commands, and prints answers, until /exit or the end of the input."""

    def __init__(self, session: ChatSession, reader: Any, quiet: bool = False, show_draft: bool = False) -> None:
        self.session, self.reader, self.quiet, self.show_draft = session, reader, quiet, show_draft
        self.commands: dict[str, Callable[[str], None]] = {
            "/reset": self._reset, "/stats": self._stats, "/system": self._system, "/draft": self._draft,
            "/save": self._save, "/load": self._load, "/help": lambda _: say(HELP, "dim")}

    def run(self) -> None:
        while True:
            try:
                line = self.reader.read()
            except EOFError:
                sys.stdout.write("\n")
                return
            except KeyboardInterrupt:  # Ctrl-C at the prompt drops the line, as in a shell
                sys.stdout.write("\n")
                continue
            if line.strip() in EXIT:
                return
            try:
                if line.lstrip().startswith("/"):
                    self.command(line.strip())
                elif text := unwrap(line):
                    self.answer(text)
            except KeyboardInterrupt:  # Ctrl-C just before an answer's own handler was in place
                sys.stdout.write("\n")

    def command(self, line: str) -> None:
        name, _, arg = line.partition(" ")
        if name not in self.commands:
            say(f"unknown command {name}\n{HELP}")
            return
        try:
            self.commands[name](arg.strip())
        except EdgespecError as e:  # a file that cannot be read or written keeps the session
            say(f"error: {e}", "red")

    def answer(self, text: str) -> None:
        """Stream one answer; Ctrl-C cancels it after the current cycle and keeps the session."""
        engine = self.session.engine
        previous = signal.signal(signal.SIGINT, lambda *_: engine.cancel())
        try:
            last = print_stream(self.session.send(text), self.show_draft, quiet=self.quiet)
        except EdgespecError as e:  # one bad turn (too long, template error) keeps the session
            say(f"error: {e}", "red")
            return
        finally:
            signal.signal(signal.SIGINT, previous)
        for notice in self.session.notices:
            say(f"note: {notice}", "yellow")
        self.session.notices.clear()
        if not self.quiet and last is not None and last.stats is not None:
            say(stats_line(last.stats, last.finish_reason), "dim")

    def _reset(self, _: str) -> None:
        self.session.reset()
        say("conversation cleared", "dim")

    def _stats(self, _: str) -> None:
        s = self.session.last_stats
        print(stats_line(s, self.session.last_finish) if s is not None else "no answer yet")
        print(self.session.totals.line())

    def _system(self, arg: str) -> None:
        self.session.system = arg or None
        say(f"system prompt {'set' if self.session.system else 'cleared'}", "dim")

    def _draft(self, arg: str) -> None:
        if arg not in ("on", "off"):
            say(f"/draft {arg}: say /draft on or /draft off", "red")
            return
        self.show_draft = arg == "on"
        where = "" if is_terminal(sys.stdout) else " (colours show only on a terminal)"
        say(f"drafted text {'coloured' if self.show_draft else 'plain'}{where}", "dim")

    @staticmethod
    def _file(arg: str, command: str) -> Path | None:
        if not arg:
            say(f"{command} needs a file name: {command} chat.json", "red")
            return None
        return Path(arg).expanduser()

    def _save(self, arg: str) -> None:
        if (path := self._file(arg, "/save")) is None:
            return
        write_transcript(path, self.session.messages())
        say(f"saved {len(self.session.messages())} messages to {path}", "dim")

    def _load(self, arg: str) -> None:
        if (path := self._file(arg, "/load")) is None:
            return
        messages = read_transcript(path)
        self.session.restore(messages)
        say(f"loaded {len(messages)} messages from {path}", "dim")
        try:  # read now, so that the next answer starts as soon as it would have in the saved session
            with Spinner(enabled=not self.quiet) as spinner:
                spinner.update("reading the conversation into the cache")
                self.session.prefill()
        except KeyboardInterrupt:
            say("stopped; the next answer reads the conversation instead", "dim")


def run_chat(session: ChatSession, interactive: bool, history: Path, quiet: bool = False,
             show_draft: bool = False) -> None:
    """Talk until the input ends: prompt_toolkit where stdin and stdout are a terminal, plain lines otherwise;
    not `interactive`: all of standard input is one message, answered once."""
    if not interactive:
        if text := read_stdin().strip():
            Repl(session, None, quiet, show_draft).answer(text)
        return
    if not quiet:
        say(HELP, "dim")
    use_terminal = is_terminal(sys.stdin) and is_terminal(sys.stdout)
    Repl(session, TerminalReader(history) if use_terminal else PlainReader(), quiet, show_draft).run()
