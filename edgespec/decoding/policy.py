"""Which proposal a cycle verifies, and how long: pure functions of costs, acceptance and room.

A cycle that drafts k tokens verifies a batch of k+1 and commits 1 + (the accepted
prefix) tokens. With t(B) the measured cost of a batch of B and a(j) the chance that
draft token j is accepted once 0..j-1 were, a bet of k is worth
(1 + sum_i prod_{j<i} a(j)) / (t(k+1) + draft cost) tokens per second against
1 / t(1) for a plain step; `choose_proposal` takes the best, a plain step (k = 0)
included. Every cap on k is applied in `k_cap`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

# An n-gram bet is made only if it still pays with every estimate one standard error lower (docs/policy.md).
CONFIDENCE_Z = 1.0
DRAFT_P_MIN = 0.5  # drafting stops at a row whose best token the draft itself rates below this
# Acceptance per position a same-family draft reaches on favourable text (FACTS.md: 93% on code edits);
# a draft that cannot pay even at this rate is not worth its memory.
DRAFT_ACCEPT_CEILING = 0.9
# ... and it must beat plain decoding by this much there: calibration is one short measurement.
DRAFT_MIN_GAIN = 1.1
# Acceptance per drafted token the planner expects of a same-family draft when it prices layouts: the mean
# over the recorded traces of Qwen2.5-Coder-0.5B drafting for 1.5B (docs/gpu.md).
DRAFT_ACCEPT_EXPECTED = 0.7


@dataclass(frozen=True)
class Costs:
    """Measured seconds: target batch of B tokens (B in `batches`), and the draft per token."""

    batches: tuple[int, ...]
    target_seconds: tuple[float, ...]
    draft_seconds_per_token: float | None = None
    # More sizes timed for prompts only (decoding.costs.PROMPT_BATCHES), as (B, seconds): no cycle verifies them.
    prompt_only: tuple[tuple[int, float], ...] = ()

    @property
    def prompt_curve(self) -> tuple[tuple[int, ...], tuple[float, ...]]:
        """Every size timed and its seconds, in order of size: what a prompt's batch can cost."""
        both = sorted({**dict(zip(self.batches, self.target_seconds)), **dict(self.prompt_only)}.items())
        return tuple(b for b, _ in both), tuple(t for _, t in both)

    def verify_seconds(self, b: int) -> float:
        return self.target_seconds[self.batches.index(b)]

    @property
    def candidate_ks(self) -> tuple[int, ...]:
        return tuple(b - 1 for b in self.batches)

    def draft_batch_seconds(self, n: int) -> float:
        """The draft decoding n tokens in one batch (catching up), priced on the target's curve
        scaled to the draft's per-token cost: same architecture, smaller matrices."""
        if n <= 0 or self.draft_seconds_per_token is None:
            return 0.0
        b = next((b for b in self.batches if b >= n), self.batches[-1])
        return self.draft_seconds_per_token * self.verify_seconds(b) / self.verify_seconds(1) * max(1.0, n / b)


def k_cap(context_room: int, tokens_left: int, plan_k_max: int, user_k: int | None = None) -> int:
    """The most tokens a cycle may propose.

    A cycle writes k+1 cache cells (`context_room` cells are free) and commits up to
    k+1 tokens (`tokens_left` remain of max_tokens); the memory plan sized its logits
    rows for `plan_k_max`, and `user_k` is -k, if given.
    """
    caps = [context_room, tokens_left - 1, plan_k_max]
    if user_k is not None:
        caps.append(user_k)
    return max(0, min(caps))


def expected_tokens(accept: Sequence[float], k: int) -> float:
    """Expected tokens committed by a cycle drafting k: 1 + sum over i<=k of P(first i accepted).

    `accept[j]` is the probability that draft token j is accepted given that
    tokens 0..j-1 were.
    """
    total, run = 1.0, 1.0
    for j in range(k):
        run *= accept[j] if j < len(accept) else 0.0
        total += run
    return total


def choose_k(costs: Costs, accept: Sequence[float], k_max: int, draft_cost_per_token: float = 0.0,
             fixed_cost: float = 0.0, accept_low: Sequence[float] | None = None) -> tuple[int, float]:
    """The k in 0..k_max (among calibrated batch sizes) with the most expected tokens per second.

    Returns (k, expected tokens per second). `draft_cost_per_token` is 0 for
    proposals that cost nothing (n-gram lookup); `fixed_cost` is paid once by
    any k > 0 (a draft catching up on tokens committed while it was idle).
    With `accept_low` (pessimistic estimates), only the k that also beat a
    plain step at those are candidates: k is sized by the mean among the bets
    likely to pay, and 0 when none is.
    """
    def cycle_seconds(k: int) -> float:
        return costs.verify_seconds(k + 1) + k * draft_cost_per_token + fixed_cost

    plain = 1.0 / costs.verify_seconds(1)
    best_k, best_rate = 0, plain
    for k in costs.candidate_ks:
        if k == 0 or k > min(k_max, len(accept)):
            continue
        if accept_low is not None and expected_tokens(accept_low, k) / cycle_seconds(k) <= plain:
            continue
        rate = expected_tokens(accept, k) / cycle_seconds(k)
        if rate > best_rate:
            best_k, best_rate = k, rate
    return best_k, best_rate


@dataclass(frozen=True)
class Bets:
    """What a cycle could verify, with the acceptance expected at each position."""

    ngram: Sequence[float] = ()  # per token of the lookup proposal; empty when lookup found nothing
    ngram_low: Sequence[float] = ()  # the same estimates, CONFIDENCE_Z standard errors lower
    draft: Sequence[float] | None = None  # per draft position; None without a draft model
    draft_lag: int = 0  # tokens the draft must decode before its first proposal
    memory: Sequence[float] = ()  # per token of the memory's proposal (earlier requests' text); priced as lookup's
    memory_low: Sequence[float] = ()


def choose_proposal(costs: Costs, bets: Bets, k: int) -> tuple[str, int]:
    """("none", 0), ("ngram", k), ("memory", k) or ("draft", k): the bet with the most expected tokens per second.

    `k` is the cycle's cap (`k_cap`). Lookup and memory are gated by their pessimistic estimates, which
    learn on every cycle; the draft, which learns only from drafts verified, by its mean.
    """
    best, best_rate, source = 0, 1.0 / costs.verify_seconds(1), "none"
    for name, accept, low in (("ngram", bets.ngram, bets.ngram_low), ("memory", bets.memory, bets.memory_low)):
        if accept:
            k_copy, rate = choose_k(costs, accept, k, accept_low=low)
            if rate > best_rate:
                best, best_rate, source = k_copy, rate, name
    if bets.draft is not None and costs.draft_seconds_per_token is not None:
        # An idle draft first decodes what was committed without it; its first pass is a draft step anyway.
        catch_up = costs.draft_batch_seconds(bets.draft_lag) - costs.draft_seconds_per_token
        k_d, rate = choose_k(costs, bets.draft, k, costs.draft_seconds_per_token, fixed_cost=max(0.0, catch_up))
        if rate > best_rate:
            best, best_rate, source = k_d, rate, "draft"
    return source, best


def draft_can_pay(costs: Costs, k_max: int) -> bool:
    """Whether the draft beats plain decoding by DRAFT_MIN_GAIN at DRAFT_ACCEPT_CEILING for some k."""
    if costs.draft_seconds_per_token is None:
        return False
    _, rate = choose_k(costs, [DRAFT_ACCEPT_CEILING] * k_max, k_max, costs.draft_seconds_per_token)
    return rate >= DRAFT_MIN_GAIN / costs.verify_seconds(1)


def match_class(length: int) -> int:
    """Bucket of an n-gram match length: 1..4 exactly, then one class per doubling (5-7, 8-15, 16-31, ...)."""
    return length if length <= 4 else length.bit_length() + 2


def match_prior(cls: int) -> float:
    """Acceptance expected of a match class before any evidence: 1 - 1/L for its shortest length L.

    A match of L tokens that has held so far fails at the next one about once in L (docs/policy.md).
    """
    shortest = cls if cls <= 4 else max(cls, 1 << (cls - 3))
    return 1.0 - 1.0 / shortest


def memory_class(length: int, seen: int) -> int:
    """Key of a memory proposal's estimates: the match class of its length, and how many earlier places continued
    the match that way (1, 2, 3 or more): a continuation several earlier texts agree on is likelier to hold."""
    return match_class(length) * 4 + min(max(seen, 1), 3)


def memory_prior(key: int) -> float:
    """Before any evidence a memory match is priced as a lookup match of its length (match_prior)."""
    return match_prior(key // 4)


def draft_cannot_pay(c: Costs) -> str:
    """Why a draft that fails draft_can_pay is not worth loading, with the costs that decided it."""
    return (f"on this machine it would be slower than plain decoding even at {DRAFT_ACCEPT_CEILING:.0%} acceptance "
            f"(draft ÷ target per token {c.draft_seconds_per_token / c.target_seconds[0]:.2f}, verifying "
            f"{c.batches[-1]} tokens costs {c.target_seconds[-1] / c.target_seconds[0]:.1f} single steps)")
