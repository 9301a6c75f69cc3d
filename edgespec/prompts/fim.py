"""Fill-in-the-middle prompts from the model's own FIM tokens, in llama.cpp's repo-level layout:

    [<repo>myproject\\n] [<file_sep>name\\ntext]... [<file_sep>filename\\n]
    <fim_prefix>prefix <fim_suffix>suffix <fim_middle>

The typed part of the cursor line (/infill's `prompt`) goes at the end of the prefix (layout "prefix", llama.cpp's)
or at the start of the middle (layout "middle"): there a keystroke appends to the prompt instead of moving the
suffix after it, so the cache keeps everything but the new characters.

How much context a prompt takes: `llama_cpp_sizes` cuts as llama.cpp's server does for its batch size (3/4 of it
for the prefix, the rest for the suffix, extra chunks in what is left of the context); `fit` takes whole lines
nearest the cursor first, as many as a budget of newly evaluated tokens allows, after `cut_long` has cut a long line
at the cursor.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Iterator, Sequence, TypeVar

import numpy as np

from edgespec.errors import InvalidRequestError, UnsupportedModelError
from edgespec.gguf import Vocab

# llama.cpp separates extra chunks this way when the model has no file separator token.
CHUNK_SEPARATOR = "\n\n--- snippet ---\n\n"
LAYOUTS = ("prefix", "middle")
FIT_STEPS = 256  # resolution of the search over how many lines to keep: a step is one line of a 256-line window
# Lines before the cursor a budget never leaves out (and the suffix's SUFFIX_LINES with them). While the user types,
# they slide with the cursor and cost only the line just written (the rest is cached, moved); a cold cache pays once.
NEAR_LINES = 8
# Suffix lines a budgeted prompt takes (the cursor line's rest and the next two), more only where SUFFIX_SHARE buys
# them: past the cursor nothing moved is reused (cursor_anchor), so the suffix is evaluated again wherever it moves, on
# every keystroke in the prefix layout, once a line in the middle layout. In sessions two completed better than one.
# Blank lines after the cursor line's rest are not counted: a token each, and the line after them says what comes.
SUFFIX_LINES = 3
# Of what a budget has left past them, the share that buys further suffix lines. Fresh suffix lines complete better
# (docs/bench/editor.md), but every keystroke pays for them: on a 2-core CPU this buys less than a line, where a
# batch is nearly free (a GPU) it buys the editor's whole suffix window.
SUFFIX_SHARE = 0.1
# Tokens at a time a line too long for the budget is cut by from its end (FimPrompt._tail): whole steps, so the
# next request at the cursor finds the same cut cached.
TAIL_STEP = 16
# Characters at a time a long line next to the cursor is cut by (FimPrompt.cut_long): whole steps from the typed
# text's start and the suffix's, which stay while the user types, so the next request finds the same cut cached.
CUT_STEP = 64
# An answer ends before a line that repeats one of the first REPEAT_LINES non-blank lines below the cursor line
# (text.RepeatLimit), lines of REPEAT_MIN_CHARS or more: a `}` or an `end` recurs in new code. Without the rule the
# editor's speculative request ran on to its t_max_predict_ms, writing lines the file holds (docs/bench/editor.md).
REPEAT_LINES = 3
REPEAT_MIN_CHARS = 4
# Lines written since a slot's prompt (new code above text that stayed below) go after <fim_middle>, before the typed
# text, while its prefix and suffix stay: a line start then evaluates the line written, not the suffix again after a
# longer prefix. Up to this many lines; past them the prompt is laid out afresh.
WRITTEN_LINES = 32
WRITTEN_ANCHOR_LINES = 4  # the cached prefix's last lines that locate its end in a request's prefix
HELD_LINES = 8  # lines at the start of a cached prompt's lines that locate it in a request's (lines_start)
ANCHOR_SCAN = 512  # tokens before the cursor searched for the line before it (cursor_anchor); a longer line ends it
# The longest word healed, the character before it counted where it goes along (the answer spells it again, a
# token at a time): past it, none is.
HEAL_MAX_CHARS = 48
_WORD_END = re.compile(r"\w+\Z")
# In the middle layout, with the blank or the lone mark before it that BPE writes as the word's first character
# (" glob", ".free", "(self"; " (" and "->" are tokens of their own): left in, it is a token the model never ends on.
_WORD_LEAD_END = re.compile(r"(?:[ \t](?=[^\W\d])|(?:(?<=[\w\n])|\A)[^\w\s])?\w+\Z")
_BLANK_END = re.compile(r"[ \t]+\Z")
_MARK_END = re.compile(r"[ \t]*[^\w\s]+\Z")  # punctuation, with the blanks before it: BPE merges them (" !=", " (")
T = TypeVar("T")


@dataclass(frozen=True)
class Infill:
    """What an editor sends around the cursor."""

    prefix: str  # the lines before the cursor line
    suffix: str  # the rest of the cursor line, then the lines after it
    typed: str = ""  # the cursor line before the cursor
    extra: tuple[tuple[str, str], ...] = ()  # (filename, text) of other chunks, oldest first


@dataclass(frozen=True)
class Take:
    """How much of an Infill a prompt holds, counted from the cursor outwards (None: all of it)."""

    prefix_lines: int | None = None
    suffix_lines: int | None = None
    extra_chunks: int | None = None  # the latest ones


@dataclass(frozen=True)
class Kept:
    """What a prompt kept of an Infill and what it was given: (kept, given) prefix and suffix tokens and chunks."""

    prefix_tokens: tuple[int, int]
    suffix_tokens: tuple[int, int]
    extra_chunks: tuple[int, int]
    typed_tokens: tuple[int, int] = (0, 0)  # the cursor line's typed part: cut only in a long line (cut_long)

    @property
    def cut(self) -> bool:
        return any(kept < given for kept, given in (self.prefix_tokens, self.suffix_tokens, self.extra_chunks,
                                                     self.typed_tokens))

    def to_dict(self) -> dict[str, list[int]]:
        return {"prefix_tokens": list(self.prefix_tokens), "suffix_tokens": list(self.suffix_tokens),
                "extra_chunks": list(self.extra_chunks), "typed_tokens": list(self.typed_tokens)}


class FimPrompt:
    """FIM prompts for one model: its FIM tokens, its tokenizer (no BOS, special tokens not parsed) and a layout."""

    def __init__(self, vocab: Vocab, tokenize: Callable[[str], list[int]], layout: str = "prefix",
                 piece: Callable[[int], bytes] | None = None) -> None:
        """`piece`: a token's bytes. With it the prefix and suffix are tokenized once and cut at the tokens where
        lines start (as llama.cpp cuts tokens), instead of tokenizing the lines of every candidate prompt."""
        if vocab.fim_pre is None or vocab.fim_suf is None or vocab.fim_mid is None:
            raise UnsupportedModelError("this model has no fill-in-the-middle tokens; use a code model such as "
                                        "qwen2.5-coder-1.5b for /infill")
        if layout not in LAYOUTS:
            raise InvalidRequestError(f"FIM layout {layout!r} must be one of {', '.join(LAYOUTS)}")
        self.vocab, self.tokenize, self.layout, self.piece = vocab, tokenize, layout, piece
        self._lines: dict[str, tuple[list[int], list[int]] | None] = {}

    def split_lines(self, text: str) -> tuple[list[int], list[int]] | None:
        """`text`'s tokens and the index of the token each of its lines starts at, then len(tokens) (a line whose
        start falls inside a token starts after it); None without `piece`, or where the tokens' bytes are not the
        text's (a tokenizer that adds a space)."""
        if text not in self._lines:
            self._lines[text] = None
            if self.piece is not None:
                tokens = self.tokenize(text)
                ends = np.cumsum([len(self.piece(t)) for t in tokens], dtype=np.int64)
                line_ends = np.cumsum([len(line.encode()) for line in text.splitlines(keepends=True)], dtype=np.int64)
                if (ends[-1] if len(ends) else 0) == (line_ends[-1] if len(line_ends) else 0):
                    starts = np.searchsorted(ends, line_ends[:-1], side="left") + 1
                    self._lines[text] = tokens, [0, *starts.tolist(), len(tokens)] if len(line_ends) else [0]
        return self._lines[text]

    def head(self, extra: Sequence[tuple[str, str]]) -> list[int]:
        """The repository part: the project name and the extra chunks, each under its file name."""
        v, out = self.vocab, []
        if v.fim_rep is not None:
            out += [v.fim_rep, *self.tokenize("myproject\n")]
        for filename, text in extra:
            out += [v.fim_sep, *self.tokenize(filename + "\n")] if v.fim_sep is not None else \
                self.tokenize(CHUNK_SEPARATOR)
            out += self.tokenize(text)
        if v.fim_sep is not None:
            out += [v.fim_sep, *self.tokenize("filename\n")]
        return out

    def assemble(self, head: list[int], pre: list[int], typed: list[int], suf: list[int]) -> list[int]:
        v = self.vocab
        bos = [v.bos] if v.add_bos and v.bos is not None else []  # after the extra context, as llama.cpp
        if self.layout == "middle":
            return [*head, *bos, v.fim_pre, *pre, v.fim_suf, *suf, v.fim_mid, *typed]
        return [*head, *bos, v.fim_pre, *pre, *typed, v.fim_suf, *suf, v.fim_mid]

    def warm_up(self, extra: Sequence[tuple[str, str]], cached: Sequence[int]) -> list[int] | None:
        """An editor's warm-up (extra chunks, no prefix or suffix): the chunks, then the FIM part a slot's `cached`
        prompt holds (<fim_prefix> to <fim_middle>, or to its end where a stopped evaluation left no <fim_middle>:
        a widening the warm-up preempted still holds the lines), so the next completion finds both cached instead of
        its lines evicted by the warm-up; None when the slot holds no FIM part."""
        v, cached = self.vocab, list(cached)
        if (pre := _last(cached, v.fim_pre)) is None:
            return None
        body = cached[pre:_find(cached, v.fim_mid, pre) + 1]
        return [*self.head(extra), *([v.bos] if v.add_bos and v.bos is not None else []), *body]

    def tokens(self, infill: Infill, take: Take = Take()) -> tuple[list[int], list[int], list[int]]:
        """The prompt holding `take` of `infill` (whole lines nearest the cursor, the latest extra chunks), and the
        prefix and suffix tokens it holds."""
        pre_lines, suf_lines = infill.prefix.splitlines(keepends=True), infill.suffix.splitlines(keepends=True)
        n_pre, n_suf, n_extra = (_count(take.prefix_lines, len(pre_lines)), _count(take.suffix_lines, len(suf_lines)),
                                 _count(take.extra_chunks, len(infill.extra)))
        pre = self.lines_tokens(infill.prefix, pre_lines, len(pre_lines) - n_pre, len(pre_lines))
        suf = self.lines_tokens(infill.suffix, suf_lines, 0, n_suf)
        extra = infill.extra[len(infill.extra) - n_extra:]
        return self.assemble(self.head(extra), pre, self.tokenize(infill.typed), suf), pre, suf

    def lines_tokens(self, text: str, lines: list[str], first: int, last: int) -> list[int]:
        """The tokens of `lines[first:last]` of `text`: cut from its one tokenization where there is one."""
        if (split := self.split_lines(text)) is not None:
            tokens, starts = split
            return tokens[starts[first]:starts[last]]
        return self.tokenize("".join(lines[first:last]))

    def kept(self, infill: Infill, pre: list[int], suf: list[int], n_extra: int) -> Kept:
        """What a prompt with these prefix and suffix tokens (and all the typed text) kept of `infill`."""
        typed = len(self.tokenize(infill.typed))
        return Kept((len(pre), len(self.tokenize(infill.prefix))), (len(suf), len(self.tokenize(infill.suffix))),
                    (n_extra, len(infill.extra)), (typed, typed))

    def llama_cpp_sizes(self, infill: Infill, n_batch: int, n_ctx: int, n_predict: int) -> tuple[list[int], Kept]:
        """The prompt llama.cpp's server builds (format_prompt_infill): the prefix's last 3/4 of n_batch tokens, the
        suffix's first n_batch/4 less the typed part, and the end of the extra chunks in the room left."""
        head, pre, suf = self.head(infill.extra), self.tokenize(infill.prefix), self.tokenize(infill.suffix)
        typed = self.tokenize(infill.typed)
        n_pre = min(len(pre), 3 * (n_batch // 4))
        n_suf = min(len(suf), max(0, n_batch // 4 - (2 + len(typed))))
        n_head = min(max(0, n_ctx - n_batch - 2 * n_predict), len(head))
        prompt = self.assemble(head[len(head) - n_head:], pre[len(pre) - n_pre:], typed, suf[:n_suf])
        return prompt, Kept((n_pre, len(pre)), (n_suf, len(suf)),
                            (len(infill.extra) if n_head == len(head) else 0, len(infill.extra)), (len(typed),) * 2)

    def fit(self, infill: Infill, room: int, max_new: int | None = None,
            new_tokens: Callable[[list[int]], int] = len, starts: Sequence[int] = (),
            near_most: int | None = None) -> Fitted:
        """The widest prompt of at most `room` tokens of which at most `max_new` are new (`new_tokens` counts them
        against what is cached): whole lines nearest the cursor first, then the latest extra chunks. A budget below
        the cost of the nearest lines (NEAR_LINES before the cursor, with fewer suffix lines, then fewer of them, where
        they cost more than `near_most`) is raised to it: without them a completion is a guess, and what the cache
        holds around them comes free. `starts`: counts of prefix lines where a cache's prompt starts (cheaper alone)."""
        def fits(take: Take, most: int | None) -> tuple[list[int], list[int], list[int]] | None:
            built = self.tokens(infill, take)
            ok = len(built[0]) <= room and (most is None or new_tokens(built[0]) <= most)
            return built if ok else None

        memo: dict[tuple[int, int], tuple[tuple[list[int], list[int], list[int]], int | None]] = {}

        def lines(step: int) -> tuple[tuple[list[int], list[int], list[int]], int | None]:
            """The prompt taking `step` of the lines, and its new tokens (None: over the room)."""
            if (step, least) not in memo:
                built = self.tokens(infill, _share(infill, step, 0, least, least))
                memo[step, least] = built, new_tokens(built[0]) if len(built[0]) <= room else None
            return memo[step, least]

        n_near, n_lines, least = NEAR_LINES, len(infill.prefix.splitlines()), SUFFIX_LINES  # least: suffix lines
        near, cached = _steps_for(n_near, n_lines), {_steps_for(k, n_lines) for k in starts}

        def lowest(first: int) -> int:  # the nearest lines' cost, where they cost least: alone, or with what is cached
            costs = [c for s in {first, *_grid(FIT_STEPS), *cached} if s >= first and (c := lines(s)[1]) is not None]
            return min(costs, default=max_new or 0)

        if max_new is not None:
            floor = lowest(near)
            # a slow CPU's budget, long lines: the suffix down to the cursor line's rest first (lines before the
            # cursor say more), then fewer of the nearest lines
            while near_most is not None and floor > near_most and (least > 1 or n_near > 0):
                least, n_near = (least - 1, n_near) if least > 1 else (least, n_near - 1)
                near = _steps_for(n_near, n_lines)
                floor = lowest(near)
            max_new = max(max_new, floor)

        def affordable(step: int) -> tuple[list[int], list[int], list[int]] | None:
            built, cost = lines(step)
            return built if cost is not None and (max_new is None or cost <= max_new) else None

        also = (near, *cached) if max_new is not None else ()
        step, built = _widest(FIT_STEPS, affordable, also)
        if step == 0 and (tail := self._tail(infill, room, max_new, near_most, new_tokens)) is not None:
            return tail
        if built is None:  # not even the nearest lines fit the room: the typed text alone, over the budget
            if (built := fits(Take(0, 0, 0), None)) is None:
                alone = len(self.tokens(infill, Take(0, 0, 0))[0])
                raise InvalidRequestError(f"the typed text and FIM tokens take {alone} tokens, more than the {room} "
                                          f"available for the prompt; send a shorter 'prompt'")
            return Fitted(built[0], self.kept(infill, built[1], built[2], 0), 0, 0)
        cap: int | None = least
        if max_new is not None:  # the suffix's further lines: free where cached unchanged, else a share of the budget
            cap, built = _suffix(self, infill, step, room, lines(step)[1] or 0, max_new, new_tokens, built, least)
        n_extra, with_extra = _largest(len(infill.extra), lambda e: fits(_share(infill, step, e, cap, least), max_new))
        prompt, pre, suf = with_extra or built
        return Fitted(prompt, self.kept(infill, pre, suf, n_extra), step, n_extra)

    def _tail(self, infill: Infill, room: int, max_new: int | None, near_most: int | None,
              new_tokens: Callable[[list[int]], int]) -> Fitted | None:
        """Where not even the line before the cursor fits a budget (a very long one): its end, cut at a token as
        llama.cpp cuts, TAIL_STEP tokens at a time (the next request finds the same cut cached), as much as the
        nearest lines may take (fit's `max_new`, `near_most`), with the suffix's nearest lines where they fit too;
        None without a budget or where no step of it fits."""
        if max_new is None or not (lines := infill.prefix.splitlines(keepends=True)):
            return None
        most = max(max_new, near_most or 0)
        last, typed = self.lines_tokens(infill.prefix, lines, len(lines) - 1, len(lines)), self.tokenize(infill.typed)
        head, suffix = self.head(()), infill.suffix.splitlines(keepends=True)
        for n_suf in dict.fromkeys([_share(infill, FIT_STEPS, 0).suffix_lines or 0, 0]):  # its nearest, or none
            suf = self.lines_tokens(infill.suffix, suffix, 0, n_suf)
            # the widest first, from twice what the budget buys fresh: a cut the cache holds was sized to a budget
            # like this one, and a line of thousands of tokens (minified code) is not priced step by step
            for k in range(min(len(last) - 1, room, 2 * most) // TAIL_STEP, 0, -1):
                pre = last[len(last) - k * TAIL_STEP:]
                prompt = self.assemble(head, pre, typed, suf)
                if len(prompt) <= room and new_tokens(prompt) <= most:
                    return Fitted(prompt, self.kept(infill, pre, suf, 0), 0, 0)
        return None

    def cut_long(self, infill: Infill, most: int) -> Infill:
        """`infill` with what a long line puts next to the cursor cut where it alone is over twice `most` tokens
        (what the nearest lines may take; a line of code is far shorter): the typed text (the cursor far into a long
        line) to its end, the suffix to fewer of its nearest lines, else to the start of its first. Cut to half of
        `most` in whole CUT_STEPs of characters, so that typing on finds the same cut cached. The steps are tried
        from the cursor outwards, the widest taken before the first that does not fit: each tokenization is about
        `half` tokens, where trying them from the far end tokenized most of the line at each step
        (docs/bench/editor.md)."""
        fits = lambda text, n: len(self.tokenize(text)) <= n  # noqa: E731
        half, over, typed, suffix = max(1, most // 2), 2 * most, infill.typed, infill.suffix
        if not fits(typed, over):  # from a whole step after its start: the widest that fits, else the shortest
            starts = range(CUT_STEP, len(typed), CUT_STEP)
            at = _run_end(reversed(starts), lambda j: fits(typed[j:], half))
            typed = typed[at if at is not None else starts[-1] if starts else 0:]
        lines, through = suffix.splitlines(keepends=True), _counted_lines(suffix)[:SUFFIX_LINES]
        held = [n for n in through if fits("".join(lines[:n]), over)]
        # fewer of the nearest lines (every prompt takes them: over the budget, they would crowd out the lines before
        # the cursor); a first one over it alone to a whole step from its start
        if held and len(held) < len(through):
            suffix = "".join(lines[:held[-1]])
        elif through and not held:
            ends = range(CUT_STEP, len(lines[0]) // CUT_STEP * CUT_STEP + 1, CUT_STEP)
            suffix = suffix[:_run_end(ends, lambda k: fits(suffix[:k], half)) or 0]
        return replace(infill, typed=typed, suffix=suffix)

    def stable(self, infill: Infill, first: int, most: int, held: str = "") -> tuple[list[int], str]:
        """The start of `infill`'s prompts that stays while the cursor moves on down (the head without extra chunks,
        then whole lines of the prefix) and the lines it holds: from where the lines `held` start while they fit
        `most` tokens, else the nearest lines that fit `first`."""
        lines = infill.prefix.splitlines(keepends=True)
        n = len(lines)

        def fits(k: int, most: int) -> int | None:
            return k if len(self.lines_tokens(infill.prefix, lines, n - k, n)) <= most else None

        at = lines_start(lines, held)
        k = n - at if at is not None and fits(n - at, most) is not None else _largest(n, lambda k: fits(k, first))[0]
        return self.head_and_lines(infill, k), "".join(lines[n - k:])

    def head_and_lines(self, infill: Infill, k: int) -> list[int]:
        """The head without extra chunks, then the `k` nearest whole lines of `infill`'s prefix."""
        return self.tokens(Infill(infill.prefix, "", "", ()), Take(k, 0, 0))[0][:-2]

    def widening(self, infill: Infill, room: int, fitted: Fitted, lines_step: int) -> Iterator[list[int]]:
        """Prompts ever wider than `fitted`, out to all that fits `room`: `lines_step` more steps of lines at a
        time, then one extra chunk more at a time, each the one before it with more context around it."""
        last = fitted.tokens
        for step in [*range(fitted.step + lines_step, FIT_STEPS, lines_step), FIT_STEPS]:
            prompt = self.tokens(infill, _share(infill, step, fitted.extra_chunks))[0]
            if len(prompt) > room:
                return
            if prompt != last:
                yield (last := prompt)
        for n in range(fitted.extra_chunks + 1, len(infill.extra) + 1):
            prompt = self.tokens(infill, _share(infill, FIT_STEPS, n))[0]
            if len(prompt) > room:
                return
            yield prompt


def _suffix(fim: FimPrompt, infill: Infill, step: int, room: int, base: int, max_new: int,
            new_tokens: Callable[[list[int]], int], built: tuple[list[int], list[int], list[int]],
            least: int) -> tuple[int | None, tuple[list[int], list[int], list[int]]]:
    """FimPrompt.fit's suffix cap for `step` and its prompt: `least` lines (`built`, `base` new tokens), or the most
    lines whose new tokens stay within `base` and SUFFIX_SHARE of what the budget `max_new` has left (all: None)."""
    allowed, top = base + int(SUFFIX_SHARE * max(0, max_new - base)), len(_counted_lines(infill.suffix))

    def with_lines(n: int) -> tuple[list[int], list[int], list[int]] | None:
        wide = fim.tokens(infill, _share(infill, step, 0, n, least))
        return wide if len(wide[0]) <= room and new_tokens(wide[0]) <= allowed else None

    if (every := with_lines(top)) is not None:
        return None, every
    if top <= least + 1 or (one := with_lines(least + 1)) is None:  # a CPU's usual answer
        return least, built
    return _bisect(least + 2, top - 1, with_lines, (least + 1, one))


def next_lines(infill: Infill) -> tuple[str, ...]:
    """The lines below `infill`'s cursor line an answer ends before repeating (REPEAT_LINES, REPEAT_MIN_CHARS)."""
    below = (s for line in infill.suffix.splitlines()[1:] if (s := line.strip()))
    return tuple(s for _, s in zip(range(REPEAT_LINES), below) if len(s) >= REPEAT_MIN_CHARS)


def lines_start(lines: Sequence[str], held: str) -> int | None:
    """The first of `lines` from which they begin as the text `held` does, its first HELD_LINES lines (None: nowhere,
    or `held` is empty). Not all of it: an editor's speculative request puts the suggestion's lines before the
    cursor, and the next request takes them out again; what follows the lines that match is priced token by token."""
    first = held.splitlines(keepends=True)[:HELD_LINES]
    start = "".join(first)
    return next((i for i, line in enumerate(lines) if start and start.startswith(line) and
                 "".join(lines[i:i + len(first)]) == start), None)


def accepted(infill: Infill, suggestion: str) -> Infill | None:
    """The request llama.vim (its speculative FIM) and llama.vscode (cacheFutureSuggestion) send as soon as they show
    `suggestion` at `infill`: the suggestion taken as typed. Its first line goes after the typed text; with more
    lines, the lines but the last join the prefix and the last is the typed text. None for a suggestion of blank
    lines (both drop trailing empty ones)."""
    if not (shown := suggestion.rstrip("\n")):
        return None
    lines = shown.split("\n")
    if len(lines) == 1:
        return Infill(infill.prefix, infill.suffix, infill.typed + lines[0], infill.extra)
    done = [infill.typed + lines[0], *lines[1:-1]]
    return Infill(infill.prefix + "".join(line + "\n" for line in done), infill.suffix, lines[-1], infill.extra)


def healed(infill: Infill, layout: str = "prefix") -> tuple[Infill, str]:
    """Token healing: `infill` less the word its typed text ends inside, and that word, which the answer must start
    with. Typed alone, a word's start is tokenized as the model would not have written it there, and the model goes
    on from those tokens as from a whole word; left out, the word is written in the model's own tokens
    (docs/editors.md). In the middle `layout` the model reads the typed text as its own, so a word goes with the blank
    or lone mark before it (" gl", ".f": a space before a word is the word's token's own, " glob"), and blanks or
    punctuation the typed text ends with are healed too, with the blanks before them (a bracket is often one token
    with what follows it, `("`). `infill` itself and "" where its typed text ends otherwise."""
    tail = infill.typed[-HEAL_MAX_CHARS - 1:]  # a bounded tail: a longer word is healed nowhere
    word = _WORD_END.search(tail) if layout != "middle" else (
        _WORD_LEAD_END.search(tail) or _BLANK_END.search(tail) or _MARK_END.search(tail))
    if word is None or len(word.group()) > HEAL_MAX_CHARS:
        return infill, ""
    return replace(infill, typed=infill.typed[:len(infill.typed) - len(word.group())]), word.group()


def cached_lines(prompt: Sequence[int], vocab: Vocab, piece: Callable[[int], bytes]) -> str:
    """The first whole lines (HELD_LINES) of the prefix a cached FIM prompt holds, to find where they start in a
    request's (lines_start); "" where it holds no FIM prefix or its text is not whole characters."""
    tokens = list(prompt)
    if (pre := _last(tokens, vocab.fim_pre)) is None:
        return ""
    text, newlines = bytearray(), 0
    for t in tokens[pre + 1:_find(tokens, vocab.fim_suf, pre + 1)]:
        text += (b := piece(t))
        if (newlines := newlines + b.count(b"\n")) >= HELD_LINES:
            break
    try:
        return bytes(text[:text.rfind(b"\n") + 1]).decode()
    except UnicodeDecodeError:
        return ""


def cursor_anchor(prompt: Sequence[int], vocab: Vocab, piece: Callable[[int], bytes]) -> int | None:
    """Where in a FIM prompt cached entries stop being reusable at a new position (decoding.reuse): the start of the
    line before the cursor. Past it an entry moved from an older prompt still holds the old cursor line; kept, it
    sends completions astray (a FIM suffix shifted from before the last keystroke: 3 of 30 right, against 11 with
    it evaluated again; docs/bench/editor.md). None when the prompt has no FIM prefix token."""
    tokens = list(prompt)
    if vocab.fim_suf is None or (pre := _last(tokens, vocab.fim_pre)) is None:
        return None
    # the cursor: where the prefix ends, at <fim_suffix> after it (PSM), else at <fim_middle> (SPM) or the end
    cursor = min(_find(tokens, vocab.fim_suf, pre + 1), _find(tokens, vocab.fim_mid, pre + 1))
    at = line_before(tokens, cursor, max(pre, cursor - ANCHOR_SCAN), piece)
    return pre + 1 if at is None else at


def written_since(infill: Infill, cached: Sequence[int], vocab: Vocab, piece: Callable[[int], bytes],
                  walked: bool = False) -> Infill | None:
    """`infill` laid out to continue the middle-layout FIM prompt `cached`: where its suffix's text still starts
    the request's suffix (or, `walked`, its first line and then its lines from any but the first: the cursor walked
    over them, a file typed over), and its prefix's last lines come 1 to WRITTEN_LINES whole lines before the
    request's cursor line, those lines start the typed text and the prefix ends there. The same text in another
    layout, evaluated afresh where it is new; None where `cached` is not such a prompt."""
    tokens = list(cached)
    if (pre := _last(tokens, vocab.fim_pre)) is None:
        return None
    suf = _find(tokens, vocab.fim_suf, pre)
    if (mid := _find(tokens, vocab.fim_mid, suf)) == len(tokens):
        return None
    try:
        prefix, suffix = (b"".join(piece(t) for t in part).decode()
                          for part in (tokens[pre + 1:suf], tokens[suf + 1:mid]))
    except UnicodeDecodeError:
        return None
    anchor = "".join(prefix.splitlines(keepends=True)[-WRITTEN_ANCHOR_LINES:])
    first, *rest = suffix.splitlines(keepends=True) or [""]
    kept = [first + "".join(rest[j:]) for j in range(len(rest) if walked else 1)]
    if not anchor.endswith("\n") or not suffix or not any(infill.suffix.startswith(k) for k in kept):
        return None
    lines, end = infill.prefix.splitlines(keepends=True), len(infill.prefix)
    for line in lines[:-WRITTEN_LINES - 1:-1]:
        end -= len(line)
        if infill.prefix.endswith(anchor, 0, end):
            return replace(infill, prefix=infill.prefix[:end], typed=infill.prefix[end:] + infill.typed)
    return None


def line_before(prompt: Sequence[int], end: int, floor: int, piece: Callable[[int], bytes]) -> int | None:
    """The start of the line before the one `end` is in: the token after the second newline back from `end`, searched
    down to `floor` (not included); None where there is none after it."""
    newlines = 0
    for i in range(end - 1, floor, -1):
        newlines += piece(prompt[i]).count(b"\n")
        if newlines >= 2:
            return i + 1
    return None


def _last(tokens: list[int], token: int | None) -> int | None:
    """The last index of `token`; None when there is none."""
    return len(tokens) - 1 - tokens[::-1].index(token) if token is not None and token in tokens else None


def _find(tokens: list[int], token: int | None, start: int) -> int:
    """The first index of `token` from `start` on; len(tokens) when there is none."""
    try:
        return tokens.index(token, start) if token is not None else len(tokens)
    except ValueError:
        return len(tokens)


@dataclass(frozen=True)
class Fitted:
    """A prompt `fit` chose: its tokens, what it kept, its lines step and how many extra chunks it holds."""

    tokens: list[int]
    kept: Kept
    step: int  # of FIT_STEPS: the share of each side's lines, nearest first
    extra_chunks: int


def _share(infill: Infill, step: int, extra: int | None, suffix_cap: int | None = SUFFIX_LINES,
           least: int = SUFFIX_LINES) -> Take:
    """`step`/FIT_STEPS of each side's lines, nearest first (of the suffix's, `least` at least and `suffix_cap` at
    most, blank lines after the cursor line's rest not counted), and the `extra` latest chunks."""
    n_pre = math.ceil(step * len(infill.prefix.splitlines()) / FIT_STEPS)
    through = _counted_lines(infill.suffix)
    n_suf = math.ceil(step * len(through) / FIT_STEPS)
    # the nearest suffix lines at every width: with fewer of them, a narrow prompt would cost less than a wide one the
    # cache holds, and fit would drop the cached lines to save the suffix's
    n_suf = max(n_suf, min(least, len(through))) if step else 0
    n_suf = n_suf if suffix_cap is None else min(n_suf, suffix_cap)
    return Take(n_pre, through[n_suf - 1] if n_suf else 0, extra)


@functools.lru_cache(maxsize=16)
def _counted_lines(suffix: str) -> tuple[int, ...]:
    """For each counted line of `suffix` (its first, the cursor line's rest, then each line with text), how many of
    its lines a prompt takes to hold it; the blank lines at its end come with the last."""
    lines = suffix.splitlines()
    through = [i + 1 for i, line in enumerate(lines) if i == 0 or line.strip()]
    return (*through[:-1], len(lines)) if through else ()


def _run_end(candidates: Iterable[int], ok: Callable[[int], bool]) -> int | None:
    """The last of `candidates`, in their order, before the first that is not `ok`; None when the first is not."""
    last = None
    for c in candidates:
        if not ok(c):
            break
        last = c
    return last


def _largest(top: int, build: Callable[[int], T | None]) -> tuple[int, T | None]:
    """The largest n in 0..top for which `build` gives something, where more never costs less; (0, None) when
    even 0 gives nothing."""
    if (full := build(top)) is not None:
        return top, full
    return _bisect(0, top - 1, build, (0, None))


def _widest(top: int, build: Callable[[int], T | None], also: Sequence[int] = ()) -> tuple[int, T | None]:
    """As _largest where the cost of lines against the cache is not monotonic: a few lines that moved cost in full
    (a run shorter than the reuse minimum), more of them cost nothing (a moved run, or the cached prompt's own
    start, a dip as narrow as a few lines). A coarse scan down from the top (through the points `also`) finds the
    highest feasible point, then each point between it and the one above it is tried, from the top."""
    above = top + 1
    for n in sorted({*_grid(top), *(a for a in also if 0 <= a <= top)}, reverse=True):
        if (found := build(n)) is not None:
            for m in range(above - 1, n, -1):
                if (wider := build(m)) is not None:
                    return m, wider
            return n, found
        above = n
    return 0, None


def _grid(top: int) -> list[int]:
    """The coarse scan's points, from the top down: every sixteenth, then 8, 4, 2, 1, 0."""
    return sorted({*range(top, 0, -max(1, top // 16)), 8, 4, 2, 1, 0} & set(range(top + 1)), reverse=True)


def _steps_for(n_lines: int, available: int) -> int:
    """The fewest steps that take `n_lines` of `available` lines (all of them when fewer), as _share counts."""
    return (min(n_lines, available) - 1) * FIT_STEPS // available + 1 if available and n_lines > 0 else 0


def _bisect(lo: int, hi: int, build: Callable[[int], T | None], best: tuple[int, T | None]) -> tuple[int, T | None]:
    """The largest n in lo..hi that `build` accepts, taking acceptance as monotonic there; `best` when none."""
    while lo <= hi:
        mid = (lo + hi) // 2
        if (candidate := build(mid)) is not None:
            lo, best = mid + 1, (mid, candidate)
        else:
            hi = mid - 1
    return best


def _count(wanted: int | None, available: int) -> int:
    return available if wanted is None else max(0, min(wanted, available))


@dataclass(frozen=True)
class Continuation:
    """The request an editor sends as soon as it shows an answer (`accepted`), and the prompt that serves it: the
    answer's own prompt and tokens, the answer starting the middle where the model wrote it. A typed middle completes
    worse because it ends inside a token (docs/editors.md); this one holds the model's own tokens."""

    infill: Infill  # the request, as accepted() predicts it
    held: str  # the end of its prefix that the prompt holds: the editor's window may drop lines before it
    tokens: list[int]
    lead: str = ""  # what the prompt holds past the request's text, which its answer starts with (a line break)

    def serves(self, request: Infill) -> bool:
        want = self.infill
        return ((request.typed, request.suffix, request.extra) == (want.typed, want.suffix, want.extra)
                and want.prefix.endswith(request.prefix) and request.prefix.endswith(self.held))


def continuation(infill: Infill, answer: str, prompt: Sequence[int], generated: Sequence[int], vocab: Vocab,
                 piece: Callable[[int], bytes], layout: str = "prefix", ended: bool = False,
                 newline: Sequence[int] = ()) -> Continuation | None:
    """How the editor's request after `answer` (a completion of `prompt` at `infill`, its tokens `generated`) is
    served; None for a prompt that is not a FIM prompt of `layout`, and for an answer that the editor does not show
    whole (blank lines dropped, a line the indentation cut) or that ends where the model chose (`ended`: its end of
    generation or a stop string): the same prompt would only choose that end again. Except in the middle layout,
    given the tokens of a `newline` (an end of generation, not a stop string): there the answer's line is done, and
    the prompt goes on at the next line's start, the answer to come starting with the line break (`lead`). So it
    does where the tokens spell line breaks past what the editor shows (`:\n` is one token), ended or cut."""
    nxt, tokens = accepted(infill, answer), list(prompt)
    pre = _last(tokens, vocab.fim_pre)
    suf = len(tokens) if pre is None else _find(tokens, vocab.fim_suf, pre)
    next_line = ended and layout == "middle" and bool(newline)
    if nxt is None or (ended and not next_line) or suf == len(tokens):
        return None
    held = b"".join(piece(t) for t in tokens[pre + 1:suf])
    typed = infill.typed.encode() if layout == "prefix" else b""
    if layout == "middle":  # lines written since the prompt's prefix go before the typed text (written_since)
        middle, typed_now = b"".join(piece(t) for t in tokens[_find(tokens, vocab.fim_mid, suf) + 1:]), \
            infill.typed.encode()
        held += middle[:len(middle) - len(typed_now)] if middle.endswith(typed_now) else b""
    shown, got, k = answer.rstrip("\n").encode(), b"", 0
    while len(got) < len(shown) and k < len(generated):
        got, k = got + piece(generated[k]), k + 1
    # past what the editor shows: nothing, or in the middle layout line breaks, where the prompt goes on from them
    past = got[len(shown):] + b"".join(piece(t) for t in generated[k:])
    if not got.startswith(shown) or past.strip(b"\n") or (past and layout != "middle") or not held.endswith(typed):
        return None
    held_text = held[:len(held) - len(typed)].decode("utf-8", "replace")
    if next_line or past:  # the line breaks the model wrote, else one
        return Continuation(nxt, held_text + nxt.prefix[len(infill.prefix):],
                            [*tokens, *generated, *(() if past else newline)], past.decode() or "\n")
    return Continuation(nxt, held_text + nxt.prefix[len(infill.prefix):], [*tokens, *generated[:k]])
