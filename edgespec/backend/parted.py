"""A KV sequence's FIM prompt held as parts (decoding.parts): suffix lines in groups that see only the prompt's head.

Each part is evaluated in a park sequence that holds only the cells it sees, right after them (llama.cpp appends to
a sequence only), then moved into place and added to the sequence. The mirror then keeps each token's position (cut
suffix lines leave theirs empty) and part, up to the tokens decoded after the prompt.
"""

from __future__ import annotations

from typing import Callable, Sequence

import llama_cpp
import numpy as np

from edgespec import compute
from edgespec.decoding import parts, reuse
from edgespec.decoding.reuse import Reuse
from edgespec.errors import EdgespecError


class PartsHeld:
    """What backend.kv.KVSequence adds to hold a FIM prompt as parts."""

    model: "backend.Model"
    seq_id: int
    tokens: list[int]

    def __init__(self) -> None:
        # A FIM prompt held as parts: its tokens' positions and parts (decoding.parts); what follows is plain
        self._parted: tuple[list[int], list[int]] | None = None
        # FIM prompts /infill lays out are held as parts in groups of this many suffix lines (0: in one piece)
        self.group_lines = 0

    def position(self, i: int) -> int:
        """Where token i is (or goes, for i = n_past)."""
        if self._parted is None or not self._parted[0]:
            return i
        pos = self._parted[0]
        return pos[i] if i < len(pos) else pos[-1] + 1 + i - len(pos)

    @property
    def plain(self) -> int:
        """How many tokens from the start sit at their own index, each having seen all before it (reusable as a
        prefix); all but in a prompt held as parts."""
        if self._parted is None:
            return self.n_past
        pos, labels = self._parted
        return next((i for i, (p, x) in enumerate(zip(pos, labels)) if p != i or x != parts.PLAIN), self.n_past)

    def grouped(self, prompt: Sequence[int]) -> Reuse | None:
        """The plan that holds `prompt` as parts (decoding.parts), where this sequence holds FIM prompts so
        (`group_lines`), `prompt` is one and it keeps more than the head of what this one holds. Where it keeps no
        more but this one holds parts, the plain prefix alone, unmoved: a prompt that moves the head (lines put
        before it) would drop the parts, which the pauses built for the lines to come, to buy lines a pause adds
        in front without dropping them (engine.slots.join_front). Else None."""
        marks = self.model.fim_marks
        if not self.group_lines or not self.can_shift or marks is None:
            return None
        newline = self.model.newline_ends()
        if (lay := parts.layout(prompt, marks, newline)) is None:
            return None
        pos, labels = self._parted or ([], [])
        after = self.position(len(pos))
        positions = [*pos, *range(after, after + self.n_past - len(pos))]  # position(i) for every token
        labels = [*labels, *[parts.PLAIN] * (self.n_past - len(labels))]
        plan = parts.plan(self.tokens, positions, labels, parts.layout(self.tokens, marks, newline), prompt, lay,
                          self.group_lines)
        return plan if plan is not None or self._parted is None else reuse.plan(self.tokens[:self.plain], prompt)

    def hold(self, prompt: Sequence[int], plan: parts.PartsPlan, stop: Callable[[], bool] | None = None,
             step: int | None = None) -> np.ndarray | None:
        """Make the cache hold `prompt` as `plan` (grouped) says and return its last token's logits, as evaluate.
        The parts are evaluated first, beside it, in batches of `step`: None when `stop` ended that (the cache as it
        was), or the tail's evaluation (the prompt evaluated up to there)."""
        if (placed := self._evaluate_parts(prompt, plan, stop, step)) is None:
            return None
        mem, seq = self.model._mem, self.seq_id
        kept = np.zeros(self.n_past + 1, dtype=bool)
        kept[-1] = True  # past the end: each stretch dropped ends before it
        for r in plan.runs:
            kept[r.source:r.source + r.length] = True
        starts = np.flatnonzero(~kept[:-1] & np.r_[True, kept[:-2]])  # each stretch of cells dropped
        for a in starts.tolist():
            b = int(np.argmax(kept[a:])) + a
            llama_cpp.llama_memory_seq_rm(mem, seq, self.position(a), self.position(b - 1) + 1)
        if plan.shift[1]:
            llama_cpp.llama_memory_seq_add(mem, seq, plan.shift[0], -1, plan.shift[1])
            self.model._shifted = True
        for z, part, base in placed:  # each into place (a move, re-rotated by the next decode), then into this one
            if part.at != base:
                llama_cpp.llama_memory_seq_add(mem, z, base, base + part.end - part.start, part.at - base)
                self.model._shifted = True
            llama_cpp.llama_memory_seq_cp(mem, z, seq, part.at, part.at + part.end - part.start)
            llama_cpp.llama_memory_seq_rm(mem, z, -1, -1)
        self.tokens = list(prompt[:plan.tail])
        self._parted = (list(plan.positions[:plan.tail]), list(plan.labels[:plan.tail]))
        self._dropped(0)
        rows = self.decode(prompt[plan.tail:], 1, stop, step)
        self._keep_row(rows)
        return rows

    def _evaluate_parts(self, prompt: Sequence[int], plan: parts.PartsPlan, stop: Callable[[], bool] | None,
                        step: int | None) -> list[tuple[int, parts.Part, int]] | None:
        """Evaluate each part of `plan` in a park sequence that holds only the cells it sees, right after them
        (llama.cpp appends to a sequence only; the kept middle where it is before it moves on), and leave it there
        alone: (park, part, where it is). None where `stop` ended it, the parks emptied."""
        mem, seq, parks = self.model._mem, self.seq_id, self.model._parks
        if len(plan.parts) > len(parks):
            raise ValueError(f"{len(plan.parts)} parts, more than the {len(parks)} park sequences")
        since, by = plan.shift
        placed, cells, seen = [], [], []
        for z, part in zip(parks, plan.parts):
            sees = [(lo - by, hi - by) if by and lo >= since else (lo, hi) for lo, hi in part.sees]
            for lo, hi in sees:
                llama_cpp.llama_memory_seq_cp(mem, seq, z, lo, hi)
            base = max(hi for _, hi in sees)
            cells += [(base + k, prompt[i], z) for k, i in enumerate(range(part.start, part.end))]
            placed.append((z, part, base))
            seen += [(z, lo, hi) for lo, hi in sees]
        try:
            done = self._decode_cells(cells, stop, step)
        finally:
            for z, lo, hi in seen:  # a part alone in its park: what it saw stays this one's only
                llama_cpp.llama_memory_seq_rm(mem, z, lo, hi)
        if not done:
            for z, _, _ in placed:
                llama_cpp.llama_memory_seq_rm(mem, z, -1, -1)
            return None
        return placed

    def _decode_cells(self, cells: Sequence[tuple[int, int, int]], stop: Callable[[], bool] | None,
                      step: int | None) -> bool:
        """(position, token, sequence) cells in batches of `step` (at most n_batch), no logits; False where `stop`
        said so before one."""
        md = self.model
        size = min(step or md.n_batch, md.n_batch)
        for at in range(0, len(cells), size):
            if stop is not None and stop():
                return False
            chunk = cells[at:at + size]
            m = len(chunk)
            for k, (_, _, z) in enumerate(chunk):
                md._batch.seq_id[k][0] = z
            md._batch_seq = -1  # rows name other sequences now: Model._set_batch_seq writes them all again
            md._b_token[:m] = [t for _, t, _ in chunk]
            md._b_pos[:m] = [p for p, _, _ in chunk]
            md._b_logits[:m] = False
            md._batch.n_tokens = m
            md._arm(False)
            if (rc := compute.run(llama_cpp.llama_decode, md._ctx, md._batch)) != 0:
                raise EdgespecError(f"llama_decode failed with code {rc} for {m} cells of FIM parts")
            md._shifted = False
        return True
