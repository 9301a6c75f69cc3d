"""FIM prompts on a literal vocabulary (characters as tokens): llama.cpp's layout and sizes, the typed text in the
middle, and fitting whole lines to a budget of new tokens."""

from dataclasses import replace
from typing import Callable

import pytest

from edgespec.decoding import reuse
from edgespec.errors import InvalidRequestError, UnsupportedModelError
from edgespec.gguf import Vocab
from edgespec.prompts.fim import (CUT_STEP, HEAL_MAX_CHARS, NEAR_LINES, REPEAT_LINES, SUFFIX_LINES, SUFFIX_SHARE,
                                  TAIL_STEP, WRITTEN_LINES, FimPrompt, Infill, Take, accepted, continuation,
                                  cursor_anchor, healed, next_lines, written_since)

PRE, SUF, MID, REP, SEP = 1001, 1002, 1003, 1004, 1005
QWEN_LIKE = Vocab(n_tokens=2000, type=2, bos=None, eos=1, add_bos=False, fim_pre=PRE, fim_suf=SUF,
                  fim_mid=MID, fim_pad=None, fim_rep=REP, fim_sep=SEP)
PLAIN = Vocab(**{**QWEN_LIKE.__dict__, "fim_rep": None, "fim_sep": None})


def chars(text: str) -> list[int]:
    return [ord(c) for c in text]


def per_line() -> Callable[[str], list[int]]:
    """A tokenizer of whole lines (a token per distinct line), so that only whole lines can match a cache."""
    ids: dict[str, int] = {}
    return lambda text: [ids.setdefault(line, len(ids)) for line in text.splitlines(keepends=True)]


def test_repo_level_layout_as_llama_cpp():
    toks, _, _ = FimPrompt(QWEN_LIKE, chars).tokens(Infill("ab", "yz", "P", (("u.py", "T"),)))
    expected = [REP, *chars("myproject\n"), SEP, *chars("u.py\n"), *chars("T"), SEP, *chars("filename\n"),
                PRE, *chars("ab"), *chars("P"), SUF, *chars("yz"), MID]
    assert toks == expected


def test_a_warm_up_keeps_the_fim_part_its_slot_holds_after_the_new_chunks():
    fim = FimPrompt(QWEN_LIKE, chars)
    head = fim.head((("u.py", "T"),))
    cached = [*fim.head((("o.py", "O"),)), PRE, *chars("ab\n"), *chars("P"), SUF, *chars("yz"), MID, *chars("ans")]
    assert fim.warm_up((("u.py", "T"),), cached) == [*head, PRE, *chars("ab\nP"), SUF, *chars("yz"), MID]
    # a widening stopped by the warm-up leaves its lines and no <fim_middle>: the lines are still worth keeping
    stopped = [*fim.head((("o.py", "O"),)), PRE, *chars("wider\nab\n")]
    assert fim.warm_up((("u.py", "T"),), stopped) == [*head, PRE, *chars("wider\nab\n")]
    assert fim.warm_up((("u.py", "T"),), [*fim.head((("o.py", "O"),))]) is None


def test_the_middle_layout_puts_the_typed_text_after_the_middle_token():
    toks, _, _ = FimPrompt(PLAIN, chars, "middle").tokens(Infill("ab\n", "yz\n", "P"))
    assert toks == [PRE, *chars("ab\n"), SUF, *chars("yz\n"), MID, *chars("P")]
    # a keystroke appends: the prompt before it is a prefix of the prompt after it
    more, _, _ = FimPrompt(PLAIN, chars, "middle").tokens(Infill("ab\n", "yz\n", "Pq"))
    assert more[: len(toks)] == toks


def test_llama_cpp_sizes_take_three_quarters_of_the_batch_for_the_prefix():
    """format_prompt_infill: the prefix's last 3*(n_batch/4) tokens, the suffix's first n_batch/4 - 2 - typed."""
    fim = FimPrompt(PLAIN, chars)
    toks, kept = fim.llama_cpp_sizes(Infill("0123456789" * 3, "abcdefghij" * 3, "P"), n_batch=16, n_ctx=64,
                                     n_predict=4)
    assert toks == [PRE, *chars("890123456789"), *chars("P"), SUF, *chars("a"), MID]
    assert kept.prefix_tokens == (12, 30) and kept.suffix_tokens == (1, 30) and kept.cut


def test_take_counts_whole_lines_from_the_cursor_outwards():
    fim = FimPrompt(PLAIN, chars)
    infill = Infill("l1\nl2\nl3\n", "s1\ns2\ns3\n")
    toks, pre, suf = fim.tokens(infill, Take(prefix_lines=2, suffix_lines=1))
    assert pre == chars("l2\nl3\n") and suf == chars("s1\n")
    assert toks == [PRE, *pre, SUF, *suf, MID]


def test_fit_keeps_the_lines_nearest_the_cursor_within_the_new_token_budget():
    fim = FimPrompt(PLAIN, chars)
    infill = Infill("".join(f"p{i:02d}\n" for i in range(40)), "".join(f"s{i:02d}\n" for i in range(40)))
    full = fim.fit(infill, room=10_000)  # all of the prefix, the suffix's nearest lines
    assert full.kept.prefix_tokens == (160, 160) and full.kept.suffix_tokens == (4 * SUFFIX_LINES, 160)
    cut = fim.fit(infill, room=10_000, max_new=3 + 4 * 10 + 4 * SUFFIX_LINES)  # every token new: 10 prefix lines
    assert cut.kept.cut and cut.kept.prefix_tokens == (40, 160) and cut.kept.suffix_tokens == (4 * SUFFIX_LINES, 160)
    assert cut.tokens[1:5] == chars("p30\n") and cut.tokens[-5:-1] == chars(f"s{SUFFIX_LINES - 1:02d}\n")


def test_a_budget_with_room_left_buys_further_suffix_lines_with_a_share_of_it():
    """Fresh suffix lines complete better but cost every keystroke: past SUFFIX_LINES they take SUFFIX_SHARE of what
    the budget has left. A CPU's budget leaves too little for a line; a fast machine's buys many."""
    fim = FimPrompt(PLAIN, chars)
    infill = Infill("".join(f"p{i:02d}\n" for i in range(40)), "".join(f"s{i:02d}\n" for i in range(40)))
    base = 3 + 4 * 40 + 4 * SUFFIX_LINES  # every token new: all 40 prefix lines, SUFFIX_LINES of the suffix
    tight = fim.fit(infill, room=10_000, max_new=base + 30)  # a tenth of 30 tokens: less than a 4-token line
    assert tight.kept.prefix_tokens == (160, 160) and tight.kept.suffix_tokens == (4 * SUFFIX_LINES, 160)
    fast = fim.fit(infill, room=10_000, max_new=base + 1000)
    more = int(SUFFIX_SHARE * 1000) // 4  # whole 4-token lines within the share
    assert fast.kept.suffix_tokens == (4 * (SUFFIX_LINES + more), 160) and len(fast.tokens) <= base + 100
    assert fim.fit(infill, room=10_000, max_new=base + 10_000).kept.suffix_tokens == (160, 160)  # the whole window


def test_blank_lines_after_the_cursor_line_do_not_count_against_the_suffix_lines():
    fim = FimPrompt(PLAIN, chars)
    prefix = "".join(f"p{i:02d}\n" for i in range(40))
    suffix = "\n\n  \n" + "".join(f"s{i:02d}\n" for i in range(40))  # the cursor line's rest, 2 blank lines, text
    cut = fim.fit(Infill(prefix, suffix), room=10_000, max_new=3 + 4 * 10 + 6 * SUFFIX_LINES)
    assert cut.kept.cut and fim.vocab.fim_suf in cut.tokens
    held = cut.tokens[cut.tokens.index(fim.vocab.fim_suf) + 1:-1]
    assert held == chars("\n\n  \n" + "".join(f"s{i:02d}\n" for i in range(SUFFIX_LINES - 1)))


def test_a_line_too_long_for_the_budget_is_cut_from_its_end_in_whole_steps():
    """llama.cpp cuts the prefix at a token; a budget that cannot take the line before the cursor keeps its end rather
    than nothing, and a request after it (the cut cached) keeps the same end."""
    fim = FimPrompt(PLAIN, chars)
    long_line = "".join(chr(97 + i % 26) for i in range(200)) + "END\n"
    infill = Infill("short\n" + long_line, "\ns1\n", "  ")
    cold = fim.fit(infill, room=10_000, max_new=60, near_most=80)
    pre = cold.tokens[1:cold.tokens.index(SUF) - 2]
    assert pre == chars(long_line)[-len(pre):] and len(pre) % TAIL_STEP == 0 and 0 < len(pre) <= 80
    assert cold.tokens[cold.tokens.index(SUF):] == [SUF, *chars("\ns1\n"), MID] and cold.kept.cut
    cached = cold.tokens[:-1]
    warm = fim.fit(Infill(infill.prefix, infill.suffix, "  y"), room=10_000, max_new=10, near_most=50,
                   new_tokens=lambda t: len(t) - reuse.common_prefix(cached, t))
    assert warm.tokens[:len(pre) + 1] == cold.tokens[:len(pre) + 1] and len(pre) > 50  # fresh, it would not fit
    assert fim.fit(infill, room=10_000).kept.prefix_tokens == (210, 210)  # no budget: whole lines, as before


def test_fit_counts_only_what_the_cache_cannot_reuse():
    fim = FimPrompt(PLAIN, chars)
    infill = Infill("".join(f"p{i:02d}\n" for i in range(40)), "")
    cached = set(fim.tokens(infill)[0][:-1])  # a stand-in for the cache: tokens it holds cost nothing
    assert not fim.fit(infill, room=10_000, max_new=5, new_tokens=lambda t: sum(x not in cached for x in t)).kept.cut


def test_fit_takes_lines_near_the_cursor_before_the_latest_extra_chunks():
    fim = FimPrompt(QWEN_LIKE, chars)
    chunks = (("old.py", "o" * 100), ("new.py", "n" * 100))
    infill = Infill("".join(f"p{i}\n" for i in range(10)), "", extra=chunks)
    one_chunk = fim.tokens(infill, Take(None, None, 1))[0]
    f = fim.fit(infill, room=10_000, max_new=len(one_chunk))  # every token new: the lines and the latest chunk
    assert f.kept.prefix_tokens == (30, 30) and f.kept.extra_chunks == (1, 2) and f.tokens == one_chunk
    assert chars("new.py\n") == f.tokens[12:19]


def test_widening_grows_outwards_and_ends_with_everything_that_fits():
    fim = FimPrompt(PLAIN, chars)
    infill = Infill("".join(f"p{i:02d}\n" for i in range(64)), "".join(f"s{i:02d}\n" for i in range(64)))
    start = fim.fit(infill, room=10_000, max_new=3 + 2 * 4 * 8)
    wider = list(fim.widening(infill, 10_000, start, 8))
    assert wider and wider[-1] == fim.tokens(infill, Take(None, SUFFIX_LINES))[0]
    sizes = [len(start.tokens), *map(len, wider)]
    assert sizes == sorted(sizes) and len(set(sizes)) == len(sizes)


def test_a_budget_below_the_nearest_lines_still_sends_them():
    f = FimPrompt(PLAIN, chars).fit(Infill("a\n" * 20, "b\n" * 20, "x" * 50), room=1000, max_new=10)
    assert f.tokens[:1 + 2 * NEAR_LINES] == [PRE, *chars("a\n" * NEAR_LINES)]
    assert f.kept.prefix_tokens[0] >= 2 * NEAR_LINES and f.kept.suffix_tokens[0] > 0 and f.kept.cut


def test_long_nearest_lines_are_fewer_within_near_most():
    """Lines of prose or generated code: the nearest 8 would cost far more than the budget on a cold cache, so only
    as many of them as cost at most `near_most` new tokens raise the budget."""
    long = "".join(f"{i:02d}" + "w" * 98 + "\n" for i in range(20))  # 101 tokens a line
    fim = FimPrompt(PLAIN, chars)
    assert fim.fit(Infill(long, "b\n"), room=10_000, max_new=10).kept.prefix_tokens[0] == NEAR_LINES * 101
    f = fim.fit(Infill(long, "b\n"), room=10_000, max_new=10, near_most=250)
    assert f.kept.prefix_tokens[0] == 2 * 101 and f.tokens[1:3] == chars("18") and len(f.tokens) <= 250
    # cheaper than the cap, the nearest lines are all sent
    assert fim.fit(Infill("a\n" * 20, "b\n"), room=1000, max_new=10, near_most=250).kept.prefix_tokens[0] >= 16
    # and the cap changes nothing where they cost less than it: cached, or short
    infill = Infill("".join(f"p{i:02d}\n" for i in range(40)), "b\n")
    assert fim.fit(infill, 1000, 10, near_most=40) == fim.fit(infill, 1000, 10)
    cached = set(fim.tokens(Infill(long, "b\n"))[0][:-1])
    held = lambda t: sum(x not in cached for x in t)  # noqa: E731
    warm = Infill(long, "b\n")
    assert fim.fit(warm, 10_000, 10, held, near_most=40) == fim.fit(warm, 10_000, 10, held)


def test_where_the_suffix_lines_take_the_nearest_lines_budget_they_go_first_down_to_the_cursor_lines_rest():
    """On a slow CPU, twice the budget (`near_most`) may not buy the nearest lines with the suffix's nearest lines
    (long ones): those go first, down to the cursor line's rest, and the lines before the cursor stay (the prompt
    once fell to no line at all here, and the model wrote a file name)."""
    fim = FimPrompt(PLAIN, chars, "middle")
    infill = Infill("a\n" * 20, "\n" + ("s" * 30 + "\n") * 3)  # the cursor line's rest is empty, 31 tokens a line
    f = fim.fit(infill, room=10_000, max_new=10, near_most=40)
    assert f.kept.prefix_tokens[0] == 2 * NEAR_LINES and f.kept.suffix_tokens[0] == 1, f.kept
    f = fim.fit(infill, room=10_000, max_new=10, near_most=60)  # room for the next line too: it comes first
    assert f.kept.prefix_tokens[0] == 2 * NEAR_LINES and f.kept.suffix_tokens[0] == 32, f.kept
    assert fim.fit(infill, room=10_000, max_new=10).kept.suffix_tokens[0] == 63  # no cap: SUFFIX_LINES


def test_a_line_over_the_budget_keeps_everything_cached_around_it():
    """The cursor moved down a line: the line just written is new and costs more than the budget, but dropping it
    would drop all the context the cache holds around it (the budget once fell to no context at all here)."""
    fim = FimPrompt(PLAIN, per_line())
    lines = [f"line {i:02d}\n" for i in range(300)]
    cached = fim.tokens(Infill("".join(lines[:199]), "".join(lines[200:264])))[0]
    moved = Infill("".join(lines[:200]), "".join(lines[201:265]))
    f = fim.fit(moved, room=10_000, max_new=1, new_tokens=lambda t: reuse.plan(cached, t, 4).new)
    # all but the far ends, where the window took a line the cache does not hold (past SUFFIX_LINES: cached lines)
    assert f.kept.prefix_tokens[0] >= 190 and f.kept.suffix_tokens[0] >= 60, f.kept


def test_a_line_start_keeps_the_cached_lines_though_the_nearest_lines_alone_would_take_less_suffix():
    """The cursor moved down a line (middle layout): the line just written and the suffix's nearest lines are new and
    cost more than the budget. The nearest prefix lines alone take the same suffix lines as the 60 the cache holds, so
    they cost no less, and the prompt keeps the cached lines (they once took fewer, and the cached lines were dropped)."""
    fim = FimPrompt(PLAIN, per_line(), "middle")
    lines = [f"line {i:03d}\n" for i in range(300)]
    here = Infill("".join(lines[:200]), "\n" + "".join(lines[201:221]))
    cached = fim.tokens(here, Take(60, SUFFIX_LINES))[0]
    down = Infill("".join(lines[:201]), "\n" + "".join(lines[202:222]))
    f = fim.fit(down, room=10_000, max_new=2, new_tokens=lambda t: reuse.plan(cached, t, 4).new,
                starts=(61,))
    assert f.kept.prefix_tokens[0] == 61 and f.kept.suffix_tokens[0] == SUFFIX_LINES, f.kept


def test_a_long_line_at_the_cursor_is_cut_in_whole_steps_that_typing_on_keeps_and_the_lines_stay():
    """The cursor far into a long line (minified code, data, prose), a long line after it: alone, each would cost
    many budgets, so the typed text keeps its end, cut whole steps of characters from the start that stays while the
    user types, and the suffix its lines before the long one (else the long line's start); the lines before the
    cursor still go in."""
    fim = FimPrompt(PLAIN, chars, "middle")
    typed, suffix = "".join(chr(97 + i % 26) for i in range(300)), "\n" + "y" * 300 + "\nz\n"
    infill = Infill("a\nb\n", suffix, typed, (("f.py", "x\n"),))
    short = replace(infill, typed=typed[:150], suffix="\nc\n")
    assert fim.cut_long(short, 140) == short  # within twice what the nearest lines may take: whole
    cut = fim.cut_long(infill, 140)
    assert cut == replace(infill, typed=typed[4 * CUT_STEP:], suffix="\n")  # the widest within half of it; whole lines
    assert fim.cut_long(replace(infill, typed=typed + "q"), 140).typed == typed[4 * CUT_STEP:] + "q"
    rest = suffix[1:]  # the cursor line's own rest is the long line: its start
    assert fim.cut_long(replace(infill, suffix=rest), 140).suffix == rest[:CUT_STEP]
    fitted = fim.fit(cut, room=10_000, max_new=30, near_most=200)
    assert fitted.kept.prefix_tokens == (4, 4) and fitted.tokens[-len(cut.typed):] == chars(cut.typed)


def test_a_long_line_is_cut_by_tokenizing_about_what_is_kept_not_the_line_at_each_step():
    """A minified line of 60,000 characters at the cursor or after it: the cut tokenizes the line a few times and
    then steps of about what it keeps, not most of the line once per step (docs/bench/editor.md)."""
    seen: list[int] = []
    fim = FimPrompt(PLAIN, lambda text: seen.append(len(text)) or chars(text), "middle")
    line = "".join(chr(97 + i % 26) for i in range(60_000))
    long_typed, long_rest, long_below = (Infill("a\n", "\nz\n", line), Infill("a\n", line + "\nz\n", "x = "),
                                         Infill("a\n", "\n" + line, "x"))
    for infill in (long_typed, long_rest, long_below):
        seen.clear()
        cut = fim.cut_long(infill, 140)
        assert len(cut.typed) + len(cut.suffix) <= 2 * CUT_STEP + 140  # about half of 140 tokens, in whole steps
        assert sum(seen) <= 4 * len(line), (sum(seen), len(seen))


def test_the_typed_text_alone_when_the_nearest_lines_do_not_fit_the_room():
    f = FimPrompt(PLAIN, chars).fit(Infill("a\n" * 5, "b\n" * 5, "x" * 50), room=55, max_new=10)
    assert f.tokens == [PRE, *chars("x" * 50), SUF, MID] and f.kept.cut


def test_room_too_small_for_the_typed_text_is_a_clear_400():
    with pytest.raises(InvalidRequestError, match="shorter 'prompt'"):
        FimPrompt(PLAIN, chars).fit(Infill("a\n", "b\n", "x" * 50), room=20)


def test_model_without_fim_tokens_is_refused():
    with pytest.raises(UnsupportedModelError, match="fill-in-the-middle"):
        FimPrompt(Vocab(**{**QWEN_LIKE.__dict__, "fim_pre": None}), chars)


def test_the_anchor_is_the_start_of_the_line_before_the_cursor():
    pieces = lambda t: chr(t).encode() if t < 1000 else b""  # noqa: E731
    toks, _, _ = FimPrompt(QWEN_LIKE, chars).tokens(Infill("l1\nl2\nl3\n", "s1\n", "  x", (("u.py", "T\nU\n"),)))
    assert toks[cursor_anchor(toks, QWEN_LIKE, pieces):toks.index(SUF)] == chars("l3\n  x")
    spm = [SUF, *chars("s1\n"), PRE, *chars("l1\nl2\n  x"), MID]  # suffix first: the cursor is at <fim_middle>
    assert spm[cursor_anchor(spm, QWEN_LIKE, pieces):] == [*chars("l2\n  x"), MID]
    assert cursor_anchor(chars("no fim here\n"), QWEN_LIKE, pieces) is None
    short = FimPrompt(PLAIN, chars).tokens(Infill("", "s1\n", "x"))[0]
    assert cursor_anchor(short, PLAIN, pieces) == 1  # no line before the cursor: the prefix's start


def test_lines_cut_from_one_tokenization_as_from_their_own_text():
    """With a token's bytes at hand, the prefix and suffix are tokenized once and cut where lines start."""
    infill = Infill("".join(f"p{i}\n" for i in range(9)), "\n" + "".join(f"s{i}\n" for i in range(9)), "t")
    once = FimPrompt(PLAIN, chars, piece=lambda t: chr(t).encode())
    for take in (Take(), Take(3, 2), Take(0, 0), Take(9, 1)):
        assert once.tokens(infill, take) == FimPrompt(PLAIN, chars).tokens(infill, take)

    def pairs(text: str) -> list[int]:  # "\n\n" is one token, as BPE merges blank lines
        return [2000 if c == "\0" else ord(c) for c in text.replace("\n\n", "\0")]

    merged = FimPrompt(PLAIN, pairs, piece=lambda t: b"\n\n" if t == 2000 else chr(t).encode())
    tokens, starts = merged.split_lines("a\n\nb\n")
    assert tokens == [ord("a"), 2000, ord("b"), ord("\n")] and starts == [0, 2, 2, 4]  # the blank line inside a token


def test_a_shown_suggestion_taken_as_typed_as_llama_vim_asks_next():
    """llama.vim's s:fim_ctx_local with a previous completion: one line joins the typed text; with more, the lines but
    the last join the prefix and the last is the typed text; trailing empty lines are dropped first."""
    at = Infill("def f(x):\n", "\nprint(f(1))\n", "    return", (("a.py", "x = 1\n"),))
    assert accepted(at, " x + 1\n") == Infill(at.prefix, at.suffix, "    return x + 1", at.extra)
    assert accepted(at, " (x\n        + 1)\n\n") == Infill("def f(x):\n    return (x\n", at.suffix, "        + 1)",
                                                      at.extra)
    assert accepted(at, " (x\n\n  1)") == Infill("def f(x):\n    return (x\n\n", at.suffix, "  1)", at.extra)
    assert accepted(at, "\n\n") is None and accepted(at, "") is None


def test_the_editors_next_request_is_served_by_the_answer_left_in_the_prompt():
    """After an answer the editor asks again with the answer taken as typed; the prompt that serves it is the old
    prompt and the answer's own tokens, where its context is the context the request sends."""
    fim = FimPrompt(PLAIN, chars)
    at = Infill("a\nb\ndef f(x):\n", "\nz\n", "    return")
    prompt, _, _ = fim.tokens(at, Take(prefix_lines=2))  # the budget kept 2 lines of 3
    answer = " (x\n        + 1)"
    generated = chars(answer)  # cut by the time limit: the model had not chosen to end there
    cont = continuation(at, answer, prompt, generated, PLAIN, lambda t: chr(t).encode())
    assert cont.tokens == prompt + generated
    nxt = accepted(at, answer)
    assert cont.infill == nxt and cont.serves(nxt)
    assert cont.serves(Infill(nxt.prefix[2:], nxt.suffix, nxt.typed))  # the window dropped a line the prompt lacks
    assert not cont.serves(Infill(nxt.prefix[4:], nxt.suffix, nxt.typed))  # one the prompt holds
    assert not cont.serves(Infill(nxt.prefix, nxt.suffix, nxt.typed + "x"))  # typed on
    assert not cont.serves(Infill(nxt.prefix, nxt.suffix, nxt.typed, (("u.py", "T"),)))  # the ring changed
    # the shown text must end where a token ends, and the prompt must be a FIM prompt
    assert continuation(at, " (x\n", prompt, [ord(" "), 5000, 1], PLAIN, lambda t: {5000: b"(x\n  "}.get(
        t, chr(t).encode())) is None
    assert continuation(at, answer, chars("plain text"), generated, PLAIN, lambda t: chr(t).encode()) is None
    assert continuation(at, "\n\n", prompt, chars("\n\n"), PLAIN, lambda t: chr(t).encode()) is None
    # where the model chose the end (its end of text; empty lines the editor drops), it would choose it again
    assert continuation(at, answer, prompt, generated, PLAIN, lambda t: chr(t).encode(), ended=True) is None
    assert continuation(at, answer[:-1], prompt, generated, PLAIN, lambda t: chr(t).encode()) is None  # indent cut
    assert continuation(at, answer + "\n\n", prompt, chars(answer + "\n\n"), PLAIN, lambda t: chr(t).encode()) is None


def test_in_the_middle_layout_an_answer_the_model_ended_is_continued_at_the_next_line():
    """Typed text after <fim_middle> with its line done and the suffix after it: asked again as it stands, the model
    only ends again (an empty suggestion). Ended by the model (not by a stop string), the answer's prompt goes on
    with a line break, and the answer to the editor's next request starts with it."""
    fim = FimPrompt(PLAIN, chars, "middle")
    at = Infill("def f(x):\n", "\nz\n", "    return")
    prompt, _, _ = fim.tokens(at)
    piece = lambda t: chr(t).encode()  # noqa: E731
    answer = " x + 1"
    cont = continuation(at, answer, prompt, chars(answer), PLAIN, piece, "middle", ended=True, newline=[ord("\n")])
    assert cont.tokens == prompt + chars(answer + "\n") and cont.lead == "\n"
    assert cont.serves(accepted(at, answer))
    # the model's own line break, where it wrote one (the editor drops it): kept, and the lead is what it wrote
    cont = continuation(at, answer + "\n", prompt, chars(answer + "\n"), PLAIN, piece, "middle", ended=True,
                        newline=[ord("\n")])
    assert cont.tokens == prompt + chars(answer + "\n") and cont.lead == "\n"
    # without the newline's tokens (a stop string ended it), in the prefix layout, or past a blank line: none
    assert continuation(at, answer, prompt, chars(answer), PLAIN, piece, "middle", ended=True) is None
    plain_prompt, _, _ = FimPrompt(PLAIN, chars).tokens(at)
    assert continuation(at, answer, plain_prompt, chars(answer), PLAIN, piece, ended=True,
                        newline=[ord("\n")]) is None
    assert continuation(at, answer + "\nx", prompt, chars(answer + "\nx"), PLAIN, piece, "middle", ended=True,
                        newline=[ord("\n")]).lead == "\n"
    # not ended (cut by the time limit): as in the prefix layout, the prompt and the answer's tokens, no lead
    cont = continuation(at, answer, prompt, chars(answer), PLAIN, piece, "middle", newline=[ord("\n")])
    assert cont.tokens == prompt + chars(answer) and cont.lead == ""
    # cut at a line break the editor drops, also one token with the line's end (":\n"): the line is done, as above
    colon = lambda t: b"1:\n" if t == 5000 else chr(t).encode()  # noqa: E731
    for generated, spelt in ((chars(answer + "\n"), piece), ([*chars(" x + "), 5000], colon)):
        shown = b"".join(spelt(t) for t in generated).decode()
        cont = continuation(at, shown, prompt, generated, PLAIN, spelt, "middle")
        assert cont.tokens == prompt + generated and cont.lead == "\n" and cont.serves(accepted(at, shown))
        assert continuation(at, shown, plain_prompt, generated, PLAIN, spelt) is None  # the prefix layout: none
    assert continuation(at, " x + 1:", prompt, [*chars(" x + "), 5000, ord("y")], PLAIN, colon, "middle") is None


def test_the_stable_part_keeps_its_first_line_as_the_cursor_moves_down_and_a_fit_starts_there():
    """An aside build holds the lines before the cursor line: the nearest that fit `first` tokens, and, once built,
    from the same first line on while they fit `most`. A prompt priced against it starts where it does."""
    fim = FimPrompt(QWEN_LIKE, chars)
    lines = [f"l{i:03d}\n" for i in range(200)]  # 5 tokens a line
    tokens, held = fim.stable(Infill("".join(lines[:120]), "\n"), first=100, most=300)
    assert held == "".join(lines[100:120]) and tokens == [*fim.head(()), PRE, *chars(held)]
    later = Infill("".join(lines[:125]), "\n" + "".join(lines[126:130]), "  x")
    tokens2, held2 = fim.stable(later, first=100, most=300, held=held)
    assert held2 == "".join(lines[100:125]) and tokens2[:len(tokens)] == tokens
    assert fim.stable(later, first=100, most=110, held=held)[1] == "".join(lines[105:125])  # too wide: anew
    # an editor's speculative request put a suggestion's lines before the cursor; the next request has them no more
    shown = Infill("".join(lines[:120]) + "a suggested line\n", "\n")
    held3 = fim.stable(shown, first=100, most=300, held=held)[1]
    assert held3 == held + "a suggested line\n" and fim.stable(later, 100, 300, held3)[1] == held2
    assert fim.stable(later, first=100, most=300, held="gone\n")[1] == "".join(lines[105:125])
    fitted = fim.fit(later, room=10_000, max_new=60, new_tokens=lambda t: reuse.plan(tokens, t).new, starts=(25,))
    assert fitted.kept.prefix_tokens[0] == 25 * 5 and fitted.tokens[:len(tokens)] == tokens


def test_healing_leaves_out_the_word_the_typed_text_ends_inside():
    """Token healing gives the model the typed word back (prompts.fim.healed): from its start, whatever precedes it;
    nothing after a space, a bracket or an empty line in llama.cpp's layout, and nothing of a word longer than
    HEAL_MAX_CHARS."""
    at = Infill("def f(x):\n", "\n", "    return x.app", (("a.py", "x = 1\n"),))
    assert healed(at) == (Infill(at.prefix, at.suffix, "    return x.", at.extra), "app")
    assert healed(Infill("", "", "retur")) == (Infill("", "", ""), "retur")
    assert healed(Infill("", "", "    n_ctx_2")) == (Infill("", "", "    "), "n_ctx_2")
    for typed in ("    return x.", "f(", "x = ", "", "    ", "a" * (HEAL_MAX_CHARS + 1)):
        assert healed(Infill("", "", typed)) == (Infill("", "", typed), "")
    assert healed(Infill("", "", " " + "a" * HEAL_MAX_CHARS))[1] == "a" * HEAL_MAX_CHARS
    # after <fim_middle> the model reads the typed text as its own: the blanks it ends with are healed there too
    assert healed(Infill("", "", "for pattern "), "middle") == (Infill("", "", "for pattern"), " ")
    assert healed(Infill("", "", "x =\t "), "middle") == (Infill("", "", "x ="), "\t ")
    # there a word goes with the blank or the lone mark before it, which BPE writes as the word's first character
    # (" glob", ".append", "(self"); a mark after a blank or another mark is a token of its own (" (", "->")
    assert healed(Infill("", "", "    return x.app"), "middle") == (Infill("", "", "    return x"), ".app")
    assert healed(Infill("", "", "    let mut gl"), "middle") == (Infill("", "", "    let mut"), " gl")
    assert healed(Infill("", "", "gl"), "middle") == (Infill("", "", ""), "gl")
    for typed, word in (("f(sel", "(sel"), ("f (sel", "sel"), ("a->f", "f"), ("x = 12", "12"), ("self.__in", ".__in")):
        assert healed(Infill("", "", typed), "middle")[1] == word, typed
    # the character that goes along counts in HEAL_MAX_CHARS
    assert healed(Infill("", "", "x " + "a" * (HEAL_MAX_CHARS - 1)), "middle")[1] == " " + "a" * (HEAL_MAX_CHARS - 1)
    assert healed(Infill("", "", "x " + "a" * HEAL_MAX_CHARS), "middle")[1] == ""
    # and the punctuation it ends with, with the blanks before it: the model writes " !=" as one token, not " !", "="
    assert healed(Infill("", "", "f("), "middle") == (Infill("", "", "f"), "(")
    assert healed(Infill("", "", "    if status !"), "middle") == (Infill("", "", "    if status"), " !")
    assert healed(Infill("", "", '    print("a",'), "middle") == (Infill("", "", '    print("a'), '",')


def test_a_healed_answer_serves_the_editors_next_request_with_the_models_own_tokens():
    """The prompt left the typed word out and the answer's tokens spell it again: the next request (the answer taken
    as typed after the whole word) is served by that prompt and those tokens."""
    fim = FimPrompt(PLAIN, chars)
    at = Infill("a\ndef f(x):\n", "\nz\n", "    return x.app")
    held, heal = healed(at)
    prompt, _, _ = fim.tokens(held)
    answer = "end(1)\n    x"
    generated = chars(heal + answer)
    cont = continuation(held, heal + answer, prompt, generated, PLAIN, lambda t: chr(t).encode())
    assert cont is not None and cont.tokens == prompt + generated
    assert cont.infill == accepted(at, answer) and cont.serves(accepted(at, answer))


def test_the_lines_an_answer_ends_before_are_the_first_nonblank_ones_below_the_cursor_line():
    # The cursor line's rest is never one (the answer writes it), nor a short line that recurs in new code.
    infill = Infill("def f(x):\n", " + 1\n\n    }\n    y = g(x)\n\n        return y\n    z = 3\n", "    x")
    assert next_lines(infill) == ("y = g(x)", "return y")
    assert next_lines(replace(infill, suffix="\n")) == ()
    assert len(next_lines(Infill("", "\n" + "".join(f"line {i}\n" for i in range(9))))) == REPEAT_LINES


def test_lines_written_above_a_suffix_that_stayed_go_after_fim_middle():
    """New code written line by line above text that stays (the suffix): a request continues the slot's prompt, the
    lines written since its prefix starting the middle before the typed text (prompts.fim.written_since); where
    the suffix changed (a line below became the cursor line), or the prefix is not found just above the lines, not."""
    fim, piece = FimPrompt(PLAIN, chars, "middle"), lambda t: chr(t).encode()
    at = Infill("a\nb\nc\nd\ne\ndef f(x):\n", "\nz = f(1)\nprint(z)\n", "    y = 1")
    cached = fim.tokens(at)[0] + chars(" + x\n")  # the prompt and the answer after it
    down = Infill(at.prefix + "    y = 1 + x\n    y *= 2\n", at.suffix, "    ret")
    walked = written_since(down, cached, PLAIN, piece)
    assert walked == Infill(at.prefix, at.suffix, "    y = 1 + x\n    y *= 2\n    ret")
    mid = cached.index(PLAIN.fim_mid) + 1
    assert fim.tokens(walked)[0][:mid] == cached[:mid]  # all but the middle as cached
    # the editor's window dropped a line at its start: the prefix's end is found by its last lines (the anchor)
    assert written_since(replace(down, prefix=down.prefix[2:]), cached, PLAIN, piece).prefix == at.prefix[2:]
    assert written_since(replace(down, suffix="\nprint(z)\n"), cached, PLAIN, piece) is None  # the suffix moved up
    assert written_since(at, cached, PLAIN, piece) is None  # nothing written since: laid out as ever
    far = replace(down, prefix=at.prefix + "    y += 1\n" * (WRITTEN_LINES + 1))
    assert written_since(far, cached, PLAIN, piece) is None
    assert written_since(down, chars("plain text"), PLAIN, piece) is None


def test_an_answer_after_lines_written_serves_the_editors_next_request():
    """The prompt that continued the slot's with lines written since its prefix (written_since) leaves the answer
    for the editor's next request as any middle-layout prompt does: the lines written are held before the answer's."""
    fim, piece = FimPrompt(PLAIN, chars, "middle"), lambda t: chr(t).encode()
    at = Infill("a\ndef f(x):\n", "\nprint(f(1))\n", "    y = 1")
    down = Infill(at.prefix + "    y = 1 + x\n", at.suffix, "    return")
    prompt = fim.tokens(written_since(down, fim.tokens(at)[0], PLAIN, piece))[0]
    answer = " (y\n        + 1)"
    cont = continuation(down, answer, prompt, chars(answer), PLAIN, piece, "middle")
    assert cont is not None and cont.tokens == prompt + chars(answer) and cont.serves(accepted(down, answer))
