"""Editing sessions replayed as llama.vim and llama.vscode drive them, in lockstep against `edgespec serve` and
llama-server, built from the llama.cpp that llama-cpp-python vendors (scripts/llama_tools.py --server).

A session walks the cursor down real source files, line by line: a completion right after the indent, another
half-way through the line (the user typed on), and the editor's speculative request (the suggestion taken as
accepted), which both editors send the moment they show a suggestion. A file named again in --files is a return to
it, further down, as a user goes back to a file after working in another. Chunks of other files go into the ring of
extra context, announced by the editor's warm-up request (n_predict 0, fire and forget), the ring dropping its
oldest chunk when full (with --buf-enter, a file's first visit adds the chunk both editors pick around the cursor
on entering it). The bodies are the editors' own (tests/clients/llama_vim.json, llama_vscode.json), with
their default windows (256 lines before the cursor, 64 after).

Both servers get the same requests in the same order; the one not being asked is frozen (SIGSTOP), so neither's
background work runs in the other's time, and before each request the server asked keeps the machine for the
user's think time since its last answer (--think): CPU time alike, and the pause ends by its clock where it would
for a user. edgespec starts each run with an empty memory (a new project's first session), so
what it remembers is this run's own answers. Reported per server: median and p90 latency of the requests the user
waits on, prompt tokens evaluated per request (timings.prompt_n), completions that agree with the file's real next
text for at least 4 characters (of llama.vscode's 3, the first it shows; how many of them came in the first
COLD_FIRST completions of each visit to a file, on a cold cache or one kept from before, and how many after), and
answers slower than t_max_prompt_ms + t_max_predict_ms + 1 s.

    python scripts/llama_tools.py --server          # once: about 20 minutes on 2 cores
    python scripts/bench_editor.py --out bench-results/editor.json

With --greedy every completion asks for temperature 0, which the editors do not send: the right completions then
vary with the context each server gives the model, not with its sampling, for comparing servers or trees.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

from llama_tools import SERVER, tool  # noqa: E402

from edgespec.backend import amx_build  # noqa: E402
from edgespec.models import fetch  # noqa: E402
from edgespec.paths import MEMORY_ENV  # noqa: E402

N_PREFIX, N_SUFFIX = 256, 64  # both editors' default windows, in lines
RING_CHUNK_LINES = 32
RING_SIZE, RING_EVERY = 8, 4  # chunks the ring holds, and lines walked between new ones (--ring-size, --ring-every)
COLD_FIRST = 3  # a visit's first completions in a file, counted apart in the right ones (`right`)
VIM_FIELDS = ["content", "timings/prompt_n", "timings/prompt_ms", "timings/prompt_per_token_ms",
              "timings/prompt_per_second", "timings/predicted_n", "timings/predicted_ms",
              "timings/predicted_per_token_ms", "timings/predicted_per_second", "truncated", "tokens_cached"]
# Files walked by default: this project's own code (no model has seen it) and one standard-library module.
DEFAULT_FILES = ("edgespec/decoding/loop.py:182:24", "edgespec/server/schemas.py:268:20",
                 f"{Path(json.__file__).parent / 'decoder.py'}:330:16")
DEFAULT_RING = ("edgespec/backend.py", "edgespec/prompts/fim.py", "edgespec/engine/slots.py", "edgespec/memory.py",
                "edgespec/decoding/reuse.py", "edgespec/planning/budget.py")


@dataclass(frozen=True)
class Cursor:
    """A place in a file where the editor asks for a completion."""

    path: str
    line: int  # 0-based
    col: int
    prefix: str  # the lines before the cursor line, as the editor sends them
    suffix: str  # the rest of the line, then the lines after
    typed: str  # the cursor line before the cursor
    indent: int
    real: str  # what the file really holds after the cursor
    # A line of only its indent (the rest not written yet): both editors ask from the line's start (llama.vim's
    # s:fim_ctx_local: no `prompt`, n_indent 0; llama.vscode: no `prompt`) and show the answer less its indentation.
    blank: bool = False


def cursors(path: Path, start: int, n_lines: int, write: bool = False) -> Iterator[Cursor]:
    """The user (re)writes each non-blank line of [start, start + n_lines): a completion after the indent, then one
    half-way through the line. The rest of the line is not written yet, so the editor's suffix starts with the line
    end, and the completion is compared with the line's real rest (and the lines after it). The lines below the
    cursor line are the file's, as if each line were written again over the file (the suffix loses a line at each
    line start); with `write` the block's lines are new, written one after the other above the file's lines after
    the block (the suffix stays the same while the block is written)."""
    lines = path.read_text().splitlines()
    end = min(start + n_lines, len(lines))
    for y in range(start, end):
        line = lines[y]
        indent = len(line) - len(line.lstrip())
        if not line.strip():
            continue
        for x in sorted({indent, indent + (len(line) - indent) // 2}):
            yield cursor_at(path, lines, y, x, end if write else None)


def cursor_at(path: Path, lines: list[str], y: int, x: int, below: int | None = None) -> Cursor:
    """The cursor at column `x` of line `y` of `lines` (the file at `path`), with the editors' windows around it; the
    lines after the cursor line from line `below` on (None: the next line)."""
    line, below = lines[y], y + 1 if below is None else below
    return Cursor(str(path), y, x, "".join(s + "\n" for s in lines[max(0, y - N_PREFIX):y]),
                  "\n".join(["", *lines[below:below + N_SUFFIX]]) + "\n", line[:x], len(line) - len(line.lstrip()),
                  "\n".join([line[x:], *lines[y + 1:y + 8]]), not line[:x].strip())


def ring_chunks(paths: list[Path]) -> Iterator[dict[str, Any]]:
    """Chunks of other files, as the editors collect them (on opening a buffer, a yank, a save)."""
    for path in paths:
        lines = path.read_text().splitlines()
        for start in range(0, len(lines), RING_CHUNK_LINES * 3):
            yield _chunk(path, lines[start:start + RING_CHUNK_LINES])


def check_ring(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse a ring that never fills (--ring-every, --ring-size below 1) before any model loads."""
    if args.ring_every < 1 or args.ring_size < 1:
        ap.error(f"--ring-every {args.ring_every} and --ring-size {args.ring_size} must be at least 1")


class Ring:
    """The ring of extra context as a session fills it: a chunk of the ring files every `every` lines walked, the
    oldest dropped past `size` (`held`, oldest first)."""

    def __init__(self, paths: list[Path], size: int, every: int) -> None:
        self.chunks, self.size, self.every = ring_chunks(paths), size, every
        self.held: list[dict[str, Any]] = []
        self.lines = 0

    def walked(self) -> bool:
        """The cursor reached a new line: whether a chunk joined the ring there."""
        self.lines += 1
        if (self.lines - 1) % self.every or (chunk := next(self.chunks, None)) is None:
            return False
        self.enter(chunk)
        return True

    def enter(self, chunk: dict[str, Any]) -> None:
        """`chunk` joins the ring, newest; the oldest goes past the ring's size."""
        self.held = (self.held + [chunk])[-self.size:]


def entered_chunk(path: Path, start: int, n_lines: int) -> dict[str, Any]:
    """The chunk both editors pick on entering a file (llama.vim's BufEnter, llama.vscode's
    onDidChangeActiveTextEditor: pickChunkAroundCursor): RING_CHUNK_LINES lines at a random place among the
    2 * RING_CHUNK_LINES around the cursor. The file is taken as entered, before the visit writes its lines, so the
    chunk never holds text the walk is about to write; the place is seeded by the file and line, for runs to repeat."""
    lines = path.read_text().splitlines()
    buffer = lines[:start] + lines[start + n_lines:]
    around = buffer[max(0, start - RING_CHUNK_LINES):start + RING_CHUNK_LINES]
    first = random.Random(f"{path.name}:{start}").randint(0, max(0, len(around) - RING_CHUNK_LINES))
    return _chunk(path, around[first:first + RING_CHUNK_LINES])


def _chunk(path: Path, lines: list[str]) -> dict[str, Any]:
    """An extra-context chunk as the editors send it, under the file's name relative to the project where it lies
    in it (`expand('%')`)."""
    name = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
    return {"text": "\n".join(lines) + "\n", "time": [int(time.time()), 0], "filename": name}


def vim_fim(c: Cursor, extra: list[dict], speculative: bool) -> dict[str, Any]:
    """llama.vim's llama#fim body: 250 ms to predict on the first request at a place, 1000 on the speculative."""
    return {"id_slot": 0, "input_prefix": c.prefix, "input_suffix": c.suffix, "input_extra": extra,
            "prompt": "" if c.blank else c.typed, "n_predict": 128, "stop": [],
            "n_indent": 0 if c.blank else c.indent, "top_k": 40, "top_p": 0.90,
            "samplers": ["top_k", "top_p", "infill"], "stream": False, "cache_prompt": True,
            "t_max_prompt_ms": 500, "t_max_predict_ms": 1000 if speculative else 250,
            "response_fields": VIM_FIELDS, "model": ""}


def vim_warmup(extra: list[dict]) -> dict[str, Any]:
    return {"id_slot": 0, "input_prefix": "", "input_suffix": "", "input_extra": extra, "prompt": "",
            "n_predict": 0, "temperature": 0.0, "samplers": [], "stream": False, "cache_prompt": True,
            "t_max_prompt_ms": 1, "t_max_predict_ms": 1, "response_fields": [""], "model": ""}


def vscode_fim(c: Cursor, extra: list[dict], speculative: bool) -> dict[str, Any]:
    """llama.vscode's getFIMCompletion body (n_indent left out when 0, as its spread does)."""
    body = {"id_slot": 0, "input_prefix": c.prefix, "input_suffix": c.suffix,
            "input_extra": [{**e, "time": 1767225600123} for e in extra],
            "prompt": c.typed if c.typed.strip() else "", "n_predict": 128, "n_cmpl": 3, "top_k": 40, "top_p": 0.99,
            "stream": False, "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True,
            "t_max_prompt_ms": 500, "t_max_predict_ms": 500, "model": "google/gemini-2.5-flash"}
    if c.indent:
        body["n_indent"] = c.indent
    return body


def vscode_warmup(extra: list[dict]) -> dict[str, Any]:
    return {"id_slot": 0, "input_prefix": "", "input_suffix": "",
            "input_extra": [{**e, "time": 1767225600123} for e in extra], "prompt": "", "n_predict": 0,
            "samplers": [], "cache_prompt": True, "t_max_prompt_ms": 500, "t_max_predict_ms": 1}


FLAVOURS = {"llama.vim": (vim_fim, vim_warmup), "llama.vscode": (vscode_fim, vscode_warmup)}


def shown(c: Cursor, content: str) -> str:
    """What the editor shows of an answer at `c`: on a blank line, the answer's first line less as much of its own
    indentation as the line holds (llama.vim's s:fim_render, llama.vscode's removeLeadingSpaces)."""
    if not c.blank:
        return content
    lead = len(content) - len(content.lstrip(" \t"))
    return content[min(lead, len(c.typed)):]


def accepted(c: Cursor, suggestion: str) -> Cursor:
    """The cursor of the editor's speculative request after it shows `suggestion` (as shown), built as llama.vim's
    s:fim_ctx_local builds it: trailing empty lines dropped, one line appended to the line as typed; with more, the
    lines but the last join the prefix (its window giving up as many lines at its start) and the last is the typed
    text. Its n_indent is the first request's (s:indent_last: 0 from a blank line). llama.vscode's
    cacheFutureSuggestion appends the answer as written, which differs only on a blank line the answer indents less
    than the line. The real text after it is unknown, so nothing to compare."""
    lines = suggestion.rstrip("\n").split("\n")
    indent = 0 if c.blank else c.indent
    if len(lines) == 1:
        return Cursor(c.path, c.line, c.col + len(lines[0]), c.prefix, c.suffix, c.typed + lines[0], indent, "")
    file_lines = Path(c.path).read_text().splitlines()
    window = file_lines[max(0, c.line - N_PREFIX + len(lines) - 1):c.line]
    prefix = "".join(s + "\n" for s in [*window, c.typed + lines[0], *lines[1:-1]])
    return Cursor(c.path, c.line, len(lines[-1]), prefix, c.suffix, lines[-1], indent, "")


def agreement(completion: str, real: str) -> int:
    """Characters the completion gets right before it parts from the file's real text."""
    return len(os.path.commonprefix([completion, real]))


@dataclass
class Record:
    kind: str  # fim, speculative, warmup
    where: str
    seconds: float
    prompt_n: int | None
    cache_n: int | None
    content: str
    real: str
    limit_seconds: float  # t_max_prompt_ms + t_max_predict_ms + 1 s
    agree: int
    prompt_ms: float | None = None  # the server's own split of `seconds`
    predicted_ms: float | None = None
    predicted_n: int | None = None
    drafted: int | None = None  # edgespec's speculation figures, where the response carries them
    accepted: int | None = None
    # extra chunks the prompt held of those sent (edgespec's `infill.extra_chunks`, where the response carries it)
    extra_chunks: list[int] | None = None
    prefix_tokens: list[int] | None = None  # and of the prefix's tokens, and the suffix's (`infill.*_tokens`)
    suffix_tokens: list[int] | None = None


@dataclass
class Peer:
    name: str
    command: list[str]
    port: int
    env: dict[str, str] = field(default_factory=dict)  # added to this process's environment
    proc: subprocess.Popen | None = None
    records: list[Record] = field(default_factory=list)
    pending: list[threading.Thread] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, log: Path) -> None:
        self.proc = subprocess.Popen(self.command, stdout=subprocess.DEVNULL, stderr=open(log, "w"),
                                     env={**os.environ, **self.env})
        deadline = time.time() + 900
        while time.time() < deadline:
            assert self.proc.poll() is None, f"{self.name} exited; see {log}"
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} did not become healthy")

    def freeze(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def ask(self, body: dict[str, Any]) -> tuple[dict[str, Any], float]:
        t0 = time.perf_counter()
        r = httpx.post(self.url + "/infill", json=body, timeout=3600)
        seconds = time.perf_counter() - t0
        if r.status_code != 200:
            raise RuntimeError(f"{self.name} answered {r.status_code}: {r.text[:300]}")
        data = r.json()
        return (data if isinstance(data, list) else [data]), seconds

    def post_and_forget(self, body: dict[str, Any]) -> None:
        """A warm-up: the editor does not wait for it, the server's next answer may."""
        def send() -> None:
            t0 = time.perf_counter()
            try:
                data = self.ask(body)[0][0]
            except httpx.HTTPError as e:
                data = {"content": f"error: {e}"}
            self.records.append(_record("warmup", "ring", data, time.perf_counter() - t0, body, ""))

        thread = threading.Thread(target=send, daemon=True)
        thread.start()
        self.pending.append(thread)

    def stop(self) -> None:
        if self.proc is not None:
            self.thaw()
            self.proc.terminate()
            self.proc.wait(60)


def _record(kind: str, where: str, data: dict, seconds: float, body: dict, real: str,
            content: str | None = None) -> Record:
    """`content`: the answer as the editor shows it (shown), compared with `real`; the answer itself by default."""
    timings = data.get("timings") or {}
    prompt_n = data.get("timings/prompt_n", timings.get("prompt_n"))
    cache_n = data.get("tokens_cached", timings.get("cache_n"))
    content = data.get("content", "") if content is None else content
    limit = (body.get("t_max_prompt_ms", 0) + body.get("t_max_predict_ms", 0)) / 1000 + 1.0
    prompt_ms = data.get("timings/prompt_ms", timings.get("prompt_ms"))
    predicted_ms = data.get("timings/predicted_ms", timings.get("predicted_ms"))
    predicted_n = data.get("timings/predicted_n", timings.get("predicted_n"))
    spec, infill = data.get("speculative") or {}, data.get("infill") or {}
    return Record(kind, where, seconds, prompt_n, cache_n, content, real, limit, agreement(content, real),
                  prompt_ms, predicted_ms, predicted_n, spec.get("drafted"), spec.get("accepted"),
                  infill.get("extra_chunks"), infill.get("prefix_tokens"), infill.get("suffix_tokens"))


def turn(peer: Peer, others: list[Peer], fn: Any) -> Any:
    """Run `fn` with `peer` alone on the machine."""
    for o in others:
        o.freeze()
    peer.thaw()
    try:
        return fn()
    finally:
        for o in others:
            o.thaw()


def session(peers: list[Peer], flavour: str, files: list[tuple[Path, int, int]], ring_files: list[Path],
            ring_size: int, ring_every: int, think: float, greedy: bool = False, write: bool = False,
            buf_enter: bool = False) -> None:
    fim, warmup = FLAVOURS[flavour]
    ring = Ring(ring_files, ring_size, ring_every)
    entered: set[Path] = set()

    def warm_up() -> None:  # the ring changed: each server gets the editor's warm-up after the user's think time
        for p in peers:
            turn(p, [o for o in peers if o is not p], lambda p=p: (time.sleep(think),
                                                                   p.post_and_forget(warmup(ring.held))))

    for path, start, n in files:
        last_line = None
        if buf_enter and path not in entered:  # a return finds the buffer modified: the editors pick nothing then
            entered.add(path)
            ring.enter(entered_chunk(path, start, n))
            warm_up()
        for c in cursors(path, start, n, write):
            if c.line != last_line:
                last_line = c.line
                if ring.walked():
                    warm_up()
            for p in peers:
                turn(p, [o for o in peers if o is not p], lambda p=p: _ask_pair(p, c, ring.held, fim, think, greedy))
            print(f"{flavour} {Path(c.path).name}:{c.line + 1}:{c.col}  " + "  ".join(
                f"{p.name} {p.records[-1].seconds:5.1f}s" for p in peers), file=sys.stderr)


def _ask_pair(p: Peer, c: Cursor, ring: list[dict], fim: Any, think: float, greedy: bool = False) -> None:
    """The user's think time since the last answer, then the completion at `c`, then the editor's speculative
    request on the suggestion, sent the moment the suggestion is shown (llama.vim's s:fim_try_hint, llama.vscode's
    cacheFutureSuggestion in a setTimeout of 0). The think time comes last in a peer's pause, after its frozen
    spell: a server that sizes its background work by the clock then sees the pause end where the user's does.
    edgespec counts its pauses in the time it ran, not frozen (server.service.Pauses)."""
    time.sleep(think)
    where = f"{Path(c.path).name}:{c.line + 1}:{c.col}"
    asked = (lambda body: {**body, "temperature": 0.0}) if greedy else (lambda body: body)  # --greedy
    body = asked(fim(c, ring, False))
    results, seconds = p.ask(body)
    data = kept_completion(c, results)
    answer = shown(c, data.get("content", ""))
    p.records.append(_record("fim", where, data, seconds, body, c.real, answer))
    if _asks_again(fim, c, answer):
        spec = accepted(c, answer)
        body = asked(fim(spec, ring, True))
        results, seconds = p.ask(body)
        p.records.append(_record("speculative", where, kept_completion(spec, results), seconds, body, ""))


def kept_completion(c: Cursor, results: list[dict[str, Any]]) -> dict[str, Any]:
    """The completion the editor shows of an answer's `n_cmpl` results: llama.vscode's first that its
    shouldDiscardSuggestion keeps (not blank, not the lines that follow the cursor again), else the first. Its
    timings are the answer's (the results share one prompt)."""
    after = c.suffix.split("\n")[1:]  # the document's lines after the cursor line (the suffix starts at its end)
    for data in results:
        lines = data.get("content", "").split("\n")
        while lines and not lines[-1].strip():  # Utils.removeTrailingNewLines
            lines.pop()
        if not _discarded(lines, c.typed, after):
            return {**results[0], "content": data.get("content", "")}
    return results[0]


def _discarded(lines: list[str], prefix: str, after: list[str]) -> bool:
    """llama.vscode's shouldDiscardSuggestion, the line's rest empty (the user writes the line anew)."""
    if not lines or (len(lines) == 1 and not lines[0].strip()):
        return True
    if not any(line.strip() for line in after):  # at the end of the file (or only blank lines follow)
        return False
    if len(lines) > 1 and not lines[0].strip() and lines[1:] == after[:len(lines) - 1]:
        return True
    first = next(i for i, line in enumerate(after) if line.strip())
    if prefix + lines[0] != after[first]:
        return False
    if len(lines) == 1:
        return True
    nxt = after[first + 1:]
    if len(lines) == 2:
        return bool(nxt) and lines[1] == nxt[0][:len(lines[1])]
    return lines[1:] == nxt[:len(lines) - 1]


def _asks_again(fim: Any, c: Cursor, answer: str) -> bool:
    """Whether the editor sends its speculative request after showing `answer` at `c`: llama.vscode for an answer
    not all blank (cacheFutureSuggestion); llama.vim where its cache lacks that request, so after an answer of more
    than empty lines, or any answer on a blank line (then sent as typed: the indent as `prompt`)."""
    if fim is vscode_fim:
        return bool(answer.strip())
    return bool(answer.strip("\n")) or c.blank


def summary(peers: list[Peer], flavour: str) -> list[str]:
    rows, stats = [], {}
    for p in peers:
        waited = [r for r in p.records if r.kind != "warmup"]
        if not waited:
            continue
        lat = sorted(r.seconds for r in waited)
        fims = [r for r in waited if r.kind == "fim"]
        stats[p.name] = (statistics.median(lat), lat[max(0, round(0.9 * len(lat)) - 1)])
        prompt_ns = [r.prompt_n for r in waited if r.prompt_n is not None]
        over = sum(r.seconds > r.limit_seconds for r in waited[1:])
        rows.append(f"| {flavour} | {p.name} | {len(waited)} | {stats[p.name][0]:.2f} s | {stats[p.name][1]:.2f} s | "
                    f"{statistics.mean(prompt_ns) if prompt_ns else float('nan'):.0f} | {right(fims)} | {over} |")
    if len(stats) == 2:
        (a, sa), (b, sb) = stats.items()
        rows.append(f"| {flavour} | {a} ÷ {b} | | {sa[0] / sb[0]:.3f}x | {sa[1] / sb[1]:.3f}x | | | |")
    return rows


def right(fims: list[Record]) -> str:
    """Completions right for at least 4 characters, of all; then how many of them came in the first COLD_FIRST
    completions of each visit to a file (the session came from another file: a cold cache, or one kept from an
    earlier visit) and how many after."""
    cold = warm = n = 0
    last = None
    for r in fims:
        file = r.where.rsplit(":", 2)[0]
        n, last = (n + 1 if file == last else 1), file
        if r.agree >= 4:
            cold, warm = (cold + 1, warm) if n <= COLD_FIRST else (cold, warm + 1)
    return f"{cold + warm}/{len(fims)} ({cold} + {warm})"


def parse_files(specs: list[str]) -> list[tuple[Path, int, int]]:
    out = []
    for spec in specs:
        path, start, n = spec.rsplit(":", 2)
        p = Path(path)
        out.append((p if p.is_absolute() else ROOT / p, int(start) - 1, int(n)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--files", nargs="+", default=list(DEFAULT_FILES),
                    help="PATH:FIRST_LINE:LINES, walked in order; a file named again is a return to it")
    ap.add_argument("--ring", nargs="+", default=list(DEFAULT_RING), help="files whose chunks fill the ring")
    ap.add_argument("--ring-size", type=int, default=RING_SIZE)
    ap.add_argument("--ring-every", type=int, default=RING_EVERY, help="a new ring chunk (and a warm-up) every N lines")
    ap.add_argument("--flavours", nargs="+", default=list(FLAVOURS), choices=list(FLAVOURS))
    ap.add_argument("--think", type=float, default=1.0, help="seconds the user takes after each answer")
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--greedy", action="store_true",
                    help="temperature 0 in every completion (not the editors' own): right completions without noise")
    ap.add_argument("--write", action="store_true",
                    help="each walked block is written anew above the lines after it, which stay the suffix "
                         "(default: each line written again over the file, so the suffix loses a line at each)")
    ap.add_argument("--buf-enter", action="store_true",
                    help="on a file's first visit the editor puts a chunk around the cursor in the ring and sends "
                         "its warm-up, as both editors do on entering an unmodified file (default: only the ring "
                         "files' chunks)")
    ap.add_argument("--edgespec-args", default="", help="extra arguments for edgespec serve")
    ap.add_argument("--servers", nargs="+", default=["edgespec", "llama-server"], choices=["edgespec", "llama-server"],
                    help="one alone for a quick look at its own records (no ratio: runs are fair only side by side)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench-results" / "editor.json")
    args = ap.parse_args()
    check_ring(ap, args)

    model = fetch(args.model)
    server_bin = tool(SERVER, build=False)
    if server_bin is None:
        sys.exit(f"{SERVER} is not built; run: python scripts/llama_tools.py --server (about 20 minutes)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "runs": {}}
    table = ["| session | server | requests | median | p90 | prompt tokens evaluated (mean) | right ≥ 4 chars "
             f"(a visit's first {COLD_FIRST} + after) | over budget + 1 s |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for flavour in args.flavours:
        # edgespec's memory of what it wrote starts empty: earlier runs over the same files would draft the answers
        memory = tempfile.TemporaryDirectory(prefix="bench-editor-memory-")
        peers = [Peer("edgespec", [sys.executable, "-m", "edgespec.cli", "serve", "-m", str(model), "--ctx",
                                   str(args.ctx), "--threads", str(args.threads), "--port", "18012", "-q",
                                   *args.edgespec_args.split()], 18012, {MEMORY_ENV: memory.name}),
                 Peer("llama-server", [str(server_bin), "-m", str(model), "--ctx-size", str(args.ctx), "-t",
                                       str(args.threads), "--cache-reuse", "256", "-ub", "1024", "-b", "1024",
                                       "--host", "127.0.0.1", "--port", "18080",
                                       # GCC 12's AMX build crashes; llama-server's one switch for it also
                                       # turns off repacking, which edgespec keeps (backend.repack_without_amx)
                                       *(["--no-repack"] if amx_build() else [])], 18080)]
        peers = [p for p in peers if p.name in args.servers]
        try:
            for p in peers:  # one at a time: edgespec calibrates at its first load, on a quiet machine
                p.start(args.out.with_suffix(f".{p.name}.log"))
            session(peers, flavour, parse_files(args.files), [ROOT / f for f in args.ring], args.ring_size,
                    args.ring_every, args.think, args.greedy, args.write, args.buf_enter)
        finally:
            for p in peers:
                p.stop()
            memory.cleanup()
        results["runs"][flavour] = {p.name: [asdict(r) for r in p.records] for p in peers}
        table += summary(peers, flavour)
        args.out.write_text(json.dumps(results, indent=1))
    print("\n".join(table))
    results["table"] = table
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
