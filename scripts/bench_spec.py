"""Speculative decoding speed and acceptance, side by side with plain decoding in one run.

For every prompt all modes run back to back (prompt-major order), so machine
noise hits every mode alike; per category the script reports decode tok/s
(tokens after the first, over decode time), its ratio to plain decoding in the
same run, and acceptance. Greedy, as Spec-Bench is usually reported.

    python scripts/bench_spec.py --modes none,ngram:2,ngram:4,ngram:8,draft:2,draft:4
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import workloads  # noqa: E402

from edgespec import Engine, GenerationConfig, LoadConfig  # noqa: E402


def parse_modes(text: str) -> list[tuple[str, int]]:
    out = []
    for item in text.split(","):
        name, _, k = item.partition(":")
        out.append((name, int(k) if k else 0))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--modes", default="none,ngram:2,ngram:4,ngram:8,draft:2,draft:4")
    ap.add_argument("--per-category", type=int, default=2, help="Spec-Bench questions per category")
    ap.add_argument("--code-edits", type=int, default=6, help="prompts in the code-editing set")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("bench-results/spec.json"))
    args = ap.parse_args()

    modes = parse_modes(args.modes)
    load = LoadConfig(n_ctx=4096, n_threads=args.threads)
    names = {name for name, _ in modes}
    engines = {"none": Engine(args.model, load=load)}
    if "ngram" in names:
        engines["ngram"] = Engine(args.model, proposer="ngram", load=load)
    if "draft" in names:
        engines["draft"] = Engine(args.model, draft=args.draft, load=load)
    prompts = workloads.spec_bench(args.per_category) + workloads.code_edits(args.code_edits)
    config = GenerationConfig(max_tokens=args.max_tokens)

    rows = []
    t_start = time.time()
    for i, (category, text) in enumerate(prompts):
        for name, k in modes:
            engine = engines[name]
            engine.k = k
            tokens = engine.chat_tokens([{"role": "user", "content": text}])
            s = engine.generate(tokens, config).stats
            rows.append({"category": category, "prompt": i, "mode": f"{name}:{k}" if k else name,
                         "tokens": s.completion_tokens - 1, "seconds": s.decode_seconds, "drafted": s.drafted,
                         "accepted": s.accepted, "cycles": s.cycles, "accepted_at": s.accepted_at,
                         "drafted_at": s.drafted_at})
        print(f"[{i + 1}/{len(prompts)}] {category} done, {time.time() - t_start:.0f}s", file=sys.stderr)

    report(rows, [f"{n}:{k}" if k else n for n, k in modes])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "rows": rows}, indent=1))


def report(rows: list[dict], modes: list[str]) -> None:
    agg: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0, 0, 0])
    for r in rows:
        for cat in (r["category"], "all Spec-Bench" if r["category"] != "code-edit" else None):
            if cat is None:
                continue
            a = agg[(cat, r["mode"])]
            a[0] += r["tokens"]
            a[1] += r["seconds"]
            a[2] += r["drafted"]
            a[3] += r["accepted"]
    cats = list(dict.fromkeys(r["category"] for r in rows)) + ["all Spec-Bench"]
    print("\ndecode speed ÷ plain decoding in the same run (acceptance in brackets)\n")
    print("| category | plain tok/s | " + " | ".join(m for m in modes if m != "none") + " |")
    print("|---|---:|" + "---:|" * (len(modes) - 1))
    for cat in cats:
        base = agg[(cat, "none")]
        base_tps = base[0] / base[1] if base[1] else 0.0
        cells = []
        for m in modes:
            if m == "none":
                continue
            a = agg[(cat, m)]
            tps = a[0] / a[1] if a[1] else 0.0
            acc = f" ({a[3] / a[2]:.0%})" if a[2] else ""
            cells.append(f"{tps / base_tps:.2f}×{acc}" if base_tps else "n/a")
        print(f"| {cat} | {base_tps:.1f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
