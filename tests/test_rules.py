"""rules.py as pure logic: a set-based grammar stands in for llama.cpp's, so the widening search can be
checked against a full mask on thousands of rows (the real grammar sampler is tested in test_structured.py)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgespec.decoding import sampling
from edgespec.decoding import verify
from edgespec.config import SamplingConfig
from edgespec.decoding.rules import Pieces, Rules, Start

N_VOCAB = 5000


class SetGrammar:
    """Admits the ids in `allowed[step]` at each step; accepting a forbidden id is an error, as in llama.cpp."""

    done = False

    def __init__(self, allowed: list[np.ndarray], step: int = 0) -> None:
        self.sets, self.step = allowed, step

    def allowed(self, ids: np.ndarray) -> np.ndarray:
        return np.isin(ids, self.sets[min(self.step, len(self.sets) - 1)])

    def accept(self, token: int) -> None:
        assert self.allowed(np.array([token]))[0], f"accepted forbidden token {token}"
        self.step += 1

    def clone(self) -> SetGrammar:
        return SetGrammar(self.sets, self.step)

    def close(self) -> None:
        pass


def full_mask(row: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    x = np.full_like(row, -np.inf)
    x[allowed] = row[allowed]
    return x


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n_allowed=st.sampled_from([1, 3, 50, 700, N_VOCAB]),
       top_k=st.sampled_from([0, 1, 40, 200]))
def test_widening_search_equals_a_full_mask(seed, n_allowed, top_k):
    rng = np.random.default_rng(seed)
    row = rng.normal(0, 3, N_VOCAB).astype(np.float32)
    allowed = rng.choice(N_VOCAB, n_allowed, replace=False)
    sc = SamplingConfig(temperature=0.7, top_k=top_k, top_p=0.9, min_p=0.02)
    rules = Rules(sc, SetGrammar([allowed]))
    masked = full_mask(row, allowed)
    assert rules.token(row, [], None) == int(np.argmax(masked))
    ids, p = rules.dist(row, [])
    ref_ids, ref_p = sampling.distribution(masked, sc)
    got = dict(zip(ids.tolist(), p.tolist()))
    ref = {i: q for i, q in zip(ref_ids.tolist(), ref_p.tolist()) if q > 0}
    assert {i for i, q in got.items() if q > 0} == set(ref)
    assert all(abs(got[i] - q) < 1e-9 for i, q in ref.items())


def test_penalties_follow_llama_cpp_arithmetic():
    row = np.array([2.0, -1.0, 0.5, 3.0], dtype=np.float32)
    sc = SamplingConfig(repeat_penalty=2.0, repeat_last_n=3, frequency_penalty=0.25, presence_penalty=0.5)
    x = Rules(sc).logits(row, [3, 0, 1, 1])  # the window is the last 3: 0 once, 1 twice; 3 is outside it
    assert x.tolist() == pytest.approx([2.0 / 2 - 0.25 - 0.5, -1.0 * 2 - 0.5 - 0.5, 0.5, 3.0])


def test_logit_bias_adds_and_minus_infinity_forbids():
    row = np.array([1.0, 5.0, 2.0], dtype=np.float32)
    rules = Rules.of(SamplingConfig(logit_bias=((1, -np.inf), (2, 0.5))))
    assert rules is not None and rules.token(row, [], None) == 2


def test_no_rules_means_the_fast_path():
    assert Rules.of(SamplingConfig()) is None
    assert Rules.of(SamplingConfig(repeat_penalty=1.1, repeat_last_n=0)) is None


def test_greedy_verification_advances_the_grammar_only_through_committed_tokens():
    # Step 0 admits {1, 2}, step 1 admits {3}, step 2 admits {4}. The draft [2, 5] has its second token forbidden.
    grammar = SetGrammar([np.array([1, 2]), np.array([3]), np.array([4])])
    rules = Rules(SamplingConfig(), grammar)
    rows = np.zeros((3, 8), dtype=np.float32)
    rows[0, 2] = rows[1, 5] = rows[1, 3] = 1.0  # the target itself prefers 5 at step 1, which the grammar forbids
    rows[1, 5] = 9.0
    assert rules.admits([2, 5]) == 1 and grammar.step == 0  # the check runs on a clone
    assert verify.greedy(rows[:2], [2], rules, []) == (1, 3)
    assert grammar.step == 2


def test_sampled_verification_under_a_grammar_matches_the_masked_distribution():
    """Sample-and-match with a grammar: the committed first token is distributed as the masked row."""
    rng = np.random.default_rng(0)
    row = np.log(np.array([0.4, 0.3, 0.2, 0.1], dtype=np.float32))
    sc = SamplingConfig(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    counts = np.zeros(4)
    n = 20000
    for _ in range(n):
        rules = Rules(sc, SetGrammar([np.array([1, 2, 3])]))
        _, tok = verify.sampled(row[None, :], [], None, sc, rng, rules, [])
        counts[tok] += 1
    expected = np.array([0.0, 0.5, 1 / 3, 1 / 6]) * n
    assert counts[0] == 0
    chi2 = float((((counts - expected) ** 2)[1:] / expected[1:]).sum())
    assert chi2 < 13.8  # 2 degrees of freedom, p = 0.001


def test_a_start_admits_only_tokens_that_agree_with_its_text_until_the_answer_holds_it():
    """Token healing: with "retur" left out of the prompt, the first tokens must spell it (one may run past it, one
    may spell part of it); then every token is admitted and the rules read rows as without a grammar."""
    vocab = {0: b"ret", 1: b"return", 2: b"retry", 3: b"ur", 4: b"u", 5: b"x", 6: b"", 7: b"returned"}
    pieces = Pieces(len(vocab), vocab.__getitem__, lambda t: t == 6)
    start = Start(b"retur", pieces)
    assert start.allowed(np.arange(8)).tolist() == [True, True, False, False, False, False, False, True]
    rules = Rules(SamplingConfig(temperature=0.0), start)
    row = np.array([0.0, 1.0, 9.0, 0.0, 0.0, 8.0, 7.0, 2.0], dtype=np.float32)  # retry, x and the end score best
    assert rules.token(row, [], None) == 7  # the best that agrees
    assert rules.admits([0, 3, 5]) == 3 and rules.admits([0, 5]) == 1  # "ret" + "ur" spells it; then anything
    rules.accept(0)
    assert start.left == b"ur" and start.allowed(np.arange(8)).tolist() == [False] * 3 + [True, True] + [False] * 3
    assert rules.token(row, [0], None) == 3
    rules.accept(3)
    assert rules.grammar is None and rules.token(row, [0, 3], None) == 2  # healed: the plain argmax again
