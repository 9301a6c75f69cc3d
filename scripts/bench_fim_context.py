"""How wide a FIM context a completion needs: greedy completions at scripts/bench_editor.py's cursors, each with a
given number of whole lines before the cursor line and after it, compared with the file's real next text.

The budgeted /infill takes what its time buys (about 12 lines before the cursor and 2 after on a 2-core CPU); the
aside sequence (engine.slots) builds wider prefixes while nobody waits. This measures what either width is worth.
Each variant keeps its own slot, reused as a prefix only, so every completion is of its prompt evaluated afresh.

With --moved FIRST:STEP each variant is replayed a second time (its own slot again) with its prefix lines built as a
context widened by moving would hold them: the nearest FIRST tokens of lines evaluated first, then the lines before
them put in front, STEP tokens at a time, the cached ones shifted after them (KV computed without the lines now
before it: what chunk reuse keeps, as the README says of reuse); the rest of the prompt is evaluated as usual.

    python scripts/bench_fim_context.py --variants 12:2 12:8 40:2 --out bench-results/fim-context.json
    python scripts/bench_fim_context.py --layout middle --variants 24:16 96:16 --moved 192:96
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
from edgespec.backend import KVSequence  # noqa: E402
from edgespec.prompts.fim import LAYOUTS, FimPrompt, Infill, Take, healed  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--files", nargs="+", default=list(DEFAULT_FILES), help="PATH:FIRST_LINE:LINES")
    ap.add_argument("--variants", nargs="+", default=["12:2", "12:8", "40:2"],
                    help="LINES_BEFORE:LINES_AFTER the cursor line")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--layout", choices=LAYOUTS, default="prefix",
                    help="llama.cpp's, or the typed text after <fim_middle> (healed, as /infill lays it out)")
    ap.add_argument("--moved", metavar="FIRST:STEP", help="also each variant with its prefix built by moving")
    ap.add_argument("--out", type=Path, default=ROOT / "bench-results" / "fim-context.json")
    args = ap.parse_args()
    moved = tuple(int(n) for n in args.moved.split(":")) if args.moved else None
    keys = [*args.variants, *(f"{v} moved" for v in args.variants if moved)]
    records = []
    config = EngineConfig(args.model, proposer="none", memory=False, load=LoadConfig(n_ctx=4096, n_seq=len(keys)))
    with Engine(config) as eng:
        m = eng.target
        fim = FimPrompt(m.vocab, lambda t: m.tokenize(t, add_special=False, parse_special=False), args.layout,
                        m.token_bytes)
        for path, start, n in parse_files(args.files):
            for c in cursors(path, start, n):
                infill, heal = Infill(c.prefix, c.suffix, "" if c.blank else c.typed), ""
                if args.layout == "middle":
                    infill, heal = healed(infill, "middle")
                row = {"where": f"{Path(c.path).name}:{c.line + 1}:{c.col}", "real": c.real[:60]}
                for slot, key in enumerate(keys):
                    before, after = (int(n) for n in key.split()[0].split(":"))
                    prompt, pre, _ = fim.tokens(infill, Take(before, after, 0))
                    if key.endswith("moved"):
                        _build_moving(eng.slots[slot].cache, prompt, prompt.index(m.vocab.fim_pre) + 1, pre, *moved)
                    out = eng.generate(prompt, GenerationConfig(max_tokens=args.max_tokens, slot=slot, memory=None,
                                                                heal=heal, sampling=SamplingConfig(temperature=0.0)))
                    answer = shown(c, out.text)
                    row[key] = {"agree": agreement(answer, c.real), "prompt": len(prompt), "answer": answer[:60],
                                "cached": out.stats.cached_prompt_tokens}
                records.append(row)
                print(row["where"], *(row[k]["agree"] for k in keys), file=sys.stderr)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(records, indent=1))
    print("| lines before : after the cursor line | prompt tokens (mean) | right ≥ 4 chars | characters right |")
    print("|---|---:|---:|---:|")
    for key in keys:
        got = [r[key] for r in records]
        print(f"| {key} | {sum(g['prompt'] for g in got) / len(got):.0f} | {sum(g['agree'] >= 4 for g in got)}/"
              f"{len(got)} | {sum(g['agree'] for g in got)} |")


def _build_moving(seq: KVSequence, prompt: list[int], head: int, pre: list[int], first: int, step: int) -> None:
    """Make `seq` hold `prompt` up to the end of its prefix lines `pre` (after its first `head` tokens) as a context
    widened by moving holds them: the nearest `first` tokens of lines evaluated, then the lines before them put in
    front, `step` tokens at a time."""
    n = len(pre)
    ends = [i + 1 for i, t in enumerate(pre) if seq.model.token_bytes(t).endswith(b"\n")]  # where lines start
    at = max([0, *(e for e in ends if n - e >= first)])
    seq.trim(0)
    seq.evaluate(prompt[:head] + pre[at:], n_outputs=0)
    while at > 0:
        nxt = max([0, *(e for e in ends if at - e >= step)])
        # the cached lines move after the new ones; the last token is evaluated again, so the decode is not empty
        seq.evaluate(prompt[:head] + pre[nxt:], runs=[(0, 0, head), (head + at - nxt, head, n - at - 1)])
        at = nxt
    assert seq.tokens == prompt[:head + n]


if __name__ == "__main__":
    main()
