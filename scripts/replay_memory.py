"""Replay bench_memory's generations under several cost curves: what the memory adds to `auto`, and the ceiling.

    python scripts/replay_memory.py bench-results/memory.json [--curve NAME=1,1.7,...]

bench_memory.py stores every prompt, both modes' outputs, how many entries the memory held before each
prompt, and those entries. Here each prompt-only output (the target's own tokens) is replayed through the
engine's loop (replay_auto.RecordedTarget: a pass is charged t(B) from a curve, a proposed token is accepted
when it is the recorded one) three ways: prompt-only `auto`, `auto` reading a memory rebuilt from the entries
the live run held at that point, and an oracle that knows how far the lookup and the memory proposals will be
accepted and takes the best of both at the best batch size each cycle: the ceiling of these two sources under
that curve. Last, a bound for tree speculation (several continuations verified in one batch, as SuffixDecoding
does): each cycle commits the longest accepted continuation of any earlier place, in the memory or in this
prompt and answer, where the context's last TREE_KEY tokens occur, charged as if that branch were verified
alone and sized by the oracle's rule. Ratios are against prompt-only `auto`, the goal's baseline.
Each mode keeps one proposer across the prompts, as the benchmark's slots do. At temperature 0.7
a proposed token is accepted with the probability the target gave it; matching the one recorded sample has
that same chance, so the replay prices sampled answers too. Kernel flips are not modelled, and curves not
measured on this machine are labelled simulated.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from replay_auto import accepted_run, best_batch, oracle_one, replay_one  # noqa: E402

from edgespec.decoding.costs import CostTracker  # noqa: E402
from edgespec.memory import Memory  # noqa: E402
from edgespec.decoding.policy import Costs  # noqa: E402
from edgespec.proposers.auto import MEMORY_CARRY, AutoProposer  # noqa: E402
from edgespec.proposers.memory import MemoryProposer  # noqa: E402
from edgespec.proposers.ngram import NgramProposer  # noqa: E402

QWEN_EOG = (151643, 151645)  # <|endoftext|>, <|im_end|>: the memory never proposes past them
CURVES = {  # t(B)/t(1) at B = 1, 2, 4, 8, 16, 32, 64 (fewer where a curve stops)
    "AVX-512 EPYC, 2 threads (measured)": "1,1.71,2.7,4.58,5.31,9.09,16.3",
    "AVX2 build on it (measured)": "1,1.74,2.83,6.27,8.65,15.53,29.7",
    "RTX 3090 (SIMULATED: llama.cpp PR 15802's batch curve, B <= 8)": "1,1.119,1.331,2.146",
    "free batches (HYPOTHETICAL: t(B) = t(1) up to 64, no device is this fast)": "1,1,1,1,1,1,1",
}
TREE_KEY = 2  # context tokens a tree branch must match; at 1 every earlier place of the last token is a branch


def tree_bound_one(prompt: list[int], out: list[int], curve: dict[int, float], entries: list[list[int]],
                   key: int = TREE_KEY) -> float:
    """Cost in single steps when each cycle commits the longest accepted continuation of any earlier place (in
    `entries`, the prompt or the answer so far) of the context's last `key` tokens, at its best batch size."""
    memory = np.array([t for e in entries for t in (*e, -1)], dtype=np.int64)
    pos, cost = 1, 0.0
    while pos < len(out):
        k = min(max(curve) - 1, len(out) - pos - 1)
        context = prompt + out[:pos]
        hay = np.concatenate([memory, context])
        at = np.ones(len(hay) - key, dtype=bool)  # places where the context's last `key` tokens end
        for j in range(key):
            at &= hay[j: len(hay) - key + j] == context[len(context) - key + j]
        run = max((accepted_run(hay[s: s + k].tolist(), out, pos) for s in np.flatnonzero(at) + key), default=0)
        b, n = best_batch(curve, k, run)
        cost += curve[b]
        pos += n + 1
    return cost


def replay(data: dict, curve: dict[int, float], memory_carry: float = MEMORY_CARRY) -> dict[str, list[float]]:
    """Per workload: tokens, then steps of prompt-only auto, memory+auto, the lookup-only oracle, the
    two-source oracle and the tree bound."""
    ids: dict[int, int] = {}
    remap = lambda ts: [ids.setdefault(t, len(ids)) for t in ts]  # noqa: E731
    entries = [remap(e) for e in data["memory_entries"]]
    eog = {ids.setdefault(t, len(ids)) for t in QWEN_EOG}
    is_eog = eog.__contains__
    costs = Costs(tuple(curve), tuple(curve.values()))
    plain = AutoProposer(NgramProposer(lambda t: False), None, CostTracker(costs))
    with_memory = AutoProposer(NgramProposer(lambda t: False), None, CostTracker(costs), memory_carry=memory_carry)
    memory, held = Memory(None), 0
    with_memory.memory = MemoryProposer(is_eog, memory)
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0.0, 0.0, 0.0])
    rows = [r for r in data["rows"] if r["mode"] == "auto"]
    for r in rows:
        for entry in entries[held: r["entries_before"]]:
            memory.add(entry)
        held = max(held, r["entries_before"])
        prompt, out = remap(r["prompt"]), remap(r["output"])
        t = totals[r["workload"]]
        t[0] += len(out) - 1
        t[1] += replay_one(prompt, out, curve, plain)
        t[2] += replay_one(prompt, out, curve, with_memory)
        t[3] += oracle_one(prompt, out, curve)[0]
        t[4] += oracle_one(prompt, out, curve, [MemoryProposer(is_eog, memory)])[0]
        t[5] += tree_bound_one(prompt, out, curve, entries[: r["entries_before"]])
    return totals


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", type=Path, help="bench_memory.py's JSON")
    ap.add_argument("--curve", action="append", default=[], help="NAME=t(1),t(2),... (repeatable)")
    ap.add_argument("--memory-carry", type=float, default=MEMORY_CARRY,
                    help="share of the memory estimates' counts a request keeps (default: auto's MEMORY_CARRY)")
    args = ap.parse_args()
    data = json.loads(args.results.read_text())
    if "memory_entries" not in data:
        sys.exit(f"{args.results} has no memory entries: rerun scripts/bench_memory.py, which now stores them")
    curves = dict(c.split("=", 1) for c in args.curve) or CURVES
    for name, spec in curves.items():
        values = [float(x) for x in spec.split(",")]
        curve = dict(zip((1, 2, 4, 8, 16, 32, 64), values))
        print(f"\n{name}: t(B)/t(1) = {', '.join(f'{v:g}' for v in values)}\n")
        print("| workload | auto ÷ plain | memory+auto ÷ auto | oracle, lookup ÷ auto | oracle, lookup + memory "
              "÷ auto | tree bound ÷ auto |")
        print("|---|---:|---:|---:|---:|---:|")
        for workload, (n, a, m, ol, om, tree) in replay(data, curve, args.memory_carry).items():
            print(f"| {workload} | {n / a:.2f}× | {a / m:.2f}× | {a / ol:.2f}× | {a / om:.2f}× | {a / tree:.2f}× |")


if __name__ == "__main__":
    main()
