"""Accepting or rejecting drafted tokens against the target's logits rows. Pure numpy.

`rows[i]` is the target's prediction for the position of `draft[i]`; row k
(after the last draft token) gives the bonus token when all k are accepted.
Every rule returns (n_accepted, next_token): the committed block is
draft[:n_accepted] + [next_token], so each cycle commits at least one token.

Sampling is lossless (Leviathan et al. 2023; Chen et al. 2023): with q the
target's and p the draft's distribution (both after the same filters), draft
token x is kept with probability min(1, q(x)/p(x)); on rejection the next token
is drawn from the residual max(0, q - p), renormalized. Without p (n-gram
proposals are point masses) this reduces to sample-and-match: draw y ~ q, keep
x if y == x, else emit y.

With `rules` (rules.py: a grammar, penalties, logit bias) each row is read after
the history up to it, committed + draft[:i], and the grammar advances through
each token as it is committed, so the rule is the same, applied to what the
target alone would see.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from edgespec.config import SamplingConfig
from edgespec.decoding.rules import Dist, Rules
from edgespec.decoding.sampling import distribution, draw


def greedy(rows: np.ndarray, draft: Sequence[int], rules: Rules | None = None,
           committed: Sequence[int] = ()) -> tuple[int, int]:
    """Keep draft tokens while they equal the target's argmax (under `rules`, after committed + the draft so far)."""
    if rules is None:
        preds = rows.argmax(axis=1)
        n = 0
        while n < len(draft) and preds[n] == draft[n]:
            n += 1
        return n, int(preds[n])
    history = list(committed)
    for i, x in enumerate(draft):
        y = rules.token(rows[i], history, None)
        if y != x:
            rules.accept(y)
            return i, y
        rules.accept(x)
        history.append(x)
    y = rules.token(rows[len(draft)], history, None)
    rules.accept(y)
    return len(draft), y


def sampled(
    rows: np.ndarray,
    draft: Sequence[int],
    draft_dists: Sequence[Dist] | None,
    cfg: SamplingConfig,
    rng: np.random.Generator,
    rules: Rules | None = None,
    committed: Sequence[int] = (),
) -> tuple[int, int]:
    """Rejection sampling when the proposer gave its distributions, else sample-and-match."""
    history = list(committed) if rules is not None else []

    def target(i: int) -> Dist:
        return distribution(rows[i], cfg) if rules is None else rules.dist(rows[i], history)

    def commit(i: int, token: int) -> tuple[int, int]:
        if rules is not None:
            rules.accept(token)
        return i, token

    for i, x in enumerate(draft):
        q = target(i)
        if draft_dists is None:
            y = draw(*q, rng)
            if y != x:
                return commit(i, y)
        else:
            p = draft_dists[i]
            qx, px = prob_of(q, x), prob_of(p, x)
            # px > 0 always holds for a token the draft sampled; the guard keeps a zero from dividing.
            if not (px > 0 and rng.random() * px < qx):
                return commit(i, draw(*residual(q, p), rng))
        if rules is not None:
            rules.accept(x)
            history.append(x)
    return commit(len(draft), draw(*target(len(draft)), rng))


def prob_of(d: Dist, token: int) -> float:
    ids, p = d
    hit = np.flatnonzero(ids == token)
    return float(p[hit[0]]) if hit.size else 0.0


def residual(q: Dist, p: Dist) -> Dist:
    """max(0, q - p) over the union of both supports, renormalized."""
    ids = np.union1d(q[0], p[0])
    qv = np.zeros(len(ids))
    pv = np.zeros(len(ids))
    qv[np.searchsorted(ids, q[0])] = q[1]
    pv[np.searchsorted(ids, p[0])] = p[1]
    r = np.maximum(qv - pv, 0.0)
    total = r.sum()
    if total <= 1e-12:  # q == p up to rounding: rejection had probability ~0; q is the right fallback
        return q
    return ids, r / total
