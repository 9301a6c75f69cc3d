"""The automatic proposer: n-gram lookup when it pays, the draft model when it pays, nothing otherwise.

A thin adapter over `policy.choose_proposal`: it turns its trackers into the
acceptance expected at each position, asks the policy which bet to make, and
learns from `accept(n, seconds)`: the verify pass's cost, and how far the bet
held. Lookup's estimates learn on every cycle, used or not, by comparing what
lookup proposed with what the target then committed; the draft's only when used.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from edgespec.config import SamplingConfig
from edgespec.decoding.costs import AcceptanceTracker, CostTracker
from edgespec.decoding.policy import CONFIDENCE_Z, Bets, choose_proposal, match_class, match_prior, memory_class, memory_prior
from edgespec.proposers import Proposal
from edgespec.proposers.draft import DraftProposer
from edgespec.proposers.memory import MemoryProposer
from edgespec.proposers.ngram import NgramProposer


MEMORY_CARRY = 0.5


class AutoProposer:
    name = "auto"

    def __init__(self, ngram: NgramProposer, draft: DraftProposer | None, costs: CostTracker,
                 confidence_z: float = CONFIDENCE_Z, carry: float = 1.0, memory_carry: float = MEMORY_CARRY) -> None:
        self.ngram, self.draft, self.cost_tracker = ngram, draft, costs
        self.ngram_accept = AcceptanceTracker(prior=match_prior)  # keyed by match_class of the match length
        self.draft_accept = AcceptanceTracker()  # keyed by draft position, read as a chain (AcceptanceTracker.chain)
        self.confidence_z = confidence_z  # standard errors below its estimates a lookup bet must still pay
        self.carry = carry  # weight lookup's counts keep from one generation to the next
        self._chosen: Proposal = Proposal(source="none")
        self._shadow: tuple[int, list[int], int] | None = None  # (context length, n-gram tokens, match length)
        # Earlier requests' text (the engine sets it when its memory is on), with estimates keyed by memory_class,
        # learned like lookup's by scoring every proposal, used or not. Only MEMORY_CARRY of their counts pass to
        # the next request: what recurs changes with the workload (docs/bench/replay-memory.md).
        self.memory: MemoryProposer | None = None
        self.memory_accept = AcceptanceTracker(prior=memory_prior)
        self.memory_carry = memory_carry
        self._memory_shadow: tuple[int, Proposal] | None = None  # (context length, the memory's last proposal)

    def begin(self, prompt: Sequence[int], cfg: SamplingConfig, rng: np.random.Generator) -> None:
        self.ngram.begin(prompt, cfg, rng)
        self.ngram_accept.discount(self.carry)
        self.memory_accept.discount(self.memory_carry)
        if self.draft is not None:
            self.draft.begin(prompt, cfg, rng)
        self._shadow = None
        self._memory_shadow = None

    def propose(self, context: Sequence[int], k: int) -> Proposal:
        if k <= 0:  # no room for a bet (the last token, a full context): a plain step, nothing to learn yet
            self._chosen = Proposal(source="none")
            return self._chosen
        self._observe_ngram(context)
        ng = self.ngram.propose(context, k)
        self._shadow = (len(context), ng.tokens, ng.match) if ng.tokens else None
        # Once token j is accepted the match is ng.match + j long, so each position has its own estimate.
        keys = [match_class(ng.match + j) for j in range(len(ng.tokens))]
        mem, mem_accept, mem_low = self._memory_bets(context, k)
        bets = Bets(ngram=[self.ngram_accept.get(c) for c in keys],
                    ngram_low=[self.ngram_accept.lower(c, self.confidence_z) for c in keys],
                    draft=self.draft_accept.chain(k) if self.draft is not None else None,
                    draft_lag=self.draft.lag(context) if self.draft is not None else 0,
                    memory=mem_accept, memory_low=mem_low)
        source, n = choose_proposal(self.cost_tracker.costs, bets, k)
        if source == "ngram":
            self._chosen = Proposal(ng.tokens[:n], source="ngram", match=ng.match)
        elif source == "memory":
            self._chosen = dataclasses.replace(mem, tokens=mem.tokens[:n])
        elif source == "draft":
            self._chosen = self.draft.propose(context, n)  # type: ignore[union-attr]
        else:
            self._chosen = Proposal(source="none")
        return self._chosen

    def accept(self, n_accepted: int, seconds: float | None) -> None:
        chosen = self._chosen
        draft = self.draft if chosen.source == "draft" else None
        if seconds is not None:
            if draft is not None and draft.last_seconds_per_token is not None:
                self.cost_tracker.observe_draft(draft.last_seconds_per_token)
            self.cost_tracker.observe(len(chosen.tokens) + 1, seconds)
        if draft is not None:
            draft.accept(n_accepted, seconds)
            for j in range(min(n_accepted + 1, len(chosen.tokens))):
                self.draft_accept.update(j, j < n_accepted)

    def close(self) -> None:
        if self.draft is not None:
            self.draft.close()

    def _memory_bets(self, context: Sequence[int], k: int) -> tuple[Proposal, list[float], list[float]]:
        """The memory's proposal and its estimates per token (mean, pessimistic), after scoring its last one."""
        if self._memory_shadow is not None:
            start, last = self._memory_shadow
            _score(self.memory_accept, [memory_class(last.match + j, last.seen) for j in range(len(last.tokens))],
                   last.tokens, context[start:])
        mem = self.memory.propose(context, k) if self.memory is not None else Proposal()
        self._memory_shadow = (len(context), mem) if mem.tokens else None
        keys = [memory_class(mem.match + j, mem.seen) for j in range(len(mem.tokens))]
        return (mem, [self.memory_accept.get(c) for c in keys],
                [self.memory_accept.lower(c, self.confidence_z) for c in keys])

    def _observe_ngram(self, context: Sequence[int]) -> None:
        """Score the previous n-gram proposal against the tokens the target committed since."""
        if self._shadow is None:
            return
        start, tokens, match = self._shadow
        _score(self.ngram_accept, [match_class(match + j) for j in range(len(tokens))], tokens, context[start:])
        self._shadow = None


def _score(tracker: AcceptanceTracker, keys: list[int], proposed: list[int], committed: Sequence[int]) -> None:
    """Count each proposed token, up to the first the target did not commit, as accepted or not under its key."""
    for key, token, actual in zip(keys, proposed, committed):
        tracker.update(key, token == actual)
        if token != actual:
            return
