"""Choosing the proposal and K from costs, acceptance and room, with literal numbers."""

import pytest

from edgespec.decoding.costs import AcceptanceTracker
from edgespec.decoding.policy import (Bets, Costs, choose_k, choose_proposal, draft_can_pay, expected_tokens, k_cap, match_class,
                             match_prior)

# ../shared/FACTS.md: time of a batch of B tokens over a single-token pass, 2-core CPU.
CPU = Costs((1, 2, 3, 4, 8, 16), (1.00, 1.59, 2.00, 2.51, 4.30, 4.93))
GPU = Costs((1, 2, 3, 4, 8, 16), (1.00, 1.02, 1.03, 1.05, 1.10, 1.20))


def test_expected_tokens():
    assert expected_tokens([1.0] * 4, 4) == 5
    assert expected_tokens([0.5, 0.5], 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens([0.9], 3) == pytest.approx(1.9)  # positions without an estimate count as rejected


def test_zero_when_verification_costs_more_than_it_gains():
    # 60% acceptance: two tokens' worth in a batch that costs 1.59 singles only if a > 0.59; three need more
    assert choose_k(CPU, [0.5] * 15, 15) == (0, 1.0)
    assert choose_k(CPU, [0.3] * 15, 15)[0] == 0


def test_high_acceptance_takes_the_long_cheap_batch():
    k, rate = choose_k(CPU, [0.95] * 15, 15)
    assert k == 15  # t(16) < t(12) on this curve: the non-monotonic point is used
    assert rate == pytest.approx(expected_tokens([0.95] * 15, 15) / 4.93)


def test_batches_of_32_and_64_only_for_matches_that_almost_never_fail():
    # measured here at 500 tokens of context, rounded: 64 tokens cost 0.20 of a step each, 16 cost 0.28
    cpu64 = Costs((1, 2, 4, 8, 16, 32, 64), (1.0, 1.5, 1.9, 3.3, 4.5, 8.0, 13.0))
    # 0.99: 47.4 tokens expected for 13.0 beats 14.9 for 4.5 (3.65 vs 3.31 per step)
    assert choose_k(cpu64, [0.99] * 63, 63)[0] == 63
    # 0.95: a draft of 63 is mostly wasted: 19.2 tokens for 13.0, while 15 give 11.2 for 4.5
    assert choose_k(cpu64, [0.95] * 63, 63)[0] == 15


def test_a_bet_must_pay_at_the_pessimistic_estimates_too():
    # 0.7 per token: two drafts give 2.19 tokens for 2.00 singles (1.095), the best k by the mean
    assert choose_k(CPU, [0.7] * 15, 15) == (2, pytest.approx(2.19 / 2.00))
    # one standard error lower, 0.6: two drafts give 1.96 tokens for 2.00 singles, one gives 1.6 for 1.59
    assert choose_k(CPU, [0.7] * 15, 15, accept_low=[0.6] * 15) == (1, pytest.approx(1.7 / 1.59))
    # at 0.55 no k pays (one draft: 1.55 for 1.59): a plain step
    assert choose_k(CPU, [0.7] * 15, 15, accept_low=[0.55] * 15) == (0, 1.0)
    # at 0.65 it still pays (2.0725 for 2.00), and k stays the mean's choice
    assert choose_k(CPU, [0.7] * 15, 15, accept_low=[0.65] * 15)[0] == 2


def test_the_best_bet_among_those_that_pay_at_the_pessimistic_estimates():
    # the mean alone, 0.95 per token, takes 15 drafts
    assert choose_k(CPU, [0.95] * 15, 15)[0] == 15
    # at 0.8 the 15 drafts give 4.86 tokens for 4.93 singles and 7 give 4.16 for 4.30: both lose;
    # 3 drafts (2.95 for 2.51 at 0.8) still pay, and by the mean they give 3.71 for 2.51
    assert choose_k(CPU, [0.95] * 15, 15, accept_low=[0.8] * 15) == (3, pytest.approx(3.7099 / 2.51, rel=1e-4))


def test_gpu_curve_pays_at_modest_acceptance():
    assert choose_k(GPU, [0.6] * 15, 15)[0] >= 3
    assert choose_k(CPU, [0.6] * 15, 15)[0] <= 1


def test_k_max_and_proposal_length_bound_the_choice():
    assert choose_k(CPU, [0.99] * 15, 3)[0] == 3
    assert choose_k(CPU, [0.99] * 2, 15)[0] == 2


def test_a_draft_at_half_the_target_cost_does_not_pay_on_this_cpu():
    # ../shared/FACTS.md: the 0.5B draft costs 0.53 of the 1.5B target per token
    assert choose_k(CPU, [0.9] * 15, 15, draft_cost_per_token=0.53)[0] == 0
    assert not draft_can_pay(Costs(CPU.batches, CPU.target_seconds, 0.53), 15)
    # only a perfect draft would, through the cheap batch of 16
    assert choose_k(CPU, [1.0] * 15, 15, draft_cost_per_token=0.53)[0] == 15
    assert choose_k(GPU, [0.9] * 15, 15, draft_cost_per_token=0.1)[0] > 0
    assert draft_can_pay(Costs(GPU.batches, GPU.target_seconds, 0.1), 15)


def test_match_classes_and_their_priors():
    assert [match_class(n) for n in (1, 2, 4, 5, 7, 8, 15, 16, 64)] == [1, 2, 4, 5, 5, 6, 6, 7, 9]
    assert match_prior(match_class(1)) == 0.0  # a one-token match is never worth a batch before evidence
    assert match_prior(match_class(2)) == 0.5
    assert match_prior(match_class(20)) == pytest.approx(1 - 1 / 16)
    # with no evidence a 2-token match does not pay on the CPU curve, a 16-token one pays for 15
    t = AcceptanceTracker(prior=match_prior)
    assert choose_k(CPU, [t.get(match_class(2 + j)) for j in range(15)], 15)[0] == 0
    assert choose_k(CPU, [t.get(match_class(16 + j)) for j in range(15)], 15)[0] == 15


def test_an_idle_draft_pays_for_catching_up():
    costs = Costs(GPU.batches, GPU.target_seconds, 0.3)
    # the draft's batch of n is priced on the target's curve: 8 tokens at 1.10/1.00 of one step
    assert costs.draft_batch_seconds(8) == pytest.approx(0.3 * 1.10)
    assert costs.draft_batch_seconds(700) == pytest.approx(0.3 * 1.20 * 700 / 16)
    accept = [0.9] * 15
    assert choose_k(costs, accept, 15, 0.3)[0] > 0
    # the same draft after 700 prompt tokens it never saw: catching up costs more than it saves
    assert choose_k(costs, accept, 15, 0.3, fixed_cost=costs.draft_batch_seconds(700) - 0.3)[0] == 0


def test_a_draft_that_gains_only_a_few_percent_is_not_kept():
    # at 90% acceptance and 0.44 per token, k=3 beats plain decoding by ~5% on this curve
    curve = Costs((1, 2, 4, 8, 16, 32), (1.00, 1.75, 1.96, 3.91, 4.86, 7.35), 0.44)
    k, rate = choose_k(curve, [0.9] * 31, 31, 0.44)
    assert k == 3 and 1.0 < rate < 1.1
    assert not draft_can_pay(curve, 31)


def test_every_cap_on_k_in_one_place():
    # context_room, tokens_left, the plan's Kmax, the user's -k: the smallest wins
    assert k_cap(1000, 200, 63) == 63
    assert k_cap(1000, 200, 63, user_k=8) == 8
    assert k_cap(1000, 200, 15, user_k=32) == 15  # the plan sized logits rows for 15
    assert k_cap(1000, 6, 63) == 5  # 6 tokens left: the cycle's own token plus 5 drafts
    assert k_cap(3, 200, 63) == 3  # 3 free cache cells
    assert k_cap(1000, 1, 63) == 0  # the last token: a plain step
    assert k_cap(0, 200, 63) == 0 and k_cap(1000, 200, 63, user_k=0) == 0


def test_choose_proposal_takes_the_best_bet_within_the_cap():
    cpu64 = Costs((1, 2, 4, 8, 16, 32, 64), (1.0, 1.5, 1.9, 3.3, 4.5, 8.0, 13.0), draft_seconds_per_token=0.1)
    # a long lookup match that almost never fails: the batch of 64, unless the cap says less
    sure = Bets(ngram=[0.99] * 63, ngram_low=[0.98] * 63)
    assert choose_proposal(cpu64, sure, 63) == ("ngram", 63)
    assert choose_proposal(cpu64, sure, 20) == ("ngram", 15)  # only calibrated sizes: 15 is the largest <= 20
    assert choose_proposal(cpu64, sure, 0) == ("none", 0)
    # a lookup bet that pays by the mean but not one standard error lower is declined
    doubtful = Bets(ngram=[0.6] * 3, ngram_low=[0.3] * 3)
    assert choose_proposal(cpu64, doubtful, 63) == ("none", 0)
    # a cheap draft at 0.8 beats that: 3 drafts give 2.95 tokens for 1.9 + 0.3 (1.34 per step) against
    # 1 draft, 1.8 for 1.6 (1.125), and 7 drafts, 4.16 for 3.3 + 0.7 (1.04)
    draft = Bets(ngram=[0.6] * 3, ngram_low=[0.3] * 3, draft=[0.8] * 63)
    assert choose_proposal(cpu64, draft, 63) == ("draft", 3)
    assert choose_proposal(cpu64, draft, 2) == ("draft", 1)
    # catching up on 60 tokens committed while the draft sat idle costs what a batch of 64 costs it
    assert choose_proposal(cpu64, Bets(draft=[0.8] * 63, draft_lag=60), 63) == ("none", 0)
    # no draft model, or no draft cost measured: the draft is never chosen
    assert choose_proposal(Costs(cpu64.batches, cpu64.target_seconds), Bets(draft=[1.0] * 63), 63) == ("none", 0)
