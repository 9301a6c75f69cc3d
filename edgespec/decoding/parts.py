"""A middle-layout FIM prompt held as parts, so that the suffix lines a cursor walks over are cut out without a leak.

Evaluated in one piece, every KV entry after a suffix line has seen it. When the cursor moves onto that line (a file
typed over, line by line), the entries kept from before still hold the line the user now writes again, and
completions copy it or go astray (docs/bench/editor.md). So the prompt's parts see less:
- the head (extra chunks, <fim_prefix>, the prefix, <fim_suffix>, the cursor line's rest) is evaluated as ever;
- the suffix lines in groups (config.FIM_GROUP_LINES), each group seeing the head and itself only;
- <fim_middle> and the whole lines written after it seeing the head and each other, no suffix line;
- the tail (the typed text; at least the prompt's last token, for its logits) seeing everything.
A prompt that keeps nothing past the head is evaluated in one piece, as ever (chunk reuse and all: decoding.reuse);
its suffix lines are one group then.
Otherwise a part is evaluated in a sequence of its own that holds only what it sees, right after it (llama.cpp
appends to a sequence only), and moved into place where that is elsewhere: a move re-rotates every cell of the cache.
A suffix line cut out leaves its group's later lines to evaluate again, where llama.cpp puts them, right after the
head: its positions stay empty, nothing else saw it, and nothing moves. The lines written after <fim_middle> add to
it where it is. Only the first parts after a prompt in one piece, and suffix lines added at the end (which move the
middle on), move anything. Pure: it reads token lists; the backend (backend.parted) moves the KV.

The parts plan as a decoding.reuse.Reuse, so that budgets price it as any other: its runs are what it keeps, and
the cells it moves count as moved (a re-rotation).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from edgespec.config import FIM_GROUP_LINES
from edgespec.decoding.reuse import Reuse, Run, common_prefix

PLAIN, MIDDLE = 0, -1  # cell labels: seen everything before it; <fim_middle> or a line after it. Groups are 1, 2, ...


@dataclass(frozen=True)
class Layout:
    """A middle-layout FIM prompt's parts, as prompt indices."""

    head: int  # prompt[:head]: through <fim_suffix> and the cursor line's rest
    lines: tuple[tuple[int, int], ...]  # the suffix's lines, [start, end)
    middle: tuple[int, int]  # <fim_middle> and the whole lines after it, [start, end); the tail follows


def layout(prompt: Sequence[int], marks: tuple[int, int, int], newline: np.ndarray) -> Layout | None:
    """`prompt` split into parts, `marks` its <fim_prefix>, <fim_suffix> and <fim_middle> tokens; None where it is not
    a middle-layout FIM prompt. A line ends with a token whose text ends with a newline (`newline`, by token id). The
    head takes the suffix's first line too, the rest of the cursor line: a cursor on the next line of a file typed
    over sends the same one (empty), and the lines it walks over come after it."""
    pre, suf, mid = marks
    tokens = list(prompt)
    try:
        s = tokens.index(suf, tokens.index(pre) + 1)
        m = tokens.index(mid, s + 1)
    except ValueError:
        return None
    at = newline[np.asarray(tokens, dtype=np.int64)]
    ends = (np.flatnonzero(at[s + 1:m]) + s + 2).tolist()
    written = np.flatnonzero(at[m + 1:])
    middle = (m, min(int(written[-1]) + m + 2 if written.size else m + 1, len(tokens) - 1))  # the tail: 1 at least
    if not ends:  # the cursor line's rest alone
        return Layout(m, (), middle)
    lines = tuple(zip(ends, ends[1:]))
    if ends[-1] < m:
        lines += ((ends[-1], m),)
    return Layout(ends[0], lines, middle)


@dataclass(frozen=True)
class Part:
    """Prompt tokens [start, end) evaluated at position `at` on, seeing the cells at the positions in `sees`."""

    start: int
    end: int
    at: int
    sees: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class PartsPlan(Reuse):
    """What to keep of a cache held as parts and what to evaluate, for one prompt (runs: prompt start, cache source,
    the cells kept where they are but the middle's, moved on by `shift`)."""

    shift: tuple[int, int] = (0, 0)  # (from position, by): the kept middle moves on
    shifted: int = 0  # cells it moves
    parts: tuple[Part, ...] = ()
    tail: int = 0  # prompt[tail:] evaluated last in the sequence itself
    positions: tuple[int, ...] = ()  # of every prompt token, once held
    labels: tuple[int, ...] = ()

    @property
    def moved(self) -> int:
        return self.shifted


def plan(tokens: Sequence[int], positions: Sequence[int], labels: Sequence[int], cached: Layout | None,
         prompt: Sequence[int], lay: Layout, group_lines: int = FIM_GROUP_LINES) -> PartsPlan | None:
    """What of a cache holding `tokens` at `positions`, labelled `labels` and laid out as `cached` (None: not a FIM
    prompt), a prompt laid out as `lay` keeps, and what it evaluates where; None where it keeps nothing past the
    head, to be evaluated in one piece as ever. A prompt evaluated in one piece gives its suffix lines as one group;
    its <fim_middle> and what follows saw them, and are not kept. A prompt that continues all the cache holds (the
    answer's tokens, the editor's request after it) keeps all of it, and evaluates the rest after it."""
    parted = _parted(tokens, positions, labels, cached, prompt, lay, group_lines)
    whole = common_prefix(tokens, prompt[:len(prompt) - 1])
    if whole <= lay.head or (parted is not None and parted.reused >= whole):
        return parted
    n = len(prompt) - whole
    return PartsPlan((Run(0, 0, whole),), len(prompt), tail=whole, labels=(*labels[:whole], *[PLAIN] * n),
                     positions=(*positions[:whole], *range(positions[whole - 1] + 1, positions[whole - 1] + 1 + n)))


def _parted(tokens: Sequence[int], positions: Sequence[int], labels: Sequence[int], cached: Layout | None,
            prompt: Sequence[int], lay: Layout, group_lines: int) -> PartsPlan | None:
    """plan's parts: each kept where it can be, the rest evaluated."""
    h = lay.head
    plain = next((i for i, (x, p) in enumerate(zip(labels, positions)) if x != PLAIN or p != i), len(tokens))
    c = min(common_prefix(tokens[:plain], prompt[:h]), h)
    runs = [Run(0, 0, c)] if c else []
    held = _held_lines(tokens, positions, labels, cached) if c == h and cached and cached.head == h else []
    lines = [list(prompt[a:b]) for a, b in lay.lines]
    cut, k = _match([list(tokens[a:b]) for a, b, _ in held], lines)
    base = h  # where a part that sees the head alone is evaluated
    fresh = iter(range(max(labels, default=0) + 1, 1 << 30))
    relabel = {g: next(fresh) for g in {g for _, _, g in held[cut:cut + k] if g == PLAIN}}  # a group from now on
    out_pos, out_lab, parts, at = list(range(h)), [PLAIN] * h, [], h
    again = held[cut][2] if k and cut and held[cut - 1][2] == held[cut][2] else None  # its group lost lines before it
    rest = next(fresh) if again is not None else None
    for (a, b, g), (start, end) in zip(held[cut:cut + k], lay.lines):
        if g == again:  # saw a line cut out: evaluated again right after the head, where nothing moves
            parts[-1:] = [Part(parts[-1].start if parts else start, end, base, ((0, h),))]
            out_pos += range(parts[-1].at + start - parts[-1].start, parts[-1].at + end - parts[-1].start)
        else:
            runs.append(Run(start, a, b - a))
            out_pos += positions[a:b]
        out_lab += [rest if g == again else relabel.get(g, g)] * (b - a)
        at = out_pos[-1] + 1
    for g0 in range(k, len(lines), group_lines):  # new lines at the end, in groups
        a, b = lay.lines[g0][0], lay.lines[min(g0 + group_lines, len(lines)) - 1][1]
        parts.append(Part(a, b, at, ((0, h),)))
        out_pos += range(at, at + b - a)
        out_lab += [next(fresh)] * (b - a)
        at += b - a
    return _with_middle(tokens, positions, labels, prompt, lay, c == h, at, runs, parts, out_pos, out_lab)


def _with_middle(tokens: Sequence[int], positions: Sequence[int], labels: Sequence[int], prompt: Sequence[int],
                 lay: Layout, same_head: bool, at: int, runs: list[Run], parts: list[Part], out_pos: list[int],
                 out_lab: list[int]) -> PartsPlan | None:
    """The plan with the middle (kept as far as it matches, moved on past the suffix's end `at` where it must) and
    the tail added; None where it keeps nothing past the head."""
    h, (m0, m1) = lay.head, lay.middle
    mids = [i for i, x in enumerate(labels) if x == MIDDLE] if same_head else []
    kept = common_prefix([tokens[i] for i in mids], prompt[m0:m1]) if mids else 0
    start = positions[mids[0]] if kept else at
    shift = (start, at - start) if kept and at > start else (0, 0)
    start += shift[1]
    if kept:
        runs.append(Run(m0, mids[0], kept))
    if m0 + kept < m1:
        parts.append(Part(m0 + kept, m1, start + kept, ((0, h), (start, start + kept)) if kept else ((0, h),)))
    out_pos += range(start, start + len(prompt) - m0)
    out_lab += [MIDDLE] * (m1 - m0) + [PLAIN] * (len(prompt) - m1)
    if not same_head or len(runs) == 1:  # nothing kept past the head: in one piece, as ever (decoding.reuse)
        return None
    moving = sum(p.end - p.start for p in parts if p.at != max(hi for _, hi in p.sees))
    return PartsPlan(tuple(runs), len(prompt), shift, (kept if shift[1] else 0) + moving, tuple(parts), m1,
                     tuple(out_pos), tuple(out_lab))


def _held_lines(tokens: Sequence[int], positions: Sequence[int], labels: Sequence[int],
                cached: Layout) -> list[tuple[int, int, int]]:
    """The suffix lines a cache laid out as `cached` holds as groups, (start, end, group): a group's lines, or a
    suffix evaluated in one piece right after the head (group PLAIN); up to the first line that is neither."""
    out = []
    for a, b in cached.lines:
        group = set(labels[a:b])
        if len(group) != 1 or (g := group.pop()) == MIDDLE or (g == PLAIN and positions[b - 1] != b - 1):
            break
        out.append((a, b, g))
    return out


def _match(held: list[list[int]], lines: list[list[int]]) -> tuple[int, int]:
    """(cut, k): the first held line from which on the held lines start the prompt's, and how many match; (0, 0)
    where none do. The lines before `cut` were walked over."""
    for cut in range(len(held)):
        k = min(len(lines), len(held) - cut)
        if k and held[cut:cut + k] == lines[:k]:
            return cut, k
    return 0, 0
