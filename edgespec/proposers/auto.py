"""The automatic proposer: n-gram lookup when it pays, the draft model when it pays, nothing otherwise.

Each cycle it prices three options with the measured costs and the running
acceptance estimates (controller.choose_k): a plain step, the n-gram proposal
(free to make) and a draft of k tokens (k draft passes). n-gram estimates are
updated on every cycle, used or not, by comparing what lookup proposed with
what the target then committed; the draft is only observed when used.
"""

from __future__ import annotations

import logging
from typing import Sequence

import numpy as np

from edgespec.config import SamplingConfig
from edgespec.controller import CONFIDENCE_Z, AcceptanceTracker, CostTracker, choose_k
from edgespec.proposers import Proposal
from edgespec.proposers.draft import DraftProposer
from edgespec.proposers.ngram import NgramProposer

log = logging.getLogger(__name__)


def match_class(length: int) -> int:
    """Bucket of an n-gram match length: 1..4 exactly, then one class per doubling (5-7, 8-15, 16-31, ...)."""
    return length if length <= 4 else length.bit_length() + 2


def match_prior(cls: int) -> float:
    """Acceptance expected of a match class before any evidence: 1 - 1/L for its shortest length L.

    A match of L tokens that has held so far fails at the next one about once in L
    (target-only greedy outputs of the benchmark prompts: 1-token matches were right
    20-24% of the time, 2-token 48-61%, 8-15 88-93%, 16 and longer 90-100%).
    """
    shortest = cls if cls <= 4 else max(cls, 1 << (cls - 3))
    return 1.0 - 1.0 / shortest


class AutoProposer:
    name = "auto"

    def __init__(self, ngram: NgramProposer, draft: DraftProposer | None, costs: CostTracker) -> None:
        self.ngram, self.draft, self.cost_tracker = ngram, draft, costs
        self.ngram_accept = AcceptanceTracker(prior=match_prior)  # keyed by match_class of the match length
        self.draft_accept = AcceptanceTracker()  # keyed by draft position
        self.confidence_z = CONFIDENCE_Z  # standard errors below its estimates a lookup bet must still pay
        self.last_source = "none"
        self._chosen: Proposal = Proposal()
        self._shadow: tuple[int, list[int], int] | None = None  # (context length, n-gram tokens, match length)

    def begin(self, prompt: Sequence[int], cfg: SamplingConfig, rng: np.random.Generator) -> None:
        self.ngram.begin(prompt, cfg, rng)
        if self.draft is not None:
            self.draft.begin(prompt, cfg, rng)
        self._shadow = None

    def propose(self, context: Sequence[int], k: int) -> Proposal:
        self._observe_ngram(context)
        ng = self.ngram.propose(context, k)
        self._shadow = (len(context), ng.tokens, ng.match) if ng.tokens else None

        costs = self.cost_tracker.costs
        best, best_rate, source = 0, 1.0 / costs.verify_seconds(1), "none"
        if ng.tokens:
            # Once token j is accepted the match is ng.match + j long, so each position has its own estimate.
            # Lookup's estimates learn on every cycle, taken or not, so declining a doubtful bet costs nothing.
            keys = [match_class(ng.match + j) for j in range(len(ng.tokens))]
            k_ng, rate = choose_k(costs, [self.ngram_accept.get(c) for c in keys], k,
                                  accept_low=[self.ngram_accept.lower(c, self.confidence_z) for c in keys])
            if rate > best_rate:
                best, best_rate, source = k_ng, rate, "ngram"
        if self.draft is not None and costs.draft_seconds_per_token is not None:
            # An idle draft first decodes what was committed without it; its first pass is a draft step anyway.
            catch_up = costs.draft_batch_seconds(self.draft.lag(context)) - costs.draft_seconds_per_token
            # Priced by the mean alone: the draft's estimates learn only from drafts verified, so a
            # pessimistic gate would keep an untried draft untried.
            accept = [self.draft_accept.get(j) for j in range(k)]
            k_d, rate = choose_k(costs, accept, k, costs.draft_seconds_per_token, fixed_cost=max(0.0, catch_up))
            if rate > best_rate:
                best, best_rate, source = k_d, rate, "draft"

        self.last_source = source
        if source == "ngram":
            self._chosen = Proposal(ng.tokens[:best], source="ngram", match=ng.match)
        elif source == "draft":
            self._chosen = self.draft.propose(context, best)  # type: ignore[union-attr]
            if self.draft.last_seconds_per_token is not None:  # type: ignore[union-attr]
                self.cost_tracker.observe_draft(self.draft.last_seconds_per_token)  # type: ignore[union-attr]
        else:
            self._chosen = Proposal(source="none")
        return self._chosen

    def accept(self, n_accepted: int) -> None:
        if self.last_source == "draft":
            self.draft.accept(n_accepted)  # type: ignore[union-attr]
            for j in range(min(n_accepted + 1, len(self._chosen.tokens))):
                self.draft_accept.update(j, j < n_accepted)

    def close(self) -> None:
        if self.draft is not None:
            self.draft.close()

    def _observe_ngram(self, context: Sequence[int]) -> None:
        """Score the previous n-gram proposal against the tokens the target committed since."""
        if self._shadow is None:
            return
        start, tokens, match = self._shadow
        committed = context[start:]
        for j, t in enumerate(tokens[: len(committed)]):
            self.ngram_accept.update(match_class(match + j), t == committed[j])
            if t != committed[j]:
                break
        self._shadow = None
