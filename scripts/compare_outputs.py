"""Compare the greedy outputs of two bench_spec.py runs (e.g. before and after a change), token by token.

    python scripts/compare_outputs.py bench-results/before.json bench-results/after.json

Modes with fixed batch shapes (none, ngram:K, draft:K) run the same kernels in both runs, so their
outputs must be identical. `auto` picks its batch sizes from timing, so a batch can differ between
runs and a kernel flip can part the outputs, but only at a near-tie: there the target-only top-two
logit gap (prompt prefilled, then one token at a time, as plain decoding runs) must be below
NEAR_TIE_GAP (tests/test_speculative.py). Exits 1 on any other difference.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from test_speculative import NEAR_TIE_GAP  # noqa: E402

from edgespec.backend import Model  # noqa: E402
from edgespec.config import LoadConfig  # noqa: E402
from edgespec.models import resolve  # noqa: E402


def first_difference(a: list[int], b: list[int]) -> int | None:
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return i if i is not None or len(a) == len(b) else min(len(a), len(b))


def target_gap(model: Model, prompt: list[int], prefix: list[int]) -> float:
    """Top-two logit gap of the target after `prompt + prefix`, decoded as plain decoding does."""
    model.trim(0)
    row = model.decode(prompt, n_outputs=1)[-1]
    for t in prefix:
        row = model.decode([t])[-1]
    top2 = np.partition(row, -2)[-2:]
    return float(top2[1] - top2[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    before, after = (json.loads(p.read_text()) for p in (args.before, args.after))
    if before["prompts"] != after["prompts"]:
        raise SystemExit("the two runs tokenized different prompts; compare runs of the same prompt set")
    key = lambda r: (r["prompt"], r["mode"], r["repeat"])  # noqa: E731
    old = {key(r): r["output"] for r in before["rows"] if "output" in r}
    model = None
    counts: dict[str, list[int]] = {}  # mode -> [identical, near-tie partings, other partings]
    bad = []
    for r in after["rows"]:
        if key(r) not in old or r["mode"].startswith("llama.cpp"):
            continue
        c = counts.setdefault(r["mode"], [0, 0, 0])
        i = first_difference(old[key(r)], r["output"])
        if i is None:
            c[0] += 1
            continue
        where = f"prompt {r['prompt']} ({r['category']}), {r['mode']}, repeat {r['repeat']}: parts at token {i}"
        if r["mode"].startswith("auto") and i < min(len(old[key(r)]), len(r["output"])):
            model = model or Model(resolve(before["args"]["model"]), LoadConfig(n_ctx=4096, n_threads=args.threads))
            gap = target_gap(model, before["prompts"][r["prompt"]], r["output"][:i])
            if gap < NEAR_TIE_GAP:
                c[1] += 1
                print(f"{where}, target-only top-two gap {gap:.4f} (near-tie, < {NEAR_TIE_GAP})")
                continue
            where += f", target-only top-two gap {gap:.4f}"
        c[2] += 1
        bad.append(where)
    print("\n| mode | identical | parted at a near-tie | parted elsewhere |\n|---|---:|---:|---:|")
    for mode, (same, tie, other) in counts.items():
        print(f"| {mode} | {same} | {tie} | {other} |")
    for b in bad:
        print(f"DIFFERENT: {b}")
    if model is not None:
        model.close()
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
