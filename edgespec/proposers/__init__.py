"""Proposers guess the next tokens cheaply; the target verifies them in one batch.

The lifecycle follows llama.cpp's common/speculative: `begin(prompt, ...)` once per
generation, then per cycle `propose(context, k)` and `accept(n_accepted, seconds)`.
`context` is every committed token (prompt and output); `k` is the cycle's cap
(`policy.k_cap`, possibly 0), and a proposal may be shorter than k, or empty.
`seconds` is what the target's verify pass cost (None if it failed), for proposers that
learn costs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

import numpy as np

from edgespec.config import SamplingConfig
from edgespec.decoding.verify import Dist


@dataclass
class Proposal:
    tokens: list[int] = field(default_factory=list)
    # The proposer's own distribution at each position (same filters as the
    # target's) when it has one; None means the tokens are point guesses.
    dists: list[Dist] | None = None
    source: str = ""  # which proposer made it ("ngram", "memory", "draft"; "none" for a plain step)
    match: int = 0  # n-gram lookup: context tokens that matched where the proposal was copied from
    seen: int = 0  # memory: earlier places that matched as far and continued this way


class Proposer(Protocol):
    name: str

    def begin(self, prompt: Sequence[int], cfg: SamplingConfig, rng: np.random.Generator) -> None: ...

    def propose(self, context: Sequence[int], k: int) -> Proposal: ...

    def accept(self, n_accepted: int, seconds: float | None) -> None: ...

    def close(self) -> None: ...

