"""An editor's completion request laid out against what a slot already holds.

Without a time budget the FIM context is cut as llama.cpp's server cuts it for the same batch size. With one
(llama.vim's and llama.vscode's `t_max_prompt_ms`) it takes as many whole lines nearest the cursor as the prompt
evaluation cost allows in that time, counting only tokens the slot's cache cannot reuse, and never fewer than the
nearest lines (fim.NEAR_LINES): a cold cache gets a narrow context, answered in about the time asked.

While nobody waits, a wider context is evaluated afresh beside the slot (the aside sequence, engine.slots): the
lines before the cursor line, which stay as the cursor moves on down, ASIDE_FIRST_TOKENS of them at first, then
kept from the same line on as the file is walked. A request prices its prompts against the aside too, and takes it
where that is wider for its budget: then only its new lines, the typed text and the suffix are evaluated. Once a
slot holds such lines, the lines before them are evaluated in the aside, ASIDE_FRONT_TOKENS at a time, and put in
front of the slot's when ready, which then move on (SlotPool.join_front), up to the aside's cells in all; where the
cache cannot shift, ASIDE_GROWTH times as many lines are built afresh instead. Without an aside (LoadConfig.aside 0,
or a model that cannot park chunks) the server widens the context in place after a pause, a few lines at a time.

New code written above text that stays (the request's suffix still starts as the slot's prompt's suffix does) goes
after <fim_middle>, before the typed text, the slot's prefix and suffix kept as they are (written_since): a line
start then evaluates the line written, where in the prefix it would move the suffix after it, to be evaluated again.
A cursor that moved onto a line that was below (the suffix lost its first line) is laid out as ever.
"""

from __future__ import annotations

import bisect
import functools
import math
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator, Sequence

from edgespec.backend import KVSequence, Model
from edgespec.config import GROUPED_SUFFIX_LINES
from edgespec.decoding import reuse
from edgespec.decoding.costs import PromptRate
from edgespec.decoding.loop import Target, planned
from edgespec.engine.recall import near_cursor
from edgespec.engine.slots import Slot, SlotPool
from edgespec.prompts.fim import (FIT_STEPS, Fitted, FimPrompt, Infill, Kept, cached_lines, cursor_anchor,
                                  lines_start, written_since)

# New tokens a request's budget must buy after moving what the slot holds (a re-rotation of every cell of the
# context) for the move to be worth it; where it buys fewer, the request takes what the slot serves in place and the
# pauses widen the context.
MOVE_MIN_GAIN = 64
# Tokens of prefix lines a first aside build takes: ready after a few of an editor's pauses, yet enough wider than
# what a budget buys to complete better (docs/bench/editor.md).
ASIDE_FIRST_TOKENS = 192
# Once the slot holds a build, lines before it this many tokens at a time: each is ready within two or three of an
# editor's pauses, and costs one re-rotation of the cache when put in front (docs/bench/editor.md).
ASIDE_FRONT_TOKENS = 192
# Where the cache cannot shift, the next build is this much wider, afresh; none for less than ASIDE_GROWTH_LEAST
# times as wide.
ASIDE_GROWTH = 2
ASIDE_GROWTH_LEAST = 1.5
# Budgets of evaluation the nearest lines (fim.NEAR_LINES) may take on a cold cache, a re-rotation they need counted
# in: past it, fewer of them (long lines), so the answer still comes within the second an editor's user is promised
# past the budgets.
NEAR_BUDGETS = 2.0
FOLLOWS_CHECKED = 32  # tokens of a slot's first lines checked before lines go in front of them (SlotPool.join_front)
ASIDE_HEAD = 32  # tokens an aside build leaves of LoadConfig.aside for what precedes the lines (FIM and file tokens)
WIDEN_LINES_STEP = 4  # of fim.FIT_STEPS: a background step adds 1/64 of the lines a side, done within a pause
# Texts kept tokenized: a fit tokenizes the prefix, the suffix and the typed text once, and mostly the same ones
# again on an editor's next request (the same line typed further, its speculative request).
TOKENIZED_TEXTS = 512


@dataclass(frozen=True)
class AsideBuild:
    """What to evaluate in the aside sequence while nobody waits, and what becomes of it (engine.slots)."""

    tokens: list[int]  # a FIM head, then prefix lines
    lines: str  # the lines they hold
    # The slot whose lines they go in front of once built, which must hold the same head and then `follows`; None:
    # a request takes the aside whole where its prompt does better starting there.
    slot: int | None = None
    head: int = 0
    follows: tuple[int, ...] = ()


@dataclass(frozen=True)
class InfillPrompt:
    tokens: list[int]
    kept: Kept  # what of the request the prompt holds
    slot: int  # the slot it was sized against: the generation should run there
    new_tokens: int  # prompt tokens to evaluate in that slot, as planned now
    budget_tokens: int | None  # new tokens the time budget allowed (None: no budget, or no rate known yet)
    # Ever wider prompts out to all the context that fits, when the budget cut it: for the background.
    widening: Callable[[], Iterator[list[int]]] = field(default=lambda: iter(()))
    # What to build in the aside sequence for the requests that follow, where that widens this prompt's context;
    # None without a budget or an aside.
    aside: Callable[[], AsideBuild | None] = field(default=lambda: None)
    # The prompt with its suffix ever wider, a group of lines at a time, for a slot that holds FIM prompts as parts
    # to evaluate in a pause (each evaluates its new lines, and moves the middle on).
    grown: Callable[[], Iterator[list[int]]] = field(default=lambda: iter(()))
    grouped: bool = False  # the slot holds FIM prompts as parts: the background grows them before the aside builds


def infill_prompt(m: Model, pool: SlotPool, rate: PromptRate, infill: Infill, max_tokens: int,
                  budget_seconds: float | None = None, slot: int | None = None, cache_reuse: int = 0,
                  layout: str = "prefix", warm_up: bool = False) -> InfillPrompt:
    """The FIM prompt for `infill` on target `m` that leaves `max_tokens` of room, sized for `budget_seconds` of
    prompt evaluation at `rate` (None: as llama.cpp sizes it), in `slot` or else the free slot that reuses most of
    it, once it took back a prompt it held before that holds more of the file (SlotPool.recall). A `warm_up` of chunks
    alone keeps the slot's FIM part (FimPrompt.warm_up). The prompt may start where the pool's aside does."""
    fim = FimPrompt(m.vocab, lambda text: list(_tokens(m, text)), layout, m.token_bytes)
    room, slots, aside, aside_lines = m.n_ctx - max_tokens, pool.slots, pool.aside, pool.aside_lines

    def plan(cache: Target, tokens: list[int]) -> reuse.Reuse:  # as the generation will keep it (Engine.stream)
        anchor = cursor_anchor(tokens, m.vocab, m.token_bytes) if cache_reuse else None
        return planned(cache, tokens, cache_reuse, anchor)

    def new_tokens(s: Slot, tokens: list[int]) -> int:
        return plan(s.cache, tokens).new

    if warm_up and (chunks := _warm_up(fim, infill, slots, slot, room, new_tokens)) is not None:
        return chunks
    if budget_seconds is None or not rate.known:
        tokens, kept = fim.llama_cpp_sizes(infill, m.n_batch, m.n_ctx, max_tokens)
        chosen = _slot_for(slots, slot, lambda s: new_tokens(s, tokens))
        pool.recall(slots[chosen], lambda c: plan(c, tokens), held=False)
        return InfillPrompt(tokens, kept, chosen, new_tokens(slots[chosen], tokens), None)
    near = rate.tokens_within(NEAR_BUDGETS * budget_seconds) or 0
    asked, infill = infill, fim.cut_long(infill, max(near, 1))  # a long line at the cursor: what is next to it
    widest = fim.fit(infill, room).tokens
    chosen = _slot_for(slots, slot, lambda s: new_tokens(s, widest))
    own = functools.cache(lambda: fim.fit(replace(infill, extra=()), room).tokens)  # the file's lines decide it
    fitted, budget = None, rate.tokens_within(budget_seconds) or 0
    # a kept prompt comes back where it holds more of the lines next to the cursor than the budget buys there
    pool.recall(target := slots[chosen], lambda c: plan(c, own()), False,
                lambda r: near_cursor(r, own().index(m.vocab.fim_suf), budget), max(budget, 1))
    plain, starts, relaxed = budget, (), None  # plain: what the budget buys where nothing moves (as in the aside)
    if plan(target.cache, widest).moved:  # moving what the slot holds costs a re-rotation before any token's price
        moving = rate.tokens_within(budget_seconds, True) or 0
        # the one start that moves nothing is the slot's own: fit's scan may miss it
        starts = _starts(infill, cached_lines(target.cache.tokens, m.vocab, m.token_bytes))
        if moving <= MOVE_MIN_GAIN:
            fitted, relaxed = _in_place(fim, infill, room, budget, near, lambda t: plan(target.cache, t), starts)
        if not fitted:  # the move's price comes first, for the nearest lines too
            budget, near = moving, rate.tokens_within(NEAR_BUDGETS * budget_seconds, True) or 0
    fitted = fitted or fim.fit(infill, room, max(budget, 1), lambda t: new_tokens(target, t), starts, near)
    if relaxed is not None and relaxed.kept.prefix_tokens[0] > fitted.kept.prefix_tokens[0]:
        fitted, budget = relaxed, plain
    new = new_tokens(target, fitted.tokens)
    grouped = bool(target.cache.group_lines and cache_reuse and layout == "middle")
    parted = grouped and pool.holds_parts(chosen)  # its parts are kept: no build afresh taken
    if not parted and aside is not None and aside.tokens and (wide := _from_aside(fim, infill, room, aside,
                                                                                  aside_lines, plain, fitted, new)):
        fitted, new = wide
    widening = functools.partial(fim.widening, infill, room, fitted, WIDEN_LINES_STEP)
    fitted, new, written = _continued(fim, infill, target, room, max(budget, 1), near,
                                      functools.partial(plan, target.cache), fitted, new, layout, parted)
    front = chosen if cache_reuse and m.can_shift and not fitted.extra_chunks else None  # moves asked, and can be
    build = (lambda: None) if aside is None or fitted.kept.prefix_tokens[0] >= fitted.kept.prefix_tokens[1] else \
        functools.partial(_aside_build, fim, infill, fitted, m.cfg.aside - ASIDE_HEAD, aside_lines, front, parted)
    grown = functools.partial(_grown, fim, infill.suffix, fitted.tokens, target, room) if grouped else None
    return InfillPrompt(fitted.tokens, _kept(m, fitted.kept, asked, written), chosen, new, budget, widening, build,
                        grown or (lambda: iter(())), grouped)


def _kept(m: Model, kept: Kept, asked: Infill, written: str) -> Kept:
    """What a prompt kept of the request `asked`, out of all it was sent; the lines `written` (written_since), in the
    typed text, counted as the prefix's."""
    lines = len(_tokens(m, written)) if written else 0
    return replace(kept, prefix_tokens=(kept.prefix_tokens[0] + lines, len(_tokens(m, asked.prefix))),
                   typed_tokens=(kept.typed_tokens[0] - lines, len(_tokens(m, asked.typed))),
                   suffix_tokens=(kept.suffix_tokens[0], len(_tokens(m, asked.suffix))))


def _continued(fim: FimPrompt, infill: Infill, target: Slot, room: int, budget: int, near: int,
               kept: Callable[[list[int]], reuse.Reuse], fitted: Fitted, new: int, layout: str,
               parted: bool) -> tuple[Fitted, int, str]:
    """The prompt that continues what `target` holds, as parts (`parted`: _in_parts) or in the middle layout
    (_walked), where there is one; else `fitted`. With its new tokens and the lines written since."""
    return (parted and _in_parts(fim, infill, target, room, kept, max(budget, new))) or (
        layout == "middle" and _walked(fim, infill, target, room, budget, near, kept, fitted, new)) or (
        fitted, new, "")


def _walked(fim: FimPrompt, infill: Infill, target: Slot, room: int, budget: int, near: int,
            kept: Callable[[list[int]], reuse.Reuse], fitted: Fitted, new: int) -> tuple[Fitted, int, str] | None:
    """The prompt for `infill` that continues what `target` holds (written_since), its new tokens and the lines
    written since, where it holds no less than `fitted` (`new` tokens to evaluate) for no more than `budget` or `new`
    (what the budget leaves may buy suffix lines, which stay while lines are written) and moves nothing; else None,
    and `fitted` it is (a wider build of the aside is worth its tokens once; the lines written start again there)."""
    if (w := written_since(infill, target.cache.tokens, fim.vocab, fim.piece, target.cache.group_lines > 0)) is None:
        return None
    cost = lambda t: room + 1 if (k := kept(t)).moved else k.new  # noqa: E731
    starts = _starts(w, cached_lines(target.cache.tokens, fim.vocab, fim.piece))
    walked, written = fim.fit(w, room, budget, cost, starts, near), w.typed[:len(w.typed) - len(infill.typed)]
    n = cost(walked.tokens)
    wide = len(walked.tokens) + written.count("\n") >= len(fitted.tokens)  # a line may tokenize apart at its end
    return (walked, n, written) if wide and n <= max(budget, new) else None


def _suffix_lines(fim: FimPrompt, suffix: str, tokens: list[int]) -> tuple[int, Callable[[int], list[int] | None]]:
    """How many lines of `suffix` the middle-layout prompt `tokens` holds, and the same prompt with its first n lines
    instead (None where the prompt's are not its first lines)."""
    v, lines = fim.vocab, suffix.splitlines(keepends=True)
    s = tokens.index(v.fim_suf, tokens.index(v.fim_pre))
    m = tokens.index(v.fim_mid, s)
    held = tokens[s + 1:m]
    at = next((k for k in range(len(lines) + 1) if len(fim.lines_tokens(suffix, lines, 0, k)) >= len(held)),
              len(lines))

    def with_lines(n: int) -> list[int] | None:
        wide = fim.lines_tokens(suffix, lines, 0, min(n, len(lines)))
        return [*tokens[:s + 1], *wide, *tokens[m:]] if wide[:len(held)] == held else None

    return at, with_lines


def _in_parts(fim: FimPrompt, infill: Infill, target: Slot, room: int, kept: Callable[[list[int]], reuse.Reuse],
              most: int) -> tuple[Fitted, int, str] | None:
    """For a slot that holds its prompt as parts: the prompt that keeps its head as it is, the lines written since
    after <fim_middle> (written_since), and the most suffix lines, up to GROUPED_SUFFIX_LINES, that cost no more
    than `most` new tokens and move nothing; with its new tokens and the lines written. None where there is none.
    Built, not fitted: a fit's widths would move the head and drop the parts."""
    cache, v = target.cache, fim.vocab
    if (w := written_since(infill, cache.tokens, v, fim.piece, True)) is None:
        return None
    s = cache.tokens.index(v.fim_suf, cache.tokens.index(v.fim_pre))
    head, typed, lines = cache.tokens[:s + 1], fim.tokenize(w.typed), w.suffix.splitlines(keepends=True)
    best = None
    for n in range(min(GROUPED_SUFFIX_LINES, len(lines)), 0, -1):
        suf = fim.lines_tokens(w.suffix, lines, 0, n)
        tokens = [*head, *suf, v.fim_mid, *typed]
        if len(tokens) <= room and not (k := kept(tokens)).moved and k.new <= most:
            best = k.new, tokens, suf
            break
    if best is None:
        return None
    at = cache.tokens.index(v.fim_pre)
    written = w.typed[:len(w.typed) - len(infill.typed)]
    n_extra = max(0, head[:at].count(v.fim_sep) - 1) if v.fim_sep is not None else 0  # a file's, then the prompt's
    pre = head[at + 1:s]
    return Fitted(best[1], fim.kept(w, pre, best[2], n_extra), FIT_STEPS, n_extra), best[0], written


def _grown(fim: FimPrompt, suffix: str, tokens: list[int], target: Slot, room: int) -> Iterator[list[int]]:
    """The prompt `target` holds (`tokens` as it was laid out, unless a pause put lines in front of it since) with
    a group more lines of `suffix` after its own each time, up to GROUPED_SUFFIX_LINES, while they fit `room`."""
    while True:
        held = target.cache.tokens
        if fim.vocab.fim_mid not in held or fim.vocab.fim_pre not in held:
            held = tokens
        n, with_lines = _suffix_lines(fim, suffix, held)
        n = min(n + target.cache.group_lines, GROUPED_SUFFIX_LINES)
        if n > len(suffix.splitlines()) or (wide := with_lines(n)) is None or len(wide) > room or wide == held:
            return
        yield wide


def _warm_up(fim: FimPrompt, infill: Infill, slots: Sequence[Slot], slot: int | None, room: int,
             new_tokens: Callable[[Slot, list[int]], int]) -> InfillPrompt | None:
    """An editor's warm-up of chunks alone, in `slot` or else the slot that evaluates least for it, keeping the FIM
    part the slot holds (FimPrompt.warm_up); None for a request with more, where that slot holds no FIM part, or where
    the prompt would not fit."""
    if infill.prefix or infill.suffix or infill.typed:
        return None
    kept = {id(s): fim.warm_up(infill.extra, s.cache.tokens) for s in slots}
    chosen = _slot_for(slots, slot, lambda s: math.inf if (t := kept[id(s)]) is None else new_tokens(s, t))
    tokens = kept[id(slots[chosen])]
    if tokens is None or len(tokens) > room:  # the chunks alone, cut as llama.cpp cuts them (infill_prompt)
        return None
    n = len(infill.extra)
    return InfillPrompt(tokens, Kept((0, 0), (0, 0), (n, n)), chosen, new_tokens(slots[chosen], tokens), None)


def _in_place(fim: FimPrompt, infill: Infill, room: int, budget: int, near: int,
              kept: Callable[[list[int]], reuse.Reuse], starts: Sequence[int]) -> tuple[Fitted | None, Fitted | None]:
    """The prompt for `infill` that moves nothing of what its slot holds (`kept` plans it against the slot) within
    `budget` new tokens, else (second) one whose nearest lines take up to `near` (FimPrompt.fit's `near_most`): a
    move's price may leave them none. None where there is none."""
    def fit(most: int | None) -> Fitted | None:
        f = fim.fit(infill, room, max(budget, 1), lambda t: room + 1 if (k := kept(t)).moved else k.new, starts, most)
        k = kept(f.tokens)
        return f if k.moved == 0 and k.new <= max(budget, most or 0) else None

    return (strict, None) if (strict := fit(None)) else (None, fit(near))


def _aside_build(fim: FimPrompt, infill: Infill, fitted: Fitted, most: int, asked: str,
                 front: int | None, parted: bool = False) -> AsideBuild | None:
    """What the aside should build next (of at most `most` tokens of lines in all) after the prompt `fitted` for
    `infill`, the aside last asked to hold the lines `asked`: lines that go in front of slot `front`'s once the slot
    holds the first build (None: none go in front), else a build afresh, but for a slot that holds its prompt in
    `parted` (a build taken afresh would drop them). None where nothing is wider."""
    lines_of = lambda t: len(t) - t.index(fim.vocab.fim_pre) - 1  # noqa: E731 - prefix tokens of a build
    held = fitted.kept.prefix_tokens[0]
    tokens, lines = fim.stable(infill, min(ASIDE_FIRST_TOKENS, most), most, asked)
    if lines_of(tokens) > held and not parted:
        return AsideBuild(tokens, lines)
    if front is not None:  # the slot holds what the aside held: the lines before its own
        k = _starts(infill, cached_lines(fitted.tokens, fim.vocab, fim.piece))
        ahead = _front(fim, infill, k[0], min(ASIDE_FRONT_TOKENS, most - held)) if k and held < most else None
        return None if ahead is None else AsideBuild(ahead[0], ahead[2], front, ahead[0].index(fim.vocab.fim_pre) + 1,
                                                     tuple(ahead[1][:FOLLOWS_CHECKED]))
    if parted:
        return None
    tokens, lines = fim.stable(infill, min(ASIDE_GROWTH * held, most), most)  # the next width, afresh
    grown = lines_of(tokens)
    return AsideBuild(tokens, lines) if grown > held and grown >= ASIDE_GROWTH_LEAST * held else None


def _front(fim: FimPrompt, infill: Infill, held: int, most: int) -> tuple[list[int], list[int], str] | None:
    """For a cache that holds the `held` nearest lines of `infill`'s prefix after a FIM head: the head, then as many
    whole lines before those as fit `most` tokens; the tokens of the held lines; the lines put in front. None where
    not one line fits."""
    lines = infill.prefix.splitlines(keepends=True)
    n, base = len(lines), fim.head_and_lines(infill, held)
    k = bisect.bisect_right(range(n - held + 1), most,
                            key=lambda k: len(fim.head_and_lines(infill, held + k)) - len(base)) - 1
    if k < 1:
        return None
    tokens = fim.head_and_lines(infill, held + k)
    cut = len(tokens) - len(base) + base.index(fim.vocab.fim_pre) + 1
    return tokens[:cut], tokens[cut:], "".join(lines[n - held - k:n - held])


def _from_aside(fim: FimPrompt, infill: Infill, room: int, aside: KVSequence, lines: str, budget: int,
                fitted: Fitted, new: int) -> tuple[Fitted, int] | None:
    """The prompt that starts where the aside's lines do, and its new tokens there, where it keeps more of the
    prefix than `fitted` (the slot's, `new` tokens to evaluate) for no more than the budget or `new`; else None."""
    if not (starts := _starts(infill, lines)):
        return None
    cost = lambda t: planned(aside, t).new  # noqa: E731 - the aside is priced as a prefix only
    wide = fim.fit(infill, room, max(budget, 1), cost, starts=starts, near_most=max(budget, new))
    if wide.kept.prefix_tokens[0] <= fitted.kept.prefix_tokens[0] or (n := cost(wide.tokens)) > max(budget, new):
        return None
    return wide, n


def _starts(infill: Infill, held: str) -> tuple[int, ...]:
    """fit's `starts` for a cache that holds the lines `held`: how many of the prefix's lines a prompt takes to start
    where they do; none where they are not in the prefix."""
    lines = infill.prefix.splitlines(keepends=True)
    return () if (at := lines_start(lines, held)) is None else (len(lines) - at,)


@functools.lru_cache(maxsize=TOKENIZED_TEXTS)
def _tokens(m: Model, text: str) -> tuple[int, ...]:
    return tuple(m.tokenize(text, add_special=False, parse_special=False))


def _slot_for(slots: Sequence[Slot], wanted: int | None, cost: Callable[[Slot], int]) -> int:
    """`wanted` (modulo the slot count), else the free slot (any slot when all are busy) where the prompt costs
    least, the least recently used among equals."""
    if wanted is not None and wanted >= 0:
        return wanted % len(slots)
    pool = [s for s in slots if not s.busy] or slots
    best = min(pool, key=lambda s: (cost(s), s.last_used))
    return slots.index(best)
