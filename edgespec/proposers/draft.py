"""A small draft model of the target's family proposes by decoding ahead on its own KV cache.

The draft cache always holds a prefix of the committed tokens. After a full
acceptance it lags by one (the last draft token was sampled, never decoded);
`propose` catches up by decoding whatever the cache lacks, so the lag costs one
extra row in the next draft batch instead of a separate pass.
"""

from __future__ import annotations

import copy
import time
from typing import Sequence

import numpy as np

from edgespec.decoding import sampling
from edgespec.decoding.loop import planned
from edgespec.backend import KVSequence, Model
from edgespec.config import SamplingConfig
from edgespec.errors import IncompatibleDraftError
from edgespec.proposers import Proposal

# As llama.cpp's common/speculative: vocabularies may differ by a few padding
# entries, and the first ids (often odd control tokens) are not compared.
VOCAB_MAX_SIZE_DIFFERENCE = 128
VOCAB_CHECK_START_TOKEN_ID = 5


def check_compatible(target: Model, draft: Model) -> None:
    """Refuse a draft whose tokens would mean something else to the target."""
    t, d = target.vocab, draft.vocab
    names = f"target {target.path.name} and draft {draft.path.name}"
    fix = "use a draft from the target's family (see `edgespec models list`) or the n-gram proposer"
    if t.type != d.type:
        raise IncompatibleDraftError(f"{names} use different tokenizer types ({t.type} vs {d.type}); {fix}")
    if (t.add_bos, t.bos, t.eos) != (d.add_bos, d.bos, d.eos):
        raise IncompatibleDraftError(
            f"{names} differ in special tokens (add_bos/BOS/EOS {t.add_bos}/{t.bos}/{t.eos} vs "
            f"{d.add_bos}/{d.bos}/{d.eos}); {fix}"
        )
    if abs(t.n_tokens - d.n_tokens) > VOCAB_MAX_SIZE_DIFFERENCE:
        raise IncompatibleDraftError(
            f"{names} have vocabularies of {t.n_tokens} and {d.n_tokens} tokens "
            f"(more than {VOCAB_MAX_SIZE_DIFFERENCE} apart); {fix}"
        )
    for i in range(VOCAB_CHECK_START_TOKEN_ID, min(t.n_tokens, d.n_tokens)):
        if target.token_text(i) != draft.token_text(i):
            raise IncompatibleDraftError(
                f"{names} disagree on token {i} ({target.token_text(i)!r} vs {draft.token_text(i)!r}); {fix}"
            )


class DraftProposer:
    name = "draft"

    def __init__(self, draft: Model, target: Model, p_min: float = 0.0) -> None:
        check_compatible(target, draft)
        self.model = draft
        self.cache: Model | KVSequence = draft  # the KV sequence it drafts on (the model's own: sequence 0)
        self.p_min = p_min  # stop drafting at a token the draft itself rates below this
        self._n_vocab = min(draft.n_vocab, target.n_vocab)
        self._cfg = SamplingConfig()
        self._rng = np.random.default_rng()
        self._base = 0
        self.cache_reuse = 0  # the generation's n_cache_reuse: the draft's cache reuses moved chunks as the target's
        self.reuse_anchor: int | None = None  # and where they stop moving (decoding.reuse)
        # Seconds per drafted token in the last proposal that needed no catch-up; None otherwise.
        self.last_seconds_per_token: float | None = None

    def on_sequence(self, seq: int) -> DraftProposer:
        """A proposer like this one on the draft model's KV sequence `seq` (for the target's slot `seq`)."""
        other = copy.copy(self)
        other.cache = self.model.sequences[seq]
        other._base, other.last_seconds_per_token = 0, None
        return other

    def lag(self, context: Sequence[int]) -> int:
        """Tokens the draft must decode before its first proposal: the last committed one, and
        everything committed while it was not used (all of the prompt the first time)."""
        return planned(self.cache, context, self.cache_reuse, self.reuse_anchor).new

    def begin(self, prompt: Sequence[int], cfg: SamplingConfig, rng: np.random.Generator) -> None:
        self._cfg, self._rng = cfg, rng  # the prompt itself is decoded lazily by the first propose

    def propose(self, context: Sequence[int], k: int) -> Proposal:
        m = self.cache
        self._base = len(context)
        self.last_seconds_per_token = None
        if k <= 0:
            m.keep_prefix_of(context)
            return Proposal()
        # What the draft lacks: the last token, and all that was committed while it was not used (with the
        # generation's cache reuse, as the target's own cache).
        kept = planned(m, context, self.cache_reuse, self.reuse_anchor)
        lag = len(context) - kept.reused
        t0 = time.perf_counter()
        logits = m.evaluate(context, [(r.start, r.source, r.length) for r in kept.runs])[-1]
        out = Proposal([], None if self._cfg.greedy else [], "draft")
        for i in range(k):
            row = logits[: self._n_vocab]
            # The cut-off reads the row's best probability, never the token drawn: dropping a drawn token for its
            # own low probability would draft from q cut below p_min, and rejection sampling against q is then biased.
            dist = None if self._cfg.greedy else sampling.distribution(row, self._cfg)
            if (_top_prob(row) if dist is None else float(dist[1].max())) < self.p_min:
                break
            if dist is None:
                tok = sampling.greedy(row)
            else:
                tok = sampling.draw(*dist, self._rng)
                out.dists.append(dist)  # type: ignore[union-attr]
            out.tokens.append(tok)
            if i == k - 1 or m.is_eog(tok) or m.n_past >= m.n_ctx:
                break
            logits = m.decode([tok])[-1]
        if lag == 1 and out.tokens:  # one pass per drafted token: the draft's real cost per token
            self.last_seconds_per_token = (time.perf_counter() - t0) / len(out.tokens)
        return out

    def accept(self, n_accepted: int, seconds: float | None = None) -> None:
        # Keep the context and the accepted drafts; trim clamps when the cache lags by one.
        self.cache.trim(self._base + n_accepted)

    def close(self) -> None:
        self.model.close()


def _top_prob(row: np.ndarray) -> float:
    """Softmax probability of the argmax, without materializing the distribution."""
    m = row.max()
    return float(1.0 / np.exp(row - m).sum())
