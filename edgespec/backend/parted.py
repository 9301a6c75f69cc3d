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
from edgespec.decoding import parts
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

    def grouped(self, prompt: Sequence[int]) -> parts.PartsPlan | None:
        """The plan that holds `prompt` as parts (decoding.parts), where this sequence holds FIM prompts so
        (`group_lines`), `prompt` is one and it keeps more than the head of what this one holds; else None."""
        marks = self.model.fim_marks
        if not self.group_lines or not self.can_shift or marks is None:
            return None
        newline = self.model.newline_ends()
        if (lay := parts.layout(prompt, marks, newline)) is None:
            return None
        n, (pos, labels) = self.n_past, self._parted or ([], [])
        positions = [*pos, *range(pos[-1] + 1 if pos else len(pos), (pos[-1] + 1 if pos else 0) + n - len(pos))]
        labels = [*labels, *[parts.PLAIN] * (n - len(labels))]
        return parts.plan(self.tokens, positions, labels, parts.layout(self.tokens, marks, newline), prompt, lay,
                          self.group_lines)

    def hold(self, prompt: Sequence[int], plan: parts.PartsPlan, stop: Callable[[], bool] | None = None,
             step: int | None = None) -> np.ndarray | None:
        """Make the cache hold `prompt` as `plan` (grouped) says and return its last token's logits, as evaluate;
        None when `stop` ended it early: before it began, or in the tail (the parts, a group of lines at a time in
        the background, are evaluated whole)."""
        if stop is not None and stop():
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
        self._decode_parts(prompt, plan.parts)
        self.tokens = list(prompt[:plan.tail])
        self._parted = (list(plan.positions[:plan.tail]), list(plan.labels[:plan.tail]))
        self._dropped(0)
        rows = self.decode(prompt[plan.tail:], 1, stop, step)
        self._keep_row(rows)
        return rows

    def _decode_parts(self, prompt: Sequence[int], todo: Sequence[parts.Part]) -> None:
        """Evaluate each part in a park sequence that holds only the cells it sees, right after them (llama.cpp
        appends to a sequence only), then move it into place and add it to this one."""
        mem, seq, parks = self.model._mem, self.seq_id, self.model._parks
        for first in range(0, len(todo), len(parks)):
            batch = list(zip(parks, todo[first:first + len(parks)]))
            cells = []
            for z, part in batch:
                for lo, hi in part.sees:
                    llama_cpp.llama_memory_seq_cp(mem, seq, z, lo, hi)
                base = max(hi for _, hi in part.sees)
                cells += [(base + k, prompt[i], z) for k, i in enumerate(range(part.start, part.end))]
            try:
                self._decode_cells(cells)
                for z, part in batch:
                    base, n = max(hi for _, hi in part.sees), part.end - part.start
                    if part.at != base:
                        llama_cpp.llama_memory_seq_add(mem, z, base, base + n, part.at - base)
                        self.model._shifted = True
                    llama_cpp.llama_memory_seq_cp(mem, z, seq, part.at, part.at + n)
            finally:
                for z, _ in batch:
                    llama_cpp.llama_memory_seq_rm(mem, z, -1, -1)

    def _decode_cells(self, cells: Sequence[tuple[int, int, int]]) -> None:
        """(position, token, sequence) cells in batches of n_batch, no logits."""
        md = self.model
        for at in range(0, len(cells), md.n_batch):
            chunk = cells[at:at + md.n_batch]
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
