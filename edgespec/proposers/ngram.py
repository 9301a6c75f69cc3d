"""Prompt lookup: propose what followed the most recent earlier occurrence of the context's suffix.

Code edits, summaries and RAG answers copy long spans of their prompt; a
suffix match finds them with no model at all. The index maps every n-gram
(n_min..n_max) to the positions after its last CANDIDATES occurrences and is
extended only by the tokens committed since the last call, so a lookup costs
the same at token 100 and token 100,000. Of those occurrences the one whose
match reaches furthest back wins (the most recent among equals): a short n-gram
like "    return" recurs in the answer itself, while the span being copied
matches for dozens of tokens. Each proposal reports that length (up to
MATCH_CAP): inside a copied span it, not n, predicts the next tokens
(proposers.auto keys its estimates on it).
"""

from __future__ import annotations

from typing import Callable, Sequence

from edgespec.proposers import Proposal

DEFAULT_N_MIN = 2
DEFAULT_N_MAX = 4
MATCH_CAP = 64  # a match this long is as good as any longer one
CANDIDATES = 4  # occurrences kept per n-gram


class NgramProposer:
    name = "ngram"

    def __init__(self, is_eog: Callable[[int], bool], n_min: int = DEFAULT_N_MIN, n_max: int = DEFAULT_N_MAX) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError(f"n-gram range {n_min}..{n_max} is empty; use 1 <= n_min <= n_max")
        self.n_min, self.n_max = n_min, n_max
        self._is_eog = is_eog
        self._index: dict[tuple[int, ...], list[int]] = {}
        self._tokens: list[int] = []

    def begin(self, prompt: Sequence[int], cfg: object = None, rng: object = None) -> None:
        self._index.clear()
        self._tokens = []
        self._extend(prompt)

    def propose(self, context: Sequence[int], k: int) -> Proposal:
        if len(context) < len(self._tokens):  # a new generation without begin(): start over
            self.begin(context)
        self._extend(context[len(self._tokens) :])
        if k <= 0:
            return Proposal()
        toks = self._tokens
        for n in range(min(self.n_max, len(toks) - 1), self.n_min - 1, -1):
            starts = self._index.get(tuple(toks[len(toks) - n:]))
            if starts is None:
                continue
            match, start = max((self._match_length(s, n), s) for s in starts)  # ties: the most recent
            out = []
            for t in toks[start : start + k]:
                if self._is_eog(t):
                    break  # never propose past the end of a turn or document
                out.append(t)
            if out:
                return Proposal(out, source="ngram", match=match)
        return Proposal()

    def accept(self, n_accepted: int, seconds: float | None = None) -> None:
        pass  # the committed tokens arrive with the next context

    def close(self) -> None:
        pass

    def _match_length(self, start: int, n: int) -> int:
        """How many tokens before `start` equal the context's last ones (at least n, at most MATCH_CAP)."""
        toks, end = self._tokens, len(self._tokens)
        while n < MATCH_CAP and n < start and toks[start - 1 - n] == toks[end - 1 - n]:
            n += 1
        return n

    def _extend(self, new: Sequence[int]) -> None:
        # Index n-grams that end before the last token: only those have a continuation.
        toks = self._tokens
        for t in new:
            end = len(toks)  # the n-grams ending at toks[end-1] are followed by t
            toks.append(t)
            for n in range(self.n_min, min(self.n_max, end) + 1):
                key = tuple(toks[end - n : end])
                starts = self._index.get(key)
                if starts is None:
                    self._index[key] = [end]
                else:
                    starts.append(end)
                    if len(starts) > CANDIDATES:
                        del starts[0]
