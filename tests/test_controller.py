"""Choosing K from costs and acceptance, with literal numbers."""

import pytest

from edgespec.controller import AcceptanceTracker, Costs, choose_k, draft_can_pay, expected_tokens

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


def test_tracker_decays_toward_recent_outcomes():
    t = AcceptanceTracker(decay=0.5, prior=0.5)
    t.update(3, True)
    assert t.get(3) == 0.75 and t.get(4) == 0.5
    for _ in range(10):
        t.update(3, False)
    assert t.get(3) < 0.01
