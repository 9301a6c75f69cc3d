"""Cross-request memory: token sequences edgespec wrote before, searched for the longest match of the context's suffix.

Each entry is one finished generation: the last PROMPT_TAIL tokens of its prompt, then its answer. Entries sit
end to end in one int32 array, each followed by a separator (-1), so that no match or continuation crosses from
one entry into the next. For each key length n in LEVELS the n-gram ending at every position is hashed; the
hashes are kept sorted with their positions, so finding the places where the context's last n tokens occurred
is a binary search. Of the latest CANDIDATES such places, each is compared backwards with the context (up to
MATCH_CAP tokens, in one numpy comparison) and the longest match wins; `seen` counts the places that match as far
and continue with the same token. The store is bounded (`max_tokens`, least recently used entries out: an entry
is used when it is written again or proposed from) and saved to one file per model and namespace, written
atomically (0600, in a 0700 folder) with a format version and a fingerprint of the tokenizer: a file of another
version or tokenizer is ignored and replaced at the next save, a damaged one set aside with a warning.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from edgespec.config import MEMORY_LOCAL as LOCAL
from edgespec.config import MEMORY_NAMESPACE_CHARS

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MAGIC = b"edgespec-memory\n"
SUFFIX = ".mem"
LEVELS = (16, 4)  # key lengths, longest first: a 16-token key finds long matches among many short ones
CANDIDATES = 64  # latest places of a key compared with the context
MATCH_CAP = 64  # as lookup's: a match this long is as good as any longer one
PROMPT_TAIL = 32  # prompt tokens kept before an answer: the same prompt ending finds the answer's start
MIN_ENTRY = 8  # shorter answers are not worth an entry
DEFAULT_MAX_TOKENS = 1 << 19  # per model and namespace: 2 MiB on disk, about 18 MiB in memory when full
EVICT_TO = 0.9  # eviction frees this share of the cap at once, so a full store is not rebuilt on every write
SAVE_SECONDS = 5.0  # a write saves the file at most this often; close() saves what is left
_MASK = (1 << 64) - 1
_BASE = 0x9E3779B97F4A7C15  # odd multiplier of the polynomial hash (mod 2**64)
_POW = np.array([pow(_BASE, j, 1 << 64) for j in range(max(LEVELS))], dtype=np.uint64)


@dataclass(frozen=True)
class Match:
    tokens: list[int]  # what followed the match, at most k tokens
    length: int  # context tokens that matched there (at most MATCH_CAP)
    seen: int  # places that matched as far and continued with the same token


class DamagedMemory(Exception):
    """A memory file that cannot be read as one."""


def namespace_of_key(api_key: str) -> str:
    """The namespace of a server's API key: a hash, so that the key itself is never written to disk."""
    return hashlib.sha256(b"edgespec-memory:" + api_key.encode()).hexdigest()[:16]


def tokenizer_fingerprint(vocab: object, piece: Callable[[int], bytes], n_tokens: int) -> str:
    """A hash of the vocabulary's facts and of a spread of its tokens' bytes: a changed tokenizer changes it."""
    h = hashlib.sha256(repr(vocab).encode())
    step = max(1, n_tokens // 1024)
    for t in [*range(0, n_tokens, step), *range(max(0, n_tokens - 64), n_tokens)]:
        h.update(t.to_bytes(4, "little") + piece(t))
    return h.hexdigest()[:32]


def _hashes(tokens: np.ndarray, n: int) -> np.ndarray:
    """Hash of the n-gram ending at each position i >= n-1 (uint64 arithmetic wraps, as the hash wants)."""
    t = tokens.astype(np.uint64) + np.uint64(1)
    h = np.zeros(len(t) - n + 1, dtype=np.uint64)
    for j in range(n):
        h += t[n - 1 - j: len(t) - j] * _POW[j]
    return h


def _query_hash(reversed_tail: np.ndarray, n: int) -> np.uint64:
    """_hashes of the context's last n tokens; `reversed_tail[j]` is the token j places from its end."""
    return np.uint64(sum((int(t) + 1) * int(_POW[j]) for j, t in enumerate(reversed_tail[:n])) & _MASK)


class Memory:
    """One namespace's entries and their index; thread-safe; the file is read at first use."""

    def __init__(self, path: Path | None, fingerprint: Callable[[], str] | str = "",
                 max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        if max_tokens < MIN_ENTRY:
            raise ValueError(f"memory cap {max_tokens} tokens is below one entry ({MIN_ENTRY}); raise it")
        self.path, self.max_tokens = path, max_tokens
        self._fingerprint = fingerprint
        self._lock = threading.Lock()
        self._loaded = path is None
        self._last_save = 0.0
        self._dirty = False
        self._clock = 0  # logical time of the last use, for least-recently-used eviction
        self._set_entries([], [])
        # What it cost: lookups and their seconds, writes (adds and saves) and theirs.
        self.lookups, self.hits, self.lookup_seconds, self.writes, self.write_seconds = 0, 0, 0.0, 0, 0.0

    # -- reading -------------------------------------------------------------------------

    def lookup(self, context: Sequence[int], k: int) -> Match | None:
        """The continuation of the longest earlier match of `context`'s suffix (up to k tokens), if any."""
        if k <= 0:
            return None
        with self._lock:
            self._load()
            t0 = time.perf_counter()
            try:
                found = self._lookup(context, k)
            finally:
                self.lookups += 1
                self.lookup_seconds += time.perf_counter() - t0
            self.hits += found is not None
            return found

    def _lookup(self, context: Sequence[int], k: int) -> Match | None:
        if not self._lengths:
            return None
        tail = np.asarray(context[-MATCH_CAP:], dtype=np.int64)[::-1]  # tail[j]: j places from the end
        cand = None
        for n in LEVELS:
            keys, pos = self._index[n]
            if len(tail) >= n and len(keys):
                q = _query_hash(tail, n)
                lo, hi = np.searchsorted(keys, q, "left"), np.searchsorted(keys, q, "right")
                if hi > lo:
                    cand = pos[max(lo, hi - CANDIDATES): hi]
                    break
        if cand is None:
            return None
        # Every entry follows a separator, so walking back stops at its start; 0 holds one too.
        back = np.maximum(cand[:, None] - np.arange(len(tail)), 0)
        lengths = np.cumprod(self._tokens[back] == tail, axis=1).sum(axis=1)
        best = int(lengths.max())
        top = cand[lengths == best]
        nxt = self._tokens[top + 1]
        top, nxt = top[nxt >= 0], nxt[nxt >= 0]
        if best == 0 or not len(top):  # a hash collision, or matches only at an entry's end
            return None
        values, counts = np.unique(nxt, return_counts=True)
        at = int(top[np.isin(nxt, values[counts == counts.max()])].max())  # ties: the latest
        cont = self._tokens[at + 1: at + 1 + k]
        cut = np.flatnonzero(cont < 0)
        self._touch(at)
        return Match(cont[: cut[0] if len(cut) else len(cont)].tolist(), best, int(counts.max()))

    def _touch(self, position: int) -> None:
        self._clock += 1
        self._used[int(np.searchsorted(self._starts, position, "right")) - 1] = self._clock

    @property
    def n_entries(self) -> int:
        with self._lock:
            self._load()
            return len(self._lengths)

    @property
    def n_tokens(self) -> int:
        with self._lock:
            self._load()
            return int(sum(self._lengths))

    def entries(self) -> list[list[int]]:
        """Every entry's tokens, oldest first."""
        with self._lock:
            self._load()
            return [self._tokens[s: s + n].tolist() for s, n in zip(self._starts, self._lengths)]

    # -- writing -------------------------------------------------------------------------

    def add(self, tokens: Sequence[int]) -> bool:
        """Remember `tokens` (a prompt's tail and its answer); False if too short or already remembered."""
        arr = np.asarray(tokens, dtype=np.int32)[-self.max_tokens:]
        if len(arr) < MIN_ENTRY:
            return False
        if arr.min() < 0:
            raise ValueError(f"token ids must be >= 0, got {int(arr.min())}")
        digest = hashlib.blake2b(arr.tobytes(), digest_size=16).digest()
        with self._lock:
            self._load()
            t0 = time.perf_counter()
            self._clock += 1
            self._dirty = True
            known = self._digests.get(digest)
            if known is not None:
                self._used[known] = self._clock
            else:
                self._append(arr, digest)
                if sum(self._lengths) > self.max_tokens:
                    self._evict()
            if self.path is not None and time.monotonic() - self._last_save >= SAVE_SECONDS:
                self._save()
            self.writes += 1
            self.write_seconds += time.perf_counter() - t0
            return known is None

    def _append(self, arr: np.ndarray, digest: bytes) -> None:
        start = len(self._tokens)
        self._tokens = np.concatenate([self._tokens, arr, np.array([-1], dtype=np.int32)])
        self._starts = np.append(self._starts, start)
        self._lengths.append(len(arr))
        self._used.append(self._clock)
        self._digests[digest] = len(self._lengths) - 1
        for n in LEVELS:
            if len(arr) <= n:
                continue
            h = _hashes(arr[:-1], n)  # the n-grams followed by a token of the entry
            p = np.arange(start + n - 1, start + len(arr) - 1, dtype=np.int64)
            order = np.lexsort((p, h))
            keys, pos = self._index[n]
            at = np.searchsorted(keys, h[order], "right")  # after equal keys: positions stay in order
            self._index[n] = (np.insert(keys, at, h[order]), np.insert(pos, at, p[order]))

    def _evict(self) -> None:
        """Drop the least recently used entries until EVICT_TO of the cap is left; rebuild the index."""
        order = sorted(range(len(self._lengths)), key=lambda i: self._used[i], reverse=True)
        keep, total = [], 0
        for i in order:
            if total + self._lengths[i] > self.max_tokens * EVICT_TO and keep:
                continue
            keep.append(i)
            total += self._lengths[i]
        keep.sort()
        entries = [self._tokens[self._starts[i]: self._starts[i] + self._lengths[i]] for i in keep]
        self._set_entries(entries, [self._used[i] for i in keep])

    def _set_entries(self, entries: list[np.ndarray], used: list[int]) -> None:
        self._tokens = np.array([-1], dtype=np.int32)
        self._starts = np.zeros(0, dtype=np.int64)
        self._lengths: list[int] = []
        self._used: list[int] = []
        self._digests: dict[bytes, int] = {}
        self._index = {n: (np.zeros(0, dtype=np.uint64), np.zeros(0, dtype=np.int64)) for n in LEVELS}
        for arr, u in zip(entries, used):
            self._append(arr, hashlib.blake2b(arr.tobytes(), digest_size=16).digest())
            self._used[-1] = u
        self._clock = max(used, default=0)

    def clear(self) -> None:
        with self._lock:
            self._loaded, self._dirty = True, True
            self._set_entries([], [])
            if self.path is not None:
                self._save()

    # -- the file ------------------------------------------------------------------------

    def fingerprint(self) -> str:
        if callable(self._fingerprint):
            self._fingerprint = self._fingerprint()
        return self._fingerprint

    def save(self) -> None:
        """Write the file now if anything changed since it was read or last written."""
        with self._lock:
            if self._loaded and self._dirty and self.path is not None:
                self._save()

    def _save(self) -> None:
        assert self.path is not None
        header = {"version": FORMAT_VERSION, "tokenizer": self.fingerprint(), "entries": len(self._lengths),
                  "lengths": self._lengths, "used": self._used, "saved": time.time()}
        body = b"".join(self._tokens[s: s + n].astype("<i4").tobytes() for s, n in zip(self._starts, self._lengths))
        try:
            _write_private(self.path, MAGIC + json.dumps(header).encode() + b"\n" + body)
        except OSError as e:  # a full or read-only disk costs the memory, not the generation
            log.warning("could not save the memory to %s (%s); it is kept for this session only", self.path, e)
        self._dirty, self._last_save = False, time.monotonic()

    def _load(self) -> None:
        """Read the file the first time the memory is used (the lock is held)."""
        if self._loaded:
            return
        self._loaded = True
        assert self.path is not None
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return
        except OSError as e:
            log.warning("could not read the memory file %s (%s); starting with an empty memory", self.path, e)
            return
        try:
            header, entries = _parse(data)
        except DamagedMemory as e:
            aside = self.path.with_name(f"{self.path.name}.damaged-{int(time.time())}")
            os.replace(self.path, aside)
            log.warning("memory file %s is damaged (%s); set aside as %s, starting with an empty memory",
                        self.path, e, aside.name)
            return
        if header["version"] != FORMAT_VERSION or header["tokenizer"] != self.fingerprint():
            log.warning("memory file %s was written for another tokenizer or format; starting with an empty memory "
                        "(the file is replaced at the next save)", self.path)
            return
        self._set_entries(entries, [int(u) for u in header["used"]])


def _parse(data: bytes) -> tuple[dict, list[np.ndarray]]:
    """The header and the entries of a memory file (none for another format); DamagedMemory names what is wrong."""
    end = data.find(b"\n", len(MAGIC))
    if not data.startswith(MAGIC) or end < 0:
        raise DamagedMemory("it does not start as an edgespec memory file")
    try:
        header = json.loads(data[len(MAGIC): end])
        if header["version"] != FORMAT_VERSION:
            return header, []
        lengths, used, tokenizer = [int(n) for n in header["lengths"]], header["used"], header["tokenizer"]
    except (ValueError, KeyError, TypeError) as e:
        raise DamagedMemory(f"its header does not parse: {e}") from None
    body = data[end + 1:]
    if len(used) != len(lengths) or not isinstance(tokenizer, str) or min(lengths, default=MIN_ENTRY) < 1 \
            or sum(lengths) * 4 != len(body):
        raise DamagedMemory(f"its body holds {len(body)} bytes where the header counts {sum(lengths)} tokens")
    tokens = np.frombuffer(body, dtype="<i4").astype(np.int32)
    if len(tokens) and tokens.min() < 0:
        raise DamagedMemory("it holds negative token ids")
    bounds = np.cumsum([0, *lengths])
    return header, [tokens[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def _write_private(path: Path, data: bytes) -> None:
    """Write `data` to `path` atomically, readable by the user alone (0600, in folders of 0700)."""
    for folder in (path.parent.parent, path.parent):
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(folder, 0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class MemoryBank:
    """The memories of one model: one per namespace, each in its own file under `folder`, made at first use."""

    def __init__(self, folder: Path, fingerprint: Callable[[], str], max_tokens: int = DEFAULT_MAX_TOKENS) -> None:
        self.folder, self.max_tokens = folder, max_tokens
        self._fingerprint: Callable[[], str] = fingerprint
        self._known: str | None = None
        self._lock = threading.Lock()
        self._memories: dict[str, Memory] = {}

    def get(self, namespace: str = LOCAL) -> Memory:
        if not (0 < len(namespace) <= 64 and set(namespace) <= MEMORY_NAMESPACE_CHARS):
            raise ValueError(f"memory namespace {namespace!r} must be 1-64 letters, digits, '_' or '-'")
        with self._lock:
            if namespace not in self._memories:
                self._memories[namespace] = Memory(self.folder / f"{namespace}{SUFFIX}", self.fingerprint,
                                                   self.max_tokens)
            return self._memories[namespace]

    def fingerprint(self) -> str:
        if self._known is None:  # the tokenizer is read once, when a memory is first loaded or saved
            self._known = self._fingerprint()
        return self._known

    def close(self) -> None:
        with self._lock:
            memories = list(self._memories.values())
        for m in memories:
            m.save()


@dataclass(frozen=True)
class FileInfo:
    path: Path
    model: str
    namespace: str
    entries: int
    tokens: int
    bytes: int
    saved: float
    problem: str = ""  # why it would not be loaded


def files(root: Path) -> list[FileInfo]:
    """Every memory file under `root` (one folder per model), read from its header only."""
    out = []
    for path in sorted(root.glob(f"*/*{SUFFIX}")):
        try:
            with path.open("rb") as f:
                head = f.read(len(MAGIC))
                header = json.loads(f.readline()) if head == MAGIC else None
            lengths = [int(n) for n in header["lengths"]] if header else []
            problem = "" if header and header.get("version") == FORMAT_VERSION else "damaged or another format"
            out.append(FileInfo(path, path.parent.name, path.stem, len(lengths), sum(lengths), path.stat().st_size,
                                float(header.get("saved", 0)) if header else 0.0, problem))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            out.append(FileInfo(path, path.parent.name, path.stem, 0, 0, 0, 0.0, f"unreadable: {e}"))
    return out


def clear(root: Path, model: str | None = None) -> list[Path]:
    """Delete the memory files under `root` (of one model's folder when `model` is given); what was deleted."""
    pattern = f"{model}/*" if model else "*/*"
    gone = [p for p in sorted(root.glob(pattern)) if p.is_file() and (SUFFIX in p.name)]
    for p in gone:
        p.unlink()
    return gone


def model_key(path: Path) -> str:
    """The folder of a model's memories: its file name without .gguf, in characters any file system takes."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", path.name.removesuffix(".gguf"))[:96] or "model"
