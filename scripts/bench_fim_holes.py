"""A FIM suffix kept cached while the cursor walks down over it, its passed lines cut out of the KV cache and the
positions after them left as they were (a hole), against the same prompts evaluated exactly and against the prompts a
line start's budget buys. It drives llama.cpp directly: the engine keeps a sequence's positions contiguous.

When the cursor moves onto the next line of a file being typed over, the suffix loses its first line. Kept from the
previous prompt by moving (llama.cpp's cache reuse), the rest of the suffix must be re-rotated, and llama.cpp
re-rotates every cell of the cache for that (scripts/bench_kv_shift.py): about the whole of a 0.5 s budget here. Cut
out without moving (`llama_memory_seq_rm` of the line's positions alone), nothing is re-rotated: the suffix's later
entries keep their positions, and a line start evaluates only the line written and the typed text, which go after
<fim_middle> (the written-lines layout, prompts.fim.written_since). The entries after the hole were computed with the
cut lines before them: in a type-over session the very lines the user now writes again, so the cache still holds
the answer (docs/bench/editor.md: not built for that). What the replay measures cleanly is the suffix's width.

Variants, each in its own sequence, greedy, same cursors as scripts/bench_editor.py's type-over sessions; the prefix
starts --prefix-lines before a file's first cursor, and "24" stands for --suffix-lines:
  near3   the prefix up to the cursor line with the typed text (llama.cpp's layout), 3 suffix lines, exact
  psm24   the same with 24 suffix lines (llama-server's width)
  mid24   the prefix up to a file's first cursor line, then the suffix (24 lines from there, fewer as the cursor
          passes them), then after <fim_middle> the lines written since and the typed text, healed: exact
  holes24 mid24's prompts, its suffix evaluated once at a file's first cursor and its passed lines cut out
  iso24   mid24's prompts, each group of --block-lines suffix lines evaluated seeing only the prefix (with
          <fim_suffix>) and itself, in a sequence of its own, then added to the prompt's: contiguous positions,
          evaluated afresh whenever the suffix moves (what the grouping alone costs in completions)
  blocks24 iso24's groups evaluated once at a file's first cursor; a passed line cut out in place and the rest of
          its group evaluated again there; everything after <fim_middle> evaluated again after any cut. No entry
          kept has seen a line the user writes again, so nothing leaks
  gap24   blocks24's groups, the lines written since a file's first cursor in --gap positions kept for them
          between the prefix and <fim_suffix> (each seeing the prefix and the lines written before it, as in a
          fresh evaluation), after <fim_middle> only the typed text: a line start evaluates the line written, the
          rest of one group and the typed text
  blind24 blocks24's prompts, <fim_middle> and the lines written after it seeing the prefix and the lines written
          before them but no suffix line, so that a cut leaves them be: a line start evaluates the line written, the
          rest of one group and the typed text, which alone sees the suffix
With --groups-see mark, a group sees <fim_suffix> and its newline alone instead of the prefix before them.

    python scripts/bench_fim_holes.py --files FILE:LINE:LINES ... [--prefix-lines N] [--suffix-lines N]
        [--block-lines N] [--groups-see prefix|mark] [--gap N] [--fresh] [--variants NAME ...]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

import llama_cpp  # noqa: E402

from bench_editor import agreement, cursors, parse_files  # noqa: E402
from edgespec.decoding.rules import Pieces, Start  # noqa: E402
from edgespec.models import fetch  # noqa: E402
from edgespec.prompts.fim import Infill, healed  # noqa: E402

VARIANTS = ("near3", "psm24", "mid24", "holes24", "iso24", "blocks24", "gap24", "blind24")
HEALED = ("mid24", "holes24", "iso24", "blocks24", "gap24", "blind24")  # typed after <fim_middle>: fim.healed
ISOLATED = ("iso24", "blocks24", "gap24", "blind24")  # suffix lines in groups that see the prefix and themselves only
Cells = list[tuple[int, int]]  # (position, token) of a sequence, in order
Group = tuple[int, int, Cells]  # suffix lines evaluated together: the positions they span, and those still held


class Runner:
    """The model in one llama.cpp context, a sequence per variant, each mirrored as its cells."""

    def __init__(self, path: Path, n_seq: int, n_ctx: int, threads: int) -> None:
        self.n_seq_max = n_seq
        llama_cpp.llama_backend_init()
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), llama_cpp.llama_model_default_params())
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx, cp.n_seq_max, cp.kv_unified = n_ctx, n_seq, True
        cp.n_batch = cp.n_ubatch = 512
        cp.n_threads = cp.n_threads_batch = threads
        self.ctx = llama_cpp.llama_init_from_model(self.model, cp)
        self.mem = llama_cpp.llama_get_memory(self.ctx)
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.batch = llama_cpp.llama_batch_init(512, 0, 1)
        self.cells: list[Cells] = [[] for _ in range(n_seq)]
        # cells as a part left them (isolated): one evaluated again in the sequence itself, as the last cell of a
        # prompt is for its logits, has seen everything before it and is no longer a part's
        self.parted: list[set[tuple[int, int]]] = [set() for _ in range(n_seq)]
        self.pre, self.suf, self.mid = (f(self.vocab) for f in (llama_cpp.llama_vocab_fim_pre,
                                                                llama_cpp.llama_vocab_fim_suf,
                                                                llama_cpp.llama_vocab_fim_mid))
        self.evaluated = 0
        self.pieces: Pieces | None = None  # for token healing, made at its first use

    def tokens(self, text: str) -> list[int]:
        raw = text.encode()
        buf = (llama_cpp.llama_token * (len(raw) + 8))()
        n = llama_cpp.llama_tokenize(self.vocab, raw, len(raw), buf, len(buf), False, False)
        return list(buf[:n])

    def piece(self, token: int) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, False)
        return buf.raw[:n]

    def hold(self, seq: int, want: Cells) -> np.ndarray:
        """Make `seq` hold `want`: cached cells it lacks are cut out where the cells after them are still wanted at
        their positions; from the first cell that differs on, evaluated. The last cell's logits."""
        have, i, j = self.cells[seq], 0, 0
        wanted = set(want)
        while i < len(have) and j < len(want):
            if have[i] == want[j]:
                i, j = i + 1, j + 1
            elif have[i][0] < want[j][0] and have[i] not in wanted:  # a cell the prompt no longer holds
                llama_cpp.llama_memory_seq_rm(self.mem, seq, have[i][0], have[i][0] + 1)
                i += 1
            else:
                break
        if j == len(want):  # all cached: evaluate the last again for its logits
            j -= 1
        cut = min(want[j][0], have[i][0]) if i < len(have) else want[j][0]
        llama_cpp.llama_memory_seq_rm(self.mem, seq, cut, -1)
        self.cells[seq] = want[:j]
        self.parted[seq] &= set(want[:j])
        return self.decode(seq, want[j:])

    def isolated(self, seq: int, head: Cells, groups: list[Group], sees: list[tuple[int, int]],
                 mark: Cells = (), written: Cells = ()) -> int:
        """Make `seq` hold `head`, `mark`, `groups` and `written` (after the head or after the groups), so that
        cutting a line out of one group leaks nothing into anything else: each group's entries see only the
        positions in `sees` (the head, the mark) and the group itself; the mark sees the head; each written cell sees
        the head and the written cells before it. A part is evaluated in a sequence of its own right after what it
        sees (llama.cpp wants a sequence's new tokens there) and moved into place (a re-rotation, as llama.cpp's cache
        reuse moves a chunk); a prompt's new groups go in one batch. Cached parts are kept; when any cell was cut or
        evaluated, everything after them (the typed text) goes too. Tokens evaluated."""
        before, have = self.evaluated, self.cells[seq]
        if have[:len(head)] != head:
            llama_cpp.llama_memory_seq_rm(self.mem, seq, -1, -1)
            self.cells[seq], have, self.parted[seq] = [], [], set()
            self.decode(seq, head)
        rest, end_head = have[len(head):], head[-1][0] + 1
        cached = [c for c in rest if c in self.parted[seq]]
        spans = [(lo, hi, g) for lo, hi, g in groups] + ([(mark[0][0], mark[-1][0] + 1, list(mark))] if mark else [])
        whole = [{c for c in cached if lo <= c[0] < hi} == set(g) for lo, hi, g in spans]
        kept = set(cached)
        n_written = next((k for k, c in enumerate(written) if c not in kept), len(written))
        held = {c for (_, _, g), w in zip(spans, whole) if w for c in g} | set(written[:n_written])
        fresh = [g for (_, _, g), w in zip(spans[:len(groups)], whole) if not w]
        middle = max((hi for _, hi, _ in spans), default=end_head)
        if not all(whole) or n_written < len(written) or any(c not in held and c[0] < middle for c in rest):
            for pos, _ in (c for c in rest if c not in held):  # the prompt changed: the middle goes too
                llama_cpp.llama_memory_seq_rm(self.mem, seq, pos, pos + 1)
            self.cells[seq] = head + sorted(held)
            self.parted[seq] &= held
        if n_written < len(written):  # each new written line sees the head and the lines written before it
            self.parts([list(written[n_written:])], [[(0, end_head), (written[0][0], written[n_written][0])]], seq)
        if mark and not whole[-1]:
            self.parts([list(mark)], [[(0, end_head)]], seq)
        self.parts(fresh, [sees] * len(fresh), seq)
        return self.evaluated - before

    def parts(self, parts: list[Cells], sees: list[list[tuple[int, int]]], seq: int) -> None:
        """Evaluate each of `parts` in a sequence of its own that holds only `seq`'s cells at the positions in its
        `sees`, right after them, all in one batch; then move each into place and add it to `seq`."""
        zs = [self.n_seq_max - 1 - i for i in range(len(parts))]
        batch: Cells = []
        seqs: list[int] = []
        starts = []
        for z, part, ranges in zip(zs, parts, sees):
            for lo, hi in ranges:
                llama_cpp.llama_memory_seq_cp(self.mem, seq, z, lo, hi)
            at = max(hi for lo, hi in ranges if hi > lo)
            starts.append(at)
            batch += [(at + k, t) for k, (_, t) in enumerate(part)]
            seqs += [z] * len(part)
        self.decode_seqs(batch, seqs)
        for z, part, at in zip(zs, parts, starts):
            if part[0][0] != at:
                llama_cpp.llama_memory_seq_add(self.mem, z, at, -1, part[0][0] - at)
            llama_cpp.llama_memory_seq_cp(self.mem, z, seq, part[0][0], part[-1][0] + 1)
            llama_cpp.llama_memory_seq_rm(self.mem, z, -1, -1)
            self.parted[seq] |= set(part)
        self.cells[seq] = sorted(self.cells[seq] + [c for part in parts for c in part])

    def decode_seqs(self, cells: Cells, seqs: list[int], logits: bool = False) -> None:
        """`cells`, each in its sequence of `seqs`, in batches; with `logits`, each batch's last cell's kept."""
        for at in range(0, len(cells), 512):
            part, b = cells[at:at + 512], self.batch
            for k, ((pos, tok), z) in enumerate(zip(part, seqs[at:at + 512])):
                b.token[k], b.pos[k], b.n_seq_id[k], b.logits[k] = tok, pos, 1, False
                b.seq_id[k][0] = z
            b.logits[len(part) - 1] = logits
            b.n_tokens = len(part)
            if llama_cpp.llama_decode(self.ctx, b) != 0:
                raise RuntimeError(f"llama_decode failed at position {part[0][0]}")
            self.evaluated += len(part)

    def decode(self, seq: int, cells: Cells) -> np.ndarray:
        self.decode_seqs(cells, [seq] * len(cells), logits=True)
        self.cells[seq].extend(cells)
        ptr = llama_cpp.llama_get_logits_ith(self.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()

    def complete(self, seq: int, prompt: Cells, most: int, heal: str = "") -> tuple[str, int]:
        """Greedy tokens after `prompt` (up to `most`, or an end of generation), the first ones spelling `heal`
        (token healing, as /infill's middle layout asks), then the cache back to the prompt; the text after `heal`
        and the prompt's tokens evaluated."""
        before = self.evaluated
        logits = self.hold(seq, prompt)
        new = self.evaluated - before
        out, pos, start = [], prompt[-1][0] + 1, None
        if heal:
            if self.pieces is None:
                self.pieces = Pieces(self.n_vocab, self.piece, lambda t: llama_cpp.llama_vocab_is_eog(self.vocab, t))
            start = Start(heal.encode(), self.pieces)  # the server's own healing rule (engine.core.grammar_of)
        for _ in range(most):
            if start is not None and not start.done:
                logits = np.where(start.allowed(np.arange(self.n_vocab)), logits, -np.inf)
            tok = int(np.argmax(logits))
            if llama_cpp.llama_vocab_is_eog(self.vocab, tok):
                break
            if start is not None:
                start.accept(tok)
            out.append(tok)
            logits = self.decode(seq, [(pos, tok)])
            pos += 1
        llama_cpp.llama_memory_seq_rm(self.mem, seq, prompt[-1][0] + 1, -1)
        self.cells[seq] = self.cells[seq][:len(prompt)]
        self.evaluated -= len(out)
        return b"".join(self.piece(t) for t in out).decode(errors="replace")[len(heal):], new


def laid(parts: list[list[int]]) -> Cells:
    """`parts` one after the other at contiguous positions from 0."""
    flat = [t for p in parts for t in p]
    return list(enumerate(flat))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--files", nargs="+", required=True, help="PATH:FIRST_LINE:LINES")
    ap.add_argument("--prefix-lines", type=int, default=24, help="lines before a file's first cursor")
    ap.add_argument("--suffix-lines", type=int, default=24)
    ap.add_argument("--block-lines", type=int, default=1, help="suffix lines evaluated together (the grouped variants)")
    ap.add_argument("--groups-see", choices=("prefix", "mark"), default="prefix",
                    help="what an isolated group of suffix lines is evaluated after: the prefix and <fim_suffix>, or "
                         "<fim_suffix> and its newline alone (the grouped variants)")
    ap.add_argument("--gap", type=int, default=256, help="positions kept for the lines written (gap24)")
    ap.add_argument("--fresh", action="store_true",
                    help="evaluate iso24, blocks24, gap24 and blind24 afresh at every cursor, in the same layout, "
                         "to compare with what the kept cache completes: one that held what was cut would do better")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "bench-results" / "fim-holes.json")
    args = ap.parse_args()
    # a sequence per variant, and from the 64th down one per group being evaluated
    r = Runner(fetch(args.model), 64, 1024 * (len(args.variants) + 1), args.threads)
    line_tokens = lambda s: r.tokens(s + "\n")  # noqa: E731 - a line and its end, tokenized alone
    records = []
    for path, start, n in parse_files(args.files):
        lines = path.read_text().splitlines()
        first, block = max(0, start - args.prefix_lines), None
        for c in cursors(path, start, n):
            y, typed = c.line, r.tokens(c.typed) if c.typed else []
            less, heal = healed(Infill("", "", c.typed), "middle")
            healed_typed = r.tokens(less.typed) if less.typed else []
            if block is None:  # the block's first cursor: the suffix the holes variant keeps
                block = y
                base = [line_tokens(s) for s in lines[y + 1:y + 1 + args.suffix_lines]]
            head = [r.pre] + [t for s in lines[first:block] for t in line_tokens(s)]
            nl = r.tokens("\n")
            prompts: dict[str, Cells] = {}
            prefix = [t for s in lines[first:y] for t in line_tokens(s)]
            for name, k in (("near3", 3), ("psm24", args.suffix_lines)):
                suffix = [t for s in lines[y + 1:y + 1 + k] for t in line_tokens(s)]
                prompts[name] = laid([[r.pre], prefix, typed, [r.suf], nl, suffix, [r.mid]])
            written = [t for s in lines[block:y] for t in line_tokens(s)]
            kept = [t for s in base[y - block:] for t in s]
            prompts["mid24"] = laid([head, [r.suf], nl, kept, [r.mid], written, healed_typed])
            # the same text, the passed suffix lines' positions left empty
            full = [head, [r.suf], nl, [t for s in base for t in s]]
            cut = sum(len(s) for s in base[:y - block])
            at = sum(len(p) for p in full[:3])
            cells = laid(full)
            cells = cells[:at] + cells[at + cut:]
            after = cells[-1][0] + 1
            tail = [r.mid] + written + healed_typed
            prompts["holes24"] = cells + [(after + k, t) for k, t in enumerate(tail)]
            # the grouped variants: the head, groups of suffix lines, the middle (laid as mid24 or holes24; gap24's
            # lines written in positions kept for them before <fim_suffix>; blind24's after the groups, seeing none
            # of them), and what each part is evaluated seeing
            if len(written) > args.gap:
                raise SystemExit(f"--gap {args.gap}: {path.name} has {len(written)} tokens written by line {y + 1}; "
                                 "pass a wider --gap")
            isolated = {name: grouped(r, name, args, head, nl, base, y - block, written, healed_typed)
                        for name in ISOLATED if name in args.variants}
            prompts.update({name: prompt for name, (_, prompt) in isolated.items()})
            row = {"where": f"{path.name}:{y + 1}:{c.col}", "real": c.real}
            for seq, name in enumerate(VARIANTS):
                if name not in args.variants:
                    continue
                t0 = time.perf_counter()
                if args.fresh and name in ISOLATED:
                    llama_cpp.llama_memory_seq_rm(r.mem, seq, -1, -1)
                    r.cells[seq], r.parted[seq] = [], set()
                iso = r.isolated(seq, *isolated[name][0]) if name in ISOLATED else 0
                text, new = r.complete(seq, prompts[name], args.max_tokens, heal if name in HEALED else "")
                new += iso
                row[name] = {"text": text, "agree": agreement(text, c.real), "new": new,
                             "prompt": len(prompts[name]), "seconds": time.perf_counter() - t0}
            records.append(row)
            print(f"{row['where']:<28} " + "  ".join(f"{v} {row[v]['agree']:>3} ({row[v]['new']:>4})"
                                                    for v in args.variants), file=sys.stderr)
    print("\n".join(table := summary(records, args.variants)))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "records": records,
                                    "table": table}, indent=1))


def grouped(r: Runner, name: str, args: argparse.Namespace, head: list[int], nl: list[int], base: list[list[int]],
            passed: int, written: list[int], healed_typed: list[int]) -> tuple[tuple, Cells]:
    """A grouped variant's parts for Runner.isolated and its prompt: the head, groups of suffix lines (`base` from
    the file's first cursor, its first `passed` lines passed), the middle (laid as mid24 or holes24; gap24's lines
    written in positions kept for them before <fim_suffix>; blind24's after the groups, seeing none of them), and
    what each part is evaluated seeing."""
    n_head = len(head)
    mark_at = n_head + args.gap if name == "gap24" else n_head
    pos, gs = mark_at + 1 + len(nl), []
    for g0 in range(0, len(base), args.block_lines):
        lo, g = pos, []
        for i in range(g0, min(g0 + args.block_lines, len(base))):
            if i >= passed:
                g.extend((pos + k, t) for k, t in enumerate(base[i]))
            if name != "iso24" or i >= passed:  # iso24 alone moves the lines after a passed one
                pos += len(base[i])
        gs += [(lo, pos, g)] if g else []
    mark = [(mark_at + k, t) for k, t in enumerate([r.suf] + nl)]
    sees = [(mark_at, mark_at + 1 + len(nl))] + ([(0, n_head)] if args.groups_see == "prefix" else [])
    cells = [c for _, _, g in gs for c in g]
    if name == "gap24":
        w = [(n_head + k, t) for k, t in enumerate(written)]
        parts: tuple = (laid([head]), gs, sees, mark, w)
        cells = w + mark + cells + [(pos + k, t) for k, t in enumerate([r.mid] + healed_typed)]
    elif name == "blind24":
        w = [(pos + k, t) for k, t in enumerate([r.mid] + written)]
        parts = (laid([head]) + mark, gs, sees, (), w)
        cells = mark + cells + w + [(pos + len(w) + k, t) for k, t in enumerate(healed_typed)]
    else:  # the mark evaluated with the head, the written lines after <fim_middle>
        parts = (laid([head]) + mark, gs, sees, (), ())
        cells = mark + cells + [(pos + k, t) for k, t in enumerate([r.mid] + written + healed_typed)]
    return parts, laid([head]) + cells


def summary(records: list[dict], variants: list[str]) -> list[str]:
    """The docs' table: right completions, first lines right, long runs right (a cache that holds the answer shows
    there), mean characters right, tokens evaluated."""
    table = ["| variant | right ≥ 4 chars | first line right | right for 100 characters or more | "
             "mean characters right | tokens evaluated a cursor (mean) |", "|---|---:|---:|---:|---:|---:|"]
    for v in variants:
        rs = [(x[v], x["real"].split("\n")[0]) for x in records]
        first = sum(bool(x["text"].split("\n")[0].strip()) and x["text"].split("\n")[0] == real for x, real in rs)
        table.append(f"| {v} | {sum(x['agree'] >= 4 for x, _ in rs)}/{len(rs)} | {first} | "
                     f"{sum(x['agree'] >= 100 for x, _ in rs)} | {sum(x['agree'] for x, _ in rs) / len(rs):.1f} | "
                     f"{sum(x['new'] for x, _ in rs) / len(rs):.0f} |")
    return table


if __name__ == "__main__":
    main()
