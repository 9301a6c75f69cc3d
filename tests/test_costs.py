"""The trackers that learn costs and acceptance, with literal numbers."""

from pathlib import Path
from types import SimpleNamespace

import pytest

from edgespec.decoding.costs import (PAUSE_BATCH_STEP, RATE_LEAST_TOKENS, AcceptanceTracker, CostTracker, PromptRate,
                                     contended, pause_batch, pause_holds, time_batches)
from edgespec.decoding.policy import Costs

# ../shared/FACTS.md: time of a batch of B tokens over a single-token pass, 2-core CPU.
CPU = Costs((1, 2, 3, 4, 8, 16), (1.00, 1.59, 2.00, 2.51, 4.30, 4.93))


def test_tracker_decays_toward_recent_outcomes():
    t = AcceptanceTracker(decay=0.5, prior=lambda key: 0.5)
    t.update(3, True)
    # one success against a prior worth two trials: (1 + 0.5 * 2) / (1 + 2)
    assert t.get(3) == pytest.approx(2 / 3) and t.get(4) == 0.5
    for _ in range(10):
        t.update(3, False)
    # decayed counts: ~0 accepted of ~2 trials, the prior still weighs 2
    assert t.get(3) == pytest.approx(0.5 * 2 / (2 + 2), abs=0.01)


def test_lower_estimate_narrows_with_consistent_evidence():
    t = AcceptanceTracker(prior=lambda key: 0.5)
    # the prior alone, worth two trials: 0.5 - sqrt(0.25 / 2)
    assert t.lower(2) == pytest.approx(0.5 - 0.125 ** 0.5)
    for _ in range(30):
        t.update(2, True)
    p = t.get(2)
    assert p > 0.9 and p - t.lower(2) < 0.1


def test_cost_tracker_follows_observed_passes():
    cal = Costs((1, 2, 4), (0.10, 0.15, 0.20))
    ct = CostTracker(cal, decay=0.5)
    assert ct.costs == cal
    ct.observe(1, 0.12)  # first observation of a size is taken as is
    assert ct.costs.target_seconds == pytest.approx((0.12, 0.18, 0.24))  # unobserved sizes borrow its scale
    ct.observe(4, 0.30)  # a deep context: the batch of 4 costs 1.5x calibration, not 1.2x
    assert ct.costs.target_seconds == pytest.approx((0.12, 0.18, 0.30))
    ct.observe(1, 10.0)  # a stalled pass moves the scale at most 2x, then decays in
    assert ct.costs.target_seconds[0] == pytest.approx(0.5 * 0.12 + 0.5 * 0.24)
    ct.observe(3, 1.0)  # sizes that were not calibrated are ignored
    assert ct.costs.batches == (1, 2, 4)


def test_load_seen_in_plain_steps_moves_every_sizes_price():
    cal = Costs((1, 2, 4), (0.10, 0.15, 0.20), 0.05)
    ct = CostTracker(cal, decay=0.5, stale_decay=1.0)
    ct.observe(4, 0.20)
    ct.observe(1, 0.15)  # the machine gets busy: plain steps cost 1.5x
    # a bet of 3 still costs 2 plain steps, not 1.33 as it would if 4 kept its idle price
    assert ct.costs.target_seconds == pytest.approx((0.15, 0.225, 0.30))
    assert ct.costs.draft_seconds_per_token == pytest.approx(0.075)
    ct.observe(4, 0.30)  # a pass of 4 at that load confirms its price
    assert ct.costs.target_seconds[2] == pytest.approx(0.30)
    ct.observe(4, 0.45)  # dearer than the load explains: a deep context makes big batches dearer
    assert ct.costs.target_seconds == pytest.approx((0.15, 0.225, 0.20 * 1.5 * (0.5 * 1.0 + 0.5 * 1.5)))


def test_a_size_not_run_lately_drifts_back_to_the_smaller_sizes_scale():
    cal = Costs((1, 2, 4), (0.10, 0.15, 0.20))
    ct = CostTracker(cal, decay=0.5, stale_decay=0.5)
    ct.observe(4, 0.40)  # one dear pass of 4: twice its calibration
    ct.observe(1, 0.10)  # then only plain steps, at calibration
    assert ct.costs.target_seconds == pytest.approx((0.10, 0.15, 0.20 * (0.5 * 2.0 + 0.5 * 1.0)))
    ct.observe(1, 0.10)
    assert ct.costs.target_seconds[2] == pytest.approx(0.20 * 1.25)
    ct.observe(4, 0.20)  # its own pass moves it by `decay`, not by the drift
    assert ct.costs.target_seconds[2] == pytest.approx(0.20 * (0.5 * 1.25 + 0.5 * 1.0))
    # with the default drift a lone dear pass of 4 has lost half its excess after 34 passes of 1
    ct = CostTracker(cal)
    ct.observe(4, 0.40)
    for _ in range(34):
        ct.observe(1, 0.10)
    assert 1.45 < ct.costs.target_seconds[2] / 0.20 < 1.55


def test_cost_tracker_follows_the_draft():
    ct = CostTracker(Costs((1, 2), (0.10, 0.15), 0.05))
    ct.observe_draft(0.06)
    assert ct.costs.draft_seconds_per_token == pytest.approx(0.06)
    assert ct.costs.target_seconds == (0.10, 0.15)
    ct.observe(1, 0.12)  # load slows the draft as much as the target
    assert ct.costs.draft_seconds_per_token == pytest.approx(0.072)


def test_an_untried_draft_position_is_expected_to_do_as_the_one_before():
    # auto on a GPU-like curve: drafts of one token were accepted 9 times in 10. Longer drafts were never
    # tried; with a flat prior of 0.5 at positions 1, 2, ... they would never look worth trying.
    from edgespec.decoding.policy import Bets, Costs, choose_proposal
    from edgespec.proposers.auto import AutoProposer
    from edgespec.proposers.ngram import NgramProposer

    costs = Costs((1, 2, 4, 8), (1.0, 1.119, 1.331, 2.146), 0.22)
    auto = AutoProposer(NgramProposer(lambda t: False), None, CostTracker(costs))
    for i in range(10):
        auto.draft_accept.update(0, i != 3)
    first = auto.draft_accept.chain(1)[0]
    assert abs(auto.draft_accept.chain(3)[2] - first) < 1e-9 and first > 0.7
    bets = Bets(draft=auto.draft_accept.chain(7))
    assert choose_proposal(costs, bets, 7) == ("draft", 3)


def test_discount_lets_a_new_text_move_the_estimate_sooner():
    t = AcceptanceTracker(decay=1.0, prior=lambda key: 0.5)
    for _ in range(8):
        t.update(1, True)
    kept = AcceptanceTracker(decay=1.0, prior=lambda key: 0.5)
    kept._counts = dict(t._counts)
    t.discount(0.5)
    assert t._counts[1] == (4.0, 4.0)
    t.update(1, False), kept.update(1, False)
    assert t.get(1) < kept.get(1)  # one failure on the new text counts for more after the discount


def test_prompt_rate_prices_new_tokens_on_the_calibrated_curve():
    rate = PromptRate((1, 2, 4), (0.1, 0.15, 0.2))
    assert rate.seconds(3) == pytest.approx(0.175)  # between the calibrated sizes
    assert rate.seconds(9) == pytest.approx(0.2 + 0.2 + 0.1)  # full batches of the largest size, then the rest
    assert rate.tokens_within(0.5) == 9 and rate.tokens_within(0.05) == 0
    rate.observe(9, 1.0)  # prefills run twice the calibrated time: the scale moves towards 2
    assert 1.0 < rate.scale < 2.0 and rate.tokens_within(0.5) < 9
    assert PromptRate().tokens_within(0.5) is None  # nothing calibrated: no budget can be priced


def test_a_prefill_of_a_few_tokens_leaves_the_prompt_rate_as_it_is():
    """A speculative request's prefill of a token or two is mostly the request's own overhead (in a lockstep session,
    0.05-0.28 s against 0.033 s calibrated): it scaled every later budget's batches up to 2.4x dear."""
    rate = PromptRate((1, 8, 32), (0.033, 0.12, 0.3))
    for _ in range(5):
        rate.observe(1, 0.2)
        rate.observe(RATE_LEAST_TOKENS - 1, 1.0)
    assert rate.scale == 1.0 and rate.tokens_within(0.3) == 32
    rate.observe(RATE_LEAST_TOKENS, 0.24)  # twice its price: the scale follows
    assert rate.scale > 1.0 and rate.tokens_within(0.3) < 32


def test_batches_nobody_waits_on_are_priced_on_their_own_scale():
    """A request's prefill also pays for the request around it, an aside build's batch is a decode alone (requests'
    scale priced those batches 1.5x dear in a lockstep session): each follows its own observations."""
    rate = PromptRate((1, 16, 64), (0.1, 0.19, 0.6))
    for _ in range(20):
        rate.observe(16, 0.38)  # requests' prefills at twice the curve
        rate.observe_background(64, 0.4)  # the aside's batches at two thirds of it
    assert rate.background_seconds(64) == pytest.approx(0.4, rel=0.05)
    assert rate.seconds(16) == pytest.approx(0.38, rel=0.05)
    before = rate.background
    rate.observe_background(RATE_LEAST_TOKENS - 1, 5.0)  # a batch of a few tokens says little
    assert rate.background == before
    rate.observe(1, 0.3 + rate.seconds(1), shifted=True)  # a prefill that moved cached chunks: the re-rotation's time
    assert rate.background_seconds(64, shifted=True) == pytest.approx(0.3 + rate.background_seconds(64))
    assert rate.background_seconds(64, shifted=True) < rate.seconds(64, shifted=True)  # pause work at its own scale


def test_a_batch_aborted_past_its_price_raises_the_background_scale_and_one_within_it_teaches_nothing():
    """An aside batch a request stopped ran at least as long as it did. Priced short, such batches were aborted at
    the end of pause after pause and never timed (a slow CPU's session lost five pauses so)."""
    rate = PromptRate((1, 16, 64), (0.1, 0.19, 0.6))
    rate.observe_background(64, 0.3, at_least=True)  # stopped within its price: it may have been cheap
    assert rate.background == 1.0
    rate.observe_background(64, 0.9, at_least=True)  # stopped past it: it costs at least that
    assert rate.background_seconds(64) == pytest.approx(0.9)
    raised = rate.background
    rate.observe_background(64, 0.61, at_least=True)  # past its old price, within its new one: nothing learned
    assert rate.background == raised
    rate.observe_background(64, 0.3)  # a batch that ended is timed whole, both ways
    assert rate.background < raised


def test_a_prompt_batch_is_padded_to_a_timed_size_where_that_costs_less():
    # The 1.5B target's prompt batches on the 2-core AVX-512 Xeon, repacked weights (docs/bench/prompt-padding.md):
    # a size one short of 4, 16 or 32 costs more than that size.
    rate = PromptRate((1, 2, 3, 4, 7, 8, 15, 16, 31, 32),
                      (0.070, 0.085, 0.109, 0.090, 0.151, 0.160, 0.250, 0.190, 0.390, 0.336))
    assert [n for n in range(1, 40) if rate.padded(n) != n] == [3, 11, 12, 13, 14, 15, 27, 28, 29, 30, 31]
    assert rate.padded(13) == 16 and rate.padded(31) == 32 and rate.padded(10) == 10  # 10 alone costs less than 16
    assert rate.padded(32) == 32 and rate.padded(45) == 45  # at or past the largest size: as it is
    assert rate.seconds(13) == pytest.approx(0.190) and rate.seconds(45) == pytest.approx(0.336 + 0.190)
    assert PromptRate().padded(13) == 13  # nothing timed: nothing padded


def test_calibration_keeps_a_size_cheaper_than_the_one_just_short_of_it(monkeypatch):
    """time_batches takes a dip among powers of two for noise, and not a power of two's dip below the size one short
    of it."""
    curve = {1: 0.070, 2: 0.085, 3: 0.109, 4: 0.090, 7: 0.151, 8: 0.160, 15: 0.250, 16: 0.190}
    clock = [0.0]

    class Timed:  # a model whose passes take the curve's times on a clock of its own
        n_past, vocab, path = 0, SimpleNamespace(bos=1), Path("timed.gguf")

        def decode(self, tokens, n_outputs=1):
            clock[0] += curve[len(tokens)]

        def trim(self, n):
            pass

    monkeypatch.setattr("edgespec.decoding.costs.time", SimpleNamespace(perf_counter=lambda: clock[0]))
    assert time_batches(Timed(), tuple(curve)) == pytest.approx(tuple(curve.values()))
    curve[16] = 0.150  # below 8's: noise, raised to it
    assert time_batches(Timed(), tuple(curve))[-1] == pytest.approx(0.160)


def test_a_prefill_that_moved_chunks_teaches_the_shift_not_the_scale():
    rate = PromptRate((1, 2, 4), (0.1, 0.15, 0.2))
    rate.observe(4, 0.6, shifted=True)  # the tokens' 0.2 s, and 0.4 s re-rotating the context
    assert rate.scale == 1.0 and rate.shift == pytest.approx(0.4)
    assert rate.seconds(4, shifted=True) == pytest.approx(0.6) and rate.seconds(4) == pytest.approx(0.2)
    assert rate.tokens_within(0.5, shifted=True) == 1 and rate.tokens_within(0.5) == 9
    rate.observe(0, 0.2, shifted=True)  # a shift alone, cheaper this time: the estimate follows
    assert 0.2 < rate.shift < 0.4 and rate.scale == 1.0


def test_a_timed_re_rotation_follows_a_slow_prefill_at_most_twofold():
    """One slow spell over a long prompt that moved chunks once set the learned re-rotation whole (1.36 s against
    the 0.23-0.51 s timed ones took): with a timed one to start from, an observation moves it as the scale moves."""
    rate = PromptRate((1, 2, 4), (0.1, 0.15, 0.2), shift=0.3)  # timed at load (engine.slots.SlotPool)
    assert rate.seconds(4, shifted=True) == pytest.approx(0.5)
    rate.observe(34, rate.seconds(34) + 2.0, shifted=True)  # 2 s past the tokens' price: taken as 0.6
    assert rate.shift == pytest.approx(0.8 * 0.3 + 0.2 * 0.6) and rate.scale == 1.0
    rate.observe(1, rate.seconds(1), shifted=True)  # past the tokens' price by nothing: taken as half
    assert rate.shift == pytest.approx(0.8 * 0.36 + 0.2 * 0.18)


def test_background_batches_are_sized_to_end_within_the_pauses_seen():
    rate = PromptRate((1, 16, 64), (0.1, 0.19, 0.6))  # the 1.5B target's curve on 2 cores, about
    editor = [0.01, 1.0] * 8  # an answer's own follow-up request at once, then the user's pause of a second
    first = pause_batch(0.0, editor, rate.seconds, 320, 64)
    assert first == 64  # half the pauses outlast a full batch: none a larger one
    second = pause_batch(0.6, editor, rate.seconds, 320 - first, 64)
    assert 16 <= second < 64 and 0.6 + rate.seconds(second) <= 1.0  # the rest of the pause, not a batch it cuts
    assert pause_batch(0.6, [0.01, 10.0] * 8, rate.seconds, 256, 64) == 64  # long pauses: the cheapest per token
    assert pause_batch(0.6, [], rate.seconds, 256, 64) == 64  # nothing seen yet
    assert pause_batch(2.0, editor, rate.seconds, 256, 64) == 64  # past every pause seen: as long as it lasts
    assert pause_batch(0.0, editor, rate.seconds, 20, 64) == 20  # what is left, though not a multiple of the step
    # None fits what is left by the estimate: the smallest, which loses least and fits where the estimate is dear.
    assert pause_batch(0.95, editor, rate.seconds, 256, 64) == PAUSE_BATCH_STEP
    assert all(pause_batch(t / 10, editor, rate.seconds, 300, 64) % PAUSE_BATCH_STEP == 0 for t in range(12))


def test_work_nothing_aborts_starts_only_where_the_pause_is_expected_to_hold_it():
    editor = [0.01, 1.0] * 8  # as above: a follow-up request at once, then a second's pause
    assert pause_holds(0.05, editor, 0.3)  # a pause's start: every pause that lasted this long lasted a second
    assert not pause_holds(0.8, editor, 0.3)  # near its end: the request is due before a re-rotation ends
    assert pause_holds(2.0, editor, 0.3) and pause_holds(0.0, [], 0.3)  # past every pause seen, or none seen yet
    assert not pause_holds(0.3, [0.5, 0.6, 2.0], 0.3)  # two of the three that lasted this long end first


def test_a_timing_is_contended_where_others_take_cores_its_threads_need():
    assert not contended(0.1, 2, 2)  # a quiet machine: the kernel's odd tick
    assert contended(0.6, 2, 2)  # a build on the cores llama.cpp's threads run on
    assert not contended(1.1, 2, 1)  # a pytest-xdist neighbour on the other core: it took none of this one's
    assert contended(1.3, 2, 1)
    assert not contended(10.0, 16, 4) and contended(12.5, 16, 4)


def test_a_contended_calibration_is_timed_again_and_the_fastest_of_each_size_used_or_a_quiet_one_cached(
        monkeypatch, tmp_path):
    """Load from elsewhere only slows a pass: while every timing is contended, each size's fastest of
    CONTENDED_TRIES is used and nothing cached; a quiet try is used and cached as it is."""
    from edgespec.config import LoadConfig
    from edgespec.decoding import costs

    monkeypatch.setattr(costs, "CONTENDED_TRIES", 3)
    timings = iter([(0.010, 0.030), (0.015, 0.022), (0.012, 0.025), (0.020, 0.040), (0.011, 0.016)])
    busy = iter([True, True, True, True, False])
    monkeypatch.setattr(costs, "time_batches", lambda model, batches, progress=None: next(timings))
    monkeypatch.setattr(costs, "contended", lambda others, cpus, threads: next(busy))
    model = SimpleNamespace(path=tmp_path / "m.gguf", cfg=LoadConfig(n_threads=2))
    model.path.write_bytes(b"GGUF")
    assert costs._measured_or_timed(model, (1, 2), tmp_path / "cache", "cpu") == (0.010, 0.022)
    assert not (tmp_path / "cache").exists()
    assert costs._measured_or_timed(model, (1, 2), tmp_path / "cache", "cpu") == (0.011, 0.016)  # busy, then quiet
    assert costs._measured_or_timed(model, (1, 2), tmp_path / "cache", "cpu") == (0.011, 0.016)  # from the cache
