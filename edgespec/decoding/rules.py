"""What a verified row obeys before it becomes a token: a grammar, logit bias and repetition penalties.

Verification asks the same question of every row the target produced: which token
would the target alone pick here, given everything before it? With these rules the
answer depends on the history (penalties) and on a grammar's state, so the verifier
walks the rows in order, advancing the grammar only through tokens it commits;
nothing ever has to be rolled back. The order is llama.cpp's: the grammar's mask,
logit bias, penalties, then the filters of sampling.py.

A full grammar mask costs tens of milliseconds on a 150k vocabulary, a step of the
target, so the mask is asked only of the best-scoring candidates, widening until the
answer is settled: the argmax alone is nearly always admitted (as in llama.cpp's
sample-then-check path), and a top-k filter needs only its k best admitted tokens.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from edgespec.decoding import sampling
from edgespec.config import SamplingConfig
from edgespec.errors import EdgespecError, InvalidRequestError

Dist = tuple[np.ndarray, np.ndarray]  # sparse distribution: (token ids, probabilities)
InfillKeep = Callable[[np.ndarray, np.ndarray], np.ndarray]  # the ids llama.cpp's infill sampler keeps of a Dist
_WIDTHS = (1, 64, 2048)  # candidates masked before the whole vocabulary


class Grammar(Protocol):
    """backend.Grammar's surface: a mask over candidate ids, advanced by committed tokens."""

    done: bool  # it admits every token from here on: the rows after are read as without it

    def allowed(self, ids: np.ndarray) -> np.ndarray: ...

    def accept(self, token: int) -> None: ...

    def clone(self) -> Grammar: ...

    def close(self) -> None: ...


class Rules:
    """One generation's rules over target rows; `token`/`dist` for the next position, `accept` to commit."""

    def __init__(self, sc: SamplingConfig, grammar: Grammar | None = None,
                 infill_keep: InfillKeep | None = None) -> None:
        if sc.infill and infill_keep is None:
            raise ValueError("the infill sampler needs the model's infill_keep")
        self.sc, self.grammar, self.infill_keep = sc, grammar, infill_keep
        self._bias = dict(sc.logit_bias)
        self._penalize = sc.repeat_last_n != 0 and (
            sc.repeat_penalty != 1.0 or sc.frequency_penalty != 0.0 or sc.presence_penalty != 0.0)

    @staticmethod
    def of(sc: SamplingConfig, grammar: Grammar | None = None,
           infill_keep: InfillKeep | None = None) -> Rules | None:
        """Rules for this config, or None when a row is used as it is (the fast paths)."""
        rules = Rules(sc, grammar, infill_keep)
        infill = sc.infill and not sc.greedy
        return rules if grammar is not None or rules._bias or rules._penalize or infill else None

    def logits(self, row: np.ndarray, history: Sequence[int]) -> np.ndarray:
        """`row` with logit bias and penalties applied (a copy; the row itself when neither applies)."""
        if not (self._bias or self._penalize):
            return row
        x = np.array(row, dtype=np.float32)
        n = len(x)
        for t, b in self._bias.items():
            if 0 <= t < n:
                x[t] += b
        if self._penalize:
            last = len(history) if self.sc.repeat_last_n < 0 else self.sc.repeat_last_n
            ids, counts = np.unique(np.asarray(history[len(history) - last:], dtype=np.int64), return_counts=True)
            keep = ids < n
            ids, counts = ids[keep], counts[keep]
            v = x[ids]
            r = self.sc.repeat_penalty
            v = np.where(v <= 0, v * r, v / r)  # llama.cpp: a repeated token is pushed away from likely either way
            x[ids] = v - counts * self.sc.frequency_penalty - self.sc.presence_penalty
        return x

    def token(self, row: np.ndarray, history: Sequence[int], rng: np.random.Generator | None) -> int:
        """The token the target alone picks after `history` (greedy when rng is None or the config is)."""
        if self.sc.greedy or rng is None:
            x = self.logits(row, history)
            if self.grammar is None:
                return int(np.argmax(x))
            ids = np.sort(self._admitted(x, 1))  # sorted, so ties go to the lowest id as np.argmax does
            return int(ids[np.argmax(x[ids])])
        return sampling.draw(*self.dist(row, history), rng)

    def dist(self, row: np.ndarray, history: Sequence[int]) -> Dist:
        """The distribution the target alone samples from after `history`."""
        x = self.logits(row, history)
        if self.grammar is not None:
            masked = np.full(len(x), -np.inf, dtype=np.float32)
            ids = self._admitted(x, self.sc.top_k if self.sc.top_k > 0 else len(x))
            masked[ids] = x[ids]
            x = masked
        dist = sampling.distribution(x, self.sc)
        if self.sc.infill and self.infill_keep is not None:
            return sampling.infill(*dist, self.infill_keep)
        return dist

    def accept(self, token: int) -> None:
        if self.grammar is not None:
            self.grammar.accept(token)
            if self.grammar.done:  # healed (Start): its owner closes it
                self.grammar = None

    def admits(self, tokens: Sequence[int]) -> int:
        """How many leading `tokens` the grammar admits from its current state (all, without a grammar)."""
        if self.grammar is None or not tokens:
            return len(tokens)
        g = self.grammar.clone()
        try:
            for i, t in enumerate(tokens):
                if not g.allowed(np.array([t]))[0]:
                    return i
                g.accept(t)
            return len(tokens)
        finally:
            g.close()

    def close(self) -> None:
        if self.grammar is not None:
            self.grammar.close()

    def _admitted(self, x: np.ndarray, need: int) -> np.ndarray:
        """Admitted ids among the best of `x`: at least `need` of them, or every admitted id there is.

        Any id outside the candidates scanned scores below all of them, so the
        first `need` admitted candidates are the best `need` admitted ids."""
        assert self.grammar is not None
        n = len(x)
        for width in (*(w for w in _WIDTHS if w < n and w >= min(need, n) // 2), n):
            if width >= n:
                ids = np.arange(n)
            elif width == 1:
                ids = np.array([int(np.argmax(x))])
            else:
                ids = np.argpartition(x, n - width)[n - width:]
            ok = ids[self.grammar.allowed(ids) & (x[ids] > -np.inf)]
            if len(ok) >= min(need, n) or width >= n:
                if len(ok) == 0:
                    raise EdgespecError("the grammar admits no token here (every candidate is forbidden or "
                                        "biased to -inf); loosen the grammar or the logit_bias")
                return ok
        raise AssertionError("unreachable: the last width is the whole vocabulary")


class Pieces:
    """A vocabulary's token bytes, indexed by first byte: which tokens agree with a given text."""

    def __init__(self, n_vocab: int, piece: Callable[[int], bytes], is_eog: Callable[[int], bool]) -> None:
        self.pieces = [b"" if is_eog(t) else piece(t) for t in range(n_vocab)]
        by_first: dict[int, list[int]] = {}
        for t, p in enumerate(self.pieces):
            if p:
                by_first.setdefault(p[0], []).append(t)
        self._by_first = {b: np.array(ids, dtype=np.int64) for b, ids in by_first.items()}

    def agreeing(self, text: bytes) -> np.ndarray:
        """The ids whose bytes start with `text` or start it (none of end of generation)."""
        ids = self._by_first.get(text[0], np.empty(0, dtype=np.int64)) if text else np.empty(0, dtype=np.int64)
        return ids[[self.pieces[t].startswith(text) or text.startswith(self.pieces[t]) for t in ids.tolist()]]


_PIECES: weakref.WeakKeyDictionary[Any, Pieces] = weakref.WeakKeyDictionary()


def pieces_of(model: Any) -> Pieces:
    """`model`'s Pieces (its n_vocab, token_bytes and is_eog), made at first use and kept while it lives."""
    if model not in _PIECES:
        _PIECES[model] = Pieces(model.n_vocab, model.token_bytes, model.is_eog)
    return _PIECES[model]


class Start:
    """A grammar admitting only tokens that agree with `text` until the answer holds it, then any: token healing,
    where the prompt leaves out the typed word's end so that the model writes it in tokens of its own choosing."""

    def __init__(self, text: bytes, pieces: Pieces) -> None:
        self.left, self.pieces = text, pieces
        self._ok = pieces.agreeing(text) if text else None

    @property
    def done(self) -> bool:
        return not self.left

    def allowed(self, ids: np.ndarray) -> np.ndarray:
        if self._ok is None:
            return np.ones(len(ids), dtype=bool)
        return np.isin(ids, self._ok)

    def accept(self, token: int) -> None:
        if self.left:
            self.left = self.left[min(len(self.left), len(self.pieces.pieces[token])):]
            self._ok = self.pieces.agreeing(self.left) if self.left else None

    def clone(self) -> Start:
        return Start(self.left, self.pieces)

    def close(self) -> None:
        pass


def check_json_schema(schema: dict, what: str = "json_schema") -> None:
    """Refuse a schema that is not a valid JSON Schema, naming where, before it is turned into a grammar."""
    import jsonschema  # only here: validating a schema is all edgespec asks of it

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(map(str, e.absolute_path)) or "the top level"
        raise InvalidRequestError(f"{what} is not a valid JSON Schema: {e.message} (at {where}); fix the schema, "
                                  f"e.g. \"type\" must name a JSON type") from None
