"""decoding.reuse on literal token lists: which cached runs a new prompt keeps, and where they move."""

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from edgespec.decoding.reuse import Run, common_prefix, plan


def lines(n: int, width: int = 8, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 5000) for _ in range(width)] for _ in range(n)]


def fim(prefix: list[list[int]], suffix: list[list[int]]) -> list[int]:
    """A FIM-shaped prompt: 1 prefix 2 suffix 3."""
    return [1, *sum(prefix, []), 2, *sum(suffix, []), 3]


def test_only_the_common_prefix_without_chunk_reuse():
    r = plan([1, 2, 3, 4, 5], [1, 2, 9, 4, 5], 0)
    assert r.runs == (Run(0, 0, 2),) and r.new == 3 and r.prefix == 2


def test_the_last_token_is_never_reused():
    r = plan([1, 2, 3], [1, 2, 3], 0)
    assert r.runs == (Run(0, 0, 2),) and r.new == 1  # its logits are needed


def test_a_sliding_window_reuses_both_moved_chunks():
    """The cursor moves down a line: the prefix window drops its first line and gains the line the cursor left,
    the suffix window drops that line and gains one at its end. llama.cpp's loop stops at the inserted line;
    this plan keeps the suffix after it too, so only the two new lines are evaluated."""
    text, after = lines(300), lines(40, seed=1)
    old = fim(text[0:256], after[0:30])
    new = fim(text[1:257], after[1:31])
    r = plan(old, new, 32)
    assert [(run.start, run.source) for run in r.runs] == [(0, 0), (1, 9), (1 + 256 * 8 + 1, 1 + 256 * 8 + 1 + 8)]
    # the line added to the prefix, the separator (its neighbour changed), the line added to the suffix, the last token
    assert r.new == 8 + 1 + 8 + 1
    assert r.prefix == 1


def test_an_insertion_in_the_middle_keeps_the_chunk_after_it():
    text = lines(100)
    old = fim(text, [])
    new = fim(text[:50] + [[7, 7, 7]] + text[50:], [])
    r = plan(old, new, 16)
    assert r.runs[0] == Run(0, 0, 1 + 50 * 8)
    moved = r.runs[1]
    assert moved.source == 1 + 50 * 8 and moved.start == moved.source + 3 and moved.shift == 3
    assert r.new == 3 + 1


def test_runs_shorter_than_the_minimum_are_evaluated_again():
    text = lines(10)
    old = fim(text, [])
    new = fim(text[:5] + [[7]] + text[5:], [])
    assert plan(old, new, 64).runs == (Run(0, 0, 41),)  # 40 tokens after the insertion: below 64
    assert len(plan(old, new, 32).runs) == 2


def test_gaps_name_the_run_that_follows_each():
    r = plan([1, 2, 3, 4, 5, 6, 7, 8], [1, 9, 4, 5, 6, 7, 8], 3)
    assert r.runs == (Run(0, 0, 1), Run(2, 3, 4))
    assert r.gaps() == [(1, 2, Run(2, 3, 4)), (6, 7, None)]


def test_common_prefix():
    assert common_prefix([], [1]) == 0
    assert common_prefix([1, 2, 3], [1, 2, 3, 4]) == 3
    assert common_prefix([1, 2, 3], [1, 5]) == 1


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 6), max_size=60), st.lists(st.integers(0, 6), max_size=60), st.integers(0, 5))
def test_every_run_matches_and_runs_are_in_order_on_both_sides(cache, prompt, n):
    r = plan(cache, prompt, n)
    at_p = at_c = 0
    for run in r.runs:
        assert prompt[run.start:run.end] == cache[run.source:run.source + run.length]
        assert run.start >= at_p and run.source >= at_c and run.end < len(prompt)  # the last token stays new
        assert run.length >= n or (run.start, run.source) == (0, 0)
        at_p, at_c = run.end, run.source + run.length
    assert r.new == len(prompt) - sum(run.length for run in r.runs)
    if prompt:
        assert r.new >= 1


def test_runs_start_before_the_anchor_only():
    """Past an anchor (a FIM prompt's cursor lines) a run that moved is evaluated again: its entries still hold the
    text that was before them. A run that starts before the anchor keeps its length past it: the text around the
    anchor did not change."""
    text, after = lines(40), lines(10, seed=1)
    old = fim(text[0:30], after)
    new = fim(text[1:30] + [[7, 7]], after)  # a line dropped at the top, one written at the cursor
    anchor = 1 + 28 * 8
    r = plan(old, new, 8, anchor)
    assert all(run.start < anchor for run in r.runs)
    assert r.new == 2 + 1 + 10 * 8 + 1  # the written line, and all from the suffix token on
    whole = plan(old, fim(text[1:30], after), 8, anchor)  # only the top line dropped: one run on past the anchor
    assert whole.runs[-1].start < anchor and whole.new == 1
    assert plan(old, new, 8, None).new == 2 + 1  # no anchor: the suffix moves too
