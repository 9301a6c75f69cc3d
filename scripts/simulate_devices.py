"""SIMULATION: how `auto` with a draft model would do on machines this project has not run on.

    python scripts/simulate_devices.py record --out bench-results/draft-traces.json   # real models, this CPU
    python scripts/simulate_devices.py replay bench-results/draft-traces.json        # prints predicted ratios

`record` runs the real target (Qwen2.5-Coder-1.5B) and draft (0.5B) on Spec-Bench
questions and code edits (scripts/workloads.py), greedy and at temperature 0.7:
the target's own output, and at each output position the chance that the draft's
proposal there is accepted given that everything before it was: greedy, 1 when the
draft's argmax equals the target's token; sampled, sum_x min(p(x), q(x)) over the
draft tokens that pass auto's DRAFT_P_MIN gate. Acceptance does not depend on the
device, so these traces hold for any machine.

`replay` prices those traces under the cost curves of other machines
(scripts/machine_curves.json: published figures, each with its source; and the
curves measured on this project's CPUs): plain decoding, the draft at fixed K = 4
and 8, and `auto` (the engine's own loop and AutoProposer: lookup, draft or a plain
step per cycle, learning costs and acceptance as it does live) on a simulated clock.
Nothing here is timed: every figure it prints is a prediction, and is labelled so.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from collections import defaultdict
from pathlib import Path
from typing import Sequence

import numpy as np
import workloads
from replay_auto import RecordedTarget, dense

from edgespec.decoding import loop
from edgespec.planning import placement
from edgespec.decoding import sampling
from edgespec.config import MAX_K, GenerationConfig, SamplingConfig
from edgespec.decoding.costs import CALIBRATION_BATCHES, CostTracker
from edgespec.decoding.policy import DRAFT_P_MIN, Costs
from edgespec.proposers import Proposal
from edgespec.proposers.auto import AutoProposer
from edgespec.proposers.ngram import NgramProposer

CURVES = Path(__file__).with_name("machine_curves.json")
SAMPLED = SamplingConfig(temperature=0.7, seed=1234)


# -- record -------------------------------------------------------------------------


def _rows(model, prompt: Sequence[int], output: Sequence[int]) -> np.ndarray:
    """The model's logits row before each output token (teacher forcing), in two passes."""
    model.trim(0)
    first = model.decode(list(prompt), n_outputs=1)[-1].copy()
    rest = model.decode(list(output[:-1]), n_outputs=len(output) - 1) if len(output) > 1 else np.empty((0, len(first)))
    return np.vstack([first[None, :], rest])


def _acceptance(target_rows: np.ndarray, draft_rows: np.ndarray, output: Sequence[int],
                sc: SamplingConfig) -> tuple[list[float], list[float]]:
    """Per position: P(the draft proposes and the target accepts), P(the draft proposes at all)."""
    n = min(target_rows.shape[1], draft_rows.shape[1])
    accept, proposes = [], []
    for t_row, d_row, token in zip(target_rows, draft_rows, output):
        d_row = d_row[:n]
        if sc.greedy:
            shifted = np.exp(d_row - d_row.max())
            ok = float(shifted.max() / shifted.sum()) >= DRAFT_P_MIN
            proposes.append(float(ok))
            accept.append(float(ok and int(np.argmax(d_row)) == token))
            continue
        q_ids, q = sampling.distribution(d_row, sc)
        p_ids, p = sampling.distribution(t_row[:n], sc)
        gate = q >= DRAFT_P_MIN
        p_of = dict(zip(p_ids.tolist(), p.tolist()))
        proposes.append(float(q[gate].sum()))
        accept.append(float(sum(min(qx, p_of.get(x, 0.0)) for x, qx in zip(q_ids[gate].tolist(), q[gate].tolist()))))
    return accept, proposes


def record(args: argparse.Namespace) -> None:
    from edgespec import Engine, LoadConfig
    from edgespec.backend import Model
    from edgespec.models import resolve

    engine = Engine(args.model, proposer="none", load=LoadConfig(n_ctx=2048, n_threads=args.threads))
    draft = Model(resolve(args.draft), LoadConfig(n_ctx=2048, n_threads=args.threads))
    traces = []
    prompts = workloads.spec_bench(args.per_category) + workloads.code_edits(args.code_edits)
    for mode, sc in (("greedy", SamplingConfig()), ("sampled", SAMPLED)):
        for category, text in prompts:
            prompt = engine.chat_tokens([{"role": "user", "content": text}])
            out = list(engine.generate(prompt, GenerationConfig(max_tokens=args.max_tokens, sampling=sc, memory=None)).tokens)
            if len(out) < 2:
                continue
            d_rows = _rows(draft, prompt, out)
            t_rows = d_rows if sc.greedy else _rows(engine.target, prompt, out)  # greedy reads the draft's only
            accept, proposes = _acceptance(t_rows, d_rows, out, sc)
            traces.append({"mode": mode, "category": category, "prompt": list(prompt), "output": out,
                           "accept": [round(a, 4) for a in accept], "proposes": [round(p, 4) for p in proposes]})
            print(f"{mode} {category}: {len(prompt)}+{len(out)} tokens, draft acceptance "
                  f"{np.mean(accept):.2f}", file=sys.stderr)
    draft.close()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"target": args.model, "draft": args.draft, "p_min": DRAFT_P_MIN,
                                    "max_tokens": args.max_tokens, "traces": traces}))



# -- replay -------------------------------------------------------------------------


class RecordedDraft:
    """A stand-in draft model: at output position i its proposal holds the recorded token with the recorded
    chance of acceptance, a wrong one with the rest of the chance it proposes, else it stops (the p_min gate).
    Each pass costs `ratio` target steps on `clock` (a catch-up pass is priced on the curve)."""

    name = "draft"

    def __init__(self, n_prompt: int, trace: dict, target: RecordedTarget, ratio: float, rng: np.random.Generator,
                 fixed: int | None = None) -> None:
        self.n_prompt, self.trace, self.target, self.ratio, self.rng, self.fixed = n_prompt, trace, target, ratio, rng, fixed
        self.wrong = target.eog + 1  # an id no row ever puts on top
        self.n_past = n_prompt  # prefilled with the prompt, which plain decoding is not charged for either
        self.last_seconds_per_token: float | None = None
        self._base = 0

    def lag(self, context: Sequence[int]) -> int:
        return len(context) - min(self.n_past, len(context))

    def begin(self, prompt, cfg, rng) -> None:
        pass

    def propose(self, context: Sequence[int], k: int) -> Proposal:
        k = min(k, self.fixed) if self.fixed is not None else k
        self._base, self.last_seconds_per_token = len(context), None
        if k <= 0:
            return Proposal(source="draft")
        lag = self.lag(context)
        b = min(lag, max(self.target.curve))
        self.target.clock += self.ratio * self.target.curve[b] * lag / b
        self.target.cost += self.ratio * self.target.curve[b] * lag / b
        out, pos = [], len(context) - self.n_prompt
        for j in range(k):
            i = pos + j
            if i >= len(self.trace["accept"]):
                break
            u = self.rng.random()
            if u >= self.trace["proposes"][i]:
                break
            out.append(self.target.seq[self.n_prompt + i] if u < self.trace["accept"][i] else self.wrong)
            if j:
                self.target.clock += self.ratio
                self.target.cost += self.ratio
        if lag == 1 and out:
            self.last_seconds_per_token = self.ratio
        self.n_past = len(context) + max(0, len(out) - 1)
        return Proposal(out, None, "draft")

    def accept(self, n_accepted: int, seconds: float | None = None) -> None:
        self.n_past = min(self.n_past, self._base + n_accepted)

    def close(self) -> None:
        pass


def _run(trace: dict, prompt: list[int], out: list[int], curve: dict[int, float], ratio: float, how: str,
         auto_state: dict, rng: np.random.Generator) -> float:
    """Cost in target steps of `out` after `prompt`: "plain", "k4", "k8" (the draft, fixed K) or "auto"."""
    if how == "plain":
        return float(len(out) - 1)
    filled = {b: float(np.interp(b, list(curve), list(curve.values()))) for b in range(1, max(curve) + 1)}
    target = RecordedTarget(prompt + out, filled, lambda: 1.0)  # fixed K=4 verifies 5: between measured sizes
    k_max = min(MAX_K, max(curve) - 1)
    draft = RecordedDraft(len(prompt), trace, target, ratio, rng, None if how == "auto" else int(how[1:]))
    if how == "auto":
        costs = Costs(tuple(curve), tuple(curve.values()), ratio)  # auto verifies only at the measured sizes
        proposer = AutoProposer(NgramProposer(lambda t: False), draft, auto_state.setdefault("costs", CostTracker(costs)))
        if "accept" in auto_state:  # one server over all prompts: its estimates carry over, as live
            proposer.ngram_accept, proposer.draft_accept = auto_state["accept"]
        auto_state["accept"] = (proposer.ngram_accept, proposer.draft_accept)
    else:
        proposer = draft
        k_max = min(k_max, int(how[1:]))
    steps = loop.steps(target, proposer, prompt, GenerationConfig(max_tokens=len(out)), loop.Stats(),
                       threading.Event(), k_max, clock=lambda: target.clock)
    assert [t for step in steps for t in step.tokens] == out, "the replay left the recorded output"
    return target.cost


def machines(path: Path) -> list[tuple[str, dict[int, float], str]]:
    """(name, curve, source) of every machine with a published curve, and this project's two CPU curves."""
    data = json.loads(path.read_text())
    avx512 = placement.CURVES["cpu"]
    avx2 = (1.0, 1.69, 3.34, 8.1, 10.13, 19.38, 38.4)
    out = [("this project's CPU, AVX-512, 2 cores (measured)", dict(zip(CALIBRATION_BATCHES, avx512)), "../shared/FACTS.md"),
           ("AVX2-only CPU, 2 cores (measured)", dict(zip(CALIBRATION_BATCHES, avx2)), "issue 22")]
    for m in data["machines"]:
        known = [(b, c) for b, c in zip(data["batches"], m["curve"]) if c is not None]
        if len(known) >= 3:
            out.append((m["name"], dict(known), m["curve_source"]))
    return out


def replay(args: argparse.Namespace) -> None:
    data = json.loads(args.traces.read_text())
    traces = data["traces"]
    ids = dense(traces)
    print(f"SIMULATION (not measured): {len(traces)} recorded traces of {data['target']} with {data['draft']}, "
          f"priced under cost curves; tokens per target step relative to plain decoding.")
    for name, curve, source in machines(args.curves):
        for ratio in args.ratios:
            print(f"\n### {name}, draft ÷ target per token {ratio} ({source})\n")
            print("| mode | category | draft K=4 | draft K=8 | auto |\n|---|---|---:|---:|---:|")
            for mode in ("greedy", "sampled"):
                rows: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
                state: dict = {}
                rng = np.random.default_rng(args.seed)
                for tr, (prompt, out) in zip(traces, ids):
                    if tr["mode"] != mode:
                        continue
                    for how in ("plain", "k4", "k8", "auto"):
                        if how == "k8" and max(curve) < 9:
                            continue
                        rows[_group(tr["category"])][how] += _run(tr, prompt, out, curve, ratio, how, state, rng)
                for cat, r in rows.items():
                    cell = lambda how: f"{r['plain'] / r[how]:.2f}x" if r.get(how) else "—"  # noqa: E731
                    print(f"| {mode} | {cat} | {cell('k4')} | {cell('k8')} | {cell('auto')} |")


def _group(category: str) -> str:
    return category if category == "code-edit" else "Spec-Bench"

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("--model", default="qwen2.5-coder-1.5b")
    rec.add_argument("--draft", default="qwen2.5-coder-0.5b")
    rec.add_argument("--per-category", type=int, default=4)
    rec.add_argument("--code-edits", type=int, default=8)
    rec.add_argument("--max-tokens", type=int, default=128)
    rec.add_argument("--threads", type=int, default=2)
    rec.add_argument("--out", type=Path, default=Path("bench-results/draft-traces.json"))
    rep = sub.add_parser("replay")
    rep.add_argument("traces", type=Path)
    rep.add_argument("--curves", type=Path, default=CURVES)
    rep.add_argument("--ratios", type=float, nargs="+", default=[0.22, 0.5],
                     help="draft ÷ target time per token (0.22: Qwen2.5-Coder 0.5B vs 7B, published; 0.5: vs 1.5B)")
    rep.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    record(args) if args.command == "record" else replay(args)


if __name__ == "__main__":
    main()
