"""Where the typed part of the cursor line goes in a FIM prompt: at the end of the prefix (llama.cpp's layout), at
the start of the middle (edgespec's "middle": a keystroke then only appends to the prompt), or at the end of the
prefix less the word it ends inside, which the answer must spell again ("healed", /infill's token healing:
prompts.fim.healed). Same cursors, same context, greedy completions from the same engine; each is compared with what
the file really holds after the cursor.

Cursors are those of scripts/bench_editor.py (after the indent and half-way through each line). The prefix runs from
a fixed line to the cursor and the suffix holds the next lines, so consecutive prompts share their start and each
layout keeps its own slot: every prompt is evaluated exactly (no shifted entries), and the layouts differ in nothing
else.

    python scripts/bench_fim_layout.py --out bench-results/fim-layout.json
    python scripts/bench_fim_layout.py --variants prefix healed --half-way --files FILE:LINE:LINES ...
    python scripts/bench_fim_layout.py --variants prefix middle middle-healed --after-punctuation ...

With --ring the prompts also carry extra chunks of other files, as a bench_editor.py session's ring holds them at
each cursor (--ring-every, --ring-size as there): what the editor's ring is worth at a given width (--prefix-lines).
With --relevant N, lines of the window chosen for the names near the cursor go in as an extra chunk; with
--outline N, the window's signatures above the prefix (a file's outline) go at the prefix's start; with --below N,
the file's N lines after the suffix's go in as an extra chunk (--below-every K: from a line that stays while the cursor
walks K lines, as a chunk kept cached would). With --middle-lines N the N lines before the cursor line go after
<fim_middle> with the typed text, so the suffix stands before them (middle layouts); with --cache-reuse N each slot
keeps cached runs of at least N tokens at new positions up to the line before the cursor, the cursor where the typed
text ends (middle layouts: the suffix may move, as /infill never lets it), instead of evaluating every prompt exactly.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

from bench_editor import (DEFAULT_FILES, N_PREFIX, N_SUFFIX, RING_EVERY, RING_SIZE, Cursor, Ring,  # noqa: E402
                          agreement, check_ring, cursor_at, cursors, parse_files)

from edgespec import Engine, EngineConfig, GenerationConfig, LoadConfig  # noqa: E402
from edgespec.engine import core  # noqa: E402
from edgespec.gguf import Vocab  # noqa: E402
from edgespec.prompts.fim import LAYOUTS, NEAR_LINES, FimPrompt, Infill, healed, line_before  # noqa: E402

SUFFIX_LINES = 16
PREFIX_LINES = 96  # the prefix starts this many lines before the first cursor of a file, then grows
VARIANTS = {"prefix": ("prefix", False), "middle": ("middle", False), "healed": ("prefix", True),
            "middle-healed": ("middle", True)}  # layout, healed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--files", nargs="+", default=list(DEFAULT_FILES), help="PATH:FIRST_LINE:LINES")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--half-way", action="store_true", help="only cursors with typed text after the indent")
    ap.add_argument("--after-punctuation", action="store_true",
                    help="one cursor per line, right after the punctuation mark nearest half-way through it")
    ap.add_argument("--suffix-lines", type=int, default=SUFFIX_LINES, help="lines after the cursor line's rest")
    ap.add_argument("--prefix-lines", type=int, default=PREFIX_LINES,
                    help="lines before a file's first cursor where its prefix starts")
    ap.add_argument("--ring", nargs="*", default=[], help="files whose chunks fill the ring of extra context")
    ap.add_argument("--ring-size", type=int, default=RING_SIZE)
    ap.add_argument("--ring-every", type=int, default=RING_EVERY, help="a new ring chunk every N lines")
    ap.add_argument("--relevant", type=int, default=0,
                    help="up to N lines of the editor's window outside the prefix that first hold a rare word of "
                         "the nearest lines, or a word the typed one starts, as an extra chunk")
    ap.add_argument("--outline", type=int, default=0,
                    help="up to N header lines (a line the next one is indented under) of the editor's window before "
                         "the prefix, at the cursor's function's level or above, put before the prefix's lines")
    ap.add_argument("--below", type=int, default=0,
                    help="N lines of the file below the suffix's as an extra chunk of the file (named as it is)")
    ap.add_argument("--below-every", type=int, default=0,
                    help="with --below: the chunk starts at the next multiple of this many lines after the cursor "
                         "line, so it stays while the cursor walks that many lines (0: right after the suffix)")
    ap.add_argument("--middle-lines", type=int, default=0,
                    help="the N lines before the cursor line go at the middle's start, with the typed text (middle "
                         "layouts): the suffix then stands before them")
    ap.add_argument("--cache-reuse", type=int, default=0,
                    help="keep cached runs of at least N tokens at new positions before the line before the cursor "
                         "(the cursor: where the typed text ends)")
    ap.add_argument("--window", type=int, default=N_PREFIX, help="the editor's lines before the cursor")
    ap.add_argument("--out", type=Path, default=ROOT / "bench-results" / "fim-layout.json")
    args = ap.parse_args()
    check_ring(ap, args)
    for name in ("below", "below_every", "middle_lines", "cache_reuse"):
        if getattr(args, name) < 0:
            ap.error(f"--{name.replace('_', '-')} {getattr(args, name)} must be at least 0 (0: none)")
    if args.below_every and not args.below:
        ap.error(f"--below-every {args.below_every} places the chunk of --below lines; pass --below N too")
    if (args.middle_lines or args.cache_reuse) and any(VARIANTS[v][0] != "middle" for v in args.variants):
        ap.error("--middle-lines and --cache-reuse lay out the middle layouts only; pass --variants middle "
                 "middle-healed")

    n_ctx = 4096 + (8192 if args.ring else 0)  # a slot's: the prefix and suffix, and the ring's chunks
    config = EngineConfig(args.model, proposer="none", memory=False,
                          load=LoadConfig(n_ctx=n_ctx, n_threads=args.threads, n_seq=len(args.variants)))
    records: list[dict] = []
    ring = Ring([ROOT / f for f in args.ring], args.ring_size, args.ring_every)
    if args.cache_reuse:  # the engine's generations take this replay's anchor
        core.cursor_anchor = typed_end_anchor
    with Engine(config) as eng:
        m = eng.target
        prompts = {layout: FimPrompt(m.vocab, lambda t: m.tokenize(t, add_special=False, parse_special=False), layout)
                   for layout in LAYOUTS}
        for path, start, n in parse_files(args.files):
            lines = path.read_text().splitlines()
            first, last = max(0, start - args.prefix_lines), None
            for c in (marked if args.after_punctuation else cursors)(path, start, n):
                if c.line != last:  # the ring as a session's holds it (bench_editor.session)
                    last = c.line
                    ring.walked()
                if args.half_way and c.blank:
                    continue
                infill = Infill("".join(s + "\n" for s in lines[first:c.line]),
                                "\n".join(["", *lines[c.line + 1:c.line + 1 + args.suffix_lines]]) + "\n", c.typed,
                                tuple((r["filename"], r["text"]) for r in ring.held))
                if args.outline:
                    infill = replace(infill, prefix=outline(lines, first, c, args.window, args.outline) + infill.prefix)
                if args.below:
                    k = args.below_every
                    at = (c.line // k + 1) * k if k else c.line + 1 + args.suffix_lines
                    if below := "".join(s + "\n" for s in lines[at:at + args.below]):  # none past the file's end
                        infill = replace(infill, extra=infill.extra + ((path.name, below),))
                if args.middle_lines:
                    pre = infill.prefix.splitlines(keepends=True)
                    k = min(args.middle_lines, len(pre))
                    infill = replace(infill, prefix="".join(pre[:len(pre) - k]),
                                     typed="".join(pre[len(pre) - k:]) + infill.typed)
                if args.relevant:
                    rel = relevant(lines, first, c, args.suffix_lines, args.window, args.relevant)
                    if rel:
                        infill = replace(infill, extra=infill.extra + ((path.name, rel),))
                row = {"where": f"{path.name}:{c.line + 1}:{c.col}", "real": c.real}
                for slot, variant in enumerate(args.variants):
                    layout, heals = VARIANTS[variant]
                    held, heal = healed(infill, layout) if heals else (infill, "")
                    tokens, _, _ = prompts[layout].tokens(held)
                    t0 = time.perf_counter()
                    out = eng.generate(tokens, GenerationConfig(max_tokens=args.max_tokens, slot=slot, memory=None,
                                                                min_indent=c.indent, heal=heal,
                                                                cache_reuse=args.cache_reuse))
                    row[variant] = {"text": out.text, "agree": agreement(out.text, c.real),
                                   "prompt_tokens": len(tokens), "cached": out.stats.cached_prompt_tokens,
                                   "moved": out.stats.shifted_prompt_tokens,
                                   "seconds": time.perf_counter() - t0}
                records.append(row)
                print(f"{row['where']:<24} " + "  ".join(f"{v} {row[v]['agree']:>3}" for v in args.variants),
                      file=sys.stderr)
    lines_out = ["| variant | cursors | right ≥ 4 chars | first line right | mean characters right | "
                 "prompt tokens evaluated (mean) |", "|---|---:|---:|---:|---:|---:|"]
    for variant in args.variants:
        rs = [r[variant] for r in records]
        first_line = sum(bool(r[variant]["text"].split("\n")[0].strip())
                         and r["real"].split("\n")[0] == r[variant]["text"].split("\n")[0] for r in records)
        evaluated = sum(x["prompt_tokens"] - x["cached"] for x in rs) / len(rs)
        lines_out.append(f"| {variant} | {len(rs)} | {sum(x['agree'] >= 4 for x in rs)} | {first_line} | "
                         f"{sum(x['agree'] for x in rs) / len(rs):.1f} | {evaluated:.0f} |")
    print("\n".join(lines_out))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "cpu": os.cpu_count(),
                                    "records": records, "table": lines_out}, indent=1))


_WORD = re.compile(r"[A-Za-z_]\w*")
_NAME = re.compile(r"\w_|_\w|[a-z][A-Z]|\d")  # a word that names a thing in code, not English
_CODE = re.compile(r"[=(){};:\[\]]")
_CLASSLIKE = re.compile(r"(export\s+)?(class|struct|namespace|impl|interface)\b")
_COMMENT = ("#", "//", "*", "/*")  # how a comment line starts


def typed_end_anchor(prompt: Sequence[int], vocab: Vocab, piece: Callable[[int], bytes]) -> int | None:
    """In a middle layout's prompt, the start of the line before the cursor, the cursor at the prompt's end (where
    the typed text ends), and no earlier than the middle; prompts.fim.cursor_anchor takes the end of the prefix."""
    tokens = list(prompt)
    if vocab.fim_mid is None or vocab.fim_mid not in tokens:
        return None
    mid = len(tokens) - 1 - tokens[::-1].index(vocab.fim_mid)
    at = line_before(tokens, len(tokens), mid, piece)
    return mid + 1 if at is None else at


def outline(lines: list[str], first: int, c: Cursor, window: int, most: int) -> str:
    """The nearest `most` header lines of the window before `first` at the level of the function the cursor is in
    or above: the signatures a file's far lines hold, without their bodies."""
    def indent(y: int) -> int:
        return len(lines[y]) - len(lines[y].lstrip())

    def nxt(y: int) -> int | None:
        return next((z for z in range(y + 1, len(lines)) if lines[z].strip()), None)

    def classlike(y: int) -> bool:
        return bool(_CLASSLIKE.match(lines[y].strip()))

    chain, m = [], min(c.indent, indent(c.line)) if lines[c.line].strip() else c.indent
    for y in range(c.line - 1, -1, -1):
        if lines[y].strip() and indent(y) < m:
            chain.append(y)
            m = indent(y)
    if not chain:
        return ""
    level = indent(chain[-1])
    if len(chain) > 1 and classlike(chain[-1]):
        level = indent(chain[-2])

    def parent(y: int) -> int | None:
        return next((z for z in range(y - 1, -1, -1) if lines[z].strip() and indent(z) < indent(y)), None)

    def kept(y: int) -> bool:  # a signature at the top level, or a member's of a class-like block
        if not lines[y].strip() or indent(y) > level or lines[y].lstrip().startswith(_COMMENT):
            return False
        if not ("(" in lines[y] or classlike(y)):
            return False
        if (z := nxt(y)) is None or indent(z) <= indent(y):
            return False
        return indent(y) == 0 or ((p := parent(y)) is not None and classlike(p))

    heads = [y for y in range(max(0, c.line - window), first) if kept(y)]
    return "".join(lines[y] + "\n" for y in heads[-most:])


def relevant(lines: list[str], first: int, c: Cursor, suffix_lines: int, window: int, most: int) -> str:
    """Lines of the window outside the prompt's own that first hold a word of the nearest lines seen few times in
    the window, or a longer word that the typed text's last word starts."""
    lo, hi = max(0, c.line - window), min(len(lines), c.line + 1 + N_SUFFIX)
    inside = set(range(first, c.line + 1 + suffix_lines + 1))
    counts: dict[str, int] = {}
    for y in range(lo, hi):
        for w in _WORD.findall(lines[y]):
            counts[w] = counts.get(w, 0) + 1
    near = " ".join(lines[max(first, c.line - NEAR_LINES):c.line]) + " " + c.typed + " " + " ".join(
        lines[c.line + 1:c.line + 1 + suffix_lines])
    wanted = {w for w in _WORD.findall(near) if _NAME.search(w) and counts.get(w, 0) <= 6}
    if (m := re.search(r"[A-Za-z_]\w*\Z", c.typed)) and len(m.group()) >= 2:
        wanted |= {w for w in counts if w.startswith(m.group()) and w != m.group() and _NAME.search(w)}
    taken: list[int] = []
    for w in sorted(wanted):
        at = next((y for y in range(lo, hi) if re.search(rf"\b{w}\b", lines[y]) and _CODE.search(lines[y])
                   and not lines[y].lstrip().startswith(_COMMENT)), None)
        if at is not None and at not in inside and at not in taken:
            taken.append(at)
    return "".join(lines[y] + "\n" for y in sorted(taken)[:most])


def marked(path: Path, start: int, n_lines: int) -> Iterator[Cursor]:
    """A cursor right after the punctuation mark nearest half-way through each line of [start, start + n_lines)
    that has one with text after it (where a user types `.`, `(` or ` =` and waits for the rest)."""
    lines = path.read_text().splitlines()
    for y in range(start, min(start + n_lines, len(lines))):
        line = lines[y]
        indent = len(line) - len(line.lstrip())
        half = indent + (len(line) - indent) // 2
        marks = [x for x in range(indent + 1, len(line))
                 if not (line[x - 1].isalnum() or line[x - 1] in "_ \t") and line[x:].strip()]
        if marks:
            yield cursor_at(path, lines, y, min(marks, key=lambda x: abs(x - half)))


if __name__ == "__main__":
    main()
