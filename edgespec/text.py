"""Text and UTF-8: prompts to bytes, and token bytes to streamed text (whole characters, stop strings).

A token may end inside a multi-byte character, and a stop string may span
several tokens, so text is released only once it can no longer change: the
incremental decoder holds partial characters, and the tail that could still be
the start of a stop string is held back until the next tokens decide it.
"""

from __future__ import annotations

import codecs
import re
from typing import Sequence

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def to_utf8(text: str) -> bytes:
    """`text` as UTF-8 for the tokenizer. A lone surrogate, which UTF-8 cannot hold, becomes U+FFFD:
    Python makes one of each invalid byte in argv, and JSON may carry one ("\\ud800"). Terminals show
    invalid bytes as U+FFFD too, so the CLI and the server read such input the same way."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        return _LONE_SURROGATE.sub("\ufffd", text).encode("utf-8")


class TextStream:
    def __init__(self, stop: Sequence[str] = ()) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = tuple(s for s in stop if s)
        self._held = ""  # decoded text not yet released
        self.stopped = False  # a stop string was found; nothing after it is released
        self.matched = ""  # the stop string found

    def push(self, data: bytes) -> str:
        """Feed one token's bytes; returns the text that is now final."""
        if self.stopped:
            return ""
        self._held += self._decoder.decode(data)
        if not self._stop:
            out, self._held = self._held, ""
            return out
        cut, self.matched = min(((i, s) for s in self._stop if (i := self._held.find(s)) >= 0), default=(-1, ""))
        if cut >= 0:
            self.stopped = True
            out, self._held = self._held[:cut], ""
            return out
        keep = self._partial_stop_len()
        out, self._held = self._held[: len(self._held) - keep], self._held[len(self._held) - keep :]
        return out

    def flush(self) -> str:
        """The end of generation: release what was held (a partial stop is just text)."""
        if self.stopped:
            return ""
        out = self._held + self._decoder.decode(b"", final=True)
        self._held = ""
        return out

    def _partial_stop_len(self) -> int:
        """Length of the longest suffix of held text that is a proper prefix of a stop string."""
        best = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(self._held)), best, -1):
                if self._held.endswith(s[:n]):
                    best = n
                    break
        return best


class IndentLimit:
    """llama.cpp's n_indent: after the first generated newline, a line whose first character other than
    space or tab comes after fewer than `n` of them ends the generation, from that character on (a blank
    line counts). Unlike llama.cpp, a line's start is held back until it is decided, so the line that
    ends the generation is never streamed."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._pending: str | None = None  # spaces and tabs of an undecided line start; None: not at one
        self.stopped = False

    def push(self, text: str) -> str:
        if self.n <= 0 or self.stopped:
            return "" if self.stopped else text
        out = []
        for c in text:
            if self._pending is None:
                out.append(c)
                if c == "\n":
                    self._pending = ""
            elif c in " \t":
                self._pending += c
                if len(self._pending) >= self.n:
                    out.append(self._pending)
                    self._pending = None
            else:  # the line's first other character comes too early: stop, keeping its indentation
                out.append(self._pending)
                self._pending, self.stopped = None, True
                break
        return "".join(out)

    def flush(self) -> str:
        out, self._pending = self._pending or "", None
        return out


class RepeatLimit:
    """An infill's end where the answer runs into the text after it: a line after the first that is, blanks aside,
    one of `lines` (the next lines below the cursor, which the file holds already) ends the generation before it.
    A line is held back until its end decides it, so the repeat is never sent. The editors drop such answers
    themselves (llama.vim's fim_render, Continue's stopAtSimilarLine), after waiting for them."""

    def __init__(self, lines: Sequence[str]) -> None:
        self.lines = frozenset(s for line in lines if (s := line.strip()))
        self._first = True  # in the answer's first line, which goes on from the cursor: never a repeat
        self._held = ""  # the start of the line under way
        self.stopped = False

    def push(self, text: str) -> str:
        if not self.lines or self.stopped:
            return "" if self.stopped else text
        out = []
        while text:
            line, newline, text = text.partition("\n")
            if self._first:
                out.append(line + newline)
                self._first = not newline
                continue
            self._held += line
            if not newline:
                break
            if self._held.strip() in self.lines:
                self._held, self.stopped = "", True
                break
            out.append(self._held + newline)
            self._held = ""
        return "".join(out)

    def flush(self) -> str:
        """The end of generation: the line under way, unless it too is a repeat."""
        held, self._held = self._held, ""
        return "" if self.stopped or held.strip() in self.lines else held
