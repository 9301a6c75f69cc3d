"""How much FIM suffix a completion needs, and what a suffix kept from before the last keystroke (chunk reuse past the
cursor) does to it. Same cursors as scripts/bench_editor.py; greedy completions compared with the file's real text.

Each variant keeps its own slot. The prefix runs from a fixed line to the cursor, so consecutive prompts share their
start and the "fresh" variants evaluate everything after the common prefix; "stale" reuses the suffix's KV at its new
position (n_cache_reuse 16 with no anchor: what edgespec did before prompts.fim.cursor_anchor).

    python scripts/bench_fim_suffix.py --out bench-results/fim-suffix.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

from bench_editor import DEFAULT_FILES, agreement, cursors, parse_files  # noqa: E402

from edgespec import Engine, EngineConfig, GenerationConfig, LoadConfig  # noqa: E402
from edgespec.config import SamplingConfig  # noqa: E402
from edgespec.decoding import reuse  # noqa: E402
from edgespec.prompts.fim import FimPrompt, Infill  # noqa: E402

PREFIX_LINES = 64
# (name, suffix lines after the cursor line's rest, chunk reuse without an anchor)
VARIANTS = (("16 lines", 16, False), ("16 lines, stale", 16, True), ("4 lines", 4, False), ("1 line", 1, False),
            ("none", 0, False))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--files", nargs="+", default=list(DEFAULT_FILES), help="PATH:FIRST_LINE:LINES")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--out", type=Path, default=ROOT / "bench-results" / "fim-suffix.json")
    args = ap.parse_args()

    config = EngineConfig(args.model, proposer="none", load=LoadConfig(n_ctx=4096, n_seq=len(VARIANTS)), memory=False)
    records: list[dict] = []
    with Engine(config) as eng:
        m = eng.target
        fim = FimPrompt(m.vocab, lambda t: m.tokenize(t, add_special=False, parse_special=False))
        for path, start, n in parse_files(args.files):
            lines = path.read_text().splitlines()
            first = max(0, start - PREFIX_LINES)
            for c in cursors(path, start, n):
                row: dict = {"where": f"{path.name}:{c.line + 1}:{c.col}", "real": c.real}
                for slot, (name, n_suf, stale) in enumerate(VARIANTS):
                    infill = Infill("".join(s + "\n" for s in lines[first:c.line]),
                                    "\n".join(["", *lines[c.line + 1:c.line + 1 + n_suf]]) + "\n", c.typed)
                    tokens = fim.tokens(infill)[0]
                    cfg = GenerationConfig(max_tokens=args.max_tokens, slot=slot, memory=None, min_indent=c.indent,
                                           sampling=SamplingConfig(temperature=0.0))
                    if stale:  # evaluated here with the moved runs the plan finds anywhere, the suffix's too
                        cache = eng.slots[slot].cache
                        kept = reuse.plan(cache.tokens, tokens, 16)
                        cache.evaluate(tokens, [(r.start, r.source, r.length) for r in kept.runs])
                    out = eng.generate(tokens, cfg)
                    row[name] = {"text": out.text, "agree": agreement(out.text, c.real)}
                records.append(row)
                print(f"{row['where']:<24} " + "  ".join(f"{v[0]} {row[v[0]]['agree']:>3}" for v in VARIANTS),
                      file=sys.stderr)
    table = ["| suffix | cursors | right ≥ 4 chars | mean characters right |", "|---|---:|---:|---:|"]
    for name, _, _ in VARIANTS:
        agree = [r[name]["agree"] for r in records]
        table.append(f"| {name} | {len(agree)} | {sum(a >= 4 for a in agree)} | {sum(agree) / len(agree):.1f} |")
    print("\n".join(table))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "records": records,
                                    "table": table}, indent=1))


if __name__ == "__main__":
    main()
