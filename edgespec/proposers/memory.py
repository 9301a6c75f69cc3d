"""Memory lookup: propose what followed the longest earlier match of the context in text edgespec wrote before.

The adapter between `edgespec.memory` (the index and its file) and the proposer protocol. Which memory it reads
is set per generation by the engine (`memory`: None reads nothing), so that one slot's proposer serves requests
of different namespaces (a server's API keys) without mixing them.
"""

from __future__ import annotations

from typing import Callable, Sequence

from edgespec.memory import Memory
from edgespec.proposers import Proposal


class MemoryProposer:
    name = "memory"

    def __init__(self, is_eog: Callable[[int], bool], memory: Memory | None = None) -> None:
        self._is_eog = is_eog
        self.memory = memory

    def begin(self, prompt: Sequence[int], cfg: object = None, rng: object = None) -> None:
        pass  # the memory holds earlier requests only: this one is added when it ends (Engine)

    def propose(self, context: Sequence[int], k: int) -> Proposal:
        found = self.memory.lookup(context, k) if self.memory is not None else None
        if found is None:
            return Proposal()
        # Never past the end of a turn: a stored prompt's tail may hold one.
        out = next((found.tokens[:i] for i, t in enumerate(found.tokens) if self._is_eog(t)), found.tokens)
        return Proposal(out, source="memory", match=found.length, seen=found.seen) if out else Proposal()

    def accept(self, n_accepted: int, seconds: float | None = None) -> None:
        pass

    def close(self) -> None:
        pass
