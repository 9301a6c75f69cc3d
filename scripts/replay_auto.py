"""Replay `auto`'s n-gram choices over recorded target-only outputs, without timing noise.

    python scripts/replay_auto.py record --out bench-results/traces.json   # greedy, proposer none
    python scripts/replay_auto.py replay bench-results/traces.json [--curve 1,1.5,...] [--calibrated 1,1.4,...]

`record` decodes the benchmark prompts (scripts/workloads.py) with plain greedy
decoding. `replay` runs each output through the engine's own loop (edgespec.decoding.loop)
with the real AutoProposer over a stand-in target that "verifies" against the
recorded output: what auto proposes is accepted as far as it matches, and every
pass is charged t(B) from a curve in single steps (B = 1, 2, 4, ..., 64) on a
simulated clock. `auto` starts from the `--calibrated` curve (by default the
same) and corrects it from the passes it sees, as it does live; with `--load F
--spell N` those passes cost F times as much in every other spell of N passes
(load from elsewhere), while the cost reported stays the curve's. It also prints
an oracle that knows how far each lookup proposal will be accepted and takes the
best batch size for it: the ceiling for this proposer; and lookup at each fixed
`--fixed-k` (whatever it proposes, up to K, verified; batch sizes between the curve's
points are priced by linear interpolation); and with `--map-k` a model of llama.cpp's
ngram-map-k proposer under the same curve. Kernel flips under
batched verification are not modelled (the replayed output is always the
recorded one), so absolute figures read a little high; comparisons between
versions of the chooser are what it is for.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import threading
from collections import defaultdict
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import workloads

from edgespec.decoding import loop
from edgespec.config import MAX_K, GenerationConfig
from edgespec.decoding.costs import CALIBRATION_BATCHES, CostTracker
from edgespec.decoding.policy import CONFIDENCE_Z, Costs
from edgespec.proposers import Proposer
from edgespec.proposers.auto import AutoProposer
from edgespec.proposers.ngram import NgramProposer

# t(B)/t(1) measured on this 2-core machine at 50-1600 tokens of context, rounded (README).
DEFAULT_CURVE = "1,1.5,1.9,3.6,4.7,8.5,13.8"


def record(args: argparse.Namespace) -> None:
    from edgespec import Engine, GenerationConfig, LoadConfig

    engine = Engine(args.model, proposer="none", load=LoadConfig(n_ctx=4096, n_threads=args.threads))
    traces = []
    skip, sources = (args.per_category, workloads.HELD_OUT_SOURCES) if args.held_out else (0, workloads.EDIT_SOURCES)
    for category, text in workloads.spec_bench(args.per_category, skip=skip) + workloads.code_edits(args.code_edits,
                                                                                                   sources):
        prompt = engine.chat_tokens([{"role": "user", "content": text}])
        out = engine.generate(prompt, GenerationConfig(max_tokens=args.max_tokens, memory=None))
        traces.append({"category": category, "prompt": list(prompt), "output": list(out.tokens)})
        print(f"{category}: {len(prompt)} prompt tokens, {len(out.tokens)} generated", file=sys.stderr)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(traces))


class RecordedTarget:
    """A stand-in target whose every logits row puts the recorded next token on top.

    Ids are remapped to a dense vocabulary (`ids`) so that rows stay small; the end of the
    recording predicts an end-of-generation token. Each pass after the prefill advances
    `clock` by its curve cost times `load()` (what auto sees) and `cost` by the curve's.
    """

    def __init__(self, sequence: Sequence[int], curve: dict[int, float], load: Callable[[], float]) -> None:
        self.seq, self.curve, self.load = list(sequence), curve, load
        self.eog = max(self.seq) + 1
        self.n_ctx = len(self.seq) + max(curve) + 1
        self.n_past, self.clock, self.cost, self.passes = 0, 0.0, 0.0, 0

    def decode(self, tokens: Sequence[int], n_outputs: int = 1) -> np.ndarray:
        start = self.n_past
        self.n_past += len(tokens)
        if self.passes:
            cost = batch_cost(self.curve, len(tokens))
            self.clock += cost * self.load()
            self.cost += cost
        self.passes += 1
        rows = np.zeros((n_outputs, self.eog + 1), dtype=np.float32)
        for r, pos in enumerate(range(self.n_past - n_outputs, self.n_past)):
            rows[r, self.seq[pos + 1] if pos + 1 < len(self.seq) else self.eog] = 1.0
        assert tokens[0] == self.seq[start], "the loop decoded a token the recording does not have"
        return rows

    def trim(self, n_keep: int) -> int:
        self.n_past = min(self.n_past, n_keep)
        return self.n_past

    can_shift = False

    @property
    def tokens(self) -> list[int]:
        return self.seq[: self.n_past]

    def evaluate(self, prompt: Sequence[int], runs: Sequence[tuple[int, int, int]] = (), n_outputs: int = 1,
                 stop: object = None, step: object = None) -> np.ndarray:
        self.trim(0)  # a replay starts from an empty cache
        return self.decode(prompt, n_outputs)

    def prompt_row(self, prompt: Sequence[int]) -> None:
        return None  # every replay evaluates its prompt

    def is_eog(self, token: int) -> bool:
        return token == self.eog


def batch_cost(curve: dict[int, float], b: int) -> float:
    """t(b) in single steps, linear between the curve's batch sizes (a fixed K's shorter proposals)."""
    if b in curve:
        return curve[b]
    lo = max(x for x in curve if x < b)
    hi = min(x for x in curve if x > b)
    return curve[lo] + (curve[hi] - curve[lo]) * (b - lo) / (hi - lo)


def dense(traces: list[dict]) -> list[tuple[list[int], list[int]]]:
    """(prompt, output) of every trace in one dense id space shared by all traces."""
    ids: dict[int, int] = {}
    remap = lambda ts: [ids.setdefault(t, len(ids)) for t in ts]  # noqa: E731
    return [(remap(tr["prompt"]), remap(tr["output"])) for tr in traces]


def replay_one(prompt: list[int], out: list[int], curve: dict[int, float], auto: AutoProposer | NgramProposer,
               load: Callable[[], float] = lambda: 1.0, k: int | None = None) -> float:
    """Cost in single steps of generating `out` after `prompt` with `auto` (or lookup at a fixed `k`),
    through the engine's loop."""
    target = RecordedTarget(prompt + out, curve, load)
    steps = loop.steps(target, auto, prompt, GenerationConfig(max_tokens=len(out)), loop.Stats(),
                       threading.Event(), min(MAX_K, max(curve) - 1), user_k=k, clock=lambda: target.clock)
    made = [t for step in steps for t in step.tokens]
    assert made == out, "the replay left the recorded output"
    return target.cost


def oracle_one(prompt: list[int], out: list[int], curve: dict[int, float],
               others: Sequence[Proposer] = ()) -> tuple[float, int]:
    """Cost in single steps with lookup (and `others`: further proposal sources) and, each cycle, the proposal
    and batch size that commit most per step; and how many tokens it committed from proposals (the output's
    copied share)."""
    lookup = NgramProposer(lambda t: False)
    committed = prompt + out[:1]
    lookup.begin(committed)
    pos, cost, copied = 1, 0.0, 0
    while pos < len(out):
        k = min(max(curve) - 1, len(out) - pos - 1)
        best_b, best_n = 1, 0
        for source in (lookup, *others) if k > 0 else ():
            b, n = best_batch(curve, k, accepted_run(source.propose(committed, k).tokens, out, pos))
            if (n + 1) / curve[b] > (best_n + 1) / curve[best_b]:
                best_b, best_n = b, n
        cost += curve[best_b]
        committed = committed + out[pos : pos + best_n + 1]
        pos += best_n + 1
        copied += best_n
    return cost, copied


def best_batch(curve: dict[int, float], k: int, run: int) -> tuple[int, int]:
    """The batch size (at most k+1) that commits most per step when `run` proposed tokens would be accepted,
    and how many of them it verifies."""
    b = max((b for b in curve if b <= k + 1), key=lambda b: (min(b - 1, run) + 1) / curve[b])
    return b, min(b - 1, run)


def accepted_run(draft: Sequence[int], out: list[int], pos: int) -> int:
    """How many of `draft`'s tokens equal the recorded output from `pos` on, up to the first that does not."""
    return next((i for i, t in enumerate(draft) if t != out[pos + i]), len(draft))


def map_k_one(prompt: list[int], out: list[int], curve: dict[int, float], key: int = 12, value: int = 48) -> float:
    """Cost in single steps of a model of llama.cpp's ngram-map-k (common/ngram-map.cpp, its defaults): the last
    `key` tokens found earlier (the latest place whose `value` tokens that follow lie wholly before them) propose
    the tokens that follow, as many as that key's last draft had accepted (`value` at first), verified whole."""
    pos, cost, last_accepted = 1, 0.0, {}
    while pos < len(out):
        context = prompt + out[:pos]
        draft: list[int] = []
        tail = tuple(context[-key:])
        if len(context) - 1 >= 2 * key + value:  # llama.cpp counts the context without the token just sampled
            j = next((j for j in range(len(context) - key - value - 2, 0, -1) if tuple(context[j: j + key]) == tail), 0)
            draft = context[j + key: j + key + min(value, last_accepted.get(tail, value))] if j else []
        draft = draft[: len(out) - pos - 1]
        n = accepted_run(draft, out, pos)
        if draft:
            last_accepted[tail] = n
        cost += batch_cost(curve, len(draft) + 1)
        pos += n + 1
    return cost


def replay(args: argparse.Namespace) -> None:
    curve = dict(zip(CALIBRATION_BATCHES, (float(x) for x in args.curve.split(","))))
    calibrated = [float(x) for x in (args.calibrated or args.curve).split(",")]
    costs = Costs(tuple(curve), tuple(calibrated))
    traces = json.loads(args.traces.read_text())
    # One proposer for all prompts, as in the benchmark: its estimates carry over between requests.
    auto = AutoProposer(NgramProposer(lambda t: False), None, CostTracker(costs), confidence_z=args.z,
                        carry=args.carry)
    passes = itertools.count()

    def load() -> float:
        return args.load if (next(passes) // args.spell) % 2 else 1.0

    fixed = [int(k) for k in args.fixed_k.split(",")] if args.fixed_k else []
    # per category: tokens, auto steps, oracle steps, ngram-map-k's steps, then steps at each fixed k
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0.0] + [0.0] * len(fixed))
    for tr, (prompt, output) in zip(traces, dense(traces)):
        out = output[: args.max_tokens]
        t = totals[tr["category"]]
        t[0] += len(out) - 1
        t[1] += replay_one(prompt, out, curve, auto, load)
        t[2] += oracle_one(prompt, out, curve)[0]
        t[3] += map_k_one(prompt, out, curve) if args.map_k else 0.0
        for i, k in enumerate(fixed):
            t[4 + i] += replay_one(prompt, out, curve, NgramProposer(lambda t: False), load, k)
    map_k = " ngram-map-k ÷ plain | auto ÷ ngram-map-k |" if args.map_k else ""
    print("| category | auto ÷ plain | oracle ÷ plain | auto ÷ oracle |" + map_k
          + "".join(f" lookup k={k} |" for k in fixed))
    print("|---|---:|---:|---:|" + "---:|" * (len(fixed) + 2 * bool(args.map_k)))
    for cat, (n, steps, oracle, mk, *at_k) in totals.items():
        print(f"| {cat} | {n / steps:.2f}× | {n / oracle:.2f}× | {oracle / steps:.0%} |"
              + (f" {n / mk:.2f}× | {mk / steps:.2f}× |" if args.map_k else "")
              + "".join(f" {n / s:.2f}× |" for s in at_k))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("--model", default="qwen2.5-coder-1.5b")
    rec.add_argument("--per-category", type=int, default=5)
    rec.add_argument("--code-edits", type=int, default=8)
    rec.add_argument("--max-tokens", type=int, default=160)
    rec.add_argument("--threads", type=int, default=2)
    rec.add_argument("--held-out", action="store_true", help="the prompts of bench_spec.py --held-out")
    rec.add_argument("--out", type=Path, default=Path("bench-results/traces.json"))
    rep = sub.add_parser("replay")
    rep.add_argument("traces", type=Path)
    rep.add_argument("--curve", default=DEFAULT_CURVE, help="t(B)/t(1) for B = 1, 2, 4, 8, 16, 32, 64")
    rep.add_argument("--calibrated", help="the curve auto starts from (default: --curve)")
    rep.add_argument("--z", type=float, default=CONFIDENCE_Z, help="confidence gate; 0 turns it off")
    rep.add_argument("--carry", type=float, default=1.0, help="weight lookup's counts keep between prompts")
    rep.add_argument("--max-tokens", type=int, default=128)
    rep.add_argument("--load", type=float, default=1.0, help="cost factor auto sees in every other spell")
    rep.add_argument("--spell", type=int, default=50, help="passes per spell of --load")
    rep.add_argument("--fixed-k", default="", help="also lookup at these fixed K, e.g. 2,4,8,16")
    rep.add_argument("--map-k", action="store_true", help="also a model of llama.cpp's ngram-map-k (map_k_one)")
    args = ap.parse_args()
    record(args) if args.command == "record" else replay(args)


if __name__ == "__main__":
    main()
