"""How wide a FIM context a completion needs: greedy completions at scripts/bench_editor.py's cursors, each with a
given number of whole lines before the cursor line and after it, compared with the file's real next text.

The budgeted /infill takes what its time buys (about 12 lines before the cursor and 2 after on a 2-core CPU); the
aside sequence (engine.slots) builds wider prefixes while nobody waits. This measures what either width is worth.
Each variant keeps its own slot, reused as a prefix only, so every completion is of its prompt evaluated afresh.

    python scripts/bench_fim_context.py --variants 12:2 12:8 40:2 --out bench-results/fim-context.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

from bench_editor import DEFAULT_FILES, agreement, cursors, parse_files, shown  # noqa: E402

from edgespec import Engine, EngineConfig, GenerationConfig, LoadConfig  # noqa: E402
from edgespec.config import SamplingConfig  # noqa: E402
from edgespec.prompts.fim import FimPrompt, Infill, Take  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--files", nargs="+", default=list(DEFAULT_FILES), help="PATH:FIRST_LINE:LINES")
    ap.add_argument("--variants", nargs="+", default=["12:2", "12:8", "40:2"],
                    help="LINES_BEFORE:LINES_AFTER the cursor line")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--out", type=Path, default=ROOT / "bench-results" / "fim-context.json")
    args = ap.parse_args()
    variants = [tuple(int(n) for n in v.split(":")) for v in args.variants]
    records = []
    config = EngineConfig(args.model, proposer="none", memory=False, load=LoadConfig(n_ctx=4096, n_seq=len(variants)))
    with Engine(config) as eng:
        m = eng.target
        fim = FimPrompt(m.vocab, lambda t: m.tokenize(t, add_special=False, parse_special=False), "prefix",
                        m.token_bytes)
        for path, start, n in parse_files(args.files):
            for c in cursors(path, start, n):
                infill = Infill(c.prefix, c.suffix, "" if c.blank else c.typed)
                row = {"where": f"{Path(c.path).name}:{c.line + 1}:{c.col}", "real": c.real[:60]}
                for slot, (before, after) in enumerate(variants):
                    prompt = fim.tokens(infill, Take(before, after, 0))[0]
                    out = eng.generate(prompt, GenerationConfig(max_tokens=args.max_tokens, slot=slot, memory=None,
                                                                sampling=SamplingConfig(temperature=0.0)))
                    answer = shown(c, out.text)
                    row[f"{before}:{after}"] = {"agree": agreement(answer, c.real), "prompt": len(prompt),
                                                "answer": answer[:60]}
                records.append(row)
                print(row["where"], *(row[k]["agree"] for k in args.variants), file=sys.stderr)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(records, indent=1))
    print("| lines before : after the cursor line | prompt tokens (mean) | right ≥ 4 chars | characters right |")
    print("|---|---:|---:|---:|")
    for key in args.variants:
        got = [r[key] for r in records]
        print(f"| {key} | {sum(g['prompt'] for g in got) / len(got):.0f} | {sum(g['agree'] >= 4 for g in got)}/"
              f"{len(got)} | {sum(g['agree'] for g in got)} |")


if __name__ == "__main__":
    main()
