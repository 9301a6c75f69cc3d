"""Streaming text: whole UTF-8 characters only; stop strings across token boundaries."""

import pytest

from edgespec.text import IndentLimit, RepeatLimit, TextStream


def test_multibyte_character_split_across_tokens_is_held():
    s = TextStream()
    data = "é€😀".encode()
    out = [s.push(data[i : i + 1]) for i in range(len(data))]
    assert "".join(out) + s.flush() == "é€😀"
    assert all("\ufffd" not in piece for piece in out)


def test_stop_string_spanning_tokens_cuts_everything_after():
    s = TextStream(stop=["END"])
    out = [s.push(b) for b in [b"hello E", b"N", b"D and more", b"tail"]]
    assert "".join(out) == "hello "
    assert s.stopped and s.flush() == ""


def test_partial_stop_is_released_when_it_does_not_complete():
    s = TextStream(stop=["STOP"])
    assert s.push(b"a ST") == "a "
    assert s.push(b"x") == "STx"
    assert s.push(b"ST") == ""
    assert s.flush() == "ST"


def test_earliest_of_several_stops_wins():
    s = TextStream(stop=["cd", "b"])
    assert s.push(b"abcd") == "a"


@pytest.mark.parametrize("pieces, n, out, stopped", [
    (["return a + b\n", "\n", "def sub"], 4, "return a + b\n", True),  # a blank line ends it, as in llama.cpp
    (["x = 1\n", "    y", " = 2\n", "  z"], 4, "x = 1\n    y = 2\n  ", True),  # cut at the first other char
    (["if a:\n", "\t", "\t", "\t", "\treturn"], 4, "if a:\n\t\t\t\treturn", False),  # a tab counts one
    (["no newline at all"], 8, "no newline at all", False),  # the first line is never checked
    (["a\n", "  "], 4, "a\n  ", False),  # undecided at the end: flushed
    (["a\n", "b"], 0, "a\nb", False),  # 0 turns it off
])
def test_indent_limit_is_llama_cpps_n_indent(pieces, n, out, stopped):
    g = IndentLimit(n)
    text = "".join(g.push(p) for p in pieces) + g.flush()
    assert (text, g.stopped) == (out, stopped)


@pytest.mark.parametrize("pieces, lines, out, stopped", [
    (["x = 1\n", "    return", " total\n", "more"], ["return total"], "x = 1\n", True),  # blanks aside
    (["return total\n", "y\n"], ["return total"], "return total\ny\n", False),  # the first line goes on
    (["\n", "foo()", "\nbar()\n"], ["bar()"], "\nfoo()\n", True),  # decided at its newline, not before
    (["a\n", "b = 2"], ["b = 2"], "a\n", False),  # the line under way at the end: a repeat too
    (["a\n", "b = "], ["b = 2"], "a\nb = ", False),  # a line's start is not a repeat
    (["a\n\n", "b\n"], ["", "  "], "a\n\nb\n", False),  # blank lines are never repeats
    (["a\n", "b\n"], [], "a\nb\n", False),  # none: off
])
def test_a_line_that_repeats_the_text_below_ends_the_answer_before_it(pieces, lines, out, stopped):
    r = RepeatLimit(lines)
    text = "".join(r.push(p) for p in pieces) + r.flush()
    assert (text, r.stopped) == (out, stopped)
