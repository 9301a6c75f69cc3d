"""Turning one row of logits into a token: greedy, or a filtered distribution.

Filters follow llama.cpp's default chain (top-k, top-p, min-p, then
temperature), so the same settings mean the same thing as in llama.cpp; its
infill sampler (llama.vim's and llama.vscode's last) may follow them. The
distribution is returned sparse, as (token ids, probabilities), because after
top-k only a few dozen of 150k entries are non-zero.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np

from edgespec.config import SamplingConfig


class TokenLogprob(NamedTuple):
    """A committed token's log-probability under the target's raw row, and the row's best `n` alternatives."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


def greedy(logits: np.ndarray) -> int:
    """Index of the largest logit, first on ties (as llama.cpp's greedy sampler)."""
    return int(np.argmax(logits))


def distribution(logits: np.ndarray, cfg: SamplingConfig) -> tuple[np.ndarray, np.ndarray]:
    """The filtered, tempered distribution: (ids sorted by probability, probs)."""
    n = logits.shape[-1]
    if 0 < cfg.top_k < n:
        ids = np.argpartition(logits, n - cfg.top_k)[n - cfg.top_k :]  # O(n), unordered
    else:
        ids = np.arange(n)
    x = logits[ids].astype(np.float64)
    order = np.argsort(-x, kind="stable")
    ids, x = ids[order], x[order]
    p = _softmax(x)
    keep = len(p)
    if cfg.top_p < 1.0:
        keep = min(keep, int(np.searchsorted(np.cumsum(p), cfg.top_p)) + 1)
    if cfg.min_p > 0.0:
        keep = min(keep, int(np.count_nonzero(p >= cfg.min_p * p[0])))
    keep = max(keep, 1)
    return ids[:keep], _softmax(x[:keep] / cfg.temperature)


def infill(ids: np.ndarray, p: np.ndarray, keep: Callable[[np.ndarray, np.ndarray], np.ndarray]
           ) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's infill sampler on a filtered distribution: `keep` runs llama.cpp's own (the model's
    Model.infill_keep) and names the ids it keeps; its dist sampler then draws among them by their own
    probabilities, not the merged ones. An id it keeps that was not a candidate (the end of turn it falls back to
    when no text token is likely enough) is certain."""
    kept = keep(ids, p)
    where = {int(t): i for i, t in enumerate(ids)}
    if len(kept) == 0 or any(int(t) not in where for t in kept):
        return kept[:1], np.ones(min(1, len(kept)))
    q = p[[where[int(t)] for t in kept]]
    return kept, q / q.sum()


def sample(logits: np.ndarray, cfg: SamplingConfig, rng: np.random.Generator) -> int:
    if cfg.greedy:
        return greedy(logits)
    ids, p = distribution(logits, cfg)
    return draw(ids, p, rng)


def draw(ids: np.ndarray, p: np.ndarray, rng: np.random.Generator) -> int:
    """One token from a sparse distribution; the index clamp guards rounding at 1.0."""
    c = np.cumsum(p)
    return int(ids[min(int(np.searchsorted(c, rng.random() * c[-1], side="right")), len(ids) - 1)])


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def logprob(row: np.ndarray, token: int, n_top: int = 0) -> TokenLogprob:
    """log softmax of the raw logits (no filters, bias or grammar), as llama.cpp's n_probs and OpenAI's logprobs."""
    x = row.astype(np.float64)
    m = x.max()
    lse = m + np.log(np.exp(x - m).sum())
    top: list[tuple[int, float]] = []
    if n_top > 0:
        n_top = min(n_top, len(x))
        ids = np.argpartition(x, len(x) - n_top)[len(x) - n_top:]
        ids = ids[np.argsort(-x[ids], kind="stable")]
        top = [(int(i), float(x[i] - lse)) for i in ids]
    return TokenLogprob(token, float(x[token] - lse), top)
