"""Verification rules on hand-made logits: greedy matching and the lossless rejection sampler.

The sampler tests draw the first committed token many times with fixed seeds
and compare its frequencies with the target distribution by chi-square.
"""

import numpy as np
import pytest

from edgespec.decoding import verify
from edgespec.config import SamplingConfig

PLAIN = SamplingConfig(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
CHI2_P001 = {4: 18.47, 5: 20.52}  # chi-square critical values at p = 0.001 by degrees of freedom


def logits_of(p):
    return np.log(np.asarray(p, dtype=np.float64)).astype(np.float32)


def test_greedy_accepts_the_matching_prefix_and_corrects():
    rows = np.array([[0, 5, 1], [9, 0, 1], [0, 0, 3]], dtype=np.float32)  # argmax 1, 0, 2
    assert verify.greedy(rows, [1, 2]) == (1, 0)
    assert verify.greedy(rows, [2, 0]) == (0, 1)


def test_greedy_full_acceptance_gives_the_bonus_token():
    rows = np.array([[0, 5, 1], [9, 0, 1], [0, 0, 3]], dtype=np.float32)
    assert verify.greedy(rows, [1, 0]) == (2, 2)
    assert verify.greedy(rows[:1], []) == (0, 1)


def test_residual_is_positive_part_of_q_minus_p():
    q = (np.array([0, 1, 2]), np.array([0.5, 0.3, 0.2]))
    p = (np.array([1, 3]), np.array([0.6, 0.4]))
    ids, r = verify.residual(q, p)
    assert ids.tolist() == [0, 1, 2, 3]
    np.testing.assert_allclose(r, np.array([0.5, 0.0, 0.2, 0.0]) / 0.7)


def first_token_counts(q, p, n, seed, draft_dists=True):
    """Emit one token n times: the draft token if accepted, else the correction."""
    q, p = np.asarray(q), np.asarray(p)
    rng = np.random.default_rng(seed)
    rows = np.stack([logits_of(q), logits_of(q)])
    support = np.flatnonzero(p > 0)
    counts = np.zeros(len(q), dtype=int)
    for _ in range(n):
        x = int(rng.choice(len(p), p=p))  # the draft samples from its own distribution
        dists = [(support, p[support])] if draft_dists else None
        n_acc, nxt = verify.sampled(rows, [x], dists, PLAIN, rng)
        counts[x if n_acc == 1 else nxt] += 1
    return counts


def chi2(counts, q):
    expected = counts.sum() * np.asarray(q)
    return float((((counts - expected) ** 2) / expected).sum())


Q = [0.4, 0.3, 0.15, 0.1, 0.05]


@pytest.mark.parametrize(
    "p, seed",
    [
        (Q, 1),  # draft equal to the target
        ([0.02, 0.03, 0.05, 0.1, 0.8], 2),  # draft far from it
        ([0.0, 0.0, 0.5, 0.5, 0.0], 3),  # draft with zero mass where the target has mass
    ],
    ids=["equal", "far", "zero-mass"],
)
def test_rejection_sampler_emits_the_target_distribution(p, seed):
    counts = first_token_counts(Q, p, 20000, seed)
    assert chi2(counts, Q) < CHI2_P001[4], counts


def test_sample_and_match_without_draft_probabilities():
    # an n-gram guess is a point mass; the emitted token must still follow q
    counts = first_token_counts(Q, [0.0, 0.0, 0.0, 1.0, 0.0], 20000, 4, draft_dists=False)
    assert chi2(counts, Q) < CHI2_P001[4], counts


def test_sampler_detects_a_wrong_rule():
    # the same statistic rejects the naive rule "always keep the draft token"
    p = np.array([0.02, 0.03, 0.05, 0.1, 0.8])
    counts = np.bincount(np.random.default_rng(5).choice(5, size=20000, p=p), minlength=5)
    assert chi2(counts, Q) > CHI2_P001[4]


def test_accepted_draft_equal_to_target_is_always_kept_when_greedy_filtering_leaves_one():
    cfg = SamplingConfig(temperature=1.0, top_k=1)
    rows = np.stack([logits_of(Q)] * 3)
    support = np.array([0])
    n, nxt = verify.sampled(rows, [0, 0], [(support, np.array([1.0]))] * 2, cfg, np.random.default_rng(0))
    assert (n, nxt) == (2, 0)
