"""Slots: the target's KV sequences, each with the proposer that speculates on it, and who runs when.

A generation takes a free slot (the one it asked for, else the one whose cache it can reuse most, else the least
recently used) and waits for one while all are busy. Generations in different slots take turns on the target, one
cycle each, in arrival order (`FairLock`), so a long answer does not hold an editor's completion for its whole length.

Beside the slots, one more sequence (the aside) is built while nobody waits: a context wider than a request could
afford, evaluated afresh. A slot takes it whole, by exchanging sequences, when a prompt keeps more of it; or, where
the aside holds the lines before a slot's own, they are put in front of them (join_front).

What a slot held before a request replaced most of it is kept in host memory, and taken back by a later request
that keeps more of it (recall; engine.recall).
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Callable, Generator, Iterator, Sequence

from edgespec.backend import KVSequence
from edgespec.decoding import loop
from edgespec.decoding.parts import PartsPlan
from edgespec.decoding.reuse import Reuse
from edgespec.engine.recall import MIN_GAIN, Kept, PromptCache, replaces
from edgespec.proposers import Proposer

SLOT_POLL_SECONDS = 0.1  # a generation waiting for a slot checks its cancel event this often


@dataclass(eq=False)
class Slot:
    """A KV sequence of the target and the proposer that speculates on it."""

    cache: KVSequence
    proposer: Proposer | None
    busy: bool = False
    last_used: float = 0.0
    index: int = 0  # its place in the pool, what clients call it (its cache's sequence changes: SlotPool.adopt)


class FairLock:
    """A lock taken in arrival order, so a generation that releases it and asks again waits behind the others."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queue: collections.deque[object] = collections.deque()
        self._held = False

    def __enter__(self) -> None:
        me = object()
        with self._cond:
            self._queue.append(me)
            while self._held or self._queue[0] is not me:
                self._cond.wait()
            self._queue.popleft()
            self._held = True

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._held = False
            self._cond.notify_all()


class SlotPool:
    """The engine's slots, the lock that gives the target to one cycle at a time, and the generations under way."""

    def __init__(self, slots: Sequence[Slot], aside: KVSequence | None = None,
                 prompts: PromptCache | None = None) -> None:
        self.slots = list(slots)
        self.aside = aside  # None where the model has none (backend.Model.aside)
        self.prompts = prompts  # what slots held before, in host memory (engine.recall); None: none kept
        self.aside_lines = ""  # what the aside's builder last asked it to hold, in its own terms (engine.infill)
        self._free = threading.Condition()  # guards Slot.busy; notified when a slot is released
        self._turn = FairLock()  # one target pass at a time: generations in other slots interleave by cycle
        self._running: set[threading.Event] = set()  # cancel events of the generations under way

    def __len__(self) -> int:
        return len(self.slots)

    def cancel_all(self) -> None:
        for running in list(self._running):
            running.set()

    @contextlib.contextmanager
    def taken(self, prompt: Sequence[int], cancel: threading.Event, wanted: int | None) -> Iterator[Slot | None]:
        """A slot held for one generation (None if it was cancelled while every slot was busy)."""
        self._running.add(cancel)
        try:
            slot = self._acquire(prompt, cancel, wanted)
            try:
                yield slot
            finally:
                if slot is not None:
                    with self._free:
                        slot.busy, slot.last_used = False, time.monotonic()
                        self._free.notify()
        finally:
            self._running.discard(cancel)

    def _acquire(self, prompt: Sequence[int], cancel: threading.Event, wanted: int | None) -> Slot | None:
        """`wanted` (modulo the slot count) if it is free, else the free slot whose cache it can reuse most, else the
        least recently used."""
        with self._free:
            while not (free := [s for s in self.slots if not s.busy]):
                if cancel.is_set():
                    return None
                self._free.wait(SLOT_POLL_SECONDS)
            preferred = self.slots[wanted % len(self.slots)] if wanted is not None and wanted >= 0 else None
            slot = preferred if preferred in free else max(
                free, key=lambda s: (s.cache.shared_prefix(prompt), -s.last_used))
            slot.busy = True
            return slot

    def build_aside(self, tokens: Sequence[int], stop: Callable[[], bool], step: Callable[[int], int]) -> bool:
        """Make the aside hold `tokens`: what it holds of them is kept, the rest evaluated in batches of `step(left)`
        tokens until `stop`. Whether it holds them all. It shares no cell with a slot: a slot that moves a cell
        (chunk reuse) moves it in every sequence that holds it."""
        aside = self.aside
        assert aside is not None
        with self._turn:
            aside.keep_prefix_of(tokens)
            while aside.n_past < len(tokens):
                n = step(len(tokens) - aside.n_past)
                if aside.decode(tokens[aside.n_past:aside.n_past + n], 0, stop, n) is None:
                    return False
            return True

    def join_front(self, index: int, head: int, follows: Sequence[int]) -> float | None:
        """Put the lines the aside holds after its `head` in front of slot `index`'s own, where that slot is free and
        holds the same head, then `follows`: the seconds it took, None where it did not. The re-rotation the move asks
        for runs now, in the pause (a decode of one token, dropped), not in the next request."""
        aside, slot = self.aside, self.slots[index]
        assert aside is not None
        with self._free, self._turn:
            held = slot.cache.tokens
            if slot.busy or held[:head] != aside.tokens[:head] or held[head:head + len(follows)] != list(follows):
                return None
            first, start = aside.tokens[:1], time.perf_counter()
            slot.cache.join_front(aside, head)
            aside.decode(first, 0)
            aside.trim(0)
            return time.perf_counter() - start

    def rerotation_seconds(self) -> float | None:
        """Seconds llama.cpp takes to re-rotate moved entries, timed in the empty aside: it covers every cell of the
        context whatever the sequences hold, so one probe prices every move (decoding.costs.PromptRate.shift). None
        without an aside that can move its entries."""
        aside = self.aside
        if aside is None or not aside.can_shift or aside.n_past:
            return None
        with self._turn:
            aside.decode([0] * 5, 1)  # untimed: a load's first decode also pages the weights in
            start = time.perf_counter()
            aside.decode([0], 1)
            aside.decode([0], 1)
            plain, start = time.perf_counter() - start, time.perf_counter()
            aside.evaluate([0] * 9, [(0, 0, 1), (2, 1, 6)])  # 6 moved on by one, a token before them and after
            shifted = time.perf_counter() - start
            aside.trim(0)
        return max(0.0, shifted - plain)

    def recall(self, slot: Slot, plan: Callable[[KVSequence | Kept], Reuse], held: bool = True,
               worth: Callable[[Reuse], int] = lambda r: r.reused, gain: int = MIN_GAIN) -> bool:
        """Start `slot` from a kept prompt whose plan for the prompt `plan` prices a cache for is `worth` `gain` more
        than the slot's (by default: it keeps that many more tokens), keeping what the slot held; else, where the
        caller `held` the slot for a generation of that prompt, keep what the slot holds if the prompt replaces it
        (engine.recall). Whether a kept prompt came back. Unless `held`, only where the slot is free: a budget is
        sized against the widest prompt of the file's lines, which may keep little of a slot that the request's own
        prompt keeps."""
        if self.prompts is None:
            return False
        with contextlib.nullcontext() if held else self._free, self._turn:
            if not held and (slot.busy or not self.prompts.kept):
                return False
            cache, now = slot.cache, plan(slot.cache)
            best = self.prompts.best(lambda k: worth(plan(k)), worth(now), gain)
            if best is not None or (held and replaces(now, cache.n_past)):
                self.prompts.keep(cache)
            if best is None or not cache.restore(best.tokens, best.data):
                return False
            self.prompts.take(best)
            return True

    def holds_parts(self, index: int) -> bool:
        """Whether slot `index` holds its FIM prompt as parts (decoding.parts)."""
        cache = self.slots[index].cache
        return getattr(cache, "plain", cache.n_past) < cache.n_past

    def background_plan(self, index: int, prompt: Sequence[int], cache_reuse: int) -> Reuse | None:
        """What evaluating `prompt` in slot `index` keeps and moves (loop.planned), for work nobody waits on; None
        where it would drop the FIM prompt the slot holds as parts: such work leaves them be, as the pauses built
        them for the lines to come."""
        plan = loop.planned(self.slots[index].cache, prompt, cache_reuse)
        return None if self.holds_parts(index) and not isinstance(plan, PartsPlan) else plan

    def ready(self, slot: Slot, plan: Callable[[KVSequence | Kept], Reuse]) -> None:
        """Before a generation in `slot` evaluates the prompt `plan` prices a cache for: a kept prompt (recall), then
        the aside (adopt), taken where the slot would evaluate more."""
        self.recall(slot, plan)
        if self.aside is not None and self.aside.tokens:
            self.adopt(slot, lambda c: plan(c).new)

    def adopt(self, slot: Slot, new_tokens: Callable[[KVSequence], int]) -> None:
        """Give `slot` the aside where its prompt has fewer `new_tokens` to evaluate there; the slot's old sequence,
        emptied, becomes the aside."""
        with self._turn:
            if self.aside is not None and new_tokens(self.aside) < new_tokens(slot.cache):
                slot.cache, self.aside = self.aside, slot.cache
                if self.prompts is not None:  # what the slot held goes whole
                    self.prompts.keep(self.aside)
                self.aside.trim(0)

    def turns(self, steps: Iterator[loop.Step]) -> Generator[loop.Step, None, None]:
        """Each step of a generation under the turn lock, released while the consumer has it."""
        try:
            while True:
                with self._turn:
                    step = next(steps, None)
                if step is None:
                    return
                yield step
        finally:
            with self._turn:
                steps.close()  # type: ignore[attr-defined]
