"""Prompts kept in host memory after their slot moved on (llama-server's prompt cache, `--cache-ram`).

An editor that goes back to a file, or a client back to an earlier conversation, finds what its slot held then:
the KV entries are copied out (KVSequence.saved) when a request would keep less than half of what the slot holds
after the prefix they share, as llama-server does for the whole, and copied back into the slot when a later request
has at least MIN_GAIN fewer tokens to evaluate there, or, for an editor's budgeted request, when it holds more of the
lines next to the cursor than the budget buys (near_cursor). The bytes are llama.cpp's own, so what comes back is
exactly what was evaluated. Least recently used go first past the limit. Pure bookkeeping here; SlotPool.recall decides
when, under the pool's locks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import psutil

from edgespec.config import DEFAULT_CACHE_RAM_MIB
from edgespec.decoding.reuse import Reuse
from edgespec.planning.budget import MiB

# A slot's prompt is kept when a request would keep less than this share of it (llama-server's rule), counted after
# the prefix both share: an editor's ring chunks, or a system prompt, must not make a new file look like the old.
KEEP_BELOW = 0.5
# A kept prompt comes back only where it leaves at least this many fewer tokens to evaluate than what the slot holds
# (so none shorter is kept). A budgeted /infill is sized by what each holds next to the cursor instead: counted over
# the widest prompt of the file's lines, the window's far lines flipped a slot between two prompts of one file for
# small gains (docs/bench/editor.md, "A file the editor comes back to").
MIN_GAIN = 128


class Saving(Protocol):
    tokens: list[int]
    can_shift: bool

    def saved(self, room: Callable[[int], bool]) -> object | None: ...


@dataclass(eq=False)
class Kept:
    """A prompt a slot held, and llama.cpp's copy of its KV entries; priced as a cache would be (decoding.loop)."""

    tokens: list[int]
    data: Sequence  # the bytes KVSequence.saved gave
    can_shift: bool


def replaces(kept: Reuse, held: int) -> bool:
    """Whether a prompt that keeps `kept` of the `held` tokens a slot holds replaces most of what follows the prefix
    they share, at least MIN_GAIN tokens of it: then the slot's prompt is worth keeping."""
    first = kept.runs[0] if kept.runs else None
    shared = first.length if first is not None and first.start == first.source == 0 else 0
    return held - shared >= MIN_GAIN and kept.reused - shared < KEEP_BELOW * (held - shared)


def near_cursor(kept: Reuse, cursor: int, reach: int) -> int:
    """The tokens `kept` holds that a prompt grown out from its `cursor` (the position between prefix and suffix)
    reaches while it evaluates at most `reach` tokens on each side: what a budget of `reach` makes of a cache."""
    held = 0
    for side in (-1, 1):
        lo, hi = (0, cursor) if side < 0 else (cursor + 1, kept.prompt_len)
        clipped = [(max(r.start, lo), min(r.end, hi)) for r in kept.runs]
        at, left = (hi if side < 0 else lo), reach
        for start, end in sorted((c for c in clipped if c[0] < c[1]), key=lambda c: side * c[0]):
            gap = start - at if side > 0 else at - end
            if gap > left:
                break
            left, held, at = left - gap, held + end - start, (end if side > 0 else start)
    return held


def limit_mib(asked: int | None) -> int:
    """EngineConfig.cache_ram as it applies on this machine."""
    return min(DEFAULT_CACHE_RAM_MIB, psutil.virtual_memory().total // 8 // MiB) if asked is None else asked


class PromptCache:
    """Kept prompts, least recently used first, within `limit_mib` of host memory (-1: no limit)."""

    def __init__(self, limit_mib: int) -> None:
        self.limit = None if limit_mib < 0 else limit_mib * MiB
        self.kept: list[Kept] = []

    @property
    def size(self) -> int:
        return sum(len(k.data) for k in self.kept)

    def keep(self, seq: Saving) -> bool:
        """Keep what `seq` holds, unless it is under MIN_GAIN tokens, a kept prompt starts with all of it, or its copy
        is larger than the limit; kept prompts it holds all of go, and the least recently used make room, before the
        copy is made (as llama-server's server_prompt_cache::alloc), so the cache never holds more than its limit.
        Whether it was kept."""
        tokens = seq.tokens
        if len(tokens) < MIN_GAIN or any(k.tokens[:len(tokens)] == tokens for k in self.kept):
            return False

        def room(size: int) -> bool:
            if self.limit is not None and size > self.limit:
                return False
            self.kept = [k for k in self.kept if tokens[:len(k.tokens)] != k.tokens]
            while self.limit is not None and self.kept and self.size + size > self.limit:
                self.kept.pop(0)
            return True

        try:
            data = seq.saved(room)
        except MemoryError:  # the host had less to give than the limit allows: nothing kept, the slot serves on
            return False
        if data is None:
            return False
        self.kept.append(Kept(list(tokens), data, seq.can_shift))
        return True

    def best(self, worth: Callable[[Kept], int], than: int, gain: int = MIN_GAIN) -> Kept | None:
        """The kept prompt `worth` most, where that is at least `gain` more than `than`. `worth` counts tokens the
        prompt keeps, so one shorter than `than + gain` cannot be, and is not priced (a plan each)."""
        priced = [(worth(k), i) for i, k in enumerate(self.kept) if len(k.tokens) >= than + gain]  # recent first
        w, i = max(priced, default=(than, 0))
        return self.kept[i] if w >= than + gain else None

    def take(self, kept: Kept) -> None:
        """`kept` went back into a slot: the slot holds it now."""
        if kept in self.kept:
            self.kept.remove(kept)
