"""Structured extraction: speculation under a JSON-schema grammar, side by side with plain decoding, in one run.

Each task of scripts/extraction_workload.json (invoices, changelogs, API responses, log lines, with
their schemas; written for this benchmark) is run in four modes, in lockstep, one cycle at a time
with the mode furthest behind going next, each timed over its own cycles only (as bench_spec.py):

    plain+schema   no speculation, output constrained by the task's schema
    auto+schema    edgespec's auto proposer under the same schema
    auto           auto without the schema (the model's free answer)
    plain          no speculation, no schema

Reported: decode tok/s summed over tasks, auto+schema / plain+schema (what speculation gains under a
grammar), auto+schema / auto and plain+schema / plain (what the grammar costs), whether each
constrained output parses and validates, and whether auto+schema produced the same tokens as plain+schema.

    python scripts/bench_structured.py --out docs/bench/structured.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jsonschema

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_spec import lockstep_streams  # noqa: E402

from edgespec import Engine, GenerationConfig, LoadConfig  # noqa: E402
from edgespec.decoding.costs import cpu_model  # noqa: E402

WORKLOAD = Path(__file__).resolve().parent / "extraction_workload.json"
MODES = {"plain+schema": ("none", True), "auto+schema": ("auto", True), "auto": ("auto", False),
         "plain": ("none", False)}


def prompt_of(engine: Engine, task: dict) -> list[int]:
    text = (f"{task['instruction']}\n\nJSON schema:\n{json.dumps(task['schema'])}\n\nDocument:\n{task['document']}")
    return engine.chat_tokens([{"role": "user", "content": text}])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--tasks", type=int, default=0, help="run only the first N tasks (0: all)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    tasks = json.loads(WORKLOAD.read_text())["tasks"]
    tasks = tasks[: args.tasks] if args.tasks else tasks
    engine = Engine(args.model, proposer="auto", load=LoadConfig(n_ctx=2048, n_seq=len(MODES)))
    rows = []
    for task in tasks:
        prompt = prompt_of(engine, task)
        configs = {m: GenerationConfig(max_tokens=args.max_tokens, proposer=p,
                                       json_schema=task["schema"] if constrained else None, memory=None)
                   for m, (p, constrained) in MODES.items()}
        # Each mode in its own slot, in lockstep (bench_spec.py): a slow spell falls on all of them alike.
        results = lockstep_streams({m: engine.stream(prompt, c) for m, c in configs.items()})
        row = {"task": task["name"], "kind": task["kind"], "prompt_tokens": len(prompt)}
        for m, (s, secs, tokens) in results.items():
            row[m] = {"tokens": s.completion_tokens - 1, "seconds": secs, "drafted": s.drafted,
                      "accepted": s.accepted}
            if MODES[m][1]:
                try:
                    jsonschema.validate(json.loads(engine.target.detokenize(tokens)), task["schema"])
                    row[m]["valid"] = True
                except (json.JSONDecodeError, jsonschema.ValidationError):
                    row[m]["valid"] = False
        row["same_tokens"] = results["auto+schema"][2] == results["plain+schema"][2]
        rows.append(row)
        print(f"{task['name']:32s} " + "  ".join(
            f"{m} {row[m]['tokens'] / row[m]['seconds']:6.1f} tok/s" for m in MODES)
            + f"  same={row['same_tokens']}", flush=True)
    totals = {m: sum(r[m]["tokens"] for r in rows) / sum(r[m]["seconds"] for r in rows) for m in MODES}
    summary = {
        "machine": cpu_model(), "model": args.model, "tasks": len(rows), "tok_per_s": totals,
        "auto+schema / plain+schema": totals["auto+schema"] / totals["plain+schema"],
        "auto+schema / auto": totals["auto+schema"] / totals["auto"],
        "plain+schema / plain": totals["plain+schema"] / totals["plain"],
        "valid": {m: sum(r[m]["valid"] for r in rows) for m in MODES if MODES[m][1]},
        "same_tokens": sum(r["same_tokens"] for r in rows),
        "acceptance auto+schema": sum(r["auto+schema"]["accepted"] for r in rows)
        / max(1, sum(r["auto+schema"]["drafted"] for r in rows)),
    }
    print(json.dumps(summary, indent=2))
    if args.out:
        args.out.write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    engine.close()


if __name__ == "__main__":
    sys.exit(main())
