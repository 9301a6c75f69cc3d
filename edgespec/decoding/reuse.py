"""Which cached KV entries a new prompt can keep: its common prefix, and every later run of at least `min_chunk`
tokens that only moved (llama.cpp's cache reuse by shifting, `--cache-reuse N`).

llama-server's loop stops reusing at the first token the new prompt inserted: it only skips cached tokens. This
planner also skips prompt tokens, so a run after an insertion is found too (an editor's window that slid down a
line: its first line dropped, a new line added before the suffix, the suffix kept). Runs are taken in order on both
sides, nearest first, each extended as far as it matches. Pure: it reads token lists, the backend moves the KV.

A shifted entry was computed with other text before it, so what follows is close to a fresh evaluation, not the
same; only the common prefix is exact. Close enough far from what changed, not near it: an entry holds what the
model made of the text before it, so a FIM suffix kept from before a keystroke still "sees" the old cursor line,
and completions go wrong (docs/bench/editor.md). So a prompt may name an `anchor` (prompts.fim.cursor_anchor), from
which on moved runs are not taken: a run must start before it, where the text that follows is unchanged with it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import numpy as np

_HASH_BASE = np.uint64(1_000_003)  # odd: invertible modulo 2^64
_HASH_INVERSE = np.uint64(pow(1_000_003, -1, 2**64))


@dataclass(frozen=True)
class Run:
    """prompt[start:start + length] equals cache[source:source + length]: its KV moves by start - source."""

    start: int
    source: int
    length: int

    @property
    def end(self) -> int:
        return self.start + self.length

    @property
    def shift(self) -> int:
        return self.start - self.source


@dataclass(frozen=True)
class Reuse:
    """The runs of the prompt kept from the cache (the common prefix first when there is one), in prompt order."""

    runs: tuple[Run, ...]
    prompt_len: int

    @property
    def reused(self) -> int:
        return sum(r.length for r in self.runs)

    @property
    def new(self) -> int:
        """Prompt tokens to evaluate."""
        return self.prompt_len - self.reused

    @property
    def prefix(self) -> int:
        """Length of the common prefix kept in place (shift 0 from position 0)."""
        return self.runs[0].length if self.runs and self.runs[0].start == 0 and self.runs[0].source == 0 else 0

    @property
    def moved(self) -> int:
        """Tokens kept at a new position (chunk reuse): llama.cpp re-rotates the context's keys for them."""
        return self.reused - self.prefix

    def gaps(self) -> list[tuple[int, int, Run | None]]:
        """(start, end, the run that follows) for each stretch of new tokens, in order; the last has no run."""
        out, at = [], self.prefix
        for r in self.runs:
            if r.start == 0 and r.source == 0:
                continue
            out.append((at, r.start, r))
            at = r.end
        out.append((at, self.prompt_len, None))
        return out


def common_prefix(cache: Sequence[int], prompt: Sequence[int]) -> int:
    """Length of the longest common prefix of the two lists."""
    n = min(len(cache), len(prompt))
    if n == 0:
        return 0
    a, b = np.asarray(cache[:n], dtype=np.int64), np.asarray(prompt[:n], dtype=np.int64)
    diff = np.flatnonzero(a != b)
    return int(diff[0]) if diff.size else n


def plan(cache: Sequence[int], prompt: Sequence[int], min_chunk: int = 0, anchor: int | None = None) -> Reuse:
    """What of `cache` the KV keeps for `prompt`. The prompt's last token is never reused: its logits are needed.

    `min_chunk` 0 keeps the common prefix only (exact reuse); N > 0 also keeps each later run of at least N tokens
    that starts before `anchor` (None: anywhere).
    """
    limit = max(len(prompt) - 1, 0)
    head = common_prefix(cache, prompt[:limit])
    runs = [Run(0, 0, head)] if head else []
    starts = limit if anchor is None else min(anchor, limit)
    if min_chunk > 0 and limit - head >= min_chunk and len(cache) - head >= min_chunk and starts > head:
        runs += _moved_runs(np.asarray(cache, dtype=np.int64), np.asarray(prompt[:limit], dtype=np.int64), head,
                            min_chunk, starts)
    return Reuse(tuple(runs), len(prompt))


def _moved_runs(cache: np.ndarray, prompt: np.ndarray, head: int, n: int, starts: int) -> list[Run]:
    """Greedy in prompt order: at the first prompt position (before `starts`) whose next n tokens occur in the cache
    after the last run, take the occurrence that matches furthest, extend it, and go on after it on both sides."""
    c_hash, p_hash = _window_hashes(cache, n), _window_hashes(prompt, n)
    where = _positions(c_hash.tobytes())
    # only prompt positions whose window occurs in the cache at all can start a run: the others are skipped in C
    hits = np.flatnonzero(np.isin(p_hash[head:starts], c_hash[head:])) + head
    runs: list[Run] = []
    c, p = head, head
    for q in hits.tolist():
        if c >= len(c_hash):
            break
        if q < p:
            continue
        best_len, best_src = 0, -1
        for src in where[int(p_hash[q])]:
            if src < c:
                continue
            length = _match(cache, src, prompt, q)
            if length >= n and length > best_len:
                best_len, best_src = length, src
        if best_len:
            runs.append(Run(q, best_src, best_len))
            p, c = q + best_len, best_src + best_len
    return runs


@functools.lru_cache(maxsize=8)
def _positions(hashes: bytes) -> dict[int, list[int]]:
    """Each window hash of a cache -> where it occurs, in order. A fit plans many prompts against the same cache."""
    where: dict[int, list[int]] = {}
    for i, h in enumerate(np.frombuffer(hashes, dtype=np.uint64).tolist()):
        where.setdefault(h, []).append(i)
    return where


def _window_hashes(tokens: np.ndarray, n: int) -> np.ndarray:
    """A polynomial hash of every window of n tokens (uint64, wrapping), one per start position; equal windows hash
    alike in any list. Matches are confirmed token by token, so a collision costs a comparison, not a wrong run."""
    if len(tokens) < n:
        return np.empty(0, dtype=np.uint64)
    t = tokens.astype(np.uint64) + np.uint64(1)
    ones = np.ones(len(t), dtype=np.uint64)
    powers = np.cumprod(np.concatenate([[np.uint64(1)], ones[1:] * _HASH_BASE]), dtype=np.uint64)
    inverse = np.cumprod(np.concatenate([[np.uint64(1)], ones[1:] * _HASH_INVERSE]), dtype=np.uint64)
    prefix = np.concatenate([[np.uint64(0)], np.cumsum(t * powers, dtype=np.uint64)])
    # window i sums t[i+k] base^(i+k); times base^-i (the base is odd, so invertible mod 2^64) it is position-free
    return (prefix[n:] - prefix[: len(t) - n + 1]) * inverse[: len(t) - n + 1]


def _match(cache: np.ndarray, src: int, prompt: np.ndarray, start: int) -> int:
    """How many tokens match from cache[src] and prompt[start] on."""
    m = min(len(cache) - src, len(prompt) - start)
    diff = np.flatnonzero(cache[src:src + m] != prompt[start:start + m])
    return int(diff[0]) if diff.size else m
