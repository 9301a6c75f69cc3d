"""The automatic proposer: n-gram lookup when it pays, the draft model when it pays, nothing otherwise.

Each cycle it prices three options with the calibrated costs and the running
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
from edgespec.controller import AcceptanceTracker, Costs, choose_k
from edgespec.proposers import Proposal
from edgespec.proposers.draft import DraftProposer
from edgespec.proposers.ngram import NgramProposer

log = logging.getLogger(__name__)


class AutoProposer:
    name = "auto"

    def __init__(self, ngram: NgramProposer, draft: DraftProposer | None, costs: Costs) -> None:
        self.ngram, self.draft, self.costs = ngram, draft, costs
        self.ngram_accept = AcceptanceTracker()  # keyed by match length
        self.draft_accept = AcceptanceTracker()  # keyed by draft position
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
        match = round(ng.confidence[0] * self.ngram.n_max) if ng.tokens else 0
        self._shadow = (len(context), ng.tokens, match) if ng.tokens else None

        best, best_rate, source = 0, 1.0 / self.costs.verify_seconds(1), "none"
        if ng.tokens:
            k_ng, rate = choose_k(self.costs, [self.ngram_accept.get(match)] * len(ng.tokens), k)
            if rate > best_rate:
                best, best_rate, source = k_ng, rate, "ngram"
        if self.draft is not None and self.costs.draft_seconds_per_token is not None:
            accept = [self.draft_accept.get(j) for j in range(k)]
            k_d, rate = choose_k(self.costs, accept, k, self.costs.draft_seconds_per_token)
            if rate > best_rate:
                best, best_rate, source = k_d, rate, "draft"

        self.last_source = source
        if source == "ngram":
            self._chosen = Proposal(ng.tokens[:best], None, ng.confidence[:best], "ngram")
        elif source == "draft":
            self._chosen = self.draft.propose(context, best)  # type: ignore[union-attr]
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
            self.ngram_accept.update(match, t == committed[j])
            if t != committed[j]:
                break
        self._shadow = None
