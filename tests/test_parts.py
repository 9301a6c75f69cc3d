"""A FIM prompt held as parts (decoding.parts, backend.parted): the plan on token lists, then on a real model that a
suffix line the cursor walks onto leaks into nothing the cache keeps, and what a line start evaluates."""

from __future__ import annotations

import numpy as np
import pytest

from edgespec.decoding import parts
from edgespec.decoding.loop import Stats, planned, prefill

PRE, SUF, MID, NL = 1, 2, 3, 10  # token ids of the pure tests; NL alone ends a line
NEWLINE = np.zeros(64, dtype=bool)
NEWLINE[NL] = True
MARKS = (PRE, SUF, MID)


def line(n: int, k: int = 3) -> list[int]:
    """A line of `k` tokens and its newline, told apart by `n`."""
    return [20 + (n + i) % 40 for i in range(k)] + [NL]


def prompt(prefix: int, suffix: range, written: range, typed: int = 2) -> list[int]:
    """<fim_prefix>, `prefix` lines, <fim_suffix>, the cursor line's rest (empty), the `suffix` lines, <fim_middle>,
    the `written` lines, `typed` tokens of the cursor line."""
    return [PRE, *[t for i in range(prefix) for t in line(100 + i)], SUF, NL, *[t for i in suffix for t in line(i)],
            MID, *[t for i in written for t in line(200 + i)], *[30] * typed]


def held(p: list[int], plan: parts.PartsPlan) -> tuple[list[int], list[int], list[int], parts.Layout | None]:
    """What a cache holds once `plan` for `p` ran: its tokens, positions and labels, and its layout."""
    return p, list(plan.positions), list(plan.labels), parts.layout(p, MARKS, NEWLINE)


def plan_for(cache: tuple, p: list[int]) -> parts.PartsPlan:
    tokens, positions, labels, lay = cache
    return parts.plan(tokens, positions, labels, lay, p, parts.layout(p, MARKS, NEWLINE), 4)


def test_a_prompt_is_split_into_head_suffix_lines_middle_and_tail():
    p = prompt(2, range(3), range(1))
    lay = parts.layout(p, MARKS, NEWLINE)
    assert p[:lay.head] == [PRE, *line(100), *line(101), SUF, NL]
    assert [p[a:b] for a, b in lay.lines] == [line(0), line(1), line(2)]
    assert p[lay.middle[0]:lay.middle[1]] == [MID, *line(200)] and p[lay.middle[1]:] == [30, 30]
    assert parts.layout([PRE, 5, SUF, 6, MID], MARKS, NEWLINE).middle == (4, 4)  # the tail holds the last token
    assert parts.layout([5, 6, NL], MARKS, NEWLINE) is None


def in_one_piece(p: list[int]) -> tuple:
    return p, list(range(len(p))), [parts.PLAIN] * len(p), parts.layout(p, MARKS, NEWLINE)


def test_a_prompt_that_keeps_nothing_past_the_head_is_left_to_be_evaluated_in_one_piece():
    first = prompt(2, range(3), range(0))
    assert plan_for(([], [], [], None), first) is None
    assert plan_for(in_one_piece(prompt(3, range(3), range(0))), first) is None  # another head


def test_a_line_start_evaluates_the_rest_of_one_group_the_line_written_and_the_typed_text():
    cache = in_one_piece(prompt(2, range(3), range(0)))
    grown = prompt(2, range(12), range(0))  # the pause's wider suffix: the one piece becomes a group, 9 lines new
    plan = plan_for(cache, grown)
    assert [(q.end - q.start, q.sees) for q in plan.parts] == [(16, ((0, 11),)), (16, ((0, 11),)), (4, ((0, 11),)),
                                                                (1, ((0, 11),))]  # 3 groups, then <fim_middle>
    assert plan.moved == 37  # each evaluated after the head, moved on past the groups before it
    cache = held(grown, plan)
    walked = prompt(2, range(1, 12), range(1))  # the cursor on the next line: suffix line 0 is cut, line written
    plan = plan_for(cache, walked)
    rest, written = plan.parts
    assert walked[rest.start:rest.end] == line(1) + line(2) and rest.at == 11  # right after the head, nothing moves
    assert walked[written.start:written.end] == line(200) and written.sees == ((0, 11), (plan.positions[
        walked.index(MID)], plan.positions[walked.index(MID)] + 1))
    assert plan.moved == 0 and plan.new == 8 + 4 + 2
    kept = {walked[r.start:r.end][0] for r in plan.runs[1:]}
    assert line(3)[0] in kept and line(1)[0] not in kept  # groups after the cut one stay, its rest does not
    assert list(plan.positions) == sorted(set(plan.positions))  # increasing, the cut line's positions left empty
    cache = held(walked, plan)
    typing = walked[:-1] + [31, 32]  # typing on along the line: what it adds to the tail alone
    assert plan_for(cache, typing).new == 2 and plan_for(cache, typing).parts == ()


@pytest.fixture(scope="module")
def coder(qwen_draft_path):
    from edgespec.backend import Model
    from edgespec.config import LoadConfig

    with Model(qwen_draft_path, LoadConfig(n_ctx=2048, n_seq=1, fim_groups=4)) as m:
        yield m


LINES = [s for i in range(40) for s in (f"def f{i}(x):\n", f"    y = x * {i} + {i % 7}\n", "    return y\n")]


def walk(m, lines: list[str], at: int, steps: int, below: list[str] | None = None) -> list[np.ndarray]:
    """`lines` typed over from line `at` on, the lines below the cursor as in `below` (default: the same): a request
    at each line's indent; its slot first grown to 24 suffix lines in a pause, as `edgespec serve` grows it. The
    logits of each request's prompt."""
    seq, below = m.sequences[0], below or lines
    seq.trim(0)
    tok = lambda text: m.tokenize(text, add_special=False, parse_special=False)  # noqa: E731
    v = m.vocab
    head = [v.fim_pre, *tok("".join(lines[at - 12:at])), v.fim_suf, *tok("\n")]

    def request(y: int, end: int) -> list[int]:
        return [*head, *tok("".join(below[y + 1:at + end])), v.fim_mid, *tok("".join(lines[at:y])), *tok("    ")]

    for end in (4, 8, 12, 16, 20, 25):  # a budget's suffix, then a group at a time
        prefill(seq, request(at, end), Stats(), True, 256)
    out = []
    for y in range(at, at + steps):
        out.append(prefill(seq, request(y, 25), Stats(), True, 256).copy())
    return out


def test_a_suffix_line_the_cursor_walks_onto_leaks_into_nothing_the_cache_keeps(coder):
    """The line below the cursor read one way in the suffix, then typed over another way: once the cursor is on it
    (cut out of the suffix), the cache gives what it gives where the suffix read as typed, to the bit (tokens of the
    same count: the same batch shapes); before, the line was seen."""
    at, old = 30, list(LINES)
    old[at + 1] = old[at + 1].replace("y =", "z =")
    assert len(coder.tokenize(LINES[at + 1])) == len(coder.tokenize(old[at + 1]))
    a, b = walk(coder, LINES, at, 4), walk(coder, LINES, at, 4, below=old)
    assert not np.array_equal(a[0], b[0])  # line at + 1 in the suffix: it counts
    for y in range(1, 4):  # the cursor on it and past it: the group that saw it evaluated again
        assert np.array_equal(a[y], b[y]), y


def test_a_line_start_in_a_file_typed_over_evaluates_a_few_dozen_tokens_and_keeps_the_wide_suffix(coder):
    at = 30
    walk(coder, LINES, at, 1)
    seq, tok = coder.sequences[0], lambda text: coder.tokenize(text, add_special=False, parse_special=False)
    v = coder.vocab
    p = [v.fim_pre, *tok("".join(LINES[at - 12:at])), v.fim_suf, *tok("\n"), *tok("".join(LINES[at + 2:at + 25])),
         v.fim_mid, *tok("".join(LINES[at:at + 1])), *tok("    ")]
    plan = planned(seq, p, 256)
    assert isinstance(plan, parts.PartsPlan) and plan.moved == 0
    suffix = len(tok("".join(LINES[at + 2:at + 25])))
    assert plan.new <= 3 * len(tok(LINES[at + 1])) + len(tok(LINES[at])) + 1 < suffix  # one group's rest at most
    rows = prefill(seq, p, Stats(), True, 256)
    assert rows is not None and seq.tokens == p and seq.plain < len(p)
    assert seq.pos_max() == seq.position(len(p) - 1)


def test_a_prompt_of_another_kind_keeps_what_precedes_the_parts_and_then_holds_in_one_piece(coder):
    """A chat or llama.cpp-layout prompt on a slot that holds parts keeps the plain head at most: positions after it
    were left empty by cut lines, and its cells saw less than a plain cell would. A cache cut where positions jump
    (a speculative cycle's rollback) ends where the token before the cut is."""
    walk(coder, LINES, 30, 2)
    seq = coder.sequences[0]
    hole = next(i for i in range(1, seq.n_past) if seq.position(i) > seq.position(i - 1) + 1)
    assert seq.plain <= hole < seq.n_past
    seq.trim(hole)
    assert seq.n_past == hole and seq.pos_max() == seq.position(hole - 1)
    other = [*seq.tokens[:seq.plain], *coder.tokenize("    return 0\n", add_special=False)]
    plan = planned(seq, other, 256)
    assert not isinstance(plan, parts.PartsPlan) and plan.reused <= seq.plain
    assert prefill(seq, other, Stats(), True, 256) is not None
    assert seq.tokens == other and seq.plain == seq.n_past and seq.pos_max() == len(other) - 1


def test_a_server_with_fim_groups_grows_the_suffix_in_pauses_and_a_line_start_keeps_it(qwen_draft_path):
    """`edgespec serve --fim-groups 4`, a file typed over line by line with llama.vim's budgeted requests and a pause
    after each answer: the pauses grow the suffix the slot holds well past what a cold request's budget bought, and
    later line starts keep it, evaluating a few dozen tokens."""
    import time

    import httpx
    from test_server import Server

    server = Server(qwen_draft_path, "--ctx", "4096", "--slots", "1", "--cache-ram", "0", "--fim-groups", "4")
    try:
        answers = []
        for y in range(30, 37):
            body = {"input_prefix": "".join(LINES[:y]), "input_suffix": "\n" + "".join(LINES[y + 1:y + 40]),
                    "prompt": "    ", "n_predict": 8, "temperature": 0, "t_max_prompt_ms": 300,
                    "t_max_predict_ms": 500}
            answers.append(httpx.post(server.url + "/infill", json=body, timeout=300).json())
            time.sleep(3)  # the user reads the answer: the slot's suffix grows meanwhile
        first, later = answers[0], answers[3:]
        widest = max(a["infill"]["suffix_tokens"][0] for a in later)
        assert widest >= 3 * first["infill"]["suffix_tokens"][0], [a["infill"] for a in answers]
        held = [a for a in later if a["infill"]["suffix_tokens"][0] == widest]
        assert all(a["timings"]["prompt_n"] <= 48 for a in held), [a["timings"] for a in held]
    finally:
        server.stop()
