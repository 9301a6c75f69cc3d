"""A KV sequence of a loaded model (backend.Model), mirrored in its `tokens`: decode, trim, and moving entries.

Position i holds tokens[i], but in a FIM prompt held as parts (decoding.parts): there the mirror also keeps each
token's position (cut suffix lines leave theirs empty) and which part it is of, up to the tokens decoded after it.
Chunks moved (chunk reuse) and parts wait in the model's park sequences while the text before them is evaluated:
llama.cpp only appends to a sequence.
"""

from __future__ import annotations

import ctypes
from typing import Callable, Sequence

import llama_cpp
import numpy as np

from edgespec import compute
from edgespec.backend.parted import PartsHeld
from edgespec.decoding import parts
from edgespec.decoding.loop import KeptRow
from edgespec.errors import ContextOverflowError, EdgespecError, UnsupportedModelError


class KVSequence(PartsHeld, KeptRow):
    """One KV sequence of a loaded model, mirrored in `tokens`: what the speculative loop decodes into."""

    def __init__(self, model: "backend.Model", seq_id: int) -> None:
        super().__init__()
        self.model, self.seq_id = model, seq_id
        self.tokens: list[int] = []

    @property
    def n_ctx(self) -> int:
        return self.model.n_ctx

    @property
    def n_past(self) -> int:
        return len(self.tokens)

    def is_eog(self, token: int) -> bool:
        return self.model.is_eog(token)

    def decode(self, tokens: Sequence[int], n_outputs: int = 1, stop: Callable[[], bool] | None = None,
               step: int | None = None) -> np.ndarray | None:
        """Append `tokens` to the cache; return logits of the last `n_outputs` of them: (n_outputs, n_vocab), a view
        of llama.cpp's buffer, valid until the next decode of any sequence (copy what must outlive it). `stop` is
        asked between batches of `step` tokens (at most n_batch): when it says so, decoding ends there and None is
        returned; the cache keeps what was evaluated. With both (background work), Model.abort also ends a batch in
        flight, and the cache keeps the batches before it: any batch but one whose decode re-rotates moved entries."""
        n, md = len(tokens), self.model
        if n == 0 or not 0 <= n_outputs <= min(n, md.n_batch):
            raise ValueError(f"decode of {n} tokens with {n_outputs} outputs (batch {md.n_batch})")
        if self.n_past + n > md.n_ctx:
            raise ContextOverflowError(f"{self.n_past + n} tokens do not fit the context of {md.n_ctx}; use a larger "
                                       f"--ctx or a shorter prompt")
        toks = np.asarray(tokens, dtype=np.int32)
        size = min(step or md.n_batch, md.n_batch)
        abortable, start = stop is not None and step is not None, 0
        while start < n:
            whole = md._shifted  # a decode first re-rotates moved keys layer by layer: aborted there, some turn twice
            md._arm(abortable and not whole)  # its flag cleared before `stop` is asked: an abort that follows is kept
            if (start or abortable) and stop is not None and stop():
                return None
            end = min(start + (1 if whole and abortable else size), n)  # background work: one token unabortable
            if not self._decode_batch(toks[start:end], np.arange(start, end) >= n - n_outputs, abortable and not whole):
                return None
            start = end
        if n_outputs == 0:
            return np.empty((0, md.n_vocab), dtype=np.float32)
        ptr = llama_cpp.llama_get_logits(md._ctx)
        return np.ctypeslib.as_array(ptr, shape=(n_outputs, md.n_vocab))

    def _decode_batch(self, toks: np.ndarray, outputs: np.ndarray, abortable: bool = False, pad: bool = True) -> bool:
        """One llama_decode of at most n_batch tokens at the next positions, `pad`ded as Model.padded says; the mirror
        follows what llama.cpp kept. False when Model.abort ended an `abortable` one."""
        md, m = self.model, len(toks)
        run = md.padded(m) if pad else m
        if run > m and not (md.can_trim and run <= md.n_batch and self.n_past + run <= md.n_ctx):
            run = m
        md._set_batch_seq(self.seq_id)
        md._b_token[:m], md._b_token[m:run] = toks, toks[-1]  # the filler: rows after the batch change none of it
        at = self.position(self.n_past)
        md._b_pos[:run] = np.arange(at, at + run, dtype=np.int32)
        md._b_logits[:m], md._b_logits[m:run] = outputs, False
        md._batch.n_tokens = run
        try:
            rc = compute.run(llama_cpp.llama_decode, md._ctx, md._batch)
            md._shifted = md._shifted and abortable  # a batch that is not abortable re-rotated them
            if rc == 0:
                if run > m:
                    llama_cpp.llama_memory_seq_rm(md._mem, self.seq_id, at + m, -1)
                self.tokens.extend(toks.tolist())
        except BaseException:  # e.g. KeyboardInterrupt between the C call and the mirror update
            self._resync()
            raise
        if rc == 2 and abortable:  # aborted: llama.cpp removed the batch's positions
            self._resync()
            return False
        if rc != 0:
            self._resync()
            if rc == 1 and run > m:  # no room for the filler
                return self._decode_batch(toks, outputs, abortable, pad=False)
            if rc == 1:
                raise ContextOverflowError(f"no KV slot for {m} tokens at position {self.n_past}; use a larger --ctx")
            raise EdgespecError(f"llama_decode failed with code {rc} at position {self.n_past}")
        return True

    @property
    def can_shift(self) -> bool:
        return self.model.can_shift

    def evaluate(self, prompt: Sequence[int], runs: Sequence[tuple[int, int, int]] = (), n_outputs: int = 1,
                 stop: Callable[[], bool] | None = None, step: int | None = None) -> np.ndarray | None:
        """Make the cache hold `prompt` and return the logits of its last `n_outputs` tokens (as decode). `runs` are
        the cached stretches to keep, (start in the prompt, start in the cache, length), in prompt order
        (decoding.reuse.plan): a run at (0, 0, n) is the common prefix, kept in place; the others move to their
        start, which llama.cpp allows only where the cache can shift. All runs move before the first decode, so
        llama.cpp re-rotates the keys once: a re-rotation covers every cell of the context, as dear as a pass over
        a long prompt. Everything else is evaluated, in batches of `step`. None when `stop` ended it early: the
        cache then holds the prompt evaluated up to there, then the runs not reached yet (none of them is lost)."""
        self.trim(self.plain)  # parts held (hold) are not chunks: the plan took none of them (loop.planned)
        runs = [r for r in runs if r[2] > 0]
        prefix = runs[0][2] if runs and runs[0][:2] == (0, 0) else 0
        moved = runs[1:] if prefix else runs
        if moved and not self.can_shift:
            raise UnsupportedModelError(f"{self.model.path.name} cannot shift its KV cache, so chunks cannot be reused "
                                        f"at new positions; reuse only the prefix (n_cache_reuse 0)")
        if len(moved) > len(self.model._parks):
            raise ValueError(f"{len(moved)} moved runs, more than the {len(self.model._parks)} park sequences")
        pending = list(zip(moved, self.model._parks))
        self._keep_only(prefix, pending)
        for (start, source, length), park in pending:  # each run where the prompt wants it, waiting in its park
            self._move(park, source, length, start)
        try:
            at = prefix
            while pending:
                start, _, length = pending[0][0]
                if start > at and self.decode(prompt[at:start], 0, stop, step) is None:
                    return None
                self._unpark(pending.pop(0), prompt)
                at = start + length
            rows = self.decode(prompt[at:], n_outputs, stop, step)
            self._keep_row(rows)
            return rows
        finally:
            while pending:  # stopped or failed early: the runs still parked follow what was evaluated
                self._unpark(pending.pop(0), prompt)

    def _keep_only(self, prefix: int, parked: Sequence[tuple[tuple[int, int, int], int]]) -> None:
        """Drop every cached entry but the prefix and the moved runs; move each run to its park sequence."""
        mem, seq = self.model._mem, self.seq_id
        at = prefix
        for (_, source, length), _park in sorted(parked, key=lambda rp: rp[0][1]):
            if source > at:
                llama_cpp.llama_memory_seq_rm(mem, seq, at, source)
            at = max(at, source + length)
        llama_cpp.llama_memory_seq_rm(mem, seq, at, -1)
        for (_, source, length), park in parked:
            llama_cpp.llama_memory_seq_cp(mem, seq, park, source, source + length)
            llama_cpp.llama_memory_seq_rm(mem, seq, source, source + length)
        del self.tokens[prefix:]
        self._dropped(prefix)
        if (pos := self.pos_max()) != prefix - 1:
            raise EdgespecError(f"KV cache of {self.model.path.name} ends at {pos} after keeping {prefix} tokens")

    def _unpark(self, parked: tuple[tuple[int, int, int], int], prompt: Sequence[int]) -> None:
        """Join a parked run right after the last cached position (moved back there where a stop left it further on)."""
        (start, _, length), park = parked
        mem, at = self.model._mem, self.n_past
        self._move(park, start, length, at)
        llama_cpp.llama_memory_seq_cp(mem, park, self.seq_id, at, at + length)
        llama_cpp.llama_memory_seq_rm(mem, park, -1, -1)
        self.tokens.extend(prompt[start:start + length])

    def _move(self, park: int, source: int, length: int, to: int) -> None:
        """Move a run of sequence `park` from `source` to `to`; the next decode, not abortable, re-rotates its keys."""
        if to != source:
            llama_cpp.llama_memory_seq_add(self.model._mem, park, source, source + length, to - source)
            self.model._shifted = True

    def join_front(self, front: KVSequence, head: int) -> None:
        """Put what `front` holds after its first `head` tokens (as this one's) before what this one holds after them,
        which moves on (chunk reuse's approximation: computed without what now precedes it); `front` is emptied.
        Parts held (hold) move on with the rest, the head they saw now longer."""
        n, end = front.n_past - head, self.position(self.n_past)
        self._move(self.seq_id, head, end - head, head + n)
        llama_cpp.llama_memory_seq_cp(self.model._mem, front.seq_id, self.seq_id, head, head + n)
        self.tokens[head:head] = front.tokens[head:]
        if self._parted is not None:
            pos, labels = self._parted
            self._parted = ([*range(head + n), *(p + n for p in pos[head:])],
                            [parts.PLAIN] * (head + n) + labels[head:])
        front.trim(0)
        self._dropped(head)

    def trim(self, n_keep: int) -> int:
        """Keep the first `n_keep` cached tokens, drop the rest; returns how many were dropped."""
        n_keep = max(0, min(n_keep, self.n_past))
        dropped = self.n_past - n_keep
        if dropped == 0:
            return 0
        if n_keep > 0 and not self.model.can_trim:
            raise UnsupportedModelError(f"{self.model.path.name} has a recurrent cache that cannot be cut at position "
                                        f"{n_keep}; use it without speculation (--proposer none)")
        at, last = self.position(n_keep), self.position(n_keep - 1) if n_keep else -1
        if not llama_cpp.llama_memory_seq_rm(self.model._mem, self.seq_id, at, -1):
            raise UnsupportedModelError(f"llama.cpp refused to remove positions >= {at} of {self.model.path.name}")
        del self.tokens[n_keep:]
        self._dropped(n_keep)
        if self._parted is not None:
            del self._parted[0][n_keep:], self._parted[1][n_keep:]
            self._parted = None if self.plain >= n_keep else self._parted
        if (pos := self.pos_max()) != last:
            raise EdgespecError(f"KV cache of {self.model.path.name} ends at {pos} after trimming to {n_keep}")
        return dropped

    def saved(self, room: Callable[[int], bool] = lambda size: True) -> ctypes.Array | None:
        """A host copy of its KV entries (engine.recall), moved keys rotated first; None when it holds none or `room`,
        told the copy's bytes before any is made, refuses them."""
        if not self.tokens or self._parted is not None:  # parts are for the next keystrokes, and kept in place
            return None
        if not room(size := llama_cpp.llama_state_seq_get_size(self.model._ctx, self.seq_id)):
            return None
        if self.model._shifted:  # a decode rotates them, as the next would: its last token's again (same cells)
            last = self.tokens[-1]
            self.trim(self.n_past - 1)
            self.decode([last], 0)
        data = (ctypes.c_uint8 * size)()
        return data if llama_cpp.llama_state_seq_get_data(self.model._ctx, data, len(data), self.seq_id) else None

    def restore(self, tokens: Sequence[int], data: ctypes.Array) -> bool:
        """Hold `tokens` again from the copy `saved` made of them; whether llama.cpp found cells (else none held)."""
        self.trim(0)
        if done := llama_cpp.llama_state_seq_set_data(self.model._ctx, data, len(data), self.seq_id) == len(data):
            self.tokens.extend(tokens)
        return done

    def pos_max(self) -> int:
        """The last position llama.cpp holds for the sequence (-1 when empty)."""
        return int(llama_cpp.llama_memory_seq_pos_max(self.model._mem, self.seq_id))

    def _resync(self) -> None:
        """Make the cache and its mirror agree after an interrupted or failed decode."""
        held, end = self.pos_max() + 1, self.position(self.n_past)
        if held > end:  # decoded, but interrupted before the mirror was updated
            llama_cpp.llama_memory_seq_rm(self.model._mem, self.seq_id, end, -1)
        else:  # llama.cpp kept only part of a failed batch
            n = next(i for i in range(self.n_past + 1) if self.position(i) >= held)
            del self.tokens[n:]
            if self._parted is not None:
                del self._parted[0][n:], self._parted[1][n:]
        self._dropped(len(self.tokens))
