"""Streaming text: whole UTF-8 characters only; stop strings across token boundaries."""

from edgespec.text import TextStream


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
