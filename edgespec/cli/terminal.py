"""What a person sees on a terminal: colours, an indicator for waits, and streamed answers with drafted text marked.

Colour and animation only where the stream is a terminal (and NO_COLOR is unset): piped output stays plain text.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
from typing import Any, Iterable, TextIO

CODES = {"bold": "1", "dim": "2", "red": "31", "green": "32", "yellow": "33", "cyan": "36"}
RESET = "\x1b[0m"
DRAFT_STYLE = "cyan"  # text from accepted proposals under --show-draft
WAIT_DELAY = 1.0  # a wait shorter than this shows nothing
WAIT_TICK = 0.1
FRAMES = "|/-\\"


def is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def colour_on(stream: Any) -> bool:
    return is_terminal(stream) and not os.environ.get("NO_COLOR")  # https://no-color.org


def paint(text: str, *styles: str, stream: Any = None) -> str:
    """`text` in `styles` (names of CODES) when `stream` (default stdout) shows colour, else as it is."""
    if not styles or not colour_on(sys.stdout if stream is None else stream):
        return text
    return f"\x1b[{';'.join(CODES[s] for s in styles)}m{text}{RESET}"


def say(text: str, *styles: str, err: bool = True) -> None:
    """One line on stderr (or stdout), styled where that is a terminal."""
    stream = sys.stderr if err else sys.stdout
    stream.write(paint(text, *styles, stream=stream) + "\n")
    stream.flush()


class Spinner:
    """Tells what a wait is for, with its elapsed time (and the share done, when known), once it has lasted
    WAIT_DELAY; only on a terminal. `update` may be called from any thread; the line is cleared at exit."""

    def __init__(self, enabled: bool = True, stream: TextIO | None = None, delay: float = WAIT_DELAY) -> None:
        self.stream = sys.stderr if stream is None else stream
        self.enabled = enabled and is_terminal(self.stream)
        self.delay = delay
        self.message: str | None = None
        self.fraction: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._drawn = False
        self._t0 = time.monotonic()

    def update(self, message: str | None, fraction: float | None = None) -> None:
        # Plain attributes, no lock: a read between the two assignments shows one stale figure for one tick.
        self.message, self.fraction = message, fraction

    def __enter__(self) -> Spinner:
        self._t0 = time.monotonic()
        if self.enabled:
            self._thread = threading.Thread(target=self._run, name="edgespec-spinner", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._drawn:
            self.stream.write("\r\x1b[2K")
            self.stream.flush()

    def _run(self) -> None:
        frame = 0
        while not self._stop.wait(WAIT_TICK):
            message, fraction = self.message, self.fraction
            elapsed = time.monotonic() - self._t0
            if message is None or elapsed < self.delay:
                continue
            done = f" {fraction:.0%}" if fraction is not None else ""
            line = f"{FRAMES[frame % len(FRAMES)]} {message}{done} ({elapsed:.0f}s)"
            width = shutil.get_terminal_size().columns - 1  # a wrapped line could not be cleared with \r
            self.stream.write("\r\x1b[2K" + paint(line[:width], "dim", stream=self.stream))
            self.stream.flush()
            self._drawn, frame = True, frame + 1


def read_stdin() -> str:
    """Standard input as text; invalid UTF-8 reads as U+FFFD, as in --prompt."""
    return sys.stdin.buffer.read().decode("utf-8", "replace") if hasattr(sys.stdin, "buffer") else sys.stdin.read()


def print_stream(chunks: Iterable[Any], show_draft: bool = False, wait: str | None = "reading the prompt",
                 quiet: bool = False) -> Any:
    """Print an engine stream's text as it is committed, text from accepted proposals in DRAFT_STYLE when
    `show_draft` and stdout is a terminal; `wait` is shown while the first token takes long. The last chunk."""
    out = sys.stdout
    colour = show_draft and colour_on(out)
    it = iter(chunks)
    with Spinner(enabled=not quiet and wait is not None) as spinner:
        spinner.update(wait)
        last = next(it, None)
    chunk = last
    while chunk is not None:
        last, n = chunk, chunk.draft_chars if colour else 0
        out.write(paint(chunk.text[:n], DRAFT_STYLE, stream=out) + chunk.text[n:] if n else chunk.text)
        out.flush()
        chunk = next(it, None)
    out.write("\n")
    out.flush()
    return last


def stats_line(s: Any, finish: str | None = None) -> str:
    """One generation's figures (a loop.Stats), as the CLI prints them after each answer."""
    spec = (f", {s.accepted}/{s.drafted} drafted accepted ({s.acceptance_rate:.0%}), "
            f"{s.mean_accepted_per_cycle:.2f} per cycle") if s.drafted else ""
    reused = f" ({s.cached_prompt_tokens} reused)" if s.cached_prompt_tokens else ""
    end = f", {finish}" if finish else ""
    return (f"[{s.prompt_tokens} prompt tokens{reused} in {s.prefill_seconds:.2f}s, {s.completion_tokens} generated "
            f"at {s.tokens_per_second:.1f} tok/s{spec}{end}]")
