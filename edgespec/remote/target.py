"""The target spread over RPC workers, run in a child process that a lost worker can take down without the rest.

ggml's RPC client aborts its process when a worker goes away mid-computation, so the model whose layers live on
workers is loaded in a child process. This process keeps what needs no weights (the vocabulary, tokenizer and
grammars: a model loaded with facts_only) and the proposer, and sends the child the few calls the loop makes of a
KV sequence (evaluate, decode, trim); logits come back through shared memory. When the child dies, the call that
was waiting raises a WorkerError naming the worker that no longer answers, every cache mirror is emptied, and the
next call starts a new child once the workers answer again.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import time
from dataclasses import replace
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from edgespec import errors
from edgespec.backend import KVSequence, Model, RemoteLayers
from edgespec.config import MAX_K, LoadConfig
from edgespec.errors import WorkerError
from edgespec.remote import probe

log = logging.getLogger(__name__)

ROWS = MAX_K + 1  # logits rows one call returns at most: a verify batch
POLL_SECONDS = 0.05  # how often a waiting call checks its stop condition and the child
START_TIMEOUT = 600.0  # loading sends every remote weight over the link once


class RemoteTarget(Model):
    """A target whose layers after the first `cpu_layers` live on RPC workers (the plan's split), in a child."""

    def __init__(self, path: str | Path, cfg: LoadConfig, endpoints: Sequence[str], layers: Sequence[int]) -> None:
        super().__init__(path, replace(cfg, n_gpu_layers=0), facts_only=True)  # vocabulary, facts, tokenizer
        # the child keeps no aside sequence: this process has none of its sequences to give a slot
        self.cfg, self.endpoints, self.layers = replace(cfg, aside=0), tuple(endpoints), tuple(layers)
        self._pieces: dict[int, bytes] = {}
        self._child: _Child | None = None
        self.device_key = "rpc:" + ",".join(f"{e}={n}" for e, n in zip(self.endpoints, self.layers))
        info = self._ensure()
        self.n_ctx, self.n_batch, self.can_trim, self.can_shift = (info["n_ctx"], info["n_batch"], info["can_trim"],
                                                                   info["can_shift"])
        self.sequences = [RemoteSequence(self, i) for i in range(cfg.n_seq)]

    def _ensure(self) -> dict[str, Any]:
        """The child, started (again) if it is not running: every worker is asked first, in Python."""
        if self._child is None or not self._child.alive():
            probe.probe_all(self.endpoints)
            self._child = _Child(self.path, self.cfg, self.endpoints, self.layers, self.n_vocab)
            for s in getattr(self, "sequences", ()):
                s.tokens.clear()  # a new child starts with empty caches
        return self._child.info

    def call(self, op: str, *args: Any, stop: Callable[[], bool] | None = None) -> Any:
        self._ensure()
        assert self._child is not None
        try:
            return self._child.call(op, args, stop)
        except _ChildLost as e:
            self._child = None
            for s in self.sequences:
                s.tokens.clear()
            raise WorkerError(_lost(self.endpoints, str(e))) from None

    def close(self) -> None:
        if getattr(self, "_child", None) is not None:
            self._child.close()
            self._child = None
        super().close()


class RemoteSequence:
    """One KV sequence of the remote target, mirrored here in `tokens` as backend.KVSequence mirrors its own."""

    def __init__(self, model: RemoteTarget, seq_id: int) -> None:
        self.model, self.seq_id = model, seq_id
        self.tokens: list[int] = []

    group_lines = 0  # FIM prompts in one piece: parts (backend.parted) are not offered across the process
    n_ctx = KVSequence.n_ctx
    n_past = KVSequence.n_past
    is_eog = KVSequence.is_eog
    shared_prefix = KVSequence.shared_prefix
    keep_prefix_of = KVSequence.keep_prefix_of

    @property
    def can_shift(self) -> bool:
        return self.model.can_shift

    def decode(self, tokens: Sequence[int], n_outputs: int = 1, stop: Callable[[], bool] | None = None,
               step: int | None = None) -> np.ndarray | None:
        return self._logits(self.model.call("decode", self.seq_id, list(tokens), n_outputs, step, stop=stop),
                            [*self.tokens, *tokens])

    def evaluate(self, prompt: Sequence[int], runs: Sequence[tuple[int, int, int]] = (), n_outputs: int = 1,
                 stop: Callable[[], bool] | None = None, step: int | None = None) -> np.ndarray | None:
        return self._logits(self.model.call("evaluate", self.seq_id, list(prompt), list(runs), n_outputs, step,
                                            stop=stop), list(prompt))

    def trim(self, n_keep: int) -> int:
        dropped = self.model.call("trim", self.seq_id, n_keep)
        del self.tokens[max(0, n_keep):]
        return dropped

    def pos_max(self) -> int:
        return self.model.call("pos_max", self.seq_id)

    def prompt_row(self, prompt: Sequence[int]) -> np.ndarray | None:
        return None  # the child's cache keeps its rows to itself: a prompt evaluated again decodes its last token

    def _logits(self, answer: tuple[int | None, list[int] | None], done: list[int]) -> np.ndarray | None:
        """The rows the child wrote; the mirror follows: what was asked, or what the child says it holds when it
        stopped early (the runs it had not reached follow what it evaluated)."""
        rows, held = answer
        self.tokens = done if held is None else held
        return None if rows is None else self.model._child.logits[:rows]  # type: ignore[union-attr]


class _ChildLost(Exception):
    pass


class _Child:
    """The child process holding the model, its pipe, the shared logits and the stop flag."""

    def __init__(self, path: Path, cfg: LoadConfig, endpoints: tuple[str, ...], layers: tuple[int, ...],
                 n_vocab: int) -> None:
        ctx = multiprocessing.get_context("spawn")  # a fork would copy this process's llama.cpp state
        self.shm = shared_memory.SharedMemory(create=True, size=ROWS * n_vocab * 4)
        self.logits = np.ndarray((ROWS, n_vocab), dtype=np.float32, buffer=self.shm.buf)
        self.stop = ctx.Event()
        self.conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(target=_serve, name="edgespec-rpc-target", daemon=True,
                                   args=(child_conn, self.shm.name, self.stop, str(path), cfg, endpoints, layers))
        self.process.start()
        child_conn.close()
        self.info = self._wait(None, START_TIMEOUT)

    def alive(self) -> bool:
        return self.process.is_alive()

    def call(self, op: str, args: tuple, stop: Callable[[], bool] | None) -> Any:
        self.stop.clear()
        try:
            self.conn.send((op, args))
        except (OSError, EOFError) as e:
            raise _ChildLost(f"the target's process is gone ({e})") from e
        return self._wait(stop, None)

    def _wait(self, stop: Callable[[], bool] | None, timeout: float | None) -> Any:
        start = time.monotonic()
        while True:
            if self.conn.poll(POLL_SECONDS):
                try:
                    kind, value = self.conn.recv()
                except (OSError, EOFError) as e:
                    raise _ChildLost(f"the target's process ended ({_exit(self.process)})") from e
                if kind == "error":
                    name, message = value
                    raise getattr(errors, name, errors.EdgespecError)(message)
                return value
            if not self.process.is_alive():
                raise _ChildLost(f"the target's process ended ({_exit(self.process)})")
            if stop is not None and stop():
                self.stop.set()  # the child ends its evaluation at the next batch and answers
            if timeout is not None and time.monotonic() - start > timeout:
                self.close()
                raise _ChildLost(f"the target did not load within {timeout:.0f} s")

    def close(self) -> None:
        try:
            self.conn.send(("close", ()))
        except (OSError, EOFError):
            pass
        self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
        self.shm.close()
        self.shm.unlink()


def _exit(process: multiprocessing.process.BaseProcess) -> str:
    process.join(1)
    code = process.exitcode
    return "still running" if code is None else f"signal {-code}" if code < 0 else f"exit status {code}"


def _lost(endpoints: tuple[str, ...], why: str) -> str:
    """Which workers no longer answer, asked again now that the target's process is gone."""
    down = []
    for e in endpoints:
        try:
            probe.probe(e, timeout=2.0)
        except WorkerError:
            down.append(e)
    who = f"RPC worker {', '.join(down)} was lost" if down else f"the target on RPC workers {', '.join(endpoints)} failed"
    return (f"{who} in the middle of this request ({why}); it ended here. The next request loads the target again "
            f"once {'it answers' if down else 'they answer'}: restart `edgespec worker` there, or serve without --rpc")


def _serve(conn: Any, shm_name: str, stop: Any, path: str, cfg: LoadConfig, endpoints: tuple[str, ...],
           layers: tuple[int, ...]) -> None:
    """The child: load the model over the workers, then answer calls until told to close (or killed)."""
    os.environ["GGML_NO_BACKTRACE"] = "1"  # an abort prints its message and ends, without attaching a debugger
    from edgespec import devices

    shm = shared_memory.SharedMemory(name=shm_name)
    try:
        handles = tuple(h for e in endpoints for h in devices.rpc_devices(e))
        model = Model(path, cfg, remote=RemoteLayers(handles, layers))
    except errors.EdgespecError as e:
        conn.send(("error", (type(e).__name__, str(e))))
        return
    logits = np.ndarray((ROWS, model.n_vocab), dtype=np.float32, buffer=shm.buf)
    conn.send(("ok", {"n_ctx": model.n_ctx, "n_batch": model.n_batch, "can_trim": model.can_trim,
                      "can_shift": model.can_shift}))
    while True:
        op, args = conn.recv()
        if op == "close":
            os._exit(0)  # a worker may be gone: freeing the model would talk to it, and abort
        try:
            conn.send(("ok", _apply(model, op, args, stop, logits)))
        except Exception as e:  # noqa: BLE001 - every failure goes back to the call that caused it
            name = type(e).__name__ if isinstance(e, errors.EdgespecError) else "EdgespecError"
            conn.send(("error", (name, str(e) if name != "EdgespecError" else f"{type(e).__name__}: {e}")))


def _apply(model: Model, op: str, args: tuple, stop: Any, logits: np.ndarray) -> Any:
    """One call on a sequence: the logits rows written (and what it holds when it stopped early)."""
    seq = model.sequences[args[0]]
    if op == "trim":
        return seq.trim(args[1])
    if op == "pos_max":
        return seq.pos_max()
    if op == "decode":
        tokens, n_outputs, step = args[1:]
        rows = seq.decode(tokens, n_outputs, stop.is_set, step)
    else:
        prompt, runs, n_outputs, step = args[1:]
        rows = seq.evaluate(prompt, [tuple(r) for r in runs], n_outputs, stop.is_set, step)
    if rows is None:
        return None, list(seq.tokens)
    logits[: len(rows)] = rows
    return len(rows), None
